-- Frees a lock its owner holds (the last hold), and wakes one waiter; or, sent again
-- after a lost reply, finds that an earlier try of the same release freed it.
--
-- $1  lock name
-- $2  owner
-- $3  the release's request id, unique to this release and the same on its retries
-- $4  the lock's notification channel
--
-- Returns one row: 'freed' when this statement freed the lock (a waiter is notified
-- once it commits), 'before' when an earlier try of this release did (the lock may be
-- another owner's by now, and is left as it is); no row when the owner no longer held
-- it: its lease had run out on the database's clock, or it was force-unlocked.
--
-- The row qualifies by its owner or by the release's mark, and PostgreSQL checks that
-- against the row's latest version after waiting for its lock, so a retry that waited
-- behind its own first try sees the mark that try left. Only a row this holding still
-- owns is changed; a retry that finds the mark sets it again and nothing else.
WITH released AS (
    UPDATE distlock_locks
    SET owner = CASE WHEN owner = $2 THEN '' ELSE owner END,
        holds = CASE WHEN owner = $2 THEN 0 ELSE holds END,
        expires_at = CASE WHEN owner = $2 THEN clock_timestamp() ELSE expires_at END,
        released_txid = CASE WHEN owner = $2 THEN txid_current() ELSE released_txid END,
        released_by = $3
    WHERE name = $1
      AND ((owner = $2 AND expires_at > clock_timestamp()) OR released_by = $3)
    RETURNING released_txid = txid_current() AS now
)
SELECT CASE WHEN released.now THEN 'freed' ELSE 'before' END
FROM released
LEFT JOIN LATERAL (SELECT pg_notify($4, '0') WHERE released.now) AS woken ON true
