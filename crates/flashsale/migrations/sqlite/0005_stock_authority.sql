-- The store's stock authority: the one Redis (and key namespace) whose counters sell this
-- store's stock. Two authorities on one store would each sell the whole stock from their
-- own counter, so every instance checks it at start (src/authority.rs). NULL until the
-- store is first used; moved on purpose only by `serve --take-over-store`, and only once
-- released: its last instance stopped gracefully with every order stored (1), or taken
-- over with --abandon-old-authority.
ALTER TABLE store ADD COLUMN authority TEXT;
ALTER TABLE store ADD COLUMN authority_released INTEGER NOT NULL DEFAULT 0;
ALTER TABLE store ADD COLUMN authority_location TEXT;
ALTER TABLE store ADD COLUMN authority_since BIGINT;

-- The instances selling this store's stock now, each beating every 0.5 s and removing
-- its row when it stops gracefully: the last to stop releases the store, and an abandoning
-- take-over waits until all are silent. Two authorities must never sell at once.
CREATE TABLE store_instances (
    id         TEXT    PRIMARY KEY,
    described  TEXT    NOT NULL,
    authority  TEXT    NOT NULL,
    seen_at    BIGINT  NOT NULL
);
