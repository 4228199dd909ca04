-- How long a lock's lease has left, on the database's clock: its holder's, or, while
-- readers of the read-write lock of the name hold it, the latest expiry they need
-- (readers_until, rw_lock/sql/schema.sql).
--
-- $1  lock name
--
-- Returns one row with the milliseconds left (rounded up) while the lock is held, none
-- while it is free.
SELECT ceil(greatest(0, extract(epoch FROM greatest(expires_at, readers_until)
                                         - clock_timestamp()) * 1000))::bigint
FROM distlock_locks
WHERE name = $1 AND greatest(expires_at, readers_until) > clock_timestamp()
