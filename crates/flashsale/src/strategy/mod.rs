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

use crate::keys::{CouponKeys, Keyspace};
use crate::model::now_millis;

/// Which reservation strategy the service runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// One atomic Lua script: check stock and buyer, decrement, record, enqueue.
    Lua,
    /// A per-coupon distlock lock, acquired with a wait and a lease, around the same steps
    /// as separate commands.
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
}

impl StrategySettings {
    /// The defaults for `strategy`: 8 segments, a 5 s wait and a 5 s lease.
    pub fn new(strategy: Strategy) -> Self {
        StrategySettings {
            strategy,
            segments: 8,
            lock_wait: Duration::from_secs(5),
            lock_lease: Duration::from_secs(5),
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
        /// The order's id, a UUID.
        order_id: String,
    },
    /// No stock left.
    SoldOut,
    /// The user already bought this coupon.
    AlreadyPurchased,
    /// Redis has no stock for this coupon: it was never loaded, or Redis lost its data.
    NotLoaded,
    /// The strategy's lock was not acquired within its wait.
    Busy,
}

/// Why a reservation could not be decided.
#[derive(Debug, thiserror::Error)]
pub enum ReserveError {
    /// A Redis command failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The strategy's lock failed.
    #[error("lock: {0}")]
    Lock(#[from] distlock::Error),
}

/// Runs purchases with one strategy. Cheap to clone.
#[derive(Clone)]
pub struct Reserver {
    settings: StrategySettings,
    locks: distlock::Client,
    keyspace: Keyspace,
    batcher: std::sync::Arc<lua::Batcher>,
}

impl Reserver {
    /// A reserver using `locks` for both its locks and its Redis commands, on the keys of
    /// `keyspace`.
    pub fn new(settings: StrategySettings, locks: distlock::Client, keyspace: Keyspace) -> Self {
        Reserver {
            settings,
            locks,
            keyspace,
            batcher: Default::default(),
        }
    }

    /// The settings it runs with.
    pub fn settings(&self) -> &StrategySettings {
        &self.settings
    }

    /// One purchase of coupon `coupon_id` by `user_id`.
    pub async fn reserve(&self, coupon_id: i64, user_id: i64) -> Result<Reservation, ReserveError> {
        let sale = Sale {
            keys: self.keyspace.coupon(coupon_id),
            coupon_id,
            user_id,
            order_id: uuid::Uuid::new_v4().simple().to_string(),
            at_ms: now_millis(),
        };
        let mut conn = self.locks.connection();
        match self.settings.strategy {
            Strategy::Lua => self.batcher.reserve(&conn, &sale).await,
            Strategy::Lock => lock::reserve(&self.locks, &self.settings, &sale).await,
            Strategy::Segmented => segmented::reserve(&self.locks, &self.settings, &sale).await,
            Strategy::Unsafe => unguarded::reserve(&mut conn, &sale).await,
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
}

impl Sale {
    /// Takes one unit from `segment`, adds the buyer and appends the order event, in one
    /// MULTI/EXEC. The caller has already decided, under its own guard, that the sale may
    /// happen; this only makes the three writes land together.
    pub(crate) async fn record(
        &self,
        conn: &mut Connection,
        segment: u32,
    ) -> redis::RedisResult<()> {
        redis::pipe()
            .atomic()
            .hincr(&self.keys.stock, segment, -1)
            .ignore()
            .sadd(&self.keys.buyers, self.user_id)
            .ignore()
            .xadd(
                &self.keys.orders,
                "*",
                &[
                    ("order", self.order_id.clone()),
                    ("coupon", self.coupon_id.to_string()),
                    ("user", self.user_id.to_string()),
                    ("at", self.at_ms.to_string()),
                ],
            )
            .ignore()
            .exec_async(conn)
            .await
    }

    /// The stock left in `segment` and whether the user already bought, in one round trip.
    /// `None` stock means the coupon is not loaded.
    pub(crate) async fn peek(
        &self,
        conn: &mut Connection,
        segment: u32,
    ) -> redis::RedisResult<(Option<i64>, bool)> {
        redis::pipe()
            .hget(&self.keys.stock, segment)
            .sismember(&self.keys.buyers, self.user_id)
            .query_async(conn)
            .await
    }

    pub(crate) fn reserved(&self) -> Reservation {
        Reservation::Reserved {
            order_id: self.order_id.clone(),
        }
    }
}

/// The stock left in one segment; `None` if the coupon is not loaded.
pub(crate) async fn segment_stock(
    conn: &mut Connection,
    keys: &CouponKeys,
    segment: u32,
) -> redis::RedisResult<Option<i64>> {
    conn.hget(&keys.stock, segment).await
}
