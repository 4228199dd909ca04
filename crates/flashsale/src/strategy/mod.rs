//! How a purchase reserves stock in Redis.
//!
//! Every strategy ends the same way for a sale: one unit taken from the stock hash, the
//! user added to the buyers set, and an order event appended to the coupon's stream. They
//! differ in what keeps concurrent purchases from racing:
//!
//! - [`Strategy::Lua`]: one script does check and write atomically, for a batch of
//!   concurrent purchases at a time ([`lua`]).
//! - [`Strategy::Lock`]: a per-coupon distlock lock around separate commands ([`lock`]).
//! - [`Strategy::Segmented`]: the stock split into segments, each under its own lock
//!   ([`segmented`]).
//! - [`Strategy::Unsafe`]: nothing; the control that oversells ([`unguarded`]).

mod lock;
mod lua;
mod segmented;
mod unguarded;

use std::time::Duration;

use distlock::Connection;
use redis::AsyncCommands;
use serde::Serialize;
use tokio::time::Instant;

use crate::db::{Db, DbError};
use crate::keys::{CouponKeys, Keyspace};
use crate::metrics::Metrics;
use crate::model::{new_order_id, now_millis, OrderEvent};
use crate::scripts::{RECORD, UNCLAIM};

pub use crate::model::{CLOCK_GRACE, WRITE_WINDOW};
/// How long a purchase whose reply was lost keeps asking Redis for its outcome after the
/// fence passed, before it answers that the outcome is unknown.
pub const RESOLVE_PATIENCE: Duration = Duration::from_secs(3);

/// How long a purchase waits for a coupon's lock by default.
pub const DEFAULT_LOCK_WAIT: Duration = Duration::from_secs(10);
/// The lease of a coupon's lock by default. Safety does not rest on it (the `lock`
/// strategy's write is fenced); it bounds how long a crashed holder blocks the coupon.
pub const DEFAULT_LOCK_LEASE: Duration = Duration::from_secs(30);

/// How many times the critical section's p99, measured at start, the `lock` strategy's
/// lease must be: the probe runs idle, and a rush slows the section down.
pub const LEASE_HEADROOM: u32 = 2;

/// Why the `lock` strategy's lease was refused at start.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The lease is too short for the critical section it guards.
    #[error(
        "invalid --lock-lease: a lease of {} is shorter than {LEASE_HEADROOM} × the critical \
         section's p99 measured at start ({:.1} ms for a Redis check and a committed SQL \
         write); a holder would routinely lose its lock mid-sale. Use at least --lock-lease {}ms",
        crate::duration::format_duration(*lease),
        p99.as_secs_f64() * 1000.0,
        (p99.as_millis() + 1) * u128::from(LEASE_HEADROOM)
    )]
    TooShort {
        /// The configured lease.
        lease: Duration,
        /// The measured p99 of the critical section.
        p99: Duration,
    },
    /// The critical section could not be timed.
    #[error("invalid --lock-lease: could not time the critical section: {0}")]
    Unmeasured(#[source] ReserveError),
}

/// Refuses a `lock` lease that the critical section, timed on `locks` and `db` at start,
/// would routinely outlast. Other strategies pass.
pub async fn check_lease(
    settings: &StrategySettings,
    locks: &distlock::Client,
    db: &Db,
) -> Result<(), LeaseError> {
    if settings.strategy != Strategy::Lock {
        return Ok(());
    }
    let p99 = lock::critical_section_p99(locks, db)
        .await
        .map_err(LeaseError::Unmeasured)?;
    tracing::info!(p99_ms = p99.as_secs_f64() * 1000.0, lease = ?settings.lock_lease, "timed the lock strategy's critical section");
    lease_fits(settings.lock_lease, p99)
}

/// Whether `lease` covers a critical section whose p99 is `p99`, with [`LEASE_HEADROOM`].
fn lease_fits(lease: Duration, p99: Duration) -> Result<(), LeaseError> {
    if lease < p99 * LEASE_HEADROOM {
        return Err(LeaseError::TooShort { lease, p99 });
    }
    Ok(())
}

/// Which reservation strategy the service runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// One atomic Lua script: check stock and buyer, decrement, record, enqueue.
    Lua,
    /// A per-coupon distlock lock, acquired with a wait and a lease; under it, a check in
    /// Redis, then the order written to SQL in a transaction fenced by the lock's token.
    Lock,
    /// Stock split into segments, each with its own key field and lock; buyers spread over
    /// them. The segmented-lock idea for hot items.
    Segmented,
    /// GET, then DECR, with no lock. The control: it oversells under load.
    Unsafe,
}

impl Strategy {
    /// All strategies, in the order reports show them.
    pub const ALL: [Strategy; 4] = [
        Strategy::Lua,
        Strategy::Lock,
        Strategy::Segmented,
        Strategy::Unsafe,
    ];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Lua => "lua",
            Strategy::Lock => "lock",
            Strategy::Segmented => "segmented",
            Strategy::Unsafe => "unsafe",
        }
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The strategy and its knobs.
#[derive(Debug, Clone)]
pub struct StrategySettings {
    /// Which strategy.
    pub strategy: Strategy,
    /// Segments per coupon for [`Strategy::Segmented`]; ignored by the others.
    pub segments: u32,
    /// How long a purchase waits for a lock before it answers `busy`.
    pub lock_wait: Duration,
    /// The lease of a purchase's lock: how long it stays valid if the process stalls.
    pub lock_lease: Duration,
    /// A test hook, never set in production: the lock strategies stop their own process
    /// (SIGSTOP) while they hold the lock for this user's purchase, before its write (for
    /// segmented, after its claim), as a pause past the lease would. Set by
    /// `FLASHSALE_FAULT_STOP_HOLDER_OF_USER`.
    pub fault_stop_holder_of_user: Option<i64>,
    /// How long a purchase may take from arrival to answer: one whose deadline passed
    /// before its write was sent is not sold, and lock waits end by it.
    pub request_timeout: Duration,
    /// Most purchases of one coupon queued for the script strategy; past it, a purchase is
    /// turned away at once (`overloaded`), before anything is sold.
    pub queue_limit: usize,
}

impl StrategySettings {
    /// The defaults for `strategy`: 8 segments, and Redisson's tryLock figures, a 10 s wait
    /// and a 30 s lease.
    pub fn new(strategy: Strategy) -> Self {
        StrategySettings {
            strategy,
            segments: 8,
            lock_wait: DEFAULT_LOCK_WAIT,
            lock_lease: DEFAULT_LOCK_LEASE,
            fault_stop_holder_of_user: None,
            request_timeout: Duration::from_secs(15),
            queue_limit: 4_096,
        }
    }

    /// The fault hook ([`Self::fault_stop_holder_of_user`]): stops this process here if
    /// `sale` is the purchase named. It needs a SIGCONT (or a SIGKILL) from outside.
    pub(crate) fn fault_point(&self, sale: &Sale) {
        if self.fault_stop_holder_of_user != Some(sale.user_id) {
            return;
        }
        tracing::warn!(
            user = sale.user_id,
            "fault hook: stopping this process while it holds a lock"
        );
        if let Err(err) = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP) {
            tracing::error!(error = %err, "fault hook: could not stop this process");
        }
    }

    /// How many segments the stock hash of a coupon has under this strategy.
    pub fn stock_segments(&self) -> u32 {
        match self.strategy {
            Strategy::Segmented => self.segments.max(1),
            _ => 1,
        }
    }
}

/// The outcome of one purchase attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reservation {
    /// A unit is the user's; the order event is queued under this id.
    Reserved {
        /// The order's id (see [`new_order_id`]).
        order_id: String,
    },
    /// No stock left.
    SoldOut,
    /// The user already holds an order of this coupon: this one, or `None` while another
    /// request of the same user is still completing its sale.
    AlreadyPurchased {
        /// The order the user holds.
        order_id: Option<String>,
    },
    /// Redis has no stock for this coupon: it was never loaded, or Redis lost its data.
    NotLoaded,
    /// The strategy's lock was not acquired within its wait.
    Busy,
    /// The lock's lease ran out before the sale committed (a pause, a stall), or a newer
    /// holder had written: the write was refused and nothing was sold.
    LockLost,
    /// The purchase's deadline, or its write's fence, passed before it ran: nothing was
    /// sold.
    Expired,
    /// The coupon's queue is full: turned away before anything was sold.
    Overloaded,
}

/// Why a reservation could not be decided.
#[derive(Debug, thiserror::Error)]
pub enum ReserveError {
    /// A Redis command failed before any write was sent: nothing was sold.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The strategy's lock failed before any write was sent: nothing was sold.
    #[error("lock: {0}")]
    Lock(#[from] distlock::Error),
    /// The database failed before the commit: the transaction rolled back, nothing was
    /// sold.
    #[error("database: {0}")]
    Db(#[from] DbError),
    /// The commit of a sale's transaction failed: it may or may not have landed.
    /// [`Reserver::reserve`] resolves this before returning; strategies return it.
    #[error("the commit's outcome is unknown: {source}")]
    CommitInDoubt {
        /// What failed.
        source: sqlx::Error,
    },
    /// A sale's write was sent and its reply lost. [`Reserver::reserve`] resolves this
    /// before returning; strategies return it.
    #[error("the write's reply was lost: {source}")]
    InDoubt {
        /// The write's fence, Unix ms: after it, the write can no longer land.
        fence_ms: i64,
        /// What failed.
        source: redis::RedisError,
    },
    /// This instance may not sell now: the store was taken over by another Redis, or the
    /// store has not confirmed this instance's authority lately. Nothing was sold.
    #[error("this instance cannot confirm that it still sells this store's stock")]
    NotAuthority,
    /// The outcome could not be found out: the store did not answer after the write
    /// settled. The order may or may not exist; the order lookup tells.
    #[error("the outcome of order {order_id} is unknown: {source}")]
    Unknown {
        /// The order id the sale would have.
        order_id: String,
        /// What failed last.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl ReserveError {
    /// The error of a write sent with fence `fence_ms` that failed with `source`: in doubt
    /// unless the failure proves the write never ran. A refused connection never carried
    /// it, and a server's error reply means Redis rejected the call before running it
    /// (our scripts raise no error after a write).
    pub(crate) fn after_send(fence_ms: i64, source: redis::RedisError) -> ReserveError {
        if source.is_connection_refusal() || matches!(source.kind(), redis::ErrorKind::Server(_)) {
            ReserveError::Redis(source)
        } else {
            ReserveError::InDoubt { fence_ms, source }
        }
    }
}

/// Runs purchases with one strategy. Cheap to clone.
#[derive(Clone)]
pub struct Reserver {
    settings: StrategySettings,
    locks: distlock::Client,
    db: Db,
    keyspace: Keyspace,
    metrics: Metrics,
    /// Names this instance in the segmented strategy's claims.
    instance: std::sync::Arc<str>,
    batcher: std::sync::Arc<lua::Batcher>,
    /// Whether this instance may sell now (see [`crate::authority`]).
    tenure: std::sync::Arc<crate::authority::Tenure>,
}

impl Reserver {
    /// A reserver using `locks` for both its locks and its Redis commands, on the keys of
    /// `db`'s namespace; the `lock` strategy writes its orders to `db`.
    /// It sells only while `tenure` allows: this instance's admission to the store is
    /// confirmed and the store has not moved past it.
    pub fn new(
        settings: StrategySettings,
        locks: distlock::Client,
        db: Db,
        tenure: std::sync::Arc<crate::authority::Tenure>,
        metrics: Metrics,
    ) -> Self {
        Reserver {
            settings,
            locks,
            keyspace: db.keyspace().clone(),
            db,
            metrics,
            instance: instance_name().into(),
            batcher: Default::default(),
            tenure,
        }
    }

    /// Whether this instance may sell now: its stock authority was confirmed recently
    /// and has not moved (see [`crate::authority::Tenure`]). `/healthz` reports it.
    pub fn may_sell(&self) -> bool {
        self.tenure.may_sell()
    }

    /// Whether the store still admits this instance: it has not refused one of its beats
    /// or writes (a take-over, or a release while it was frozen).
    pub fn admitted(&self) -> bool {
        !self.tenure.moved()
    }

    /// The settings it runs with.
    pub fn settings(&self) -> &StrategySettings {
        &self.settings
    }

    /// One purchase of coupon `coupon_id` by `user_id`, to be decided by `deadline`.
    ///
    /// The answer is the truth: `Reserved` only for a sale that happened, anything else
    /// only for one that did not. When a write's reply is lost, this waits until the
    /// write's fence has passed and reads the buyer's entry; if Redis cannot be read then
    /// either, it fails with [`ReserveError::Unknown`].
    pub async fn reserve(
        &self,
        coupon_id: i64,
        user_id: i64,
        deadline: Instant,
    ) -> Result<Reservation, ReserveError> {
        if !self.tenure.may_sell() {
            return Err(ReserveError::NotAuthority);
        }
        let at_ms = now_millis();
        let left = deadline.saturating_duration_since(Instant::now());
        let sale = Sale {
            keys: self.keyspace.coupon(coupon_id),
            coupon_id,
            user_id,
            order_id: new_order_id(coupon_id, user_id),
            at_ms,
            deadline,
            // No write is sent after the deadline, and none lands after its fence.
            settle_by_ms: at_ms.saturating_add(
                i64::try_from((left + WRITE_WINDOW + CLOCK_GRACE).as_millis()).unwrap_or(i64::MAX),
            ),
            instance: self.instance.clone(),
            tenure: self.tenure.clone(),
        };
        let mut conn = self.locks.connection();
        let outcome = match self.settings.strategy {
            Strategy::Lua => self.batcher.reserve(&conn, &sale, &self.settings).await,
            Strategy::Lock => lock::reserve(self, &sale).await,
            Strategy::Segmented => segmented::reserve(self, &sale).await,
            Strategy::Unsafe => unguarded::reserve(&mut conn, &sale).await,
        };
        match outcome {
            Err(ReserveError::InDoubt { fence_ms, source }) => {
                self.resolve(&sale, fence_ms, source).await
            }
            Err(ReserveError::CommitInDoubt { source }) => self.resolve_commit(&sale, source).await,
            other => other,
        }
    }

    /// Finds out whether a sale whose SQL commit failed was stored, by reading the order
    /// behind the coupon's fence row lock (which waits out a commit still in flight).
    async fn resolve_commit(
        &self,
        sale: &Sale,
        source: sqlx::Error,
    ) -> Result<Reservation, ReserveError> {
        tracing::warn!(order = %sale.order_id, error = %source, "a sale's commit failed; reading whether it landed");
        let give_up = Instant::now() + RESOLVE_PATIENCE;
        let mut last_error: Box<dyn std::error::Error + Send + Sync> = Box::new(source);
        loop {
            let read = tokio::time::timeout_at(
                give_up,
                self.db.settled_order(sale.coupon_id, &sale.order_id),
            )
            .await;
            match read {
                Ok(Ok(Some(_))) => {
                    sale.mirror_sql(&mut self.locks.connection(), None, Some(&sale.order_id))
                        .await;
                    return Ok(sale.reserved());
                }
                Ok(Ok(None)) => return Ok(Reservation::Expired),
                Ok(Err(err)) if Instant::now() < give_up => {
                    last_error = Box::new(err);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Ok(Err(err)) => last_error = Box::new(err),
                Err(_) => {}
            }
            if Instant::now() >= give_up {
                tracing::error!(order = %sale.order_id, error = %last_error, "the outcome of a sale is unknown");
                return Err(ReserveError::Unknown {
                    order_id: sale.order_id.clone(),
                    source: last_error,
                });
            }
        }
    }

    /// Finds out what became of a sale whose write's reply was lost.
    async fn resolve(
        &self,
        sale: &Sale,
        fence_ms: i64,
        source: redis::RedisError,
    ) -> Result<Reservation, ReserveError> {
        tracing::warn!(order = %sale.order_id, error = %source, "a sale's reply was lost; reading its outcome once its fence has passed");
        let settled_ms = fence_ms.saturating_add(CLOCK_GRACE.as_millis() as i64);
        let wait = settled_ms.saturating_sub(now_millis());
        if wait > 0 {
            tokio::time::sleep(Duration::from_millis(wait.unsigned_abs())).await;
        }
        let give_up = Instant::now() + RESOLVE_PATIENCE;
        let mut conn = self.locks.connection();
        let mut last_error = source;
        loop {
            match conn
                .hget::<_, _, Option<String>>(&sale.keys.buyers, sale.user_id)
                .await
            {
                Ok(held) => return Ok(sale.settled(&mut conn, held).await),
                Err(err) if Instant::now() < give_up => {
                    last_error = err;
                    // Redis is not answering; ask again shortly, within the patience.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(err) => {
                    tracing::error!(order = %sale.order_id, error = %err, previous = %last_error, "the outcome of a sale is unknown");
                    return Err(ReserveError::Unknown {
                        order_id: sale.order_id.clone(),
                        source: Box::new(err),
                    });
                }
            }
        }
    }
}

/// One purchase in progress: the keys and the order it would create.
pub(crate) struct Sale {
    pub(crate) keys: CouponKeys,
    pub(crate) coupon_id: i64,
    pub(crate) user_id: i64,
    pub(crate) order_id: String,
    pub(crate) at_ms: i64,
    /// When the purchase must be decided: no write is sent after it.
    pub(crate) deadline: Instant,
    /// Unix ms by which this sale's write has landed or never will: the deadline plus the
    /// write window and the clock grace. A segmented claim older than this is stale.
    pub(crate) settle_by_ms: i64,
    /// The instance running the purchase, named in its claim.
    pub(crate) instance: std::sync::Arc<str>,
    /// Whether the instance may still sell: checked again right before each write.
    pub(crate) tenure: std::sync::Arc<crate::authority::Tenure>,
}

/// This process's name in claims: host and pid, so an operator can tell which instance
/// left a claim behind. Only characters that cannot be confused with the claim's `:`
/// separators are kept.
fn instance_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host: String = host
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
        .take(64)
        .collect();
    let host = if host.is_empty() {
        "host".to_owned()
    } else {
        host
    };
    format!("{host}-{}", std::process::id())
}

/// A fence for a write sent now, in Unix ms.
pub(crate) fn fence_from_now() -> i64 {
    now_millis().saturating_add(WRITE_WINDOW.as_millis() as i64)
}

impl Sale {
    /// Takes one unit from `segment`, records the buyer's order and appends the order
    /// event, in one fenced script. The caller has already decided, under its own guard,
    /// that the sale may happen; this only makes the three writes land together.
    ///
    /// With `guarded`, the script checks once more that the segment has a unit left and
    /// answers [`Reservation::SoldOut`] if not: the guard's lock made that check already,
    /// but a holder paused past its lease may write after a newer holder sold the unit.
    pub(crate) async fn record(
        &self,
        conn: &mut Connection,
        segment: u32,
        guarded: bool,
    ) -> Result<Reservation, ReserveError> {
        if Instant::now() >= self.deadline {
            return Ok(Reservation::Expired);
        }
        if !self.tenure.may_sell() {
            return Err(ReserveError::NotAuthority);
        }
        let fence_ms = fence_from_now();
        let recorded: redis::RedisResult<i64> = RECORD
            .key(&self.keys.stock)
            .key(&self.keys.buyers)
            .key(&self.keys.orders)
            .key(&self.keys.claims)
            .arg(segment)
            .arg(self.coupon_id)
            .arg(self.user_id)
            .arg(&self.order_id)
            .arg(self.at_ms)
            .arg(fence_ms)
            .arg(i32::from(guarded))
            .invoke_async(conn)
            .await;
        match recorded {
            Ok(1) => Ok(self.reserved()),
            Ok(0) => Ok(Reservation::SoldOut),
            Ok(_) => Ok(Reservation::Expired),
            Err(source) => Err(ReserveError::after_send(fence_ms, source)),
        }
    }

    /// The stock left in `segment` and the buyer's entry, in one round trip. `None` stock
    /// means the coupon is not loaded.
    pub(crate) async fn peek(
        &self,
        conn: &mut Connection,
        segment: u32,
    ) -> redis::RedisResult<(Option<i64>, Option<String>)> {
        peek(conn, &self.keys, segment, self.user_id).await
    }

    /// The order event of this sale, as SQL stores it.
    pub(crate) fn event(&self) -> OrderEvent {
        OrderEvent {
            order_id: self.order_id.clone(),
            coupon_id: self.coupon_id,
            user_id: self.user_id,
            created_at: self.at_ms,
        }
    }

    /// Writes into Redis what SQL decided for this sale's coupon: the units left and the
    /// buyer's order, so that later purchases are answered without the lock. Absolute
    /// values, so a repeat is harmless and a stale counter is corrected. A failure is
    /// logged: SQL holds the truth, and the next sale of the coupon corrects Redis.
    pub(crate) async fn mirror_sql(
        &self,
        conn: &mut Connection,
        remaining: Option<i64>,
        buyer_order: Option<&str>,
    ) {
        let mut pipe = redis::pipe();
        pipe.atomic();
        if let Some(remaining) = remaining {
            pipe.hset(&self.keys.stock, 0, remaining).ignore();
        }
        if let Some(order_id) = buyer_order {
            pipe.hset(&self.keys.buyers, self.user_id, order_id)
                .ignore();
        }
        let mirrored: redis::RedisResult<()> = pipe.query_async(conn).await;
        if let Err(err) = mirrored {
            tracing::warn!(order = %self.order_id, error = %err, "could not update Redis after a sale was decided in SQL");
        }
    }

    pub(crate) fn reserved(&self) -> Reservation {
        Reservation::Reserved {
            order_id: self.order_id.clone(),
        }
    }

    /// This purchase's claim on the buyer, in the segmented strategy:
    /// `~SETTLE_BY:INSTANCE:ORDER` (see `scripts/claim.lua`).
    pub(crate) fn claim(&self) -> String {
        format!("~{}:{}:{}", self.settle_by_ms, self.instance, self.order_id)
    }

    /// Withdraws this purchase's claim, if it is still there.
    pub(crate) async fn unclaim(&self, conn: &mut Connection) {
        unclaim(conn, &self.keys, self.user_id, &self.claim()).await;
    }

    /// What the buyer's entry, read after this sale's fence passed, says about it.
    async fn settled(&self, conn: &mut Connection, held: Option<String>) -> Reservation {
        match held {
            Some(order) if order == self.order_id => self.reserved(),
            Some(claim) if claim == self.claim() => {
                // Claimed, and the sale's write never landed: withdraw the claim.
                self.unclaim(conn).await;
                Reservation::Expired
            }
            Some(other) => already_purchased(other),
            None => Reservation::Expired,
        }
    }
}

/// The answer for a buyer whose entry is `held`: the order id, or `None` while it is
/// another request's claim.
pub(crate) fn already_purchased(held: String) -> Reservation {
    Reservation::AlreadyPurchased {
        order_id: (!held.starts_with('~')).then_some(held),
    }
}

/// Withdraws `claim` on `user_id`, if it is still there. A failure is logged: the claim
/// repair removes it once its settle-by time has passed.
pub(crate) async fn unclaim(conn: &mut Connection, keys: &CouponKeys, user_id: i64, claim: &str) {
    let withdrawn: redis::RedisResult<i64> = UNCLAIM
        .key(&keys.buyers)
        .key(&keys.claims)
        .arg(user_id)
        .arg(claim)
        .invoke_async(conn)
        .await;
    if let Err(err) = withdrawn {
        tracing::error!(user = user_id, claim, error = %err, "could not withdraw a segmented claim; the claim repair removes it once its settle-by time passes");
    }
}

/// The stock left in `segment` and `user_id`'s entry, in one round trip.
pub(crate) async fn peek(
    conn: &mut Connection,
    keys: &CouponKeys,
    segment: u32,
    user_id: i64,
) -> redis::RedisResult<(Option<i64>, Option<String>)> {
    redis::pipe()
        .hget(&keys.stock, segment)
        .hget(&keys.buyers, user_id)
        .query_async(conn)
        .await
}

/// The stock left in one segment; `None` if the coupon is not loaded.
pub(crate) async fn segment_stock(
    conn: &mut Connection,
    keys: &CouponKeys,
    segment: u32,
) -> redis::RedisResult<Option<i64>> {
    conn.hget(&keys.stock, segment).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_must_cover_the_critical_sections_p99_with_headroom() {
        let ms = Duration::from_millis;
        assert!(lease_fits(ms(30_000), ms(4)).is_ok());
        assert!(lease_fits(ms(200), ms(100)).is_ok());
        let refused = lease_fits(ms(150), ms(100)).expect_err("150 ms < 2 × 100 ms");
        let message = refused.to_string();
        assert!(
            message.contains("a lease of 150ms") && message.contains("100.0 ms"),
            "{message}"
        );
        assert!(
            message.contains("Use at least --lock-lease 202ms"),
            "{message}"
        );
    }
}
