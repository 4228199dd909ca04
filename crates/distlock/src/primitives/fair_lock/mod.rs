//! The fair lock (Redisson's `RFairLock` layout): first come, first served across every
//! process, and a release that hands the lock straight to the next waiter.
//!
//! Waiters queue on the server, in Redisson's list and sorted set, and each listens on a
//! channel of its own, named after its owner id. A client's waits on a lock take up the
//! ids of its past waits there, whose channels stay subscribed (`owners.rs`), so a
//! contended acquisition does not subscribe and unsubscribe each time. When a distlock
//! holder releases, the release script itself gives the lock to the waiter at the head of
//! the queue: its hold, its lease and a fencing token, published on that waiter's
//! channel. The waiter holds the lock when the message arrives
//! and sends nothing more, so a handoff costs one message, not a round trip. A Redisson
//! waiter at the head is told to try (`0` on its channel), as Redisson expects, so a mixed
//! fleet keeps one queue.
//!
//! A waiter refreshes its place every third of its lease (at most every second): a waiter
//! that stops doing so (a killed process) is dropped from the queue after three missed
//! refreshes, so it cannot hold up the waiters behind it. A waiter that gives up (a
//! timeout, a dropped future, a shutdown) leaves the queue at once, through the engine's
//! abandon hook, and gives back a lock granted to it meanwhile.
//!
//! A holding is the lease lock's: the guard is a [`LockGuard`], with the same token,
//! re-entry, lost signal and renewal; only its release hands the lock on.

mod attempt;
mod owners;
pub(crate) mod scripts;

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use attempt::{FairAttempt, Owner};
use owners::OwnerPool;

use crate::config::Config;
use crate::duration::to_millis;
use crate::engine::acquire::{acquire, Patience};
use crate::engine::session::Session;
use crate::error::Result;
use crate::primitives::keys::{
    fair_queue, fair_timeouts, fair_waiters, release_channel, token_key, token_key_of_other,
};
use crate::primitives::lock::LockGuard;

/// Redisson's `fairLockWaitTimeout` default: the wait each of its waiters counts per
/// waiter ahead of it. distlock's scripts take it off the scores of Redisson's waiters
/// behind one that leaves the queue, as Redisson's do.
const REDISSON_WAIT: Duration = Duration::from_secs(300);

/// The most a queued waiter waits between refreshes of its place.
const MAX_REFRESH: Duration = Duration::from_secs(1);

/// The least: a very short lease must not turn waiting into a busy loop.
const MIN_REFRESH: Duration = Duration::from_millis(20);

/// How many refreshes a waiter may miss before it counts as gone.
const MISSED_REFRESHES: u32 = 3;

/// The keys and channel of one fair lock, worked out once per handle.
pub(crate) struct FairKeys {
    pub(crate) lock: Arc<str>,
    pub(crate) queue: String,
    pub(crate) timeouts: String,
    pub(crate) waiters: String,
    pub(crate) token_key: String,
    pub(crate) other_token_key: String,
    /// The lock's channel; a waiter's own is this, `:` and its owner.
    pub(crate) channel: String,
    pub(crate) redisson_wait_ms: u64,
    /// Owner ids of past waits on this lock by this client, their channels still
    /// subscribed: found by the lock's name, like the keys, and kept by its sweep while
    /// it holds any, so that they outlive the handles.
    owners: Arc<OwnerPool>,
}

impl FairKeys {
    fn new(config: &Config, key: String, owners: Arc<OwnerPool>) -> Self {
        let (counter, prefix) = (config.fencing_counter, &*config.key_prefix);
        Self {
            queue: fair_queue(prefix, &key),
            timeouts: fair_timeouts(prefix, &key),
            waiters: fair_waiters(prefix, &key),
            token_key: token_key(counter, prefix, &key),
            other_token_key: token_key_of_other(counter, prefix, &key),
            channel: release_channel(prefix, &key),
            redisson_wait_ms: u64::try_from(REDISSON_WAIT.as_millis()).unwrap_or(u64::MAX),
            owners,
            lock: key.into(),
        }
    }
}

/// A handle on one named fair lock. Cheap to clone; holds no lock by itself.
///
/// Waiters get the lock in the order they asked for it, across every process and every
/// Redisson client of the same name, and a release hands it straight to the next one.
/// Like [`Lock`](crate::Lock), it is not reentrant by default (take a nested hold with
/// [`LockGuard::reenter`]), runs in watchdog mode unless given a lease, and every
/// acquisition gets a fencing token.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = distlock_testkit::RedisServer::start().await?;
/// # let client = distlock::Client::connect(&server.url()).await?;
/// use std::time::Duration;
///
/// let lock = client.fair_lock("payouts")?;
/// let first = lock.lock().await?;
///
/// // A second caller queues; the release hands the lock to it directly.
/// let next = tokio::spawn({
///     let lock = lock.clone();
///     async move { lock.try_lock_for(Duration::from_secs(5)).await }
/// });
/// # tokio::time::sleep(Duration::from_millis(50)).await;
/// let token = first.fencing_token();
/// first.release().await?;
/// let second = next.await??.expect("handed over");
/// assert!(second.fencing_token() > token);
/// second.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct FairLock {
    session: Session,
    keys: Arc<FairKeys>,
    lease: Option<Duration>,
}

impl fmt::Debug for FairLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FairLock")
            .field("name", &self.keys.lock)
            .field("lease", &self.lease)
            .finish()
    }
}

impl FairLock {
    /// The fair lock whose Redis key is `key`: the client's key prefix, then the name.
    /// Every handle of the lock on this client shares its keys and the owner ids its
    /// past waits keep, however the handles were made.
    pub(crate) fn new(session: Session, key: String) -> Self {
        let core = session.core();
        let owners = core.shared_by_name(&key, OwnerPool::default);
        let keys = core.shared_by_name(&key, || FairKeys::new(core.config(), key.clone(), owners));
        Self {
            session,
            keys,
            lease: None,
        }
    }

    /// The lock's name, as given to [`Client::fair_lock`](crate::Client::fair_lock).
    pub fn name(&self) -> &str {
        let prefix = self.session.core().config().key_prefix.len();
        self.keys.lock.get(prefix..).unwrap_or(&self.keys.lock)
    }

    /// The lock's Redis key: the client's key prefix, if any, followed by its name.
    pub fn key(&self) -> &str {
        &self.keys.lock
    }

    /// A handle on the same lock whose acquisitions take a fixed lease of `lease`, with
    /// no watchdog, as [`Lock::with_lease`](crate::Lock::with_lease). A waiter granted
    /// the lock directly gets this lease from the releasing script.
    pub fn with_lease(&self, lease: Duration) -> FairLock {
        FairLock {
            lease: Some(lease),
            ..self.clone()
        }
    }

    /// A handle on the same lock whose acquisitions run in watchdog mode (the default).
    pub fn with_watchdog(&self) -> FairLock {
        FairLock {
            lease: None,
            ..self.clone()
        }
    }

    /// Waits, in turn, until the lock is acquired.
    ///
    /// Cancel-safe: dropping the future leaves the queue at once (and gives back a lock
    /// granted meanwhile), in the background.
    pub async fn lock(&self) -> Result<LockGuard> {
        let attempt = self.attempt(true)?;
        loop {
            let acquired = acquire(attempt.core(), &attempt, Patience::Forever);
            if let Some(hold) = acquired.await? {
                return Ok(self.guard(hold));
            }
        }
    }

    /// Takes the lock if it is free and nobody is queued for it; `Ok(None)` otherwise.
    /// It never queues.
    pub async fn try_lock(&self) -> Result<Option<LockGuard>> {
        let attempt = self.attempt(false)?;
        let acquired = acquire(attempt.core(), &attempt, Patience::None).await?;
        Ok(acquired.map(|hold| self.guard(hold)))
    }

    /// Queues and waits up to `timeout`; `Ok(None)` if the lock did not come in time. The
    /// queue entry is gone when it returns, whatever the outcome.
    pub async fn try_lock_for(&self, timeout: Duration) -> Result<Option<LockGuard>> {
        let patience = Patience::within(timeout)?;
        let attempt = self.attempt(true)?;
        let acquired = acquire(attempt.core(), &attempt, patience).await?;
        Ok(acquired.map(|hold| self.guard(hold)))
    }

    /// True if anyone holds the lock.
    pub async fn is_locked(&self) -> Result<bool> {
        let exists = redis::cmd("EXISTS").arg(&*self.keys.lock).clone();
        let count: i64 = self.session.core().query(&exists).await?;
        Ok(count == 1)
    }

    /// How many waiters are queued for the lock right now, distlock's and Redisson's.
    pub async fn queued(&self) -> Result<usize> {
        let length = redis::cmd("LLEN").arg(&self.keys.queue).clone();
        self.session.core().query(&length).await
    }

    /// The fixed lease this lock is taken with; `None` in watchdog mode.
    pub(crate) fn fixed_lease(&self) -> Option<Duration> {
        self.lease
    }

    pub(crate) fn session(&self) -> &Session {
        &self.session
    }

    fn guard(&self, hold: crate::primitives::lock::Hold) -> LockGuard {
        LockGuard::from_hold(hold, self.session.clone())
    }

    /// One acquisition, as one owner; `queue` when the caller will wait.
    fn attempt(&self, queue: bool) -> Result<FairAttempt> {
        let core = self.session.core();
        let config = core.config();
        let (lease, renew) = match self.lease {
            Some(lease) => (lease, false),
            None => (config.watchdog_timeout, true),
        };
        let lease_ms = to_millis("lease", lease)?;
        let refresh = (lease / 3).clamp(MIN_REFRESH, MAX_REFRESH);
        let alive = refresh * MISSED_REFRESHES + config.response_timeout;
        // A caller that will wait takes up the id of a past wait, if one is kept: its
        // channel is subscribed, and heard everything from now on if it is live.
        let idle = (queue && core.synced().is_none())
            .then(|| self.keys.owners.take(lease_ms, renew))
            .flatten();
        let (owner, kept, heard_from) = match idle {
            Some(idle) => {
                let heard_from = idle.kept.take_up();
                (idle.owner, OnceLock::from(idle.kept), heard_from)
            }
            None => (core.next_owner(), OnceLock::new(), None),
        };
        let channel = format!("{}:{owner}", self.keys.channel);
        Ok(FairAttempt {
            owner: Arc::new(Owner {
                core: Arc::clone(core),
                keys: Arc::clone(&self.keys),
                owner,
                channel,
                lease,
                lease_ms,
                renew,
                kept,
                end: Default::default(),
                // Under replica sync a leave or release the master answered may still be
                // lost in a failover, and bring the id's old entry back: never reused.
                reusable: queue && core.synced().is_none(),
            }),
            heard_from,
            queue,
            refresh,
            alive_ms: to_millis("fair lock wait", alive)?,
            busy_at_token: Arc::default(),
            gave_back: Arc::default(),
        })
    }
}
