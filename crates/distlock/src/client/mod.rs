//! The client layer: the public [`Client`] facade and its [`ClientBuilder`]. It assembles
//! a session from the transport and the engine, and hands out the primitives.
//!
//! - [`builder`]: the settings, checked into a [`Config`](crate::config::Config);
//! - [`connect`]: connecting to each kind of Redis deployment, the checks every one
//!   gets, and the assembly of the session;
//! - [`stores`]: connecting to the other stores (PostgreSQL), picked by the URL.

mod builder;
mod connect;
mod stores;

use std::fmt;
use std::time::Duration;

pub use builder::ClientBuilder;

use crate::duration::to_millis;
use crate::engine::session::Session;
use crate::error::Result;
use crate::primitives::count_down_latch::CountDownLatch;
use crate::primitives::fair_lock::FairLock;
use crate::primitives::keys::validate_name;
use crate::primitives::lock::Lock;
use crate::primitives::permit_semaphore::PermitSemaphore;
use crate::primitives::red_lock::RedLock;
use crate::primitives::rw_lock::RwLock;
use crate::primitives::semaphore::Semaphore;
use crate::primitives::validate_name_for;
use crate::transport::connection::Connection;
use crate::transport::Store;

/// The kind of store a [`Client`] is connected to ([`Client::store`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreKind {
    /// Redis: one server, Sentinel or Cluster. Every primitive.
    Redis,
    /// PostgreSQL (the `postgres` feature): the lease lock.
    Postgres,
    /// etcd (the `etcd` feature): the lease lock, FIFO.
    Etcd,
    /// ZooKeeper (the `zk` feature): the lease lock, FIFO, alive with the client's
    /// session.
    Zk,
}

/// A handle on one Redis deployment, shared by every lock of a process.
///
/// Cloning is cheap: clones share one command connection, one pub/sub connection (opened on
/// the first wait), and one watchdog task that renews every held lock in batches.
///
/// Each client has a random id (a UUID from the OS's CSPRNG); lock owners are
/// `"<client id>:<n>"`, n counting its acquisitions, as Redisson's are
/// `"<uuid>:<thread id>"`.
///
/// Each client runs a thread of its own with a small tokio runtime, where its background
/// work happens (renewals, pub/sub, the releases of dropped guards), so it works from any
/// runtime and never depends on the caller's. Call [`Client::shutdown`] on a graceful exit;
/// dropping the last handle does the same.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = distlock_testkit::RedisServer::start().await?;
/// # let url = server.url();
/// use std::time::Duration;
///
/// // `url` is e.g. "redis://user:password@127.0.0.1:6379/0", or "rediss://…" for TLS.
/// let client = distlock::Client::builder()
///     .watchdog_timeout(Duration::from_secs(10))
///     .connect(&url)
///     .await?;
/// let guard = client.lock("invoices")?.lock().await?;
/// println!("token {}", guard.fencing_token());
/// guard.release().await?;
///
/// // Bad input is a typed error, not a panic.
/// assert!(matches!(client.lock(""), Err(distlock::Error::InvalidName { .. })));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Client {
    session: Session,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("id", &self.session.core().id())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Connects with the default settings; see [`ClientBuilder::connect`].
    pub async fn connect(url: &str) -> Result<Client> {
        Self::builder().connect(url).await
    }

    /// Starts configuring a client.
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    /// This client's random id, the first half of every owner it writes.
    pub fn id(&self) -> &str {
        self.session.core().id()
    }

    /// A handle on the lock called `name`. Nothing is sent to Redis until it is used.
    ///
    /// The name is the Redis key of the lock, exactly as given (after the client's
    /// [key prefix](ClientBuilder::key_prefix), if it has one), so a Redisson `RLock` of
    /// the same name excludes this one.
    pub fn lock(&self, name: impl Into<String>) -> Result<Lock> {
        Ok(Lock::new(self.session.clone(), self.key_of(name.into())?))
    }

    /// A handle on the fair lock called `name`: waiters get it in the order they asked,
    /// and a release hands it straight to the next one. Nothing is sent to Redis until it
    /// is used.
    ///
    /// Its key is the name (after the client's key prefix), with Redisson's `RFairLock`
    /// layout, so a Redisson fair lock of the same name shares its queue.
    pub fn fair_lock(&self, name: impl Into<String>) -> Result<FairLock> {
        self.redis_only("a fair lock")?;
        Ok(FairLock::new(
            self.session.clone(),
            self.key_of(name.into())?,
        ))
    }

    /// A handle on the read-write lock called `name` (Redisson's `RReadWriteLock`
    /// layout): many readers or one writer.
    pub fn rw_lock(&self, name: impl Into<String>) -> Result<RwLock> {
        // Every store has it: ZooKeeper's and etcd's queues take shared waiters beside
        // exclusive ones (Curator's and etcd's read-write lock recipes); PostgreSQL
        // keeps readers in rows of their own (rw_lock/postgres.rs).
        Ok(RwLock::new(self.session.clone(), self.key_of(name.into())?))
    }

    /// A handle on the semaphore called `name` (Redisson's `RSemaphore` layout: the count
    /// of free permits at the key). Set its permits with
    /// [`Semaphore::try_set_permits`].
    pub fn semaphore(&self, name: impl Into<String>) -> Result<Semaphore> {
        self.redis_only("a semaphore")?;
        Ok(Semaphore::new(
            self.session.clone(),
            self.key_of(name.into())?,
        ))
    }

    /// A handle on the permit semaphore called `name`: permits that are leases, renewed
    /// while held, that come back by themselves when their holder dies (Redisson's
    /// `RPermitExpirableSemaphore` layout).
    pub fn permit_semaphore(&self, name: impl Into<String>) -> Result<PermitSemaphore> {
        // Redis, PostgreSQL (an acquisition is a row) and etcd (a key in the
        // semaphore's queue) have it; ZooKeeper does not yet.
        match self.session.core().store() {
            Store::Redis => {}
            #[cfg(feature = "postgres")]
            Store::Postgres(_) => {}
            #[cfg(feature = "etcd")]
            Store::Etcd(_) => {}
            #[allow(unreachable_patterns)]
            other => {
                return Err(crate::error::Error::Unsupported {
                    store: other.name(),
                    what: "a permit semaphore",
                })
            }
        }
        Ok(PermitSemaphore::new(
            self.session.clone(),
            self.key_of(name.into())?,
        ))
    }

    /// A handle on the count-down latch called `name` (Redisson's `RCountDownLatch`
    /// layout). Set its count with [`CountDownLatch::try_set_count`].
    pub fn count_down_latch(&self, name: impl Into<String>) -> Result<CountDownLatch> {
        self.redis_only("a count-down latch")?;
        CountDownLatch::new(self.session.clone(), self.key_of(name.into())?)
    }

    /// The Redis key of the primitive called `name`: the client's key prefix, then the
    /// name, both checked.
    fn key_of(&self, name: String) -> Result<String> {
        validate_name(&name)?;
        let core = self.session.core();
        let prefix = &core.config().key_prefix;
        let key = if prefix.is_empty() {
            name
        } else {
            let key = format!("{prefix}{name}");
            validate_name(&key)?;
            key
        };
        validate_name_for(core.store(), &key)?;
        Ok(key)
    }

    /// Fails with [`Error::Unsupported`](crate::Error::Unsupported) unless the client is
    /// on Redis: for the primitives only Redis has so far.
    fn redis_only(&self, what: &'static str) -> Result<()> {
        self.session.core().store().ensure_redis(what)
    }

    /// A clone of the command connection, for callers that want to run their own commands
    /// on the same server (a fenced write, say). It works from any runtime, like the
    /// client, and fails once the client has shut down. Like any redis-rs connection
    /// manager, it reconnects after a failure, but the first command after the server
    /// restarted may fail with a broken pipe: send it again.
    pub fn connection(&self) -> Connection {
        let core = self.session.core();
        core.connection().refusing_after(core.closing())
    }

    /// Opens a connection of its own to this client's deployment (the same server, the
    /// master the sentinels name, or the cluster), for commands that block their
    /// connection on the server, such as `XREADGROUP … BLOCK` or `BLPOP`: on the shared
    /// [`Client::connection`] they would hold up every lock operation behind them.
    /// Replies may take `response_timeout`. The connection lives on the client's own
    /// runtime, works from any runtime, and fails once the client has shut down.
    pub async fn dedicated_connection(&self, response_timeout: Duration) -> Result<Connection> {
        let core = self.session.core();
        core.ensure_open()?;
        to_millis("response timeout", response_timeout)?;
        let Some(servers) = core.servers() else {
            return Err(crate::error::Error::Unsupported {
                store: core.store().name(),
                what: "a dedicated Redis connection",
            });
        };
        let connection = servers
            .open_on(core.background().handle(), core.config(), response_timeout)
            .await?;
        Ok(connection.refusing_after(core.closing()))
    }

    /// Which store this client is connected to, for code that offers a feature on some
    /// stores only (the primitives a store lacks answer [`Error::Unsupported`](crate::Error::Unsupported)).
    pub fn store(&self) -> StoreKind {
        match self.session.core().store() {
            Store::Redis => StoreKind::Redis,
            #[cfg(feature = "postgres")]
            Store::Postgres(_) => StoreKind::Postgres,
            #[cfg(feature = "etcd")]
            Store::Etcd(_) => StoreKind::Etcd,
            #[cfg(feature = "zk")]
            Store::Zk(_) => StoreKind::Zk,
        }
    }

    /// True if this client talks to a Redis Cluster: one command may then only carry
    /// keys of one hash slot.
    pub fn is_cluster(&self) -> bool {
        self.session.core().deployment().is_cluster()
    }

    /// How many leases this client's watchdog tracks right now: one per holding that is
    /// still renewed or trusted (re-entries of a holding count once).
    pub fn tracked_leases(&self) -> usize {
        self.session.core().watchdog().tracked()
    }

    /// For tests only: blocks the client's own runtime thread for `duration`, as a
    /// machine too busy to schedule it would. Not part of the API.
    #[doc(hidden)]
    pub fn stall_background_for_tests(&self, duration: Duration) {
        self.session
            .core()
            .background()
            .spawn(async move { std::thread::sleep(duration) });
    }

    /// Stops the client: waits for the releases of dropped guards and the lock operations
    /// in flight, then stops its background work (the watchdog, the pub/sub hub). Call it
    /// on a graceful exit.
    ///
    /// From the moment it is called:
    /// - acquisitions, re-entries and queries fail with [`Error::Shutdown`], and calls
    ///   waiting for a lock return that error at once;
    /// - nothing renews a live guard any more, so each one's lost signal fires at once
    ///   ([`LockGuard::lost`](crate::LockGuard::lost), `lost_token`, `is_lost`);
    /// - giving back still works: releasing or dropping a guard frees its lock, during
    ///   and after the shutdown, and an acquisition that completes after it gives its lock
    ///   back. A guard kept alive keeps its lock until its lease runs out.
    ///
    /// It waits at most a release's retry window (about 3 s by default), by the client's
    /// own clock, so it returns even if the runtime that connected is stalled. Dropping
    /// the last handle on a client (every clone, lock and guard) does the same. A client
    /// kept in a `static` is never dropped: call this before the program exits. The
    /// client's thread ends once nothing of the client is left.
    pub async fn shutdown(&self) {
        self.session.shutdown().await;
    }
}

/// The constructor that takes clients lives here, in the layer that knows them; the rest
/// of [`RedLock`] is in `primitives/red_lock.rs`.
impl RedLock {
    /// The lock `name` on each of `masters`. Fails with [`Error::InvalidConfig`] unless
    /// there are an odd number of at least 3, each a different server.
    ///
    /// [`Error::InvalidConfig`]: crate::Error::InvalidConfig
    pub fn new(name: impl Into<String>, masters: &[Client]) -> Result<Self> {
        let name: String = name.into();
        let locks = masters
            .iter()
            .map(|client| client.lock(name.clone()))
            .collect::<Result<Vec<_>>>()?;
        RedLock::on_masters(name, locks)
    }
}

#[cfg(test)]
mod tests {
    #[cfg(any(
        not(feature = "tls"),
        not(feature = "cluster"),
        not(feature = "sentinel")
    ))]
    use super::*;
    #[cfg(any(
        not(feature = "tls"),
        not(feature = "cluster"),
        not(feature = "sentinel")
    ))]
    use crate::error::Error;

    #[cfg(not(feature = "tls"))]
    #[tokio::test]
    async fn without_the_tls_feature_a_rediss_url_names_the_feature() {
        let err = Client::connect("rediss://127.0.0.1:1/").await.unwrap_err();
        assert!(matches!(err, Error::InvalidUrl { .. }), "{err}");
        assert!(err.to_string().contains("`tls` feature"), "{err}");
    }

    #[cfg(not(feature = "cluster"))]
    #[tokio::test]
    async fn without_the_cluster_feature_a_cluster_url_is_refused() {
        let err = Client::connect("redis+cluster://127.0.0.1:1,127.0.0.1:2")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidUrl { .. }), "{err}");
        assert!(err.to_string().contains("`cluster` feature"), "{err}");
    }

    #[cfg(not(feature = "sentinel"))]
    #[tokio::test]
    async fn without_the_sentinel_feature_a_sentinel_url_is_refused() {
        let err = Client::connect("redis+sentinel://127.0.0.1:1/mymaster")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidUrl { .. }), "{err}");
        assert!(err.to_string().contains("`sentinel` feature"), "{err}");
    }
}
