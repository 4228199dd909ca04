-- The permit semaphore's part of the schema, created at connect when missing (after the
-- read-write lock's, in the same transaction).
--
-- A semaphore is a row of distlock_semaphores: its name and its total permits (free plus
-- taken). Each acquisition of N permits is a row of distlock_permits with N and its own
-- expiry on the database's clock; a permit is taken while its row's expiry is ahead of
-- clock_timestamp(), so a holder that dies gives its permits back when its lease runs out.
-- The free count is never stored: it is the total less the live rows' permits, counted
-- when needed.
--
-- Every function that adds a permit row, gives one back, or moves an expiry takes the
-- semaphore's row first (FOR UPDATE), and only then reads the permit rows, each statement
-- with a fresh snapshot (they are VOLATILE, in READ COMMITTED): the decision "N fit" is
-- made on the one row PostgreSQL serializes, so a renewal cannot revive a permit that an
-- acquisition has already counted as free. A batch of renewals takes its semaphores' rows
-- in name order, as every other function takes at most one, so none can deadlock.
CREATE TABLE IF NOT EXISTS distlock_semaphores (
    name    text PRIMARY KEY,
    permits bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS distlock_permits (
    name        text NOT NULL,
    owner       text NOT NULL,
    permits     integer NOT NULL,
    expires_at  timestamptz NOT NULL,
    released_by text,
    PRIMARY KEY (name, owner)
);

-- The permits of semaphore `sem` free right now: its total less the live rows' permits,
-- 0 without a total. The caller holds the semaphore's row.
CREATE OR REPLACE FUNCTION distlock_permits_free(sem text)
RETURNS bigint LANGUAGE sql VOLATILE AS $$
    SELECT coalesce((SELECT s.permits FROM distlock_semaphores AS s WHERE s.name = sem), 0)
         - coalesce((SELECT sum(p.permits) FROM distlock_permits AS p
                     WHERE p.name = sem AND p.expires_at > clock_timestamp()), 0)
$$;

-- Takes `wanted` permits for a new owner if that many are free: see acquire.sql.
CREATE OR REPLACE FUNCTION distlock_permit_acquire(
    sem text, taker text, wanted integer, lease_ms double precision
) RETURNS TABLE (held boolean, left_ms bigint) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    total bigint;
    taken bigint;
    soonest timestamptz;
BEGIN
    SELECT s.permits INTO total FROM distlock_semaphores AS s WHERE s.name = sem FOR UPDATE;
    IF NOT FOUND THEN
        -- No total yet: nothing is free until one is set (which notifies).
        RETURN QUERY SELECT false, NULL::bigint;
        RETURN;
    END IF;
    -- Rows that ended a minute ago or more go; a release sent again within that minute
    -- still finds its mark.
    DELETE FROM distlock_permits AS p
    WHERE p.name = sem AND p.expires_at <= clock_timestamp() - interval '1 minute';
    SELECT coalesce(sum(p.permits), 0), min(p.expires_at) INTO taken, soonest
    FROM distlock_permits AS p
    WHERE p.name = sem AND p.expires_at > clock_timestamp();
    IF total - taken < wanted THEN
        RETURN QUERY SELECT false,
            ceil(greatest(0, extract(epoch FROM soonest - clock_timestamp()) * 1000))::bigint;
        RETURN;
    END IF;
    -- An owner's row that is there already is a give-up's mark (see
    -- distlock_permit_release): this statement of a given-up attempt arrived late, after
    -- the give-up, and must not take permits nobody would give back.
    INSERT INTO distlock_permits (name, owner, permits, expires_at)
    VALUES (sem, taker, wanted, clock_timestamp() + lease_ms * interval '1 millisecond')
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, NULL::bigint;
        RETURN;
    END IF;
    RETURN QUERY SELECT true, NULL::bigint;
END
$$;

-- Gives an owner's permits back: see release.sql.
CREATE OR REPLACE FUNCTION distlock_permit_release(
    sem text, taker text, request text, channel text
) RETURNS text LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM distlock_semaphores AS s WHERE s.name = sem FOR UPDATE;
    UPDATE distlock_permits AS p
    SET expires_at = clock_timestamp(), released_by = request
    WHERE p.name = sem AND p.owner = taker AND p.expires_at > clock_timestamp();
    IF FOUND THEN
        PERFORM pg_notify(channel, distlock_permits_free(sem)::text);
        RETURN 'released';
    END IF;
    IF EXISTS (SELECT 1 FROM distlock_permits AS p
               WHERE p.name = sem AND p.owner = taker AND p.released_by = request) THEN
        RETURN 'before';
    END IF;
    -- Nothing to give back: leave a mark of no permits, ended, under the owner's name, so
    -- that its acquisition, if it is still on its way (the give-up of an attempt whose
    -- reply was lost may overtake it on another connection), finds the owner taken and
    -- takes nothing. Marks go with the ended rows, a minute after.
    INSERT INTO distlock_permits (name, owner, permits, expires_at, released_by)
    VALUES (sem, taker, 0, clock_timestamp(), request)
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;

-- Renews a batch of watchdog permits: see renew.sql. A permit of a semaphore whose row
-- is gone (deleted by hand) is not renewed: it is lost.
CREATE OR REPLACE FUNCTION distlock_permit_renew(
    lease_ms double precision, names text[], owners text[]
) RETURNS TABLE (name text, owner text) LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM distlock_semaphores AS s
    WHERE s.name = ANY (names)
    ORDER BY s.name
    FOR UPDATE;
    RETURN QUERY
    UPDATE distlock_permits AS p
    SET expires_at = clock_timestamp() + lease_ms * interval '1 millisecond'
    FROM unnest(names, owners) AS due(name, owner), distlock_semaphores AS s
    WHERE p.name = due.name AND p.owner = due.owner AND s.name = p.name
      AND p.expires_at > clock_timestamp()
    RETURNING p.name, p.owner;
END
$$;

-- Sets an owner's permits' lease to a new length from now: see extend.sql.
CREATE OR REPLACE FUNCTION distlock_permit_extend(
    sem text, taker text, lease_ms double precision, channel text
) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM distlock_semaphores AS s WHERE s.name = sem FOR UPDATE;
    UPDATE distlock_permits AS p
    SET expires_at = clock_timestamp() + lease_ms * interval '1 millisecond'
    WHERE p.name = sem AND p.owner = taker AND p.expires_at > clock_timestamp();
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    -- A shorter lease may free the permits sooner than waiters were told: they look
    -- again (a payload that is not a count wakes every waiter).
    PERFORM pg_notify(channel, 'extended');
    RETURN true;
END
$$;

-- Adds `delta` permits to the total (takes them away when negative), creating the
-- semaphore with `delta` when it has none: see add_permits.sql.
CREATE OR REPLACE FUNCTION distlock_permit_add(sem text, delta bigint, channel text)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    free bigint;
BEGIN
    INSERT INTO distlock_semaphores AS s (name, permits) VALUES (sem, delta)
    ON CONFLICT (name) DO UPDATE SET permits = s.permits + excluded.permits;
    free := distlock_permits_free(sem);
    PERFORM pg_notify(channel, free::text);
    RETURN free;
END
$$;

-- Sets the total to `total` if the semaphore has none: see set_permits.sql.
CREATE OR REPLACE FUNCTION distlock_permit_set(sem text, total bigint, channel text)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    found_total bigint;
BEGIN
    INSERT INTO distlock_semaphores (name, permits) VALUES (sem, total)
    ON CONFLICT (name) DO NOTHING;
    IF FOUND THEN
        PERFORM pg_notify(channel, distlock_permits_free(sem)::text);
        RETURN NULL;
    END IF;
    SELECT s.permits INTO found_total FROM distlock_semaphores AS s WHERE s.name = sem;
    RETURN found_total;
END
$$
