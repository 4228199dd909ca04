-- The highest fencing token the `lock` strategy has written each coupon's orders under.
-- A sale commits only with a token at least this high, checked and raised in the same
-- transaction as its INSERT, so a holder whose lease ran out (a pause, a stall) cannot
-- write once a newer holder has.
CREATE TABLE lock_fences (
    coupon_id  BIGINT  PRIMARY KEY REFERENCES coupons (id),
    token      BIGINT  NOT NULL
);
