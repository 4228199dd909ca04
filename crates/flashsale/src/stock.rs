//! Loading stock from SQL into Redis, under a distlock lock.
//!
//! At start, every instance of a fleet calls [`StockLoader::load_active`]. The lock makes
//! them take turns: the first loads each active coupon, the rest find the counters there
//! and leave them alone. The load script refuses to overwrite an existing counter, so even
//! a loader that lost its lock cannot reset a live sale.
//!
//! When Redis has lost its data, the stock is rebuilt from what survives:
//! remaining = SQL stock − |buyers in SQL ∪ buyers in the stream|. The union counts an
//! order once whether the worker has stored it already, not yet, or both.

use std::collections::HashMap;
use std::time::Duration;

use redis::AsyncCommands;
use serde::Serialize;

use crate::db::{Db, DbError};
use crate::keys::CouponKeys;
use crate::metrics::Metrics;
use crate::model::{now_millis, Coupon, OrderEvent};
use crate::order_events::{ensure_group, lost_by_sql, stream_events, OrderEventsError};
use crate::scripts::{LOAD_STOCK, REPAIR_STOCK, RESPLIT_STOCK, RETIRE_STREAM};

/// How long an instance waits for another to finish loading before it gives up.
const LOADER_LOCK_WAIT: Duration = Duration::from_secs(60);
/// Buyers are added in chunks so no single command carries a huge argument list.
const BUYERS_PER_COMMAND: usize = 1000;

/// Why loading failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Reading coupons or orders failed.
    #[error(transparent)]
    Db(#[from] DbError),
    /// A Redis command failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The loader lock failed.
    #[error("stock loader lock: {0}")]
    Lock(#[from] distlock::Error),
    /// Comparing Redis's orders with SQL's failed.
    #[error(transparent)]
    Orders(#[from] OrderEventsError),
    /// This Redis is not (or no longer) the store's stock authority.
    #[error("stock authority: {0}")]
    Authority(#[from] crate::authority::ConfirmError),
    /// The store has moved past this instance's tenure: it may not load stock.
    #[error("the store has moved past this instance's tenure (a take-over or a release)")]
    NotCurrentTenure,
    /// Another instance held the loader lock for longer than the wait.
    #[error("another instance held the stock loader lock for more than {0:?}")]
    LockTimeout(Duration),
}

/// What one loading pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LoadReport {
    /// Coupons whose stock this pass wrote.
    pub loaded: Vec<i64>,
    /// Coupons whose counter was already live.
    pub skipped: Vec<i64>,
}

/// Loads stock into Redis. Cheap to clone.
#[derive(Clone)]
pub struct StockLoader {
    locks: distlock::Client,
    db: Db,
    segments: u32,
    metrics: Metrics,
    /// This instance's admission: the authority whose id must be in Redis before any
    /// stock is loaded there (see [`crate::authority`]), and what the orders given back
    /// to SQL at start carry.
    tenure: Option<std::sync::Arc<crate::authority::Tenure>>,
    /// Whether this instance alone uses its Redis (the embedded mode), so a counter in
    /// another strategy's layout was left by an earlier run, not by a running neighbour.
    sole_owner: bool,
}

impl StockLoader {
    /// A loader writing `segments` stock fields per coupon, counting its loads in
    /// `metrics`.
    pub fn new(locks: distlock::Client, db: Db, segments: u32, metrics: Metrics) -> Self {
        StockLoader {
            locks,
            db,
            segments: segments.max(1),
            metrics,
            tenure: None,
            sole_owner: false,
        }
    }

    /// Loads stock only into a Redis that holds the stock authority `tenure`'s instance
    /// was admitted under (put back if Redis lost it with its data): a Redis holding
    /// another id gets nothing. With it, a live coupon's orders that Redis holds and SQL
    /// lost are stored again at start ([`restore_orders`]).
    pub fn tenure(mut self, tenure: std::sync::Arc<crate::authority::Tenure>) -> Self {
        self.tenure = Some(tenure);
        self
    }

    /// Marks this loader the only one on its Redis (the embedded mode): at start it then
    /// re-splits a counter left in another strategy's layout by an earlier run.
    pub fn sole_owner(mut self, sole: bool) -> Self {
        self.sole_owner = sole;
        self
    }

    /// Loads every coupon whose sale has not ended, under the loader lock.
    ///
    /// Then the orders SQL lost that Redis holds (a restored database) are stored again
    /// ([`restore_orders`]), for the coupons on sale and those whose sale ended within the
    /// workers' watch window: a release waits for those too.
    pub async fn load_active(&self) -> Result<LoadReport, LoadError> {
        let now = now_millis();
        let coupons = self.db.coupons_ending_after(now).await?;
        let report = self.load_under_lock(&coupons).await?;
        if let Some(tenure) = &self.tenure {
            let mut conn = self.locks.connection();
            let ended = self
                .db
                .coupons_ending_after(now - crate::worker::WATCH_AFTER_END_MS)
                .await?;
            for coupon in ended.iter().filter(|coupon| coupon.ends_at <= now) {
                restore_orders(&self.db, &mut conn, tenure.admission(), coupon.id).await?;
            }
        }
        Ok(report)
    }

    /// Loads `coupon` unless its counter is live, under the loader lock. For a new coupon,
    /// and for a reservation that found no stock because Redis lost its data. Waits for
    /// the loader lock until `deadline` at most (a purchase's own deadline: a buyer must
    /// not wait a minute behind a slow load), and never more than a minute.
    pub async fn ensure_loaded(
        &self,
        coupon: &Coupon,
        deadline: tokio::time::Instant,
    ) -> Result<bool, LoadError> {
        let wait = deadline
            .saturating_duration_since(tokio::time::Instant::now())
            .min(LOADER_LOCK_WAIT);
        let report = self
            .load_under_lock_within(std::slice::from_ref(coupon), wait)
            .await?;
        Ok(!report.loaded.is_empty())
    }

    async fn load_under_lock(&self, coupons: &[Coupon]) -> Result<LoadReport, LoadError> {
        self.load_under_lock_within(coupons, LOADER_LOCK_WAIT).await
    }

    async fn load_under_lock_within(
        &self,
        coupons: &[Coupon],
        wait: Duration,
    ) -> Result<LoadReport, LoadError> {
        let lock = self.locks.lock(self.db.keyspace().stock_loader_lock())?;
        let guard = lock
            .try_lock_for(wait)
            .await?
            .ok_or(LoadError::LockTimeout(wait))?;
        let mut outcome = Ok(());
        if let Some(tenure) = &self.tenure {
            let key = self.db.keyspace().authority();
            let mut conn = self.locks.connection();
            let authority = &tenure.admission().authority;
            match crate::authority::confirm(&mut conn, &key, authority).await {
                Ok(true) => tracing::warn!(
                    "this Redis had lost the store's stock authority id with its data; put it back"
                ),
                Ok(false) => {}
                Err(err) => outcome = Err(LoadError::Authority(err)),
            }
            if outcome.is_ok() {
                outcome = self
                    .settle_tenure(&mut conn, &tenure.admission().tenure)
                    .await;
            }
        }
        let mut report = LoadReport::default();
        let coupons = if outcome.is_ok() { coupons } else { &[] };
        for coupon in coupons {
            match self.load_one(coupon).await {
                Ok(true) => report.loaded.push(coupon.id),
                Ok(false) => report.skipped.push(coupon.id),
                Err(err) => {
                    outcome = Err(err);
                    break;
                }
            }
        }
        guard.release().await?;
        outcome.map(|()| report)
    }

    /// Sets aside what an earlier tenure of this Redis as the store's authority left here,
    /// once per tenure, before the tenure's first load, unless that tenure is the one just
    /// before this and ended with a release (a fleet restarted: its state is the store's):
    /// every coupon's order stream (with what it sold and never stored, listed by
    /// `reconcile`) and counters (rebuilt from SQL). A new tenure's workers must not store an earlier one's orders, whose units
    /// may have been sold again by another authority since (a review's move back to an
    /// abandoned Redis stored 30 such orders over a stock of 50), and its loader must not
    /// keep an earlier tenure's buyers (another review's take-over, cut after its commit,
    /// stored them as orders SQL had lost). The Redis names the tenure its state belongs
    /// to; one without the name is new, lost its data, or comes from a build without
    /// tenures, and its state, if any, is this tenure's. Only an instance of the store's
    /// current tenure sets anything aside: one the store has moved past is refused.
    async fn settle_tenure(
        &self,
        conn: &mut distlock::Connection,
        tenure: &str,
    ) -> Result<(), LoadError> {
        let key = self.db.keyspace().stream_tenure();
        let held: Option<String> = conn.get(&key).await?;
        if held.as_deref() == Some(tenure) {
            return Ok(());
        }
        let state = self.db.store_state().await?;
        let released = state
            .authority
            .as_ref()
            .is_none_or(|current| current.released);
        if released || state.tenure_id.as_deref() != Some(tenure) {
            return Err(LoadError::NotCurrentTenure);
        }
        match held {
            // The tenure just before this one, on this very Redis, ended with a release:
            // everything it sold is stored, and its state is the store's.
            Some(held) if state.previous_tenure_id.as_ref() == Some(&held) => {}
            Some(held) => {
                let mut retired = 0;
                for coupon in self.db.coupons_ending_after(i64::MIN).await? {
                    let keys = self.db.keyspace().coupon(coupon.id);
                    retired += u32::from(retire_stream(conn, &keys, &format!("t{held}")).await?);
                    let () = conn.del(&[&keys.stock, &keys.buyers, &keys.claims]).await?;
                }
                tracing::warn!(
                    earlier = %held,
                    now = %tenure,
                    streams = retired,
                    "a new tenure of this Redis as the store's authority after another \
                     authority's, or after one that was abandoned: set aside the earlier one's \
                     order streams and counters (rebuilt from SQL); `flashsale reconcile` lists \
                     what its streams hold that the store does not"
                );
            }
            None => {}
        }
        let () = conn.set(&key, tenure).await?;
        Ok(())
    }

    async fn load_one(&self, coupon: &Coupon) -> Result<bool, LoadError> {
        let keys = self.db.keyspace().coupon(coupon.id);
        let mut conn = self.locks.connection();
        self.claim_keys(&mut conn, coupon, &keys).await?;
        ensure_group(&mut conn, &keys).await?;
        let live: bool = conn.exists(&keys.stock).await?;
        if live {
            self.fit_layout(coupon, &keys).await?;
            let stored = self.db.buyers(coupon.id).await?;
            let repair = repair_stock(&mut conn, &keys, coupon.stock, &stored).await?;
            if repair != StockRepair::default() {
                tracing::warn!(
                    coupon = coupon.id,
                    buyers_added = repair.buyers_added,
                    units_lowered = repair.units_lowered,
                    "Redis's counter was behind SQL (a Redis restored or copied from an earlier \
                     state, or an update lost after a commit): gave it the buyers SQL holds and \
                     lowered its units left to match"
                );
            }
            if let Some(tenure) = &self.tenure {
                restore_orders(&self.db, &mut conn, tenure.admission(), coupon.id).await?;
            }
            return Ok(false);
        }
        // A user in both (stored, and still in the stream) counts once, with one order id.
        let mut buyers: HashMap<i64, String> =
            self.db.buyers(coupon.id).await?.into_iter().collect();
        for event in stream_events(&mut conn, &keys).await? {
            buyers.entry(event.user_id).or_insert(event.order_id);
        }
        let sold = i64::try_from(buyers.len()).unwrap_or(i64::MAX);
        let remaining = coupon.stock.saturating_sub(sold).max(0);
        let buyers: Vec<(i64, String)> = buyers.into_iter().collect();
        put_buyers(&mut conn, &keys, &buyers).await?;
        let mut script = LOAD_STOCK.key(&keys.stock);
        for share in split_stock(remaining, self.segments) {
            script.arg(share);
        }
        let loaded: i64 = script.invoke_async(&mut conn).await?;
        if loaded == 1 {
            // A coupon that had sales lost its counter: Redis lost data.
            let kind = if sold > 0 { "reload" } else { "new" };
            self.metrics.count_stock_load(kind);
            if sold > 0 {
                tracing::warn!(
                    coupon = coupon.id,
                    already_sold = sold,
                    "reloading the stock of a coupon that had sales: its counter was missing \
                     (Redis lost its data, or a new tenure set an earlier one's aside)"
                );
            }
            self.restore_fencing_counter(coupon).await?;
            tracing::info!(
                coupon = coupon.id,
                stock = coupon.stock,
                already_sold = sold,
                remaining,
                "loaded stock into redis"
            );
        }
        Ok(loaded == 1)
    }
}

impl StockLoader {
    /// Makes `keys` this coupon row's: keys left by another coupon that had the same id
    /// (the database restored to before it was created, and the id given out again) are
    /// set aside, its stream kept for `reconcile`, its counters dropped, so this coupon is
    /// loaded from its own SQL rows (a review's new coupon of stock 10 inherited 80 orders
    /// and was sold out at creation).
    async fn claim_keys(
        &self,
        conn: &mut distlock::Connection,
        coupon: &Coupon,
        keys: &CouponKeys,
    ) -> Result<(), LoadError> {
        let row: Option<i64> = conn.get(&keys.row).await?;
        if row == Some(coupon.created_at) {
            return Ok(());
        }
        if let Some(row) = row {
            retire_stream(conn, keys, &format!("c{row}")).await?;
            let () = conn.del(&[&keys.stock, &keys.buyers, &keys.claims]).await?;
            tracing::warn!(
                coupon = coupon.id,
                "this coupon's Redis keys belonged to an earlier coupon with the same id (the \
                 database was restored to before it was made): set them aside"
            );
        }
        let () = conn.set(&keys.row, coupon.created_at).await?;
        Ok(())
    }

    /// Gives a live counter this strategy's segment layout when this instance alone uses
    /// the Redis (an earlier run used another strategy). Otherwise another instance may be
    /// running another strategy right now, and re-splitting under it would flip the layout
    /// back and forth: then a mismatch is only reported.
    async fn fit_layout(&self, coupon: &Coupon, keys: &CouponKeys) -> Result<(), LoadError> {
        let mut conn = self.locks.connection();
        let fields: u32 = conn.hlen(&keys.stock).await?;
        if fields == self.segments {
            return Ok(());
        }
        if !self.sole_owner {
            // Info, not a warning: `load` and `bench` run four strategies on one Redis.
            tracing::info!(
                coupon = coupon.id,
                fields,
                segments = self.segments,
                "the stock counter has another strategy's layout: run every instance of a fleet \
                 with the same strategy, and drain a sale before changing it"
            );
            return Ok(());
        }
        let resplit: i64 = RESPLIT_STOCK
            .key(&keys.stock)
            .arg(self.segments)
            .invoke_async(&mut conn)
            .await?;
        if resplit == 1 {
            tracing::warn!(
                coupon = coupon.id,
                segments = self.segments,
                "the stock counter had an earlier run's strategy layout; re-split it for this one"
            );
        }
        Ok(())
    }

    /// Raises the coupon lock's fencing counter above the highest token SQL accepted. A
    /// Redis that lost its data starts its counters again from 1, and the `lock`
    /// strategy's fence would refuse every sale until they caught up.
    async fn restore_fencing_counter(&self, coupon: &Coupon) -> Result<(), LoadError> {
        let Some(fence) = self.db.lock_fence(coupon.id).await? else {
            return Ok(());
        };
        let lock = self
            .locks
            .lock(self.db.keyspace().coupon(coupon.id).lock())?;
        let counter = lock.advance_fencing_counter(fence).await?;
        tracing::info!(
            coupon = coupon.id,
            fence,
            counter,
            "fencing counter restored above the highest token SQL accepted"
        );
        Ok(())
    }
}

/// What [`repair_stock`] changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StockRepair {
    /// Buyers SQL holds that Redis did not, given back to Redis.
    pub buyers_added: u64,
    /// Units the counter was lowered by, to what its buyers leave.
    pub units_lowered: u64,
}

/// Gives Redis every buyer in `stored` (user, order id from SQL) that it does not know,
/// and lowers the units left to at most `stock` minus the buyers it holds
/// (`scripts/repair_stock.lua`). Safe while the coupon sells: each page is one script.
pub async fn repair_stock(
    conn: &mut distlock::Connection,
    keys: &CouponKeys,
    stock: i64,
    stored: &[(i64, String)],
) -> redis::RedisResult<StockRepair> {
    let mut repair = StockRepair::default();
    // At least one call, so a counter above the bound is lowered with no buyer to add.
    let pages: Vec<&[(i64, String)]> = if stored.is_empty() {
        vec![&[]]
    } else {
        stored.chunks(BUYERS_PER_COMMAND).collect()
    };
    for page in pages {
        let mut script = REPAIR_STOCK.key(&keys.stock);
        script.key(&keys.buyers).key(&keys.claims).arg(stock);
        for (user, order) in page {
            script.arg(*user).arg(order);
        }
        let (added, lowered): (u64, u64) = script.invoke_async(conn).await?;
        repair.buyers_added += added;
        repair.units_lowered += lowered;
    }
    Ok(repair)
}

/// Sets coupon `keys`' order stream aside, with its consumer group, under a name made from
/// `why`, where no worker reads it again and `reconcile` finds it
/// (`scripts/retire_stream.lua`). Returns whether there was a stream.
pub(crate) async fn retire_stream(
    conn: &mut distlock::Connection,
    keys: &CouponKeys,
    why: &str,
) -> redis::RedisResult<bool> {
    let retired: i64 = RETIRE_STREAM
        .key(&keys.orders)
        .key(keys.retired_stream(why))
        .key(&keys.retired)
        .invoke_async(conn)
        .await?;
    Ok(retired == 1)
}

/// Writes `buyers` (user, order id) into the coupon's buyers hash, in chunks so no single
/// command carries a huge argument list.
pub(crate) async fn put_buyers(
    conn: &mut distlock::Connection,
    keys: &CouponKeys,
    buyers: &[(i64, String)],
) -> redis::RedisResult<()> {
    for chunk in buyers.chunks(BUYERS_PER_COMMAND) {
        let () = conn.hset_multiple(&keys.buyers, chunk).await?;
    }
    Ok(())
}

/// Stores again, under `admission`, every order of coupon `coupon_id` that Redis holds and
/// SQL lost ([`lost_by_sql`]: a database restored from a backup taken mid-sale), whose
/// buyers were told 201. Returns how many.
pub async fn restore_orders(
    db: &Db,
    conn: &mut distlock::Connection,
    admission: &crate::db::Admission,
    coupon_id: i64,
) -> Result<u64, LoadError> {
    let lost: Vec<OrderEvent> = lost_by_sql(db, conn, coupon_id)
        .await?
        .into_iter()
        .map(|order| OrderEvent {
            created_at: order.told_at_ms.unwrap_or_else(now_millis),
            order_id: order.order_id,
            coupon_id,
            user_id: order.user_id,
        })
        .collect();
    if lost.is_empty() {
        return Ok(0);
    }
    let stored = db
        .store_orders(admission, &lost, now_millis())
        .await?
        .inserted;
    tracing::warn!(
        coupon = coupon_id,
        stored,
        "SQL lacked orders that Redis holds and a worker had stored (a database restored \
         from a backup?): their buyers were told 201, so they are stored again"
    );
    Ok(stored)
}

/// Splits `stock` into `segments` shares that differ by at most one.
pub fn split_stock(stock: i64, segments: u32) -> Vec<i64> {
    let segments = i64::from(segments.max(1));
    (0..segments)
        .map(|segment| stock / segments + i64::from(segment < stock % segments))
        .collect()
}

/// The stock left for a coupon, summed over its segments; `None` if not loaded.
pub async fn remaining_stock(
    conn: &mut distlock::Connection,
    keys: &CouponKeys,
) -> redis::RedisResult<Option<i64>> {
    let shares: Vec<i64> = conn.hvals(&keys.stock).await?;
    Ok((!shares.is_empty()).then(|| shares.iter().sum()))
}

#[cfg(test)]
mod tests {
    use super::split_stock;

    #[test]
    fn shares_add_up_and_differ_by_at_most_one() {
        for (stock, segments) in [(0, 4), (7, 3), (100, 8), (5, 8), (1, 1)] {
            let shares = split_stock(stock, segments);
            assert_eq!(shares.len(), segments as usize);
            assert_eq!(shares.iter().sum::<i64>(), stock);
            let (min, max) = (shares.iter().min().unwrap(), shares.iter().max().unwrap());
            assert!(max - min <= 1, "{shares:?}");
        }
    }
}
