-- Sets an owner's permits' lease to a new length from now (distlock_permit_extend,
-- schema.sql).
--
-- $1  semaphore name
-- $2  owner
-- $3  the lease, milliseconds (double precision)
-- $4  the semaphore's notification channel
--
-- Returns one boolean: true while the owner held them (their expiry is set again).
SELECT distlock_permit_extend($1, $2, $3, $4)
