//! Distributed locks on Redis for async Rust.
//!
//! distlock gives a fleet of service instances what a `tokio::sync::Mutex` gives the
//! tasks of one process, with what a lock under money needs:
//!
//! - **fencing tokens**: every acquisition gets a number larger than all earlier ones of
//!   that lock, so a resource can refuse writes from a holder that was paused past its
//!   lease;
//! - **a lost-lock signal**: [`LockGuard::lost`] completes as soon as the lock can no
//!   longer be trusted to be held, and no later than the lease deadline;
//! - **release-woken waiting**: waiters sleep on a pub/sub notification, not a polling
//!   timer, so a handoff takes a round trip, not a retry interval;
//! - **a watchdog** that renews every held lock of a process in batches from one task.
//!
//! The data layout is Redisson's, so a Java service using Redisson's `RLock` and a Rust
//! service using distlock exclude each other on the same lock name.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let server = distlock_testkit::RedisServer::start().await?;
//! # let url = server.url();
//! let client = distlock::Client::connect(&url).await?;
//! let lock = client.lock("coupon:42")?;
//!
//! let guard = lock.lock().await?;
//! // ... read-modify-write, passing guard.fencing_token() to the store ...
//! assert_eq!(guard.hold_count(), 1);
//! guard.release().await?;
//! assert!(!lock.is_locked().await?);
//! # Ok(())
//! # }
//! ```
//!
//! # Layout of the crate
//!
//! - [`Client`]: connection, configuration, and the per-client background tasks;
//! - `engine`: the acquisition loop, the shared pub/sub subscriptions, the watchdog;
//! - [`Lock`] / [`LockGuard`]: the lease lock (one holder per acquisition, explicit
//!   re-entry), a thin layer over the engine;
//! - `runtime`: the client's own runtime, where all background work runs;
//! - `scripts/*.lua`: every command that must be atomic, one file each.

#![warn(missing_docs)]

mod client;
#[cfg(feature = "cluster")]
mod cluster_link;
mod connection;
mod deployment;
mod duration;
mod engine;
mod error;
mod eviction;
mod keys;
mod lock;
mod multi_lock;
mod red_lock;
mod replica_sync;
mod runtime;
mod scripts;
#[cfg(feature = "sentinel")]
mod sentinel;
mod tls;

pub use client::{Client, ClientBuilder};
pub use connection::{Connection, RedisConnection};
pub use error::{Error, NodeFailure, Result};
pub use keys::FencingCounter;
pub use lock::{Lock, LockGuard, ReleaseOutcome};
pub use multi_lock::{MultiLock, MultiLockGuard};
pub use red_lock::{RedLock, RedLockGuard};
pub use replica_sync::ReplicaSync;

/// The redis-rs crate distlock is built on, re-exported so that what the API takes and
/// returns ([`redis::Client`] for [`ClientBuilder::connect_with`],
/// [`redis::TlsCertificates`], the connections of [`RedisConnection`], the
/// [`redis::RedisError`] inside [`Error`]) can be named at the matching version without a
/// dependency of your own.
pub use redis;

/// The token [`LockGuard::lost_token`] returns (tokio-util's), re-exported so that
/// `distlock` and `tokio` are the only dependencies a user needs.
pub use tokio_util::sync::CancellationToken;
