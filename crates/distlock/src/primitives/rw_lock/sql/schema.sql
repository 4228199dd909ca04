-- The read-write lock's part of the schema, created at connect when missing (after the
-- lease lock's table, in the same transaction).
--
-- A writer is a lease lock: the row of distlock_locks at the name. Readers are rows of
-- distlock_readers, one per read holding, each with its own expiry. The lock's row
-- carries readers_until, the latest expiry of a live read holding (or earlier: -infinity
-- with none), so that a writer's acquisition, which must not overlap a reader, decides
-- on the one row it writes: PostgreSQL serializes writes of a row and re-checks a
-- waiting writer's condition on the row's latest version, while a condition on other
-- rows would be judged on the statement's snapshot. Everything that adds a reader or
-- moves a reader's expiry later (an acquisition, a renewal, an extension) raises
-- readers_until in the same transaction; a release lowers it to what the live readers
-- left still need, read after locking the lock's row, so no reader can slip in between.
--
-- The functions run as one round trip each, and each statement in them reads what was
-- committed before it started (they are VOLATILE, in READ COMMITTED): a release locks
-- the lock's row first, then reads the readers left. Every function takes the lock's row
-- before any reader's row, the order an acquisition takes them in, so none of them can
-- deadlock with another.
ALTER TABLE distlock_locks
    ADD COLUMN IF NOT EXISTS readers_until timestamptz NOT NULL DEFAULT '-infinity';
CREATE TABLE IF NOT EXISTS distlock_readers (
    name          text NOT NULL,
    owner         text NOT NULL,
    holds         integer NOT NULL,
    expires_at    timestamptz NOT NULL,
    released_by   text,
    released_txid bigint,
    PRIMARY KEY (name, owner)
);

-- Gives a read holding back (all its holds): see read_release.sql for its contract.
CREATE OR REPLACE FUNCTION distlock_read_release(
    lock_name text, reader text, request text, channel text
) RETURNS text LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    by_this boolean;
    still_until timestamptz;
BEGIN
    PERFORM 1 FROM distlock_locks WHERE name = lock_name FOR UPDATE;
    UPDATE distlock_readers
    SET holds = CASE WHEN expires_at > clock_timestamp() THEN 0 ELSE holds END,
        released_txid = CASE WHEN expires_at > clock_timestamp() THEN txid_current()
                             ELSE released_txid END,
        expires_at = least(expires_at, clock_timestamp()),
        released_by = request
    WHERE name = lock_name AND owner = reader
      AND (expires_at > clock_timestamp() OR released_by = request)
    RETURNING released_txid = txid_current() INTO by_this;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF NOT by_this THEN
        RETURN 'before';
    END IF;
    SELECT max(expires_at) INTO still_until
    FROM distlock_readers
    WHERE name = lock_name AND expires_at > clock_timestamp();
    UPDATE distlock_locks
    SET readers_until = coalesce(still_until, '-infinity')
    WHERE name = lock_name;
    -- Every release may bring a waiting writer's turn closer (the lease it slept on may
    -- have been this reader's): it looks again.
    PERFORM pg_notify(channel, '0');
    IF still_until IS NULL THEN
        RETURN 'freed';
    END IF;
    RETURN 'released';
END
$$;

-- Renews a batch of read holdings: see read_renew.sql for its contract.
CREATE OR REPLACE FUNCTION distlock_read_renew(
    lease_ms double precision, names text[], owners text[]
) RETURNS TABLE (name text, owner text) LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM distlock_locks AS held
    WHERE held.name = ANY (names)
    ORDER BY held.name
    FOR UPDATE;
    -- A reader counts as renewed only while its lock's row still keeps writers out for
    -- it (readers_until at least its expiry): a row deleted or truncated by hand, and
    -- made again by a writer, does not, and the reader is lost.
    RETURN QUERY
    WITH covered AS (
        SELECT reader.name, reader.owner
        FROM distlock_readers AS reader
        JOIN unnest(names, owners) AS due(name, owner)
          ON reader.name = due.name AND reader.owner = due.owner
        JOIN distlock_locks AS held ON held.name = reader.name
        WHERE reader.expires_at > clock_timestamp()
          AND held.readers_until >= reader.expires_at
    ), renewed AS (
        UPDATE distlock_readers AS reader
        SET expires_at = clock_timestamp() + lease_ms * interval '1 millisecond'
        FROM covered
        WHERE reader.name = covered.name AND reader.owner = covered.owner
        RETURNING reader.name, reader.owner, reader.expires_at
    ), raised AS (
        UPDATE distlock_locks AS held
        SET readers_until = greatest(held.readers_until, latest.until)
        FROM (SELECT renewed.name, max(renewed.expires_at) AS until
              FROM renewed GROUP BY renewed.name) AS latest
        WHERE held.name = latest.name
    )
    SELECT renewed.name, renewed.owner FROM renewed;
END
$$;

-- Sets a read holding's lease to a new length from now: see read_extend.sql.
CREATE OR REPLACE FUNCTION distlock_read_extend(
    lock_name text, reader text, lease_ms double precision, channel text
) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    until timestamptz;
BEGIN
    PERFORM 1 FROM distlock_locks WHERE name = lock_name FOR UPDATE;
    UPDATE distlock_readers
    SET expires_at = clock_timestamp() + lease_ms * interval '1 millisecond'
    WHERE name = lock_name AND owner = reader AND expires_at > clock_timestamp()
    RETURNING expires_at INTO until;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    -- A shorter lease may lower what the readers need (this row is locked, so no
    -- reader comes or goes meanwhile): read again from the live readers.
    SELECT max(expires_at) INTO until
    FROM distlock_readers
    WHERE name = lock_name AND expires_at > clock_timestamp();
    UPDATE distlock_locks
    SET readers_until = coalesce(until, '-infinity')
    WHERE name = lock_name;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    -- A waiting writer may have slept on the longer lease: it looks again.
    PERFORM pg_notify(channel, '0');
    RETURN true;
END
$$;

-- Ends read holdings whoever holds them (an operator's force-unlock): every reader of
-- the lock, or only `reader` unless it is ''. Returns how many ended; with none left,
-- notifies the lock's channel.
CREATE OR REPLACE FUNCTION distlock_read_force_end(
    lock_name text, reader text, channel text
) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    ended integer;
    still_until timestamptz;
BEGIN
    PERFORM 1 FROM distlock_locks WHERE name = lock_name FOR UPDATE;
    UPDATE distlock_readers
    SET holds = 0, expires_at = clock_timestamp()
    WHERE name = lock_name AND expires_at > clock_timestamp()
      AND (reader = '' OR owner = reader);
    GET DIAGNOSTICS ended = ROW_COUNT;
    IF ended = 0 THEN
        RETURN 0;
    END IF;
    SELECT max(expires_at) INTO still_until
    FROM distlock_readers
    WHERE name = lock_name AND expires_at > clock_timestamp();
    UPDATE distlock_locks
    SET readers_until = coalesce(still_until, '-infinity')
    WHERE name = lock_name;
    IF still_until IS NULL THEN
        PERFORM pg_notify(channel, '0');
    END IF;
    RETURN ended;
END
$$;
