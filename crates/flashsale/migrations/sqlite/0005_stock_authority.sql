-- The store's stock authority: the one Redis (and key namespace) whose counters sell this
-- store's stock. Two authorities on one store would each sell the whole stock from their
-- own counter, so every instance checks it at start (src/authority.rs). NULL until the
-- store is first used; moved on purpose only by `serve --take-over-store`.
ALTER TABLE store ADD COLUMN authority TEXT;
ALTER TABLE store ADD COLUMN authority_location TEXT;
ALTER TABLE store ADD COLUMN authority_since BIGINT;
