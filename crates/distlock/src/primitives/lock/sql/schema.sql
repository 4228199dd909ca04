-- The lease lock's table and its fencing-token sequence, created at connect when missing
-- (each client runs this under a transaction-scoped advisory lock, so two clients
-- starting together do not collide on the catalog).
--
-- One row per lock name ever used. A free lock keeps its row, with owner '' and an
-- expiry in the past, so that a release retried after a lost reply still finds the mark
-- its first try left (released_by), and so that taking a lock is an UPDATE of a row that
-- exists, which PostgreSQL serializes on the row.
--
-- Tokens come from one sequence for every lock (as Redis's per-slot counter is shared by
-- the names of a slot): each lock's tokens still only grow.
CREATE TABLE IF NOT EXISTS distlock_locks (
    name        text PRIMARY KEY,
    owner       text NOT NULL,
    holds       integer NOT NULL,
    token       bigint NOT NULL,
    expires_at  timestamptz NOT NULL,
    released_by text
);
CREATE SEQUENCE IF NOT EXISTS distlock_tokens AS bigint;
