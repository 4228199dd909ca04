//! What takes the lock in the stores scenario: distlock on one of its stores, or a peer
//! library on the same server. The parent process and the worker processes take locks
//! through the same calls, so every subject runs the same load.
//!
//! A new store (ZooKeeper) adds a [`Store`] variant, its distlock subject, and its peer
//! where one exists. A subject whose code is behind a feature that this build lacks is
//! still listed: its rows say which feature would build it (see [`Subject::missing`]).

#[cfg(feature = "peer-postgres")]
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "peer-postgres")]
use distributed_lock_core::traits::{DistributedLock, LockHandle, LockProvider};
#[cfg(feature = "peer-postgres")]
use distributed_lock_postgres::lock::PostgresDistributedLock;
#[cfg(feature = "peer-postgres")]
use distributed_lock_postgres::PostgresLockProvider;
use serde::{Deserialize, Serialize};

#[cfg(feature = "etcd")]
use super::peer_etcd;
use crate::scenarios::BenchResult;

/// The lease of distlock's watchdog mode in every client of the scenario: short, so that
/// the kill -9 row, which waits a lease out, stays short. Renewals come every third of it.
pub const WATCHDOG_LEASE: Duration = Duration::from_secs(2);

/// A store the scenario starts a private server of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    Redis,
    Postgres,
    Etcd,
}

impl Store {
    /// distlock first, then the peers on the same server.
    pub fn subjects(self) -> &'static [Subject] {
        match self {
            Store::Redis => &[Subject::Redis],
            Store::Postgres => &[Subject::Postgres, Subject::PeerPostgres],
            Store::Etcd => &[Subject::Etcd, Subject::PeerEtcd],
        }
    }

    /// Lower case, for messages.
    pub fn key(self) -> &'static str {
        match self {
            Store::Redis => "redis",
            Store::Postgres => "postgres",
            Store::Etcd => "etcd",
        }
    }

    /// The feature this build lacks to run the store at all, if any.
    pub fn missing(self) -> Option<&'static str> {
        self.subjects()
            .first()
            .and_then(|subject| subject.missing())
    }

    /// The one-round-trip request whose rate is the store's floor.
    pub fn floor_label(self) -> &'static str {
        match self {
            Store::Redis => "no-op EVALSHA",
            Store::Postgres => "SELECT 1 on one connection",
            Store::Etcd => "raw get of one key",
        }
    }
}

/// A lock implementation on a store, in the order of the summary's columns.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, Serialize, Deserialize,
)]
pub enum Subject {
    /// distlock on Redis.
    Redis,
    /// distlock on PostgreSQL (a lease row, LISTEN/NOTIFY).
    Postgres,
    /// `distributed-lock-postgres` 0.2: session advisory locks.
    PeerPostgres,
    /// distlock on etcd (a key per waiter, the session lease).
    Etcd,
    /// etcd's own v3lock `Lock`/`Unlock` RPC through `etcd-client`, on a lease kept alive.
    PeerEtcd,
}

impl Subject {
    /// Short, for scenario names and command lines.
    pub fn key(self) -> &'static str {
        match self {
            Subject::Redis => "redis",
            Subject::Postgres => "postgres",
            Subject::PeerPostgres => "peer-postgres",
            Subject::Etcd => "etcd",
            Subject::PeerEtcd => "peer-etcd",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Subject::Redis => "distlock on Redis",
            Subject::Postgres => "distlock on PostgreSQL",
            Subject::PeerPostgres => "distributed-lock-postgres 0.2",
            Subject::Etcd => "distlock on etcd",
            Subject::PeerEtcd => "etcd v3lock RPC (etcd-client)",
        }
    }

    /// The Cargo feature of distlock-bench this build lacks to run the subject, if any:
    /// the subject's rows then say so instead of vanishing.
    pub fn missing(self) -> Option<&'static str> {
        match self {
            Subject::Redis | Subject::Postgres => None,
            Subject::PeerPostgres => (!cfg!(feature = "peer-postgres")).then_some("peer-postgres"),
            Subject::Etcd | Subject::PeerEtcd => (!cfg!(feature = "etcd")).then_some("etcd"),
        }
    }

    /// Whether its locks are leases (freed when the lease runs out) rather than held by a
    /// session (freed when the holder's connection ends).
    pub fn has_lease(self) -> bool {
        !matches!(self, Subject::PeerPostgres)
    }

    /// Whether the lease left at a kill is read to the millisecond: etcd answers a lease's
    /// time to live in whole seconds (distlock's `remaining_ttl` on etcd passes that on),
    /// too coarse for the "past the lease left" row.
    pub fn reads_lease_left(self) -> bool {
        matches!(self, Subject::Redis | Subject::Postgres)
    }

    /// Whether each hold carries a number that grows from holder to holder: distlock's
    /// fencing token, or the revision of etcd's lock answer.
    pub fn has_token(self) -> bool {
        !matches!(self, Subject::PeerPostgres)
    }

    /// Whether it has a single-attempt acquire worth its own row (distlock's `try_lock`
    /// costs the same as its `lock` when free; etcd's lock RPC has no such call).
    pub fn reports_try(self) -> bool {
        matches!(self, Subject::PeerPostgres)
    }
}

/// A connection to a store through one subject: a distlock client, or the peer's provider
/// (which opens its own pool, with sqlx's defaults, as its users' code does).
pub enum Locker {
    Distlock(distlock::Client),
    #[cfg(feature = "peer-postgres")]
    Peer(PostgresLockProvider),
    #[cfg(feature = "etcd")]
    PeerEtcd(peer_etcd::Locker),
}

impl Locker {
    pub async fn connect(subject: Subject, url: &str) -> BenchResult<Locker> {
        if let Some(feature) = subject.missing() {
            return Err(format!(
                "{} is not built: rebuild distlock-bench with --features {feature}",
                subject.label()
            )
            .into());
        }
        Ok(match subject {
            Subject::Redis | Subject::Postgres | Subject::Etcd => Locker::Distlock(
                distlock::Client::builder()
                    .watchdog_timeout(WATCHDOG_LEASE)
                    .connect(url)
                    .await?,
            ),
            #[cfg(feature = "peer-postgres")]
            Subject::PeerPostgres => Locker::Peer(PostgresLockProvider::new(url).await?),
            #[cfg(feature = "etcd")]
            Subject::PeerEtcd => {
                Locker::PeerEtcd(peer_etcd::Locker::connect(url, WATCHDOG_LEASE).await?)
            }
            // Refused above: this build lacks the subject's feature.
            #[allow(unreachable_patterns)]
            _ => return Err(format!("{} is not built", subject.label()).into()),
        })
    }

    pub fn lock(&self, name: &str) -> BenchResult<OneLock> {
        Ok(match self {
            Locker::Distlock(client) => OneLock::Distlock(client.lock(name)?),
            #[cfg(feature = "peer-postgres")]
            Locker::Peer(provider) => OneLock::Peer(Arc::new(provider.create_lock(name))),
            #[cfg(feature = "etcd")]
            Locker::PeerEtcd(locker) => OneLock::PeerEtcd(locker.lock(name)),
        })
    }

    /// On a graceful exit: distlock flushes background releases; the etcd peer revokes
    /// its lease.
    pub async fn shutdown(&self) {
        match self {
            Locker::Distlock(client) => client.shutdown().await,
            #[cfg(feature = "etcd")]
            Locker::PeerEtcd(locker) => locker.shutdown().await,
            #[cfg(feature = "peer-postgres")]
            Locker::Peer(_) => {}
        }
    }
}

/// One lock name through one subject; cheap to clone, one per task.
#[derive(Clone)]
pub enum OneLock {
    Distlock(distlock::Lock),
    #[cfg(feature = "peer-postgres")]
    Peer(Arc<PostgresDistributedLock>),
    #[cfg(feature = "etcd")]
    PeerEtcd(peer_etcd::OneLock),
}

/// One hold, with what it takes to release it.
pub enum Held {
    Distlock(distlock::LockGuard),
    #[cfg(feature = "peer-postgres")]
    Peer(distributed_lock_postgres::handle::PostgresLockHandle),
    #[cfg(feature = "etcd")]
    PeerEtcd(peer_etcd::Held),
}

impl OneLock {
    /// Waits until the lock is acquired: distlock's `lock()`, the peer's `acquire(None)`.
    pub async fn acquire(&self) -> BenchResult<Held> {
        Ok(match self {
            OneLock::Distlock(lock) => Held::Distlock(lock.lock().await?),
            #[cfg(feature = "peer-postgres")]
            OneLock::Peer(lock) => Held::Peer(lock.acquire(None).await?),
            #[cfg(feature = "etcd")]
            OneLock::PeerEtcd(lock) => Held::PeerEtcd(lock.acquire().await?),
        })
    }

    /// One attempt: distlock's `try_lock()`, the PostgreSQL peer's `try_acquire()`.
    /// etcd's lock RPC has none (see [`Subject::reports_try`]).
    pub async fn try_acquire(&self) -> BenchResult<Option<Held>> {
        Ok(match self {
            OneLock::Distlock(lock) => lock.try_lock().await?.map(Held::Distlock),
            #[cfg(feature = "peer-postgres")]
            OneLock::Peer(lock) => lock.try_acquire().await?.map(Held::Peer),
            #[cfg(feature = "etcd")]
            OneLock::PeerEtcd(_) => return Err("etcd's lock RPC has no single attempt".into()),
        })
    }

    /// The lease the server has left, for a lease lock (`None` if free or not a lease).
    pub async fn lease_left(&self) -> BenchResult<Option<Duration>> {
        Ok(match self {
            OneLock::Distlock(lock) => lock.remaining_ttl().await?,
            // A session lock has no lease; etcd's peer: see `Subject::reads_lease_left`.
            #[cfg(feature = "peer-postgres")]
            OneLock::Peer(_) => None,
            #[cfg(feature = "etcd")]
            OneLock::PeerEtcd(_) => None,
        })
    }
}

impl Held {
    /// The fencing token; for etcd's lock RPC, the revision of its answer; 0 for the
    /// PostgreSQL peer, which has none.
    pub fn token(&self) -> u64 {
        match self {
            Held::Distlock(guard) => guard.fencing_token(),
            #[cfg(feature = "peer-postgres")]
            Held::Peer(_) => 0,
            #[cfg(feature = "etcd")]
            Held::PeerEtcd(held) => held.revision(),
        }
    }

    pub async fn release(self) -> BenchResult<()> {
        match self {
            Held::Distlock(guard) => {
                guard.release().await?;
            }
            #[cfg(feature = "peer-postgres")]
            Held::Peer(handle) => handle.release().await?,
            #[cfg(feature = "etcd")]
            Held::PeerEtcd(held) => held.release().await?,
        }
        Ok(())
    }
}
