-- Who holds a lock right now, on the database's clock.
--
-- $1  lock name
--
-- Returns the holder's owner id (one row while the lock is held), or no row.
SELECT owner FROM distlock_locks WHERE name = $1 AND expires_at > clock_timestamp()
