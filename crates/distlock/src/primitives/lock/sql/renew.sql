-- Renews a batch of watchdog leases in one statement (the renewal scheduler's contract).
--
-- $1  the lease, milliseconds (double precision)
-- $2  the locks' names (text[])
-- $3  their owners (text[]), in the same order
--
-- Returns a row (name, owner) for each lease its owner still held: its expiry is set
-- again. A lease with no row is lost.
--
-- The rows are locked in name order first, the order the readers' renewal
-- (distlock_read_renew) takes them in, so that the two batches, sent at once on two
-- connections, cannot deadlock over rows both touch (a writer's and its downgraded
-- reader's).
WITH locked AS MATERIALIZED (
    SELECT held.name
    FROM distlock_locks AS held
    JOIN unnest($2::text[], $3::text[]) AS due(name, owner)
      ON held.name = due.name AND held.owner = due.owner
    ORDER BY held.name
    FOR UPDATE OF held
)
UPDATE distlock_locks AS held
SET expires_at = clock_timestamp() + $1 * interval '1 millisecond'
FROM unnest($2::text[], $3::text[]) AS due(name, owner)
WHERE held.name = due.name
  AND held.owner = due.owner
  AND held.name IN (SELECT name FROM locked)
  AND held.expires_at > clock_timestamp()
RETURNING held.name, held.owner
