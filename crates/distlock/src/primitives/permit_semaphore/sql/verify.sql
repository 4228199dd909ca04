-- Whether an owner holds its permits right now, on the database's clock: its row is live
-- and its semaphore still has a row (a semaphore deleted by hand loses its permits, as
-- its renewals find).
--
-- $1  semaphore name
-- $2  owner
--
-- Returns one boolean.
SELECT EXISTS (
    SELECT 1 FROM distlock_permits AS p
    JOIN distlock_semaphores AS s ON s.name = p.name
    WHERE p.name = $1 AND p.owner = $2 AND p.expires_at > clock_timestamp()
)
