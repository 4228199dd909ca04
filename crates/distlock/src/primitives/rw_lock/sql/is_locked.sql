-- Whether anyone holds a read-write lock right now, for writing or reading, on the
-- database's clock.
--
-- $1  lock name
--
-- Returns one boolean.
SELECT EXISTS (
           SELECT 1 FROM distlock_locks
           WHERE name = $1 AND expires_at > clock_timestamp()
       )
    OR EXISTS (
           SELECT 1 FROM distlock_readers
           WHERE name = $1 AND expires_at > clock_timestamp()
       )
