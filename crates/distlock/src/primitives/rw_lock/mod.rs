//! The read-write lock (Redisson's `RReadWriteLock` layout): many readers or one writer.
//!
//! One hash at the name holds `mode` ("read" or "write"), a field per reader owner (its
//! hold count) and `<owner>:write` for the writer. Each read hold has a key of its own,
//! `{name}:<owner>:rwlock_timeout:<n>`, whose expiry is that hold's lease, and the hash
//! expires with the longest of them, so a reader that dies loses only its own holds.
//! A write release publishes `1` on `redisson_rwlock:{name}` (wake all), a read release
//! that frees the lock `0`.
//!
//! Beyond Redisson: writer preference, as an option. A writer that waits lists itself (in
//! distlock's `distlock_rwlock_writers:{name}`, refreshed while it waits), and readers with
//! the option queue behind it, so a steady stream of readers cannot starve writers.
//! Redisson's readers do not read that list.
//!
//! On ZooKeeper (feature `zk`) and etcd (feature `etcd`) it is the store's shared lock
//! recipe (Curator's, etcd's `recipes.RWMutex`) on the lock's own queue
//! (`primitives/lock/zk`, `primitives/lock/etcd`): a reader's node or key waits for
//! writers queued ahead of it only, a writer's for everything ahead. The queue is FIFO,
//! so readers always queue behind a waiting writer there, whatever `prefer_writers` says.
//! On PostgreSQL (feature `postgres`, `postgres.rs`) readers are rows of their own, and
//! the lock's row keeps how long they hold, which a writer waits out.

mod holds;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
pub(crate) mod scripts;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use holds::{ReadAttempt, ReadScripts, RwAttempt, WriteAttempt};
use scripts::RW_READ_ACQUIRE;

use crate::config::Config;
use crate::duration::to_millis;
use crate::engine::acquire::{acquire, Patience};
use crate::engine::detach::Detached;
use crate::engine::session::Session;
use crate::error::{Error, Result};
use crate::primitives::keys::{rwlock_channel, rwlock_writers, token_key, token_key_of_other};
use crate::primitives::lock::{Acquired, Hold, LockGuard, ReleaseOutcome};
use crate::transport::script::ScriptCall;
#[cfg(any(feature = "zk", feature = "etcd", feature = "postgres"))]
use crate::transport::Store;

/// How long a waiting writer stays listed without looking again, at most.
const WRITER_LISTED: Duration = Duration::from_secs(1);

/// Which hold an acquisition asks for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Read,
    Write,
}

/// The keys and channel of one read-write lock, worked out once per handle.
pub(crate) struct RwKeys {
    pub(crate) lock: Arc<str>,
    pub(crate) channel: String,
    pub(crate) writers: String,
    pub(crate) token_key: String,
    pub(crate) other_token_key: String,
    /// `{name}` (after the client's prefix), or the name when it carries its own hash
    /// tag: the start of every read hold's key.
    pub(crate) base: String,
}

impl RwKeys {
    fn new(config: &Config, key: String) -> Self {
        let (counter, prefix) = (config.fencing_counter, &*config.key_prefix);
        let base = if key.contains('{') {
            format!("{prefix}{key}")
        } else {
            format!("{prefix}{{{key}}}")
        };
        Self {
            channel: rwlock_channel(prefix, &key),
            writers: rwlock_writers(prefix, &key),
            token_key: token_key(counter, prefix, &key),
            other_token_key: token_key_of_other(counter, prefix, &key),
            base,
            lock: key.into(),
        }
    }
}

/// A handle on one named read-write lock. Cheap to clone; holds nothing by itself.
///
/// Read holds are shared, the write hold is exclusive, and each acquisition is its own
/// holder, as with [`Lock`](crate::Lock). The write side hands out fencing tokens (its
/// guard is a [`LockGuard`]); a writer can take a read hold and let go of the write hold
/// ([`RwLock::downgrade`]). Both sides run in watchdog mode unless given a lease.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = distlock_testkit::RedisServer::start().await?;
/// # let client = distlock::Client::connect(&server.url()).await?;
/// let prices = client.rw_lock("prices")?.prefer_writers(true);
///
/// let reader = prices.read().await?;
/// let another = prices.read().await?; // readers share
/// assert!(prices.try_write().await?.is_none());
/// reader.release().await?;
/// another.release().await?;
///
/// let writer = prices.write().await?;
/// let token = writer.fencing_token(); // hand this to the store you write
/// let reader = prices.downgrade(&writer).await?; // keep reading what was written
/// writer.release().await?;
/// assert!(prices.try_write().await?.is_none());
/// reader.release().await?;
/// # let _ = token;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RwLock {
    session: Session,
    keys: Arc<RwKeys>,
    lease: Option<Duration>,
    prefer_writers: bool,
}

impl fmt::Debug for RwLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RwLock")
            .field("name", &self.keys.lock)
            .field("lease", &self.lease)
            .field("prefer_writers", &self.prefer_writers)
            .finish()
    }
}

impl RwLock {
    /// The read-write lock whose Redis key is `key`: the client's key prefix, then the
    /// name.
    pub(crate) fn new(session: Session, key: String) -> Self {
        let keys = RwKeys::new(session.core().config(), key);
        Self {
            session,
            keys: Arc::new(keys),
            lease: None,
            prefer_writers: false,
        }
    }

    /// The lock's Redis key: the client's key prefix, if any, followed by its name.
    pub fn key(&self) -> &str {
        &self.keys.lock
    }

    /// A handle whose acquisitions take a fixed lease of `lease`, never renewed.
    pub fn with_lease(&self, lease: Duration) -> RwLock {
        RwLock {
            lease: Some(lease),
            ..self.clone()
        }
    }

    /// A handle whose acquisitions are renewed while held (the default).
    pub fn with_watchdog(&self) -> RwLock {
        RwLock {
            lease: None,
            ..self.clone()
        }
    }

    /// A handle whose readers queue behind a waiting writer (`true`), so that readers
    /// cannot starve writers; by default (`false`) a reader takes the lock whenever no
    /// writer holds it, as Redisson's do. Writers list themselves as waiting either way.
    /// On ZooKeeper and etcd the queue is first come, first served, so readers queue
    /// behind a waiting writer whatever this says.
    pub fn prefer_writers(&self, prefer: bool) -> RwLock {
        RwLock {
            prefer_writers: prefer,
            ..self.clone()
        }
    }

    /// Waits for a read hold. Cancel-safe.
    pub async fn read(&self) -> Result<RwReadGuard> {
        loop {
            // Waiting forever ends only with a hold; the loop is for the type's sake.
            if let Some(hold) = self.take(Side::Read, Patience::Forever).await? {
                return Ok(self.read_guard(hold));
            }
        }
    }

    /// A read hold if one can be had now; `Ok(None)` otherwise.
    pub async fn try_read(&self) -> Result<Option<RwReadGuard>> {
        let acquired = self.take(Side::Read, Patience::None).await?;
        Ok(acquired.map(|hold| self.read_guard(hold)))
    }

    /// Waits up to `timeout` for a read hold; `Ok(None)` if none came in time.
    pub async fn try_read_for(&self, timeout: Duration) -> Result<Option<RwReadGuard>> {
        let acquired = self.take(Side::Read, Patience::within(timeout)?).await?;
        Ok(acquired.map(|hold| self.read_guard(hold)))
    }

    /// Waits for the write hold, with a fencing token. Cancel-safe.
    pub async fn write(&self) -> Result<LockGuard> {
        loop {
            if let Some(hold) = self.take(Side::Write, Patience::Forever).await? {
                return Ok(LockGuard::from_hold(hold, self.session.clone()));
            }
        }
    }

    /// The write hold if it can be had now; `Ok(None)` otherwise.
    pub async fn try_write(&self) -> Result<Option<LockGuard>> {
        let acquired = self.take(Side::Write, Patience::None).await?;
        Ok(acquired.map(|hold| LockGuard::from_hold(hold, self.session.clone())))
    }

    /// Waits up to `timeout` for the write hold; `Ok(None)` if it did not come in time.
    pub async fn try_write_for(&self, timeout: Duration) -> Result<Option<LockGuard>> {
        let acquired = self.take(Side::Write, Patience::within(timeout)?).await?;
        Ok(acquired.map(|hold| LockGuard::from_hold(hold, self.session.clone())))
    }

    /// One acquisition of a read or the write hold through the engine, with the store's
    /// own attempt. A writer that waits lists itself as waiting (Redis).
    async fn take(&self, side: Side, patience: Patience) -> Result<Option<Hold>> {
        #[cfg(feature = "zk")]
        if let Store::Zk(link) = self.session.core().store() {
            let attempt = self.zk_attempt(link, side == Side::Read)?;
            return acquire(attempt.core(), &attempt, patience).await;
        }
        #[cfg(feature = "postgres")]
        if let Store::Postgres(link) = self.session.core().store() {
            let attempt = self.pg_attempt(link, side == Side::Read)?;
            return acquire(attempt.core(), &attempt, patience).await;
        }
        #[cfg(feature = "etcd")]
        if let Store::Etcd(link) = self.session.core().store() {
            let (lease, renew) = self.lease_mode();
            to_millis("lease", lease)?;
            let attempt = crate::primitives::lock::etcd::EtcdAttempt::new(
                Arc::clone(self.session.core()),
                link.clone(),
                Arc::clone(&self.keys.lock),
                self.owner_of(side),
                side == Side::Read,
                (lease, renew),
            );
            return acquire(attempt.core(), &attempt, patience).await;
        }
        let waits = side == Side::Write && !matches!(patience, Patience::None);
        let attempt = self.attempt(waits)?;
        match side {
            Side::Read => {
                let attempt = ReadAttempt(attempt);
                acquire(attempt.0.core(), &attempt, patience).await
            }
            Side::Write => {
                let attempt = WriteAttempt(attempt);
                acquire(attempt.0.core(), &attempt, patience).await
            }
        }
    }

    /// One acquisition on ZooKeeper: a node in the lock's queue, `read-…` for a reader
    /// (it waits for writers queued ahead only), `lock-…` for a writer, as a
    /// [`Lock`](crate::Lock)'s (a lock and a read-write lock of one name exclude each
    /// other). A writer's owner ends in `:write`, as on Redis.
    #[cfg(feature = "zk")]
    fn zk_attempt(
        &self,
        link: &crate::transport::zk::ZkLink,
        shared: bool,
    ) -> Result<crate::primitives::lock::zk::ZkAttempt> {
        let core = self.session.core();
        let fixed = match self.lease {
            Some(lease) => Some((lease, to_millis("lease", lease)?)),
            None => None,
        };
        let side = if shared { Side::Read } else { Side::Write };
        Ok(crate::primitives::lock::zk::ZkAttempt::new(
            Arc::clone(core),
            link.clone(),
            Arc::clone(&self.keys.lock),
            self.owner_of(side),
            shared,
            fixed,
        ))
    }

    /// One acquisition on PostgreSQL (see `postgres.rs`).
    #[cfg(feature = "postgres")]
    fn pg_attempt(
        &self,
        link: &crate::transport::postgres::PgLink,
        shared: bool,
    ) -> Result<postgres::PgRwAttempt> {
        let (lease, renew) = self.lease_mode();
        let lease_ms = to_millis("lease", lease)?;
        Ok(postgres::PgRwAttempt::new(
            Arc::clone(self.session.core()),
            link.clone(),
            Arc::clone(&self.keys.lock),
            shared,
            (lease, lease_ms, renew),
        ))
    }

    /// A new acquisition's owner on a store other than Redis: a writer's ends in
    /// `:write`, as on Redis, which is how `downgrade` knows a write guard.
    #[cfg(any(feature = "zk", feature = "etcd"))]
    fn owner_of(&self, side: Side) -> Arc<str> {
        let owner = self.session.core().next_owner();
        match side {
            Side::Read => owner,
            Side::Write => format!("{owner}:write").into(),
        }
    }

    /// Takes a read hold for the holder of `writer`, a write hold of this lock, without
    /// letting another writer in between; release `writer` afterwards to let other
    /// readers in (its release publishes to them). On etcd the read hold is one more hold
    /// on the writer's key (a new reader's key would queue behind waiting writers), so
    /// other readers come in only once it is released as well. Fails with [`Error::InvalidArgument`]
    /// for a guard of another lock or a read guard, and with [`Error::NotHeld`] if the
    /// write hold was lost; `writer` is left as it was either way.
    ///
    /// Cancel-safe: a read hold taken by a call whose future is dropped is given back.
    pub async fn downgrade(&self, writer: &LockGuard) -> Result<RwReadGuard> {
        let Some(owner) = writer
            .owner()
            .strip_suffix(":write")
            .filter(|_| writer.key() == &*self.keys.lock)
        else {
            return Err(Error::InvalidArgument {
                what: "downgrade",
                reason: format!(
                    "{:?} is not a write hold of {}",
                    writer.owner(),
                    self.keys.lock
                ),
            });
        };
        let not_held = || Error::NotHeld {
            name: self.keys.lock.to_string(),
            owner: writer.owner().to_owned(),
        };
        if writer.is_lost() {
            return Err(not_held());
        }
        let core = Arc::clone(self.session.core());
        core.ensure_open()?;
        #[cfg(feature = "postgres")]
        if let Store::Postgres(link) = core.store() {
            let attempt = self.pg_attempt(link, true)?;
            let writer = writer.owner().to_owned();
            let taking = Detached::new(core.background(), async move {
                attempt.take_beside(&writer).await
            });
            return match taking.await? {
                Some(hold) => Ok(self.read_guard(hold)),
                None => Err(not_held()),
            };
        }
        #[cfg(feature = "etcd")]
        if let Store::Etcd(_) = core.store() {
            // A reader's key of its own would be the newest in the queue, behind the
            // writers waiting for this one, and one of them could take the lock beside
            // it (a key's creation order cannot be moved). So the read hold is one more
            // hold on the writer's own key: no writer comes in, and readers queued
            // behind it come in only once this read hold is released too.
            return match writer.reenter().await {
                Ok(inner) => Ok(RwReadGuard { inner }),
                Err(Error::NotHeld { .. }) => Err(not_held()),
                Err(err) => Err(err),
            };
        }
        #[cfg(feature = "zk")]
        if let Store::Zk(link) = core.store() {
            // The reader is an owner of its own: its node must not be mistaken for an
            // earlier downgrade's.
            let attempt = self.zk_attempt(link, true)?;
            let writer = writer.owner().to_owned();
            let taking = Detached::new(core.background(), async move {
                attempt.take_beside(&writer).await
            });
            return match taking.await? {
                Some(hold) => Ok(self.read_guard(hold)),
                None => Err(not_held()),
            };
        }
        let owner: Arc<str> = owner.into();
        let (lease, renew) = self.lease_mode();
        let lease_ms = to_millis("lease", lease)?;
        let mut call = ScriptCall::new(&RW_READ_ACQUIRE, &[&self.keys.lock, &self.keys.writers], 5);
        call.arg(lease_ms)
            .arg(&*owner)
            .arg(format!("{}:{owner}:rwlock_timeout", self.keys.base))
            .arg("0")
            .arg("1");
        let keys = Arc::clone(&self.keys);
        let task_core = Arc::clone(&core);
        // Finished even if this future is dropped: a read hold it took is then dropped
        // on the client's runtime, which gives it back.
        let taking = Detached::new(core.background(), async move {
            let sent_at = tokio::time::Instant::now();
            // The writer still holds its write hold, which replicas have: a read hold
            // a failover lost leaves the lock excluded all the same.
            let taken: i64 = task_core.write(&call, &keys.lock, false).await?;
            if taken != 1 {
                return Ok(None);
            }
            Ok::<_, Error>(Some(
                Acquired {
                    core: Arc::clone(&task_core),
                    name: Arc::clone(&keys.lock),
                    owner,
                    release: Arc::new(ReadScripts(Arc::clone(&keys))),
                    token: 0,
                    sent_at,
                    lease,
                    lease_ms,
                    renew,
                }
                .into_hold(),
            ))
        });
        match taking.await? {
            Some(hold) => Ok(self.read_guard(hold)),
            None => Err(not_held()),
        }
    }

    /// True if anyone holds the lock, for reading or writing.
    pub async fn is_locked(&self) -> Result<bool> {
        #[cfg(feature = "postgres")]
        if let Store::Postgres(link) = self.session.core().store() {
            return postgres::is_locked(link, &self.keys.lock).await;
        }
        #[cfg(feature = "etcd")]
        if let Store::Etcd(link) = self.session.core().store() {
            let holders = crate::primitives::lock::etcd::holders(link, &self.keys.lock).await?;
            return Ok(!holders.is_empty());
        }
        #[cfg(feature = "zk")]
        if let Store::Zk(link) = self.session.core().store() {
            let holding = crate::primitives::lock::zk::holding(link, &self.keys.lock).await?;
            return Ok(!holding.is_empty());
        }
        let exists = redis::cmd("EXISTS").arg(&*self.keys.lock).clone();
        let count: i64 = self.session.core().query(&exists).await?;
        Ok(count == 1)
    }

    /// The fixed lease this lock is taken with; `None` in watchdog mode.
    pub(crate) fn fixed_lease(&self) -> Option<Duration> {
        self.lease
    }

    pub(crate) fn session(&self) -> &Session {
        &self.session
    }

    fn lease_mode(&self) -> (Duration, bool) {
        match self.lease {
            Some(lease) => (lease, false),
            None => (self.session.core().config().watchdog_timeout, true),
        }
    }

    fn attempt(&self, waits: bool) -> Result<RwAttempt> {
        let core = self.session.core();
        let (lease, renew) = self.lease_mode();
        Ok(RwAttempt {
            core: Arc::clone(core),
            keys: Arc::clone(&self.keys),
            lease,
            lease_ms: to_millis("lease", lease)?,
            renew,
            prefer_writers: self.prefer_writers,
            waits,
            waiter: core.next_owner(),
            alive: WRITER_LISTED.min(lease.max(Duration::from_millis(30)))
                + core.config().response_timeout,
        })
    }

    fn read_guard(&self, hold: Hold) -> RwReadGuard {
        RwReadGuard {
            inner: LockGuard::from_hold(hold, self.session.clone()),
        }
    }
}

/// Proof of one read hold on an [`RwLock`]. Release it with [`RwReadGuard::release`];
/// dropping it releases in the background. It has the lease, lost signal and re-entry a
/// [`LockGuard`] has, but no fencing token: readers do not write.
#[must_use = "dropping the guard releases the read hold at once"]
pub struct RwReadGuard {
    inner: LockGuard,
}

impl fmt::Debug for RwReadGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RwReadGuard")
            .field("name", &self.inner.name())
            .field("owner", &self.inner.owner())
            .field("holds", &self.inner.hold_count())
            .finish()
    }
}

impl RwReadGuard {
    /// The holding's guard, as a MultiLock keeps its members.
    pub(crate) fn into_lock_guard(self) -> LockGuard {
        self.inner
    }

    /// The lock's name, without the client's key prefix.
    pub fn name(&self) -> &str {
        self.inner.name()
    }

    /// The owner this read holding is written under.
    pub fn owner(&self) -> &str {
        self.inner.owner()
    }

    /// How many guards of this read holding are alive (1, plus one per re-entry).
    pub fn hold_count(&self) -> u32 {
        self.inner.hold_count()
    }

    /// How long the read holds are sure to last, by the local clock; zero once lost.
    pub fn lease_remaining(&self) -> Duration {
        self.inner.lease_remaining()
    }

    /// True once the read holding can no longer be trusted to be held.
    pub fn is_lost(&self) -> bool {
        self.inner.is_lost()
    }

    /// Completes as soon as the read holding can no longer be trusted to be held
    /// (see [`LockGuard::lost`]).
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        self.inner.lost()
    }

    /// The same signal as [`RwReadGuard::lost`], as a token to hand to other tasks.
    pub fn lost_token(&self) -> CancellationToken {
        self.inner.lost_token()
    }

    /// Asks the server whether this holding still has its read holds (one round trip).
    pub async fn verify(&self) -> Result<bool> {
        self.inner.verify().await
    }

    /// Sets the fixed lease of every hold of this holding to `lease` from now (see
    /// [`LockGuard::extend`]).
    pub async fn extend(&self, lease: Duration) -> Result<()> {
        self.inner.extend(lease).await
    }

    /// Takes one more read hold on this holding, with a lease key of its own.
    pub async fn reenter(&self) -> Result<RwReadGuard> {
        Ok(RwReadGuard {
            inner: self.inner.reenter().await?,
        })
    }

    /// Gives this read hold back; the last hold of the last reader frees the lock and
    /// wakes waiters. Cancel-safe.
    pub async fn release(self) -> Result<ReleaseOutcome> {
        self.inner.release().await
    }
}
