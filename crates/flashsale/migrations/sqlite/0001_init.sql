-- Coupons and the orders written by the stream worker. Times are Unix milliseconds so
-- that the same queries run on SQLite and PostgreSQL.
CREATE TABLE coupons (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    title       TEXT    NOT NULL,
    stock       BIGINT  NOT NULL CHECK (stock > 0),
    price       BIGINT  NOT NULL CHECK (price >= 0),
    starts_at   BIGINT  NOT NULL,
    ends_at     BIGINT  NOT NULL,
    created_at  BIGINT  NOT NULL,
    CHECK (ends_at > starts_at)
);

CREATE TABLE orders (
    id          TEXT    PRIMARY KEY,
    coupon_id   BIGINT  NOT NULL REFERENCES coupons (id),
    user_id     BIGINT  NOT NULL,
    created_at  BIGINT  NOT NULL,
    stored_at   BIGINT  NOT NULL,
    -- One coupon per user, enforced by the database as the last line of defence.
    UNIQUE (coupon_id, user_id)
);

CREATE INDEX orders_by_user ON orders (user_id, created_at);
