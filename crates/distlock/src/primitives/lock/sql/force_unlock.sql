-- Frees a lock whoever holds it, or only while a given owner does, and wakes one
-- waiter. Also what a client runs for an acquisition whose reply it lost: that owner may
-- hold the lock without knowing it.
--
-- $1  lock name
-- $2  the owner it must be, or '' for any
-- $3  the lock's notification channel
--
-- Returns one row when a holding was ended, none when there was none to end.
WITH freed AS (
    UPDATE distlock_locks
    SET owner = '', holds = 0, expires_at = clock_timestamp()
    WHERE name = $1
      AND expires_at > clock_timestamp()
      AND ($2 = '' OR owner = $2)
    RETURNING name
)
SELECT pg_notify($3, '0') FROM freed
