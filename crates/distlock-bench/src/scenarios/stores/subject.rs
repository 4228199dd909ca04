//! What takes the lock in the stores scenario: distlock on one of its stores, or a peer
//! library on the same server. The parent process and the worker processes take locks
//! through the same calls, so every subject runs the same load.
//!
//! A new store adds a [`Store`] variant, its distlock subject, and its peer where one
//! exists (as ZooKeeper did: `Store::Zk`, `Subject::Zk`, `Subject::PeerZk`). A subject whose code is behind a feature that this build lacks is
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
#[cfg(feature = "zk")]
use super::peer_zk;
use crate::scenarios::BenchResult;

/// The lease of distlock's watchdog mode in every client of the scenario: short, so that
/// the kill -9 row, which waits a lease out, stays short. Renewals come every third of it.
/// On ZooKeeper distlock asks for it as its session timeout (and refuses a shorter one),
/// and so does the peer.
pub const WATCHDOG_LEASE: Duration = Duration::from_secs(2);

/// A store the scenario starts a private server of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    Redis,
    Postgres,
    Etcd,
    Zk,
}

impl Store {
    /// distlock first, then the peers on the same server.
    pub fn subjects(self) -> &'static [Subject] {
        match self {
            Store::Redis => &[Subject::Redis],
            Store::Postgres => &[Subject::Postgres, Subject::PeerPostgres],
            Store::Etcd => &[Subject::Etcd, Subject::PeerEtcd],
            Store::Zk => &[Subject::Zk, Subject::PeerZk],
        }
    }

    /// Lower case, for messages.
    pub fn key(self) -> &'static str {
        match self {
            Store::Redis => "redis",
            Store::Postgres => "postgres",
            Store::Etcd => "etcd",
            Store::Zk => "zk",
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
            Store::Zk => "raw set_data of one node (a write)",
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
    /// distlock on ZooKeeper (an ephemeral sequential node per waiter, the session as the
    /// lease).
    Zk,
    /// `zookeeper-client` 0.11's own lock recipe (Curator's layout), on a session per
    /// process.
    PeerZk,
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
            Subject::Zk => "zk",
            Subject::PeerZk => "peer-zk",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Subject::Redis => "distlock on Redis",
            Subject::Postgres => "distlock on PostgreSQL",
            Subject::PeerPostgres => "distributed-lock-postgres 0.2",
            Subject::Etcd => "distlock on etcd",
            Subject::PeerEtcd => "etcd v3lock RPC (etcd-client)",
            Subject::Zk => "distlock on ZooKeeper",
            Subject::PeerZk => "zookeeper-client 0.11 lock (Curator recipe)",
        }
    }

    /// The Cargo feature of distlock-bench this build lacks to run the subject, if any:
    /// the subject's rows then say so instead of vanishing.
    pub fn missing(self) -> Option<&'static str> {
        match self {
            Subject::Redis | Subject::Postgres => None,
            Subject::PeerPostgres => (!cfg!(feature = "peer-postgres")).then_some("peer-postgres"),
            Subject::Etcd | Subject::PeerEtcd => (!cfg!(feature = "etcd")).then_some("etcd"),
            Subject::Zk | Subject::PeerZk => (!cfg!(feature = "zk")).then_some("zk"),
        }
    }

    /// Whether its locks are leases (freed when the lease runs out) rather than held by a
    /// session (freed when the holder's connection ends). A ZooKeeper session counts as a
    /// lease: the ensemble frees its nodes a session timeout after it last heard from the
    /// holder, not when the connection closes.
    pub fn has_lease(self) -> bool {
        !matches!(self, Subject::PeerPostgres)
    }

    /// Whether the lease left at a kill is read to the millisecond: etcd answers a lease's
    /// time to live in whole seconds (distlock's `remaining_ttl` on etcd passes that on),
    /// too coarse for the "past the lease left" row; see [`Subject::lease_unread`].
    pub fn reads_lease_left(self) -> bool {
        matches!(self, Subject::Redis | Subject::Postgres)
    }

    /// Why the lease left at a kill is not read, for a lease lock that does not.
    pub fn lease_unread(self) -> &'static str {
        match self {
            // distlock's `remaining_ttl` answers the session timeout for a watchdog-mode
            // holding: no client can read when the ensemble last heard from a session.
            Subject::Zk | Subject::PeerZk => "not read (a session's expiry is the ensemble's)",
            _ => "not read (etcd answers whole seconds)",
        }
    }

    /// What the kill -9 row's time is compared with.
    pub fn lease_label(self) -> &'static str {
        match self {
            Subject::PeerEtcd => "etcd lease TTL =",
            Subject::Zk | Subject::PeerZk => "ZooKeeper session timeout =",
            _ => "watchdog lease =",
        }
    }

    /// Whether each hold carries a number that grows from holder to holder: distlock's
    /// fencing token, the revision of etcd's lock answer, or the sequence number of the
    /// ZooKeeper peer's node.
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
    #[cfg(feature = "zk")]
    PeerZk(peer_zk::Locker),
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
            Subject::Redis | Subject::Postgres | Subject::Etcd | Subject::Zk => Locker::Distlock(
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
            #[cfg(feature = "zk")]
            Subject::PeerZk => Locker::PeerZk(peer_zk::Locker::connect(url, WATCHDOG_LEASE).await?),
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
            #[cfg(feature = "zk")]
            Locker::PeerZk(locker) => OneLock::PeerZk(locker.lock(name)),
        })
    }

    /// On a graceful exit: distlock flushes background releases; the etcd peer revokes
    /// its lease; the ZooKeeper peer's session closes when its last clone is dropped.
    pub async fn shutdown(&self) {
        match self {
            Locker::Distlock(client) => client.shutdown().await,
            #[cfg(feature = "etcd")]
            Locker::PeerEtcd(locker) => locker.shutdown().await,
            #[cfg(feature = "peer-postgres")]
            Locker::Peer(_) => {}
            #[cfg(feature = "zk")]
            Locker::PeerZk(_) => {}
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
    #[cfg(feature = "zk")]
    PeerZk(peer_zk::OneLock),
}

/// One hold, with what it takes to release it.
pub enum Held {
    Distlock(distlock::LockGuard),
    #[cfg(feature = "peer-postgres")]
    Peer(distributed_lock_postgres::handle::PostgresLockHandle),
    #[cfg(feature = "etcd")]
    PeerEtcd(peer_etcd::Held),
    #[cfg(feature = "zk")]
    PeerZk(peer_zk::Held),
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
            #[cfg(feature = "zk")]
            OneLock::PeerZk(lock) => Held::PeerZk(lock.acquire().await?),
        })
    }

    /// One attempt: distlock's `try_lock()`, the PostgreSQL peer's `try_acquire()`.
    /// etcd's lock RPC and the ZooKeeper recipe have none (see [`Subject::reports_try`]).
    pub async fn try_acquire(&self) -> BenchResult<Option<Held>> {
        Ok(match self {
            OneLock::Distlock(lock) => lock.try_lock().await?.map(Held::Distlock),
            #[cfg(feature = "peer-postgres")]
            OneLock::Peer(lock) => lock.try_acquire().await?.map(Held::Peer),
            #[cfg(feature = "etcd")]
            OneLock::PeerEtcd(_) => return Err("etcd's lock RPC has no single attempt".into()),
            #[cfg(feature = "zk")]
            OneLock::PeerZk(_) => {
                return Err("zookeeper-client's lock recipe has no single attempt".into())
            }
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
            #[cfg(feature = "zk")]
            OneLock::PeerZk(_) => None,
        })
    }
}

impl Held {
    /// The fencing token; for etcd's lock RPC, the revision of its answer; for the
    /// ZooKeeper recipe, its node's sequence number; 0 for the PostgreSQL peer, which has
    /// none.
    pub fn token(&self) -> u64 {
        match self {
            Held::Distlock(guard) => guard.fencing_token(),
            #[cfg(feature = "peer-postgres")]
            Held::Peer(_) => 0,
            #[cfg(feature = "etcd")]
            Held::PeerEtcd(held) => held.revision(),
            #[cfg(feature = "zk")]
            Held::PeerZk(held) => held.sequence(),
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
            // A drop: the node is deleted in the background (see `peer_zk`).
            #[cfg(feature = "zk")]
            Held::PeerZk(held) => held.release(),
        }
        Ok(())
    }
}
