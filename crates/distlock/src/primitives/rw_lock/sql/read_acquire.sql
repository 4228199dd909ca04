-- Takes a read holding for a new owner while no writer holds the lock, in one statement.
--
-- $1  lock name
-- $2  owner, "<client uuid>:<n>", unique to this attempt
-- $3  lease, milliseconds (double precision)
--
-- Returns one row (held, left_ms):
--   (true, NULL)   the owner holds a read holding now
--   (false, left)  a writer holds the lock; its lease has `left` ms left on the
--                  database's clock
-- or no row, when another client wrote the lock's row after this statement's snapshot
-- was taken: busy, with no hint.
--
-- The busy answer reads the row as the statement's snapshot saw it, which may be older
-- than the version the gate found taken: an expiry of -infinity (a row only readers
-- held) is clamped to now before subtracting, as PostgreSQL refuses to subtract an
-- infinite timestamp.
--
-- The lock's row is written first (created free for writers when the name is new): its
-- readers_until rises to this holding's expiry, so a writer, which waits for
-- readers_until to pass, decides on the row PostgreSQL serializes. The expiry is computed
-- once, so the row never promises less than the reader's own row. Read rows that ended a
-- minute ago or more are deleted on the way (a release sent again within that minute
-- still finds its mark).
WITH lease AS (
    SELECT clock_timestamp() + $3 * interval '1 millisecond' AS until
), gate AS (
    INSERT INTO distlock_locks AS held (name, owner, holds, token, expires_at, readers_until)
    SELECT $1, '', 0, 0, '-infinity', lease.until FROM lease
    ON CONFLICT (name) DO UPDATE
        SET readers_until = greatest(held.readers_until, excluded.readers_until)
        WHERE held.expires_at <= clock_timestamp()
    RETURNING held.name
), cleared AS (
    DELETE FROM distlock_readers
    WHERE name = $1
      AND expires_at <= clock_timestamp() - interval '1 minute'
      AND EXISTS (SELECT 1 FROM gate)
), joined AS (
    INSERT INTO distlock_readers (name, owner, holds, expires_at)
    SELECT gate.name, $2, 1, lease.until FROM gate, lease
    RETURNING owner
)
SELECT true AS held, NULL::bigint AS left_ms FROM joined
UNION ALL
SELECT false,
       ceil(greatest(0, extract(epoch FROM greatest(expires_at, clock_timestamp())
                                            - clock_timestamp()) * 1000))::bigint
FROM distlock_locks
WHERE name = $1 AND NOT EXISTS (SELECT 1 FROM gate)
