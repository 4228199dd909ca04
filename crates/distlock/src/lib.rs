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
//! Four layers, each importing only the ones below it (docs/design.md draws them):
//!
//! - `client/`: the builder and the public [`Client`] facade, which assembles the rest;
//! - `primitives/`: one module per primitive ([`Lock`], [`RedLock`], [`MultiLock`]), each
//!   a thin layer that states its keys, scripts (`scripts/*.lua`, one file each) and
//!   lease kinds;
//! - `engine/`: the acquisition loop, the shared pub/sub subscriptions, the renewal
//!   scheduler, the session every primitive shares;
//! - `transport/`: connections to standalone, Sentinel and Cluster deployments, pub/sub,
//!   replica sync, server checks and script calls; it knows nothing of locks;
//!
//! and under them all, the leaves: `config`, `error`, `duration`, and `runtime` (the
//! clients' own thread, where all background work runs).

#![warn(missing_docs)]

mod client;
mod config;
/// CRC16-CCITT (XMODEM), the checksum Redis Cluster hashes keys with (shared with build.rs).
mod crc16;
mod deadline_clock;
mod duration;
mod engine;
mod error;
mod primitives;
mod runtime;
mod transport;

pub use client::{Client, ClientBuilder, StoreKind};
pub use config::FencingCounter;
pub use duration::{format_duration, parse_duration};
pub use error::{Error, NodeFailure, Result, StoreFailure};
pub use primitives::count_down_latch::CountDownLatch;
pub use primitives::fair_lock::FairLock;
pub use primitives::lock::{Lock, LockGuard, ReleaseOutcome};
pub use primitives::multi_lock::{MultiLock, MultiLockGuard, MultiLockMember};
pub use primitives::permit_semaphore::{LeasedPermits, PermitSemaphore};
pub use primitives::red_lock::{RedLock, RedLockGuard};
pub use primitives::rw_lock::{RwLock, RwReadGuard};
pub use primitives::semaphore::{PermitsSet, Semaphore, SemaphorePermits};
pub use transport::connection::{Connection, RedisConnection};
pub use transport::replica_sync::ReplicaSync;

/// The redis-rs crate distlock is built on, re-exported so that what the API takes and
/// returns ([`redis::Client`] for [`ClientBuilder::connect_with`],
/// [`redis::TlsCertificates`], the connections of [`RedisConnection`], the
/// [`redis::RedisError`] inside [`Error`]) can be named at the matching version without a
/// dependency of your own.
pub use redis;

/// The token [`LockGuard::lost_token`] returns (tokio-util's), re-exported so that
/// `distlock` and `tokio` are the only dependencies a user needs.
pub use tokio_util::sync::CancellationToken;
