-- The namespace of this store in Redis: every key the service writes carries it, so two
-- databases sharing one Redis never share a counter, a buyers set, a stream or a lock.
-- Created with the schema, once, and never changed: changing it would orphan every key.
CREATE TABLE store (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    namespace  TEXT    NOT NULL
);
INSERT INTO store (id, namespace) VALUES (1, lower(hex(randomblob(8))));
