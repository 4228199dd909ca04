//! The lease lock (Redisson's `RLock` layout, with a fencing token per acquisition).
//!
//! Ownership: every acquisition is its own owner, `"<client id>:<n>"` with n never
//! reused, so two acquisitions exclude each other whatever tasks they run in, exactly like
//! two `tokio::sync::Mutex::lock` calls. Re-entry is explicit: [`LockGuard::reenter`]
//! adds a hold to the guard's own holding. The holds of one holding are counted on the
//! server as Redisson counts a thread's, and the client sends the holding's re-entries and
//! releases one at a time, each with the absolute count it wants, so a lost reply can never
//! leave a stray hold behind.

mod attempt;
#[cfg(feature = "etcd")]
pub(crate) mod etcd;
mod guard;
mod hold_ops;
mod holding;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "postgres")]
pub(crate) mod postgres_rows;
pub(crate) mod scripts;
#[cfg(feature = "zk")]
pub(crate) mod zk;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

pub(crate) use attempt::LockAttempt;
pub use guard::LockGuard;
pub(crate) use guard::{lease_set, listen_for_unlock};
pub(crate) use hold_ops::{HoldOps, HoldScripts, ReleaseArgs};
pub use holding::ReleaseOutcome;
pub(crate) use holding::{Acquired, Hold};

use crate::duration::to_millis;
use crate::engine::acquire::{acquire, Patience};
use crate::engine::session::Session;
use crate::error::{Error, Result};
use crate::primitives::keys::{release_channel, token_key, token_key_of_other};
use crate::transport::script::ScriptCall;
use crate::transport::Store;
use hold_ops::PlainRelease;
use scripts::{FENCE_ADVANCE, LOCK_FORCE_UNLOCK, RELEASE_MESSAGE};

/// A handle on one named lock. Cheap to clone; holds no lock by itself.
///
/// Not reentrant by default, like `tokio::sync::Mutex`: every acquisition excludes every
/// other, even two in the same task, so a task that locks twice without releasing waits
/// for itself. Take a nested hold with [`LockGuard::reenter`] instead.
///
/// By default an acquisition runs in *watchdog mode*: the lease is the client's watchdog
/// timeout, and the client's watchdog keeps renewing it until the guard is released or
/// dropped. [`Lock::with_lease`] takes a fixed lease instead, which simply expires.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = distlock_testkit::RedisServer::start().await?;
/// # let client = distlock::Client::connect(&server.url()).await?;
/// use std::time::Duration;
///
/// let lock = client.lock("reports:nightly")?;
///
/// // Wait at most 5 s; hold for at most 10 s, with no renewal.
/// let fixed = lock.with_lease(Duration::from_secs(10));
/// if let Some(guard) = fixed.try_lock_for(Duration::from_secs(5)).await? {
///     // Any other acquisition is kept out, even one from this very task...
///     assert!(lock.try_lock().await?.is_none());
///     // ...and work stops as soon as the lease can no longer be trusted.
///     tokio::select! {
///         _ = guard.lost() => eprintln!("lease lost: stop writing"),
///         _ = tokio::time::sleep(Duration::from_millis(10)) => {}
///     }
///     guard.release().await?;
/// }
/// # client.shutdown().await;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Lock {
    session: Session,
    /// The lock's Redis key: its name after the client's key prefix.
    name: Arc<str>,
    /// The name's fencing counter, the counter the other [`FencingCounter`] setting would
    /// use (read by every acquisition, so a mixed fleet never repeats a token) and its
    /// release channel (in the release every acquisition's holding shares), worked out
    /// once per handle rather than on every acquisition.
    token_key: Arc<str>,
    other_token_key: Arc<str>,
    release: Arc<PlainRelease>,
    lease: Option<Duration>,
}

impl fmt::Debug for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("name", &self.name)
            .field("lease", &self.lease)
            .finish()
    }
}

impl Lock {
    /// The lock whose Redis key is `key`: the client's key prefix, then the name.
    pub(crate) fn new(session: Session, key: String) -> Self {
        let config = session.core().config();
        let (counter, prefix) = (config.fencing_counter, &*config.key_prefix);
        let token_key = token_key(counter, prefix, &key).into();
        let other_token_key = token_key_of_other(counter, prefix, &key).into();
        let channel = match session.core().store() {
            Store::Redis => release_channel(prefix, &key),
            #[cfg(feature = "postgres")]
            Store::Postgres(_) => postgres::channel_of(&key),
            // Each waiter waits on a topic of its own (etcd.rs); this one is unused.
            #[cfg(feature = "etcd")]
            Store::Etcd(_) => String::new(),
            // Likewise on ZooKeeper (zk.rs).
            #[cfg(feature = "zk")]
            Store::Zk(_) => String::new(),
        }
        .into();
        Self {
            session,
            name: key.into(),
            token_key,
            other_token_key,
            release: Arc::new(PlainRelease { channel }),
            lease: None,
        }
    }

    /// The lock's name, as given to [`Client::lock`]. Its Redis key is the client's key
    /// prefix followed by the name ([`Lock::key`]).
    pub fn name(&self) -> &str {
        let prefix = self.session.core().config().key_prefix.len();
        self.name.get(prefix..).unwrap_or(&self.name)
    }

    /// The lock's Redis key: the client's key prefix, if any, followed by its name.
    pub fn key(&self) -> &str {
        &self.name
    }

    /// A handle on the same lock whose acquisitions take a fixed lease of `lease`, with no
    /// watchdog: each such holding frees itself when its lease runs out, released or not
    /// (re-entries and partial releases leave that deadline where it is; only
    /// [`LockGuard::extend`] moves it). Checked (non-zero, representable in milliseconds)
    /// when an acquisition starts.
    ///
    /// `self` is left as it was, so one handle serves acquisitions with different leases:
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = distlock_testkit::RedisServer::start().await?;
    /// # let client = distlock::Client::connect(&server.url()).await?;
    /// use std::time::Duration;
    ///
    /// let lock = client.lock("invoices")?;
    /// let short = lock.with_lease(Duration::from_secs(5)).lock().await?;
    /// short.release().await?;
    /// let renewed = lock.lock().await?; // still watchdog mode
    /// renewed.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_lease(&self, lease: Duration) -> Lock {
        Lock {
            lease: Some(lease),
            ..self.clone()
        }
    }

    /// A handle on the same lock whose acquisitions run in watchdog mode (the default).
    pub fn with_watchdog(&self) -> Lock {
        Lock {
            lease: None,
            ..self.clone()
        }
    }

    /// Waits until the lock is acquired.
    ///
    /// An error of the first attempt is returned at once (a dead server fails fast). Once
    /// waiting, connection errors (a restart, a failover) are retried with backoff for as
    /// long as it waits; bound the wait with [`Lock::try_lock_for`] or a timeout.
    ///
    /// Cancel-safe: dropping the future leaves no subscription and no lock behind.
    pub async fn lock(&self) -> Result<LockGuard> {
        loop {
            // Waiting forever ends only with the lock; the loop is for the type's sake.
            if let Some(hold) = self.acquire(Patience::Forever).await? {
                return Ok(self.guard(hold));
            }
        }
    }

    /// Tries once; `Ok(None)` if the lock is held, or if other tasks of this client are
    /// already waiting for it (it never takes the lock ahead of them).
    pub async fn try_lock(&self) -> Result<Option<LockGuard>> {
        let acquired = self.acquire(Patience::None).await?;
        Ok(acquired.map(|hold| self.guard(hold)))
    }

    /// Waits up to `timeout`; `Ok(None)` if the lock was held by others until then. If the
    /// last attempt before the timeout failed instead (the server unreachable, or no
    /// replica acknowledging a grant under replica sync), that error is returned, so a
    /// free lock is never reported busy. A zero timeout tries once.
    pub async fn try_lock_for(&self, timeout: Duration) -> Result<Option<LockGuard>> {
        let patience = Patience::within(timeout)?;
        let acquired = self.acquire(patience).await?;
        Ok(acquired.map(|hold| self.guard(hold)))
    }

    /// One acquisition through the engine, with the store's own attempt.
    async fn acquire(&self, patience: Patience) -> Result<Option<Hold>> {
        #[cfg(feature = "etcd")]
        if let Store::Etcd(link) = self.session.core().store() {
            let (lease, renew) = self.lease_and_mode();
            to_millis("lease", lease)?;
            let core = self.session.core();
            let attempt = etcd::EtcdAttempt::new(
                Arc::clone(core),
                link.clone(),
                Arc::clone(&self.name),
                core.next_owner(),
                false,
                (lease, renew),
            );
            return acquire(attempt.core(), &attempt, patience).await;
        }
        #[cfg(feature = "zk")]
        if let Store::Zk(link) = self.session.core().store() {
            let fixed = match self.lease {
                Some(lease) => Some((lease, to_millis("lease", lease)?)),
                None => None,
            };
            let core = self.session.core();
            let attempt = zk::ZkAttempt::new(
                Arc::clone(core),
                link.clone(),
                Arc::clone(&self.name),
                core.next_owner(),
                false,
                fixed,
            );
            return acquire(attempt.core(), &attempt, patience).await;
        }
        let attempt = self.attempt()?;
        acquire(attempt.core(), &attempt, patience).await
    }

    /// The lease each acquisition takes, and whether the watchdog renews it.
    fn lease_and_mode(&self) -> (Duration, bool) {
        match self.lease {
            Some(lease) => (lease, false),
            None => (self.session.core().config().watchdog_timeout, true),
        }
    }

    /// True if anyone holds the lock.
    pub async fn is_locked(&self) -> Result<bool> {
        #[cfg(feature = "etcd")]
        if let Store::Etcd(link) = self.session.core().store() {
            return Ok(!etcd::holders(link, &self.name).await?.is_empty());
        }
        #[cfg(feature = "zk")]
        if let Store::Zk(link) = self.session.core().store() {
            return Ok(!zk::holding(link, &self.name).await?.is_empty());
        }
        #[cfg(feature = "postgres")]
        if let Store::Postgres(link) = self.session.core().store() {
            return Ok(postgres::lease_left(link, &self.name).await?.is_some());
        }
        let exists = redis::cmd("EXISTS").arg(&*self.name).clone();
        let count: i64 = self.session.core().query(&exists).await?;
        Ok(count == 1)
    }

    /// The owners that hold the lock right now (`"<client id>:<n>"`, as
    /// [`LockGuard::owner`] gives them): one while it is held, none while it is free. For
    /// operators: pass one to [`Lock::force_unlock_held_by`] to end only that holding.
    pub async fn owners(&self) -> Result<Vec<String>> {
        #[cfg(feature = "etcd")]
        if let Store::Etcd(link) = self.session.core().store() {
            return etcd::owners(link, &self.name).await;
        }
        #[cfg(feature = "zk")]
        if let Store::Zk(link) = self.session.core().store() {
            let holding = zk::holding(link, &self.name).await?;
            return Ok(holding.into_iter().map(|(owner, _)| owner).collect());
        }
        #[cfg(feature = "postgres")]
        if let Store::Postgres(link) = self.session.core().store() {
            return postgres::owners(link, &self.name).await;
        }
        let fields = redis::cmd("HKEYS").arg(&*self.name).clone();
        match self.session.core().query::<Vec<String>>(&fields).await {
            // Another kind of key at the name: no lock holds it.
            Err(Error::Redis(err)) if err.code() == Some("WRONGTYPE") => Ok(Vec::new()),
            other => other,
        }
    }

    /// How long the current lease has left on the server, or `None` if the lock is free.
    pub async fn remaining_ttl(&self) -> Result<Option<Duration>> {
        #[cfg(feature = "etcd")]
        if let Store::Etcd(link) = self.session.core().store() {
            return etcd::lease_left(link, &self.name).await;
        }
        #[cfg(feature = "zk")]
        if let Store::Zk(link) = self.session.core().store() {
            return zk::lease_left(link, &self.name).await;
        }
        #[cfg(feature = "postgres")]
        if let Store::Postgres(link) = self.session.core().store() {
            return postgres::lease_left(link, &self.name).await;
        }
        let pttl = redis::cmd("PTTL").arg(&*self.name).clone();
        let pttl: i64 = self.session.core().query(&pttl).await?;
        Ok(match pttl {
            -2 => None,
            // A key without expiry: not written by distlock or Redisson.
            -1 => Some(Duration::MAX),
            millis => Some(Duration::from_millis(millis.unsigned_abs())),
        })
    }

    /// The highest fencing token handed out so far by this lock's counter (0 before the
    /// first): the next acquisition gets a larger one. For operators (`distlock status`).
    ///
    /// Under the default [`FencingCounter::PerSlot`](crate::FencingCounter) the counter is
    /// shared by every name of the lock's cluster slot, so this is at least the lock's
    /// own last token. Both settings' counters are read, as acquisitions read them.
    pub async fn last_fencing_token(&self) -> Result<u64> {
        #[cfg(feature = "etcd")]
        if let Store::Etcd(link) = self.session.core().store() {
            return etcd::revision(link).await;
        }
        #[cfg(feature = "zk")]
        if let Store::Zk(link) = self.session.core().store() {
            return zk::last_token(link, &self.name).await;
        }
        #[cfg(feature = "postgres")]
        if let Store::Postgres(link) = self.session.core().store() {
            return postgres::last_token(link).await;
        }
        let mut read = redis::pipe();
        read.get(&*self.token_key).get(&*self.other_token_key);
        let (own, other): (Option<String>, Option<String>) = self
            .session
            .core()
            .request(|mut connection| {
                let read = &read;
                async move { read.query_async(&mut connection).await }
            })
            .await?;
        // A counter that is not a token (a key another app wrote) counts as none, as the
        // acquire script treats it.
        let token = |counter: Option<String>| {
            counter
                .and_then(|text| text.parse::<u64>().ok())
                .unwrap_or(0)
        };
        Ok(token(own).max(token(other)))
    }

    /// Deletes the lock whoever holds it and wakes a waiter. Returns whether a lock was
    /// deleted. For operators: the holder is not told, beyond its lost signal firing at its
    /// next renewal (or its next [`LockGuard::verify`](crate::LockGuard::verify)).
    pub async fn force_unlock(&self) -> Result<bool> {
        self.force_unlock_where("").await
    }

    /// Deletes the lock only while `owner` holds it (a holder an operator was shown and
    /// confirmed), and wakes a waiter. Returns false, deleting nothing, when the lock is
    /// free or has passed to another holder meanwhile.
    pub async fn force_unlock_held_by(&self, owner: &str) -> Result<bool> {
        if owner.is_empty() {
            return Err(Error::InvalidArgument {
                what: "owner",
                reason: "is empty; use force_unlock to delete whoever holds the lock".into(),
            });
        }
        self.force_unlock_where(owner).await
    }

    async fn force_unlock_where(&self, owner: &str) -> Result<bool> {
        let channel = &self.release.channel;
        #[cfg(feature = "etcd")]
        if let Store::Etcd(link) = self.session.core().store() {
            return etcd::force_unlock(link, &self.name, owner).await;
        }
        #[cfg(feature = "zk")]
        if let Store::Zk(link) = self.session.core().store() {
            return zk::force_unlock(link, &self.name, owner).await;
        }
        #[cfg(feature = "postgres")]
        if let Store::Postgres(link) = self.session.core().store() {
            // The writer, then the readers of the read-write lock of the name.
            let writer = postgres::force_unlock(link, &self.name, owner, channel).await?;
            let readers = postgres::force_unlock_readers(link, &self.name, owner, channel).await?;
            return Ok(writer || readers);
        }
        let deleted: i64 = self
            .session
            .core()
            .request(|mut connection| {
                let mut unlock = ScriptCall::new(&LOCK_FORCE_UNLOCK, &[&self.name, channel], 3);
                unlock
                    .arg(RELEASE_MESSAGE)
                    .arg(self.session.core().deployment().publish_command())
                    .arg(owner);
                async move { unlock.invoke(&mut connection).await }
            })
            .await?;
        Ok(deleted == 1)
    }

    /// Raises this lock's fencing-token counter so that every later acquisition gets a
    /// token larger than `floor`, and returns the counter's value. Never lowers it.
    ///
    /// For recovery: if Redis lost its data (a restart without persistence, a failover to
    /// a lagging replica), tokens start again from 1 and a fenced resource refuses every
    /// holder until they pass the highest token it accepted. Pass that token here and
    /// they are accepted at once.
    ///
    /// Tokens are exact up to `i64::MAX` (Redis counters are signed 64-bit), so `floor`
    /// must be below `i64::MAX`, leaving at least one token to hand out; a larger one is
    /// refused with [`Error::InvalidConfig`].
    pub async fn advance_fencing_counter(&self, floor: u64) -> Result<u64> {
        if i64::try_from(floor).is_err() || floor == i64::MAX.unsigned_abs() {
            return Err(Error::InvalidConfig {
                what: "fencing-counter floor",
                reason: format!(
                    "must be below i64::MAX ({}), so tokens stay exact and one is left to \
                     hand out; not {floor}",
                    i64::MAX
                ),
            });
        }
        #[cfg(feature = "postgres")]
        if let Store::Postgres(link) = self.session.core().store() {
            return postgres::advance_tokens(link, floor.try_into().unwrap_or(i64::MAX - 1)).await;
        }
        #[cfg(feature = "etcd")]
        if let Store::Etcd(link) = self.session.core().store() {
            // Tokens are the cluster's revisions, which only writes raise.
            let revision = etcd::revision(link).await?;
            if floor <= revision {
                return Ok(revision);
            }
            return Err(Error::Unsupported {
                store: "etcd",
                what: "raising the fencing tokens above the cluster's revision",
            });
        }
        #[cfg(feature = "zk")]
        if let Store::Zk(link) = self.session.core().store() {
            // Tokens are the ensemble's zxids, which only writes raise.
            let last = zk::last_token(link, &self.name).await?;
            if floor <= last {
                return Ok(last);
            }
            return Err(Error::Unsupported {
                store: crate::transport::zk::STORE,
                what: "raising the fencing tokens above the ensemble's zxid",
            });
        }
        let counter: u64 = self
            .session
            .core()
            .request(|mut connection| {
                let mut advance = ScriptCall::new(&FENCE_ADVANCE, &[&self.token_key], 1);
                advance.arg(floor);
                async move { advance.invoke(&mut connection).await }
            })
            .await?;
        Ok(counter)
    }

    pub(crate) fn session(&self) -> &Session {
        &self.session
    }

    /// The fixed lease this lock is taken with; `None` in watchdog mode.
    pub(crate) fn fixed_lease(&self) -> Option<Duration> {
        self.lease
    }

    pub(crate) fn guard(&self, hold: Hold) -> LockGuard {
        LockGuard {
            hold,
            _session: self.session.clone(),
        }
    }

    /// One acquisition of this lock, for the engine (or a composite primitive) to try.
    pub(crate) fn attempt(&self) -> Result<LockAttempt> {
        #[cfg(feature = "etcd")]
        if let Store::Etcd(_) = self.session.core().store() {
            // A composite (MultiLock) drives LockAttempts itself; etcd's waiters keep a
            // key for the whole wait, which that does not do yet.
            return Err(Error::Unsupported {
                store: "etcd",
                what: "a MultiLock",
            });
        }
        #[cfg(feature = "zk")]
        if let Store::Zk(_) = self.session.core().store() {
            // As on etcd: a waiter's node lives for the whole wait.
            return Err(Error::Unsupported {
                store: crate::transport::zk::STORE,
                what: "a MultiLock",
            });
        }
        let (lease, renew) = self.lease_and_mode();
        Ok(LockAttempt {
            core: Arc::clone(self.session.core()),
            name: Arc::clone(&self.name),
            token_key: Arc::clone(&self.token_key),
            other_token_key: Arc::clone(&self.other_token_key),
            release: Arc::clone(&self.release),
            lease,
            lease_ms: to_millis("lease", lease)?,
            renew,
        })
    }
}
