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

pub mod bench;
pub mod config;
pub mod db;
pub mod embedded;
pub mod error;
pub mod http;
pub mod keys;
pub mod load;
pub mod metrics;
pub mod model;
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

/// What a subcommand returns: an exit code, or an error printed as `error: …`.
pub type CliResult = Result<std::process::ExitCode, Box<dyn std::error::Error + Send + Sync>>;
pub use strategy::Strategy;
