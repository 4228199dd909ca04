-- The store's epoch: a number that only grows, moved by every start, take-over and release
-- of the store (src/db/authority.rs). `tenure_epoch` is the epoch at which the current
-- authority's tenure began (its first start after a release, or its take-over): an
-- instance admitted at an epoch below it belongs to an earlier tenure, and every write it
-- makes is refused by the database in the write's own transaction. So an instance frozen,
-- slow or with a skewed clock can never write to the store once it has moved on.
ALTER TABLE store ADD COLUMN epoch BIGINT NOT NULL DEFAULT 0;
ALTER TABLE store ADD COLUMN tenure_epoch BIGINT NOT NULL DEFAULT 0;
-- A random id of the current tenure, never given twice: a restore can take the epoch
-- back, so a number cannot tell one tenure from another. The authority's Redis keeps the
-- id of the tenure its order streams belong to.
ALTER TABLE store ADD COLUMN tenure_id TEXT;
-- The tenure just before the current one, when that one ended with a release (everything
-- it sold stored): its Redis's state is then the store's, and a new tenure on that same
-- Redis keeps it instead of rebuilding from SQL.
ALTER TABLE store ADD COLUMN previous_tenure_id TEXT;

-- The epoch each instance was admitted at. `seen_at` is now the database's own clock
-- (Unix ms), never an instance's. `beats` counts the beats the store accepted from the
-- instance: the instance knows how many it was told of, so a count that went back (the
-- database restored from a backup under it) stops it before it writes on a store that
-- forgot what it wrote.
ALTER TABLE store_instances ADD COLUMN epoch BIGINT NOT NULL DEFAULT 0;
ALTER TABLE store_instances ADD COLUMN beats BIGINT NOT NULL DEFAULT 0;

-- Units sold per coupon, kept in the same transaction as every order stored: the store
-- itself refuses an order beyond the coupon's stock, whatever Redis counted (a Redis put
-- back to an earlier state counts sold units as left). Such an order is kept in
-- `orders_refused`, for `reconcile` to list: its buyer was told 201.
CREATE TABLE coupon_sales (
    coupon_id  BIGINT  PRIMARY KEY REFERENCES coupons (id),
    sold       BIGINT  NOT NULL
);
INSERT INTO coupon_sales (coupon_id, sold)
    SELECT coupon_id, COUNT(*) FROM orders GROUP BY coupon_id;

CREATE TABLE orders_refused (
    coupon_id   BIGINT  NOT NULL,
    user_id     BIGINT  NOT NULL,
    id          TEXT    NOT NULL,
    created_at  BIGINT  NOT NULL,
    refused_at  BIGINT  NOT NULL,
    PRIMARY KEY (coupon_id, id)
);
