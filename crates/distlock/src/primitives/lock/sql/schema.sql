-- The lease lock's table and its fencing-token sequence, created at connect when missing
-- (each client runs this under a transaction-scoped advisory lock, so two clients
-- starting together do not collide on the catalog).
--
-- One row per lock name ever used. A free lock keeps its row, with owner '' and an
-- expiry in the past, so that taking a lock is an UPDATE of a row that exists, which
-- PostgreSQL serializes on the row, and so that the row's last token bounds the next.
--
-- Tokens come from one sequence for every lock (as Redis's per-slot counter is shared by
-- the names of a slot), and never fall below the row's last token plus one, so each
-- lock's tokens only grow whatever is done to the sequence.
--
-- released_by and released_txid are the request id and transaction of the release that
-- last freed the lock. Taking the lock leaves them, so that a release sent again after a
-- lost reply still finds its mark when another client took the lock in between.
CREATE TABLE IF NOT EXISTS distlock_locks (
    name        text PRIMARY KEY,
    owner       text NOT NULL,
    holds       integer NOT NULL,
    token       bigint NOT NULL,
    expires_at  timestamptz NOT NULL,
    released_by text,
    released_txid bigint
);
CREATE SEQUENCE IF NOT EXISTS distlock_tokens AS bigint;
