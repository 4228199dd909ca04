-- Whether an owner holds a read holding right now, on the database's clock.
--
-- $1  lock name
-- $2  owner
--
-- Returns one boolean.
SELECT EXISTS (
    SELECT 1 FROM distlock_readers
    WHERE name = $1 AND owner = $2 AND expires_at > clock_timestamp()
)
