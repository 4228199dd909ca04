-- Renews a batch of watchdog permits in one statement (the renewal scheduler's contract),
-- through distlock_permit_renew (schema.sql).
--
-- $1  the lease, milliseconds (double precision)
-- $2  the semaphores' names (text[])
-- $3  the owners (text[]), in the same order
--
-- Returns a row (name, owner) for each owner whose permits were still live: their expiry
-- is set again. An owner with no row is lost.
SELECT name, owner FROM distlock_permit_renew($1, $2, $3)
