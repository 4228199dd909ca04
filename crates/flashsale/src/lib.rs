//! flashsale: a seckill coupon service on Redis and distlock.
//!
//! Thousands of buyers hit one coupon in the same second. The rules are one coupon per
//! user, never more sales than stock, and every sale stored as an order. The service keeps
//! them with three pieces, one module each:
//!
//! - [`strategy`]: how a purchase reserves stock in Redis. The default is one atomic Lua
//!   script; the others (a distlock lock, segmented locks, and an unsafe control) exist to
//!   show why.
//! - [`worker`]: every reservation appends an order event to a Redis Stream; a worker in
//!   a consumer group writes them to SQL and acknowledges only after the commit.
//! - [`stock`]: loads each coupon's stock into Redis under a distlock lock, so one
//!   instance of a fleet loads it, none overwrites a live counter, and a Redis that lost
//!   its data gets the right stock back.
//!
//! [`service`] wires them to the HTTP API in [`http`], and [`load`] is the load generator
//! that proves the rules under load. See docs/flashsale.md for the design.

pub mod authority;
pub mod bench;
pub mod config;
pub mod db;
pub mod duration;
pub mod embedded;
pub mod error;
mod faults;
pub mod http;
pub mod keys;
pub mod load;
pub mod metrics;
pub mod model;
pub mod order_events;
pub mod reconcile;
mod scripts;
pub mod serve;
pub mod server;
pub mod service;
pub mod stock;
pub mod strategy;
pub mod worker;

pub use config::{ConfigError, ServiceConfig};
pub use service::Service;

/// The exit codes of every command, so a supervisor or a cron probe can tell outcomes
/// apart. Listed in `flashsale --help`.
pub mod exit_code {
    /// The run failed: `serve` lost its private Redis or its database lock, or the store
    /// was taken over from it; `load` saw a rule broken.
    pub const FAILURE: u8 = 1;
    /// A bad flag, variable or setting, or a server that could not be reached.
    pub const USAGE: u8 = 2;
    /// `reconcile`: some coupon's Redis state and SQL disagree, or a former authority's
    /// Redis holds orders it told buyers about that the store does not.
    pub const DRIFT: u8 = 3;
    /// The store's stock is sold from another Redis, or a take-over found it still being
    /// sold (see [`crate::authority`]).
    pub const FOREIGN_STORE: u8 = 4;
    /// There is no such store (a missing data directory or SQLite file, a database
    /// without the schema) or no such coupon: only `serve` creates a store.
    pub const NO_STORE: u8 = 5;
    /// `serve` stopped without storing every order event it could have: Redis or the
    /// database failed during the drain (the events stay in Redis, stored later).
    pub const UNDRAINED: u8 = 6;

    /// The code for an error a command returned.
    pub fn of(err: &(dyn std::error::Error + Send + Sync + 'static)) -> u8 {
        use crate::authority::AuthorityError;
        match err.downcast_ref::<crate::ConfigError>() {
            Some(crate::ConfigError::Authority(err))
                if matches!(
                    **err,
                    AuthorityError::Foreign { .. }
                        | AuthorityError::StaleRedis { .. }
                        | AuthorityError::StillInUse { .. }
                        | AuthorityError::NotReleased { .. }
                ) =>
            {
                FOREIGN_STORE
            }
            Some(
                crate::ConfigError::NoDataDir { .. }
                | crate::ConfigError::NoSuchCoupon { .. }
                | crate::ConfigError::Db(crate::db::DbError::NoStore { .. }),
            ) => NO_STORE,
            _ => USAGE,
        }
    }

    /// What `--help` says about them.
    pub const HELP: &str = "Exit codes: 0 success; 1 the run failed (serve lost its \
        private Redis or its database lock, or the store was taken over from it; load saw a \
        rule broken); 2 bad arguments or configuration, or a server that cannot be reached; \
        3 reconcile found drift, or orders a former authority's Redis told and the store \
        does not hold; 4 the store's stock is sold from another Redis (see \
        --take-over-store); 5 no such store or coupon (only serve creates a store); 6 serve \
        stopped with order events not yet stored (they stay in Redis and are stored later)";
}

/// What a subcommand returns: an exit code, or an error printed as `error: …`.
pub type CliResult = Result<std::process::ExitCode, Box<dyn std::error::Error + Send + Sync>>;
pub use strategy::Strategy;
