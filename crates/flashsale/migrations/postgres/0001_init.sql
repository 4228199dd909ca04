-- Coupons and the orders written by the stream worker. Times are Unix milliseconds so
-- that the same queries run on SQLite and PostgreSQL.
CREATE TABLE coupons (
    id          BIGINT  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    title       TEXT    NOT NULL,
    stock       BIGINT  NOT NULL CHECK (stock > 0),
    price       BIGINT  NOT NULL CHECK (price >= 0),
    starts_at   BIGINT  NOT NULL,
    ends_at     BIGINT  NOT NULL,
    created_at  BIGINT  NOT NULL,
    CHECK (ends_at > starts_at)
);

-- One coupon per user is the key itself, so the database refuses a second order as the
-- last line of defence, and a re-delivered order event is a no-op. The order id (a UUID
-- chosen at reservation) is not indexed: random keys would scatter every insert over the
-- whole index, and no query looks an order up by it.
CREATE TABLE orders (
    coupon_id   BIGINT  NOT NULL REFERENCES coupons (id),
    user_id     BIGINT  NOT NULL,
    id          TEXT    NOT NULL,
    created_at  BIGINT  NOT NULL,
    stored_at   BIGINT  NOT NULL,
    PRIMARY KEY (coupon_id, user_id)
);

CREATE INDEX orders_by_user ON orders (user_id, created_at);
