//! Keeping Redis and SQL honest with each other.
//!
//! - **Stale claims.** A segmented purchase claims its buyer before it sells; a crash in
//!   between leaves the claim, and the user is refused as `already_purchased` with no
//!   order. Every claim carries the time by which its sale is settled, so once that time
//!   has passed a claim still there is known to be stale, and `repair_claims.lua` removes
//!   it. Every `serve` runs this pass every [`CLAIM_REPAIR_INTERVAL`] over the coupons it
//!   has seen.
//! - **Drift.** `flashsale reconcile` also compares each coupon's Redis state with SQL and
//!   reports what does not add up ([`CouponDrift`]); it repairs nothing but stale claims,
//!   since which side is right depends on what went wrong.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use redis::AsyncCommands;
use serde::Serialize;
use tokio::task::JoinHandle;

use crate::config::{ConfigError, StoreArgs, DEFAULT_DATA_DIR};
use crate::db::{Db, DbError};
use crate::embedded::Embedded;
use crate::keys::{CouponKeys, Keyspace};
use crate::metrics::Metrics;
use crate::model::Coupon;
use crate::order_events::{
    held_orders, refused_over_stock, retired_unstored, stream_backlog, unstored_orders,
    OrderEventsError, Unstored,
};
use crate::scripts::REPAIR_CLAIMS;
use crate::worker::Watched;
use crate::CliResult;

/// How often a running service removes stale claims.
pub const CLAIM_REPAIR_INTERVAL: Duration = Duration::from_secs(5);
/// Claims one script call looks at, so one call never holds Redis for long.
const CLAIMS_PER_CALL: usize = 500;
/// Examples of each kind of drift shown, of however many there are.
const EXAMPLES: usize = 5;

/// Removes every stale claim of one coupon; returns how many.
pub async fn repair_claims(
    conn: &mut distlock::Connection,
    keys: &CouponKeys,
) -> redis::RedisResult<u64> {
    let mut removed = 0;
    loop {
        let batch: u64 = REPAIR_CLAIMS
            .key(&keys.buyers)
            .key(&keys.claims)
            .arg(CLAIMS_PER_CALL)
            .invoke_async(conn)
            .await?;
        removed += batch;
        if batch < CLAIMS_PER_CALL as u64 {
            return Ok(removed);
        }
    }
}

/// Runs [`repair_claims`] every [`CLAIM_REPAIR_INTERVAL`] over the coupons in `watched`,
/// until aborted.
pub fn spawn_claim_repair(
    locks: distlock::Client,
    keyspace: Keyspace,
    watched: Watched,
    metrics: Metrics,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(CLAIM_REPAIR_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let mut conn = locks.connection();
            for coupon in watched.coupons() {
                match repair_claims(&mut conn, &keyspace.coupon(coupon)).await {
                    Ok(0) => {}
                    Ok(removed) => {
                        metrics.claims_repaired.inc_by(removed);
                        tracing::warn!(coupon, removed, "removed segmented claims whose sale can no longer happen (a crash, or a withdrawal that failed)");
                    }
                    Err(err) => {
                        tracing::warn!(coupon, error = %err, "could not repair segmented claims")
                    }
                }
            }
        }
    })
}

/// How one coupon's Redis state compares with SQL.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct CouponDrift {
    /// The coupon.
    pub coupon_id: i64,
    /// Units for sale.
    pub stock: i64,
    /// Units left in Redis; `None` when Redis holds no stock for it (never loaded, or lost:
    /// the next purchase reloads it from SQL).
    pub redis_remaining: Option<i64>,
    /// Buyers Redis holds an order id for.
    pub redis_orders: usize,
    /// Segmented claims still in progress (after the stale ones were removed).
    pub claims_in_progress: usize,
    /// Stale claims this pass removed.
    pub stale_claims_removed: u64,
    /// Orders in SQL.
    pub sql_orders: usize,
    /// Order events not yet stored by a worker.
    pub queued: i64,
    /// Units left in Redis minus the units truly left (the stock less every buyer Redis or
    /// SQL knows of): positive when Redis counts units that are not for sale (it could
    /// oversell; this pass lowered it, `counter_lowered`), negative when it counts fewer
    /// than are left (they would not be sold). 0 when Redis holds no stock. A buyer only
    /// SQL knows holds a unit here, and shows in `missing_in_redis`.
    pub counter_drift: i64,
    /// Buyers either side knows beyond the stock: units sold twice.
    pub oversold: i64,
    /// Order ids Redis holds for buyers with no order in SQL whose events no worker will
    /// store: acknowledged (stored once, then lost by SQL, as in a restored backup) or
    /// absent. Sales a buyer was told about that nothing will store but `serve`'s next
    /// start, which stores them again while this Redis holds them.
    /// Every one is listed: these buyers were told 201.
    pub missing_in_sql: Vec<String>,
    /// How many there are.
    pub missing_in_sql_count: usize,
    /// Orders in SQL whose buyer Redis does not hold (it could sell the user another).
    pub missing_in_redis: Vec<String>,
    /// How many there are.
    pub missing_in_redis_count: usize,
    /// How many of them this pass gave back to Redis (the buyer and their SQL order id).
    pub missing_in_redis_repaired: u64,
    /// Units this pass took off Redis's counter, down to what its buyers leave.
    pub counter_lowered: u64,
    /// Buyers whose order id differs between Redis and SQL.
    pub different_order: Vec<String>,
    /// How many there are.
    pub different_order_count: usize,
    /// Orders told 201 and never stored: the store refused them as beyond the coupon's
    /// stock (Redis counted units that were sold already), or an earlier tenure of this
    /// Redis (or an earlier coupon with this id, before the database was restored) sold
    /// them and their streams were set aside, their units sold again. Settle each with its
    /// buyer.
    pub told_not_stored: Vec<Unstored>,
    /// How many there are.
    pub told_not_stored_count: usize,
}

impl CouponDrift {
    /// True when Redis and SQL disagree, or orders told and never stored wait to be
    /// settled.
    pub fn drifted(&self) -> bool {
        self.disagrees() || self.told_not_stored_count > 0
    }

    /// True when Redis and SQL disagree about this tenure's sales.
    fn disagrees(&self) -> bool {
        self.counter_drift != 0
            || self.oversold > 0
            || self.missing_in_sql_count > 0
            || self.missing_in_redis_count > 0
            || self.different_order_count > 0
    }
}

/// Why a reconcile pass failed.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The database failed.
    #[error(transparent)]
    Db(#[from] DbError),
}

impl From<OrderEventsError> for ReconcileError {
    fn from(err: OrderEventsError) -> Self {
        match err {
            OrderEventsError::Redis(err) => ReconcileError::Redis(err),
            OrderEventsError::Db(err) => ReconcileError::Db(err),
        }
    }
}

/// Removes `coupon`'s stale claims, then compares its Redis state with SQL.
///
/// Safe to run while the coupon sells: the counters come from one atomic snapshot, SQL is
/// read before Redis (an order is in Redis before it is stored, so no stored order can
/// look missing there), and every candidate is checked once more before it is reported.
/// Large coupons are read in pages, so Redis never answers one huge command.
pub async fn reconcile_coupon(
    db: &Db,
    conn: &mut distlock::Connection,
    coupon: &Coupon,
) -> Result<CouponDrift, ReconcileError> {
    let keys = db.keyspace().coupon(coupon.id);
    let stale_claims_removed = repair_claims(conn, &keys).await?;
    let stored = db.buyers(coupon.id).await?;
    // Every write path changes the units left and the buyers together, atomically.
    let (shares, entries, claims): (Vec<i64>, i64, i64) = redis::pipe()
        .atomic()
        .hvals(&keys.stock)
        .hlen(&keys.buyers)
        .zcard(&keys.claims)
        .query_async(conn)
        .await?;
    let redis_remaining = (!shares.is_empty()).then(|| shares.iter().sum::<i64>());
    let redis_orders = entries - claims;
    let orders_in_redis = held_orders(conn, &keys).await?;
    let queued = stream_backlog(conn, &keys)
        .await
        .map(|backlog| backlog.lag + backlog.pending)?;
    // Told 201 and in no worker's way to SQL: an event acknowledged (stored, then lost by
    // SQL: a restored backup), or none at all (the lock strategy writes SQL first).
    // A buyer with another order in SQL is a different order, reported below.
    let stored_users: HashSet<i64> = stored.iter().map(|(user, _)| *user).collect();
    let mut missing_in_sql: Vec<String> = unstored_orders(db, conn, coupon.id)
        .await?
        .into_iter()
        .filter(|order| !order.queued && !stored_users.contains(&order.user_id))
        .map(|order| order.order_id)
        .collect();
    let (mut missing_in_redis, mut different_order) = (Vec::new(), Vec::new());
    if redis_remaining.is_some() {
        for (user, order) in &stored {
            if orders_in_redis.get(user) == Some(order) {
                continue;
            }
            // Read again: the scan may have run before the buyer's entry changed.
            let held: Option<String> = conn.hget(&keys.buyers, user).await?;
            match held {
                Some(held) if held == *order => {}
                Some(held) if !held.starts_with('~') => {
                    different_order.push(format!("user {user}: SQL {order}, Redis {held}"))
                }
                _ => missing_in_redis.push((*user, order.clone())),
            }
        }
    }
    // Every buyer either side knows holds a unit: a stored order whose buyer Redis forgot
    // (its update was lost) is a unit sold, not a unit sold twice.
    let known_buyers = redis_orders + i64::try_from(missing_in_redis.len()).unwrap_or(0);
    let oversold = (known_buyers - coupon.stock).max(0);
    let truly_left = (coupon.stock - known_buyers).max(0);
    let counter_drift = redis_remaining.map_or(0, |left| left - truly_left);
    // SQL is right about a stored order: giving its buyer back to Redis keeps Redis from
    // selling them a second coupon, lets a retry be answered with their order, and lowers
    // a counter that counted their unit as left (the same repair `serve` makes at start).
    let repair = if redis_remaining.is_some() {
        crate::stock::repair_stock(conn, &keys, coupon.stock, &missing_in_redis).await?
    } else {
        Default::default()
    };
    let mut missing_in_redis: Vec<String> = missing_in_redis
        .into_iter()
        .map(|(_, order)| order)
        .collect();
    let sample = |list: &mut Vec<String>| {
        list.sort();
        let count = list.len();
        list.truncate(EXAMPLES);
        count
    };
    missing_in_sql.sort();
    let mut told_not_stored = refused_over_stock(db, coupon.id).await?;
    told_not_stored.extend(retired_unstored(db, conn, coupon.id).await?);
    Ok(CouponDrift {
        coupon_id: coupon.id,
        stock: coupon.stock,
        redis_remaining,
        redis_orders: usize::try_from(redis_orders).unwrap_or(0),
        claims_in_progress: usize::try_from(claims).unwrap_or(0),
        stale_claims_removed,
        sql_orders: stored.len(),
        queued,
        counter_drift,
        missing_in_sql_count: missing_in_sql.len(),
        missing_in_sql,
        missing_in_redis_count: sample(&mut missing_in_redis),
        missing_in_redis,
        missing_in_redis_repaired: repair.buyers_added,
        counter_lowered: repair.units_lowered,
        oversold,
        different_order_count: sample(&mut different_order),
        different_order,
        told_not_stored_count: told_not_stored.len(),
        told_not_stored,
    })
}

/// Flags of `flashsale reconcile`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReconcileArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    /// The data directory of an embedded `serve` (REDIS_URL unset). It must not be
    /// running: it repairs its own claims.
    #[arg(long, env = "FLASHSALE_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// The SQLite file of the embedded mode [default: DATA_DIR/flashsale.db].
    #[arg(long)]
    pub sqlite_path: Option<PathBuf>,
    /// Only this coupon [default: every coupon].
    #[arg(long)]
    pub coupon: Option<i64>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Once every order listed as told and not stored has been settled with its buyer:
    /// remove them from Redis, so that reconcile stops listing them. On the current
    /// authority this removes the order streams set aside by earlier tenures; on a former
    /// authority's Redis, every key of the store there.
    #[arg(long)]
    pub forget_told_not_stored: bool,
}

/// The exit code when some coupon's Redis state and SQL disagree.
pub const EXIT_DRIFT: u8 = crate::exit_code::DRIFT;

/// Removes stale claims and reports drift. Exits 0 when every coupon adds up,
/// [`EXIT_DRIFT`] when one does not.
pub async fn run(args: ReconcileArgs) -> CliResult {
    let mut config = crate::ServiceConfig::new(crate::Strategy::Lua);
    config.redis_url = args.store.redis_url.clone();
    config.database_url = args.store.database_url.clone();
    config.data_dir = args.data_dir.clone();
    config.sqlite_path = args.sqlite_path.clone();
    config.create_store = false;
    let (redis_url, embedded) = Embedded::open_unless_redis_url(&config).await?;
    let locks = distlock::Client::connect(&redis_url)
        .await
        .map_err(ConfigError::redis)?;
    let db = Db::open_existing(&config.database_url())
        .await
        .map_err(ConfigError::Db)?;
    // Reconcile compares SQL with the Redis that sells its stock; a former authority's
    // Redis gets a report of its own: what it sold that the store never got.
    let verified = crate::authority::verify(
        &db,
        &mut locks.connection(),
        &crate::authority::location(&redis_url, embedded.as_ref().map(Embedded::data_dir)),
        &crate::db::mask_password(&config.database_url()),
    )
    .await
    .map_err(ConfigError::from)?;
    let coupons = match args.coupon {
        Some(id) => vec![db
            .coupon(id)
            .await?
            .ok_or(ConfigError::NoSuchCoupon { id })?],
        None => db.coupons_ending_after(i64::MIN).await?,
    };
    let mut conn = locks.connection();
    let drifted = match verified {
        crate::authority::Verified::Former { marker, owner } => {
            let mut told_not_stored = Vec::new();
            for coupon in &coupons {
                told_not_stored.extend(unstored_orders(&db, &mut conn, coupon.id).await?);
                told_not_stored.extend(retired_unstored(&db, &mut conn, coupon.id).await?);
            }
            let report = FormerAuthority {
                redis: crate::db::mask_password(&redis_url),
                authority_id: marker,
                store_authority: owner.location,
                told_not_stored_count: told_not_stored.len(),
                told_not_stored,
            };
            if args.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print_former(&report);
            }
            if args.forget_told_not_stored {
                forget_former(&db, &mut conn, &coupons).await?;
                eprintln!("flashsale: removed this store's keys from {}", report.redis);
                false
            } else {
                report.told_not_stored_count > 0
            }
        }
        _ => {
            let mut report = Vec::with_capacity(coupons.len());
            for coupon in &coupons {
                report.push(reconcile_coupon(&db, &mut conn, coupon).await?);
            }
            if args.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print_table(&report);
            }
            if args.forget_told_not_stored {
                for coupon in &report {
                    forget_retired(&db, &mut conn, coupon.coupon_id).await?;
                    db.forget_refused_orders(coupon.coupon_id).await?;
                }
                report.iter().any(CouponDrift::disagrees)
            } else {
                report.iter().any(CouponDrift::drifted)
            }
        }
    };
    db.close().await;
    locks.shutdown().await;
    if let Some(embedded) = embedded {
        embedded.stop().await;
    }
    Ok(if drifted {
        ExitCode::from(EXIT_DRIFT)
    } else {
        ExitCode::SUCCESS
    })
}

/// Removes coupon `coupon_id`'s order streams set aside by earlier tenures from this
/// Redis: what they told and never stored was settled with its buyers.
async fn forget_retired(
    db: &Db,
    conn: &mut distlock::Connection,
    coupon_id: i64,
) -> Result<(), ReconcileError> {
    let keys = db.keyspace().coupon(coupon_id);
    let streams: Vec<String> = conn.smembers(&keys.retired).await?;
    for stream in &streams {
        let () = conn.del(stream).await?;
    }
    let () = conn.del(&keys.retired).await?;
    Ok(())
}

/// Removes every key of the store from a former authority's Redis: what it told and never
/// stored was settled, and its counters are stale.
async fn forget_former(
    db: &Db,
    conn: &mut distlock::Connection,
    coupons: &[Coupon],
) -> Result<(), ReconcileError> {
    for coupon in coupons {
        forget_retired(db, conn, coupon.id).await?;
        let keys = db.keyspace().coupon(coupon.id);
        let () = conn
            .del(&[
                &keys.stock,
                &keys.buyers,
                &keys.claims,
                &keys.orders,
                &keys.row,
            ])
            .await?;
    }
    let keyspace = db.keyspace();
    // One key a command: on a cluster they live in different slots.
    for key in [keyspace.authority(), keyspace.stream_tenure()] {
        let () = conn.del(key).await?;
    }
    Ok(())
}

/// What `reconcile` reports on the Redis of a former stock authority: one the store was
/// taken over from (with `--abandon-old-authority`, while its instances were frozen or
/// cut off). Its instances' writes are refused by the store, so the orders it told buyers
/// about and had not stored never will be; the new authority sold their units again.
#[derive(Debug, Clone, Serialize)]
pub struct FormerAuthority {
    /// This Redis, password masked.
    pub redis: String,
    /// The authority id this Redis holds.
    pub authority_id: String,
    /// Where the store's stock is sold from now.
    pub store_authority: String,
    /// Orders told 201 here that the store does not hold, oldest first.
    pub told_not_stored: Vec<Unstored>,
    /// How many.
    pub told_not_stored_count: usize,
}

fn print_former(report: &FormerAuthority) {
    println!(
        "{} is a former stock authority of this store (id {}); the store is sold from {} now.",
        report.redis, report.authority_id, report.store_authority
    );
    if report.told_not_stored.is_empty() {
        println!("It holds no order the store lacks: nothing to settle.");
        return;
    }
    println!(
        "{} orders were told 201 here and are NOT in the store; their units were sold again \
         by the new authority. Settle each with its buyer (see docs/flashsale.md, \"An old Redis \
         lost for good\"), then run reconcile --forget-told-not-stored against this Redis:",
        report.told_not_stored_count
    );
    print_orders(&report.told_not_stored);
}

fn print_table(report: &[CouponDrift]) {
    println!(
        "{:>8} {:>8} {:>10} {:>12} {:>7} {:>13} {:>10} {:>7}  verdict",
        "coupon",
        "stock",
        "redis left",
        "redis orders",
        "claims",
        "stale removed",
        "sql orders",
        "queued"
    );
    for coupon in report {
        let left = coupon
            .redis_remaining
            .map_or_else(|| "-".to_owned(), |left| left.to_string());
        println!(
            "{:>8} {:>8} {:>10} {:>12} {:>7} {:>13} {:>10} {:>7}  {}",
            coupon.coupon_id,
            coupon.stock,
            left,
            coupon.redis_orders,
            coupon.claims_in_progress,
            coupon.stale_claims_removed,
            coupon.sql_orders,
            coupon.queued,
            if coupon.drifted() { "DRIFT" } else { "ok" }
        );
    }
    for coupon in report.iter().filter(|coupon| coupon.drifted()) {
        let id = coupon.coupon_id;
        if coupon.oversold > 0 {
            println!(
                "coupon {id}: OVERSOLD by {}: buyers hold {} units of a stock of {}",
                coupon.oversold,
                coupon.stock + coupon.oversold,
                coupon.stock
            );
        }
        if coupon.counter_drift > 0 {
            println!(
                "coupon {id}: Redis counted {} units more than are left, and could have sold \
                 them; lowered by {}",
                coupon.counter_drift, coupon.counter_lowered
            );
        } else if coupon.counter_drift < 0 {
            println!(
                "coupon {id}: Redis counts {} units fewer than are left: they will not be sold",
                -coupon.counter_drift
            );
        }
        let lists = [
            (
                "orders Redis holds (their buyers were told 201) that SQL lacks and no worker \
                 will store (a restored database? the next start of serve stores them again)",
                coupon.missing_in_sql_count,
                &coupon.missing_in_sql,
            ),
            (
                "orders in SQL whose buyer Redis did not hold (given back to Redis)",
                coupon.missing_in_redis_count,
                &coupon.missing_in_redis,
            ),
            (
                "buyers with another order id in Redis than in SQL",
                coupon.different_order_count,
                &coupon.different_order,
            ),
        ];
        for (what, count, examples) in lists {
            if count > 0 {
                let shown: Vec<&str> = examples.iter().take(EXAMPLES).map(String::as_str).collect();
                println!("coupon {id}: {count} {what}, e.g. {}", shown.join(", "));
            }
        }
        if coupon.told_not_stored_count > 0 {
            println!(
                "coupon {id}: {} orders were told 201 by an earlier tenure of this Redis (or an \
                 earlier coupon with this id) and are NOT in the store; their units were sold \
                 again. Settle each with its buyer, then run reconcile --forget-told-not-stored:",
                coupon.told_not_stored_count
            );
            print_orders(&coupon.told_not_stored);
        }
    }
}

/// One line per order: id, buyer, coupon, when told.
fn print_orders(orders: &[Unstored]) {
    println!("{:<48} {:>12} {:>8}  told at", "order", "user", "coupon");
    for order in orders {
        println!(
            "{:<48} {:>12} {:>8}  {}",
            order.order_id,
            order.user_id,
            order.coupon_id,
            order.told_at.as_deref().unwrap_or("-")
        );
    }
}
