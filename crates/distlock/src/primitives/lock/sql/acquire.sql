-- Takes a free lease lock for a new owner and hands out a fencing token, in one statement.
--
-- $1  lock name
-- $2  owner, "<client uuid>:<n>", unique to this attempt
-- $3  lease, milliseconds (double precision)
--
-- Returns one row (token, left_ms):
--   (token, NULL)  the owner holds the lock now, with this fencing token
--   (NULL, left)   another owner holds it, or readers of the read-write lock of the name
--                  do (rw_lock/sql/schema.sql); that lease has `left` ms left on the
--                  database's clock
-- or no row, when another client wrote the row after this statement's snapshot was
-- taken: busy, with no hint.
--
-- The busy answer reads the row as the statement's snapshot saw it, which may be older
-- than the version found taken: a row only readers held has -infinity in both
-- expiries, clamped to now before subtracting (PostgreSQL refuses to subtract an
-- infinite timestamp).
--
-- The lock is free when its row's expiry has passed on the database's clock, so no two
-- clients' clocks are ever compared. The expiry counts from when the row is written,
-- never earlier than when the client sent the statement, which is where the client's own
-- deadline counts from: the client stops trusting a lease before the database frees it.
--
-- The token is drawn when the existing row is written, after any wait for another writer
-- of that row, and is at least the row's last token plus one, so a later holder always
-- has a larger token than an earlier one, even after the sequence was restarted or is
-- cached per connection. (The value drawn in VALUES is used only by the first holder of
-- a new name; on a busy lock it is thrown away. Tokens have gaps; they only grow.)
WITH taken AS (
    INSERT INTO distlock_locks AS held (name, owner, holds, token, expires_at)
    VALUES ($1, $2, 1, nextval('distlock_tokens'),
            clock_timestamp() + $3 * interval '1 millisecond')
    ON CONFLICT (name) DO UPDATE
        SET owner = excluded.owner,
            holds = 1,
            token = greatest(nextval('distlock_tokens'), held.token + 1),
            expires_at = clock_timestamp() + $3 * interval '1 millisecond'
        WHERE held.expires_at <= clock_timestamp()
          AND held.readers_until <= clock_timestamp()
    RETURNING token
)
SELECT token, NULL::bigint AS left_ms FROM taken
UNION ALL
SELECT NULL::bigint,
       ceil(greatest(0, extract(epoch FROM greatest(expires_at, readers_until,
                                                     clock_timestamp())
                                            - clock_timestamp()) * 1000))::bigint
FROM distlock_locks
WHERE name = $1 AND NOT EXISTS (SELECT 1 FROM taken)
