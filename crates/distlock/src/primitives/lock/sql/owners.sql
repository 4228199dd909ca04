-- Who holds a lock right now, on the database's clock: its holder, or the readers of
-- the read-write lock of the name.
--
-- $1  lock name
--
-- Returns the holders' owner ids (one row while a writer holds the lock, one a reader
-- while readers do), or no row.
SELECT owner FROM distlock_locks WHERE name = $1 AND expires_at > clock_timestamp()
UNION ALL
SELECT owner FROM distlock_readers WHERE name = $1 AND expires_at > clock_timestamp()
