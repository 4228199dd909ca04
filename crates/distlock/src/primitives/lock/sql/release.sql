-- Frees a lock its owner holds (the last hold), and wakes one waiter.
--
-- $1  lock name
-- $2  owner
-- $3  the release's request id, unique to this release: kept on the row, so that the same
--     release sent again after a lost reply finds its own mark and answers alike
-- $4  the lock's notification channel
--
-- Returns one row when this request freed the lock (a waiter is notified once the
-- statement commits), none when the owner no longer held it: its lease had run out on
-- the database's clock, or it was force-unlocked, or another owner took it since.
WITH freed AS (
    UPDATE distlock_locks
    SET owner = '', holds = 0, expires_at = clock_timestamp(), released_by = $3
    WHERE name = $1
      AND ((owner = $2 AND expires_at > clock_timestamp()) OR released_by = $3)
    RETURNING name
)
SELECT pg_notify($4, '0') FROM freed
