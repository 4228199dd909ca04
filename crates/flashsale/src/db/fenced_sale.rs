//! The `lock` strategy's sale: an order written under its coupon lock's fencing token, in
//! one transaction that decides everything from the database itself (docs/flashsale.md,
//! "The lock strategy, fenced").

use sqlx::Row;

use super::{order_from_row, Admission, Db, DbError, ORDER_BY_ID};
use crate::model::{parse_order_id, Order, OrderEvent};

/// The highest token a coupon's orders were written under by the `lock` strategy.
const LOCK_FENCE: &str = "SELECT token FROM lock_fences WHERE coupon_id = $1";

/// What a fenced sale did ([`Db::sell_fenced`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FencedSale {
    /// The order is stored; this many units are left.
    Sold {
        /// Units left after this sale.
        remaining: i64,
    },
    /// Every unit has an order.
    SoldOut,
    /// The user already holds this order.
    AlreadyBought {
        /// The order the user holds.
        order_id: String,
    },
    /// A newer holder of the coupon's lock has written: this holder's lease ran out (or
    /// the token counter went back, Redis having lost it).
    Fenced {
        /// The highest token that has written.
        highest: u64,
    },
    /// The lease was no longer trusted just before the commit: rolled back.
    LeaseLost,
    /// No such coupon.
    NoCoupon,
    /// The store has moved past the selling instance's admission (a take-over): nothing
    /// is stored, and the instance may no longer sell.
    Evicted,
}

impl Db {
    /// Stores `order` under the fencing token `token` of its coupon's lock, in one
    /// transaction that decides everything from the database itself:
    ///
    /// 1. the coupon's fence is raised to `token`, or the sale is refused ([`FencedSale::Fenced`])
    ///    if a larger token has written: the first statement, so it also takes the row
    ///    lock that serializes concurrent sales of the coupon until commit;
    /// 2. the user's existing order and the store's count of the coupon's units sold
    ///    (`coupon_sales`, kept with every order stored) are read, and the order is
    ///    inserted, and counted, only if the user has none and a unit is left;
    /// 3. `still_held` is asked just before the commit; `false` rolls back
    ///    ([`FencedSale::LeaseLost`]).
    ///
    /// Before all of it, the store must still admit `admission`'s instance
    /// ([`FencedSale::Evicted`] otherwise).
    ///
    /// An error before the commit means nothing was stored. An error from the commit
    /// itself leaves the outcome unknown ([`FencedCommitError::InDoubt`]).
    pub async fn sell_fenced(
        &self,
        admission: &Admission,
        order: &OrderEvent,
        token: u64,
        now_ms: i64,
        still_held: impl FnOnce() -> bool,
    ) -> Result<FencedSale, FencedCommitError> {
        let token = i64::try_from(token).unwrap_or(i64::MAX);
        let mut tx = match self.begin_admitted(admission).await {
            Ok(tx) => tx,
            Err(DbError::Evicted { .. }) => return Ok(FencedSale::Evicted),
            Err(err) => return Err(FencedCommitError::Before(err)),
        };
        let raised = sqlx::query(
            "INSERT INTO lock_fences (coupon_id, token) SELECT id, $2 FROM coupons WHERE id = $1 \
             ON CONFLICT (coupon_id) DO UPDATE SET token = excluded.token \
             WHERE lock_fences.token <= excluded.token",
        )
        .bind(order.coupon_id)
        .bind(token)
        .execute(&mut *tx)
        .await
        .map_err(FencedCommitError::before)?
        .rows_affected();
        let row = sqlx::query(
            "SELECT (SELECT o.id FROM orders o WHERE o.coupon_id = c.id AND o.user_id = $2) \
             AS held FROM coupons c WHERE c.id = $1",
        )
        .bind(order.coupon_id)
        .bind(order.user_id)
        .fetch_optional(&mut *tx)
        .await
        .map_err(FencedCommitError::before)?;
        let Some(row) = row else {
            return Ok(FencedSale::NoCoupon);
        };
        if raised == 0 {
            // The coupon exists, so the fence row was there and holds a larger token.
            let highest: i64 = sqlx::query(LOCK_FENCE)
                .bind(order.coupon_id)
                .fetch_one(&mut *tx)
                .await
                .and_then(|row| row.try_get("token"))
                .map_err(FencedCommitError::before)?;
            return Ok(FencedSale::Fenced {
                highest: highest.max(0).unsigned_abs(),
            });
        }
        let held: Option<String> = row.try_get("held").map_err(FencedCommitError::before)?;
        if let Some(order_id) = held {
            return Ok(FencedSale::AlreadyBought { order_id });
        }
        // The store's own count of units sold, kept with every order stored.
        let left = self
            .units_left(&mut tx, order.coupon_id)
            .await
            .map_err(FencedCommitError::Before)?;
        if left == 0 {
            return Ok(FencedSale::SoldOut);
        }
        sqlx::query(
            "INSERT INTO orders (id, coupon_id, user_id, created_at, stored_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(order.order_id.as_str())
        .bind(order.coupon_id)
        .bind(order.user_id)
        .bind(order.created_at)
        .bind(now_ms)
        .execute(&mut *tx)
        .await
        .map_err(FencedCommitError::before)?;
        sqlx::query("UPDATE coupon_sales SET sold = sold + 1 WHERE coupon_id = $1")
            .bind(order.coupon_id)
            .execute(&mut *tx)
            .await
            .map_err(FencedCommitError::before)?;
        if !still_held() {
            return Ok(FencedSale::LeaseLost);
        }
        tx.commit().await.map_err(FencedCommitError::InDoubt)?;
        Ok(FencedSale::Sold {
            remaining: i64::try_from(left - 1).unwrap_or(i64::MAX),
        })
    }
}

impl Db {
    /// The highest fencing token the `lock` strategy has written coupon `coupon_id`'s
    /// orders under, if it has.
    pub async fn lock_fence(&self, coupon_id: i64) -> Result<Option<u64>, DbError> {
        let row = sqlx::query(LOCK_FENCE)
            .bind(coupon_id)
            .fetch_optional(&self.pool)
            .await?;
        let token: Option<i64> = row.map(|row| row.try_get("token")).transpose()?;
        Ok(token.map(|token| token.max(0).unsigned_abs()))
    }

    /// The order `order_id` of coupon `coupon_id`, read once no sale of the coupon can
    /// still be committing: behind the coupon's fence row lock (PostgreSQL) or the write
    /// lock (SQLite), which a transaction still in flight holds until it ends. For a sale
    /// whose commit failed, the answer is final.
    pub async fn settled_order(
        &self,
        coupon_id: i64,
        order_id: &str,
    ) -> Result<Option<Order>, DbError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("UPDATE lock_fences SET token = token WHERE coupon_id = $1")
            .bind(coupon_id)
            .execute(&mut *tx)
            .await?;
        let Some((_, user_id)) = parse_order_id(order_id) else {
            return Ok(None);
        };
        let row = sqlx::query(ORDER_BY_ID)
            .bind(coupon_id)
            .bind(user_id)
            .bind(order_id)
            .fetch_optional(&mut *tx)
            .await?;
        tx.rollback().await?;
        row.as_ref().map(order_from_row).transpose()
    }
}

/// Why [`Db::sell_fenced`] failed.
#[derive(Debug, thiserror::Error)]
pub enum FencedCommitError {
    /// A statement before the commit failed: the transaction rolled back, nothing stored.
    #[error("database query failed before the commit: {0}")]
    Before(#[source] DbError),
    /// The commit failed: the order may or may not be stored.
    #[error("the commit's outcome is unknown: {0}")]
    InDoubt(#[source] sqlx::Error),
}

impl FencedCommitError {
    fn before(err: sqlx::Error) -> Self {
        FencedCommitError::Before(DbError::Query(err))
    }
}
