-- A semaphore's total and the permits its live rows hold, read in one statement.
--
-- $1  semaphore name
--
-- Returns one row (total, taken): (0, 0) for a semaphore with no total and no permits.
SELECT coalesce((SELECT permits FROM distlock_semaphores WHERE name = $1), 0)::bigint,
       coalesce((SELECT sum(permits) FROM distlock_permits
                 WHERE name = $1 AND expires_at > clock_timestamp()), 0)::bigint
