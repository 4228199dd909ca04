-- Sets a holding's lease to a new length from now (LockGuard::extend, a MultiLock
-- member fixed to its lease).
--
-- $1  lock name
-- $2  owner
-- $3  the lease, milliseconds (double precision)
--
-- Returns one row while the owner held the lock (its expiry is set again), none if not.
UPDATE distlock_locks
SET expires_at = clock_timestamp() + $3 * interval '1 millisecond'
WHERE name = $1 AND owner = $2 AND expires_at > clock_timestamp()
RETURNING holds
