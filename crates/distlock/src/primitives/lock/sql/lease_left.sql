-- How long a lock's lease has left, on the database's clock.
--
-- $1  lock name
--
-- Returns one row with the milliseconds left (rounded up) while the lock is held, none
-- while it is free.
SELECT ceil(greatest(0, extract(epoch FROM expires_at - clock_timestamp()) * 1000))::bigint
FROM distlock_locks
WHERE name = $1 AND expires_at > clock_timestamp()
