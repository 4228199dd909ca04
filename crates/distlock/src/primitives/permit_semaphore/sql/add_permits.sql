-- Adds permits to a semaphore's total (takes them away when negative), creating it when
-- it has none, and notifies its channel with the free count (distlock_permit_add,
-- schema.sql).
--
-- $1  semaphore name
-- $2  permits to add (bigint, may be negative)
-- $3  the semaphore's notification channel
--
-- Returns one bigint: the permits free after it.
SELECT distlock_permit_add($1, $2, $3)
