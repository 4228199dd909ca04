-- Whether an owner holds a read holding right now, on the database's clock: its row is
-- live, and the lock's row still keeps writers out for it (a row deleted or truncated by
-- hand does not).
--
-- $1  lock name
-- $2  owner
--
-- Returns one boolean.
SELECT EXISTS (
    SELECT 1
    FROM distlock_readers AS reader
    JOIN distlock_locks AS held ON held.name = reader.name
    WHERE reader.name = $1 AND reader.owner = $2
      AND reader.expires_at > clock_timestamp()
      AND held.readers_until >= reader.expires_at
)
