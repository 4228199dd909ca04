-- Sets a read holding's lease to a new length from now, and raises the lock's
-- readers_until with it (distlock_read_extend, schema.sql).
--
-- $1  lock name
-- $2  owner
-- $3  the lease, milliseconds (double precision)
--
-- Returns one boolean: true while the owner held it (its expiry is set again).
SELECT distlock_read_extend($1, $2, $3)
