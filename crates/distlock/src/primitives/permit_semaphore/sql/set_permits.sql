-- Sets a semaphore's total if it has none, and then notifies its channel with the free
-- count (distlock_permit_set, schema.sql).
--
-- $1  semaphore name
-- $2  the total (bigint, not negative)
-- $3  the semaphore's notification channel
--
-- Returns one bigint: NULL when this call set it, or the total it found and kept.
SELECT distlock_permit_set($1, $2, $3)
