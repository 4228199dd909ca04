-- One row that /healthz updates, to prove the database takes writes: a locked SQLite file
-- or a read-only replica still answers reads.
CREATE TABLE health (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    checked_at  BIGINT  NOT NULL
);
INSERT INTO health (id, checked_at) VALUES (1, 0);
