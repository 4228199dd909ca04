-- Whether an owner holds its permits right now, on the database's clock.
--
-- $1  semaphore name
-- $2  owner
--
-- Returns one boolean.
SELECT EXISTS (
    SELECT 1 FROM distlock_permits
    WHERE name = $1 AND owner = $2 AND expires_at > clock_timestamp()
)
