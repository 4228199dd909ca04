//! The semaphore (Redisson's `RSemaphore` layout): a count of free permits at the name,
//! and a channel, `redisson_sc:{name}`, on which every change publishes the new count.
//!
//! Taking permits is one script (take them if that many are free); giving them back adds
//! them and publishes the free count, which wakes up to that many waiters. Local waiters
//! keep their arrival order with the permits each asks for (the engine's
//! [`WakeRule::UpTo`](crate::engine::waiters::WakeRule::UpTo)), so a task asking for 3 is
//! not passed by tasks of the same client asking for 1.
//!
//! The permits have no owner and no lease, as Redisson's: a process that dies holding
//! permits does not give them back, and a reply lost after the server took them leaves
//! them taken. A `PermitSemaphore` (each permit a lease) is the one that survives crashes.

mod attempt;
pub(crate) mod scripts;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use attempt::{add_back, add_permits, SemaphoreAttempt, Taken};
use scripts::{SEMAPHORE_DRAIN, SEMAPHORE_SET};

use crate::engine::acquire::{acquire, Patience};
use crate::engine::session::Session;
use crate::error::{Error, Result};
use crate::primitives::keys::semaphore_channel;
use crate::transport::script::ScriptCall;

/// A semaphore's key and channel, worked out once per handle.
pub(crate) struct SemaphoreKeys {
    pub(crate) key: Arc<str>,
    pub(crate) channel: String,
}

/// A handle on one named semaphore. Cheap to clone; takes nothing by itself.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = distlock_testkit::RedisServer::start().await?;
/// # let client = distlock::Client::connect(&server.url()).await?;
/// let exports = client.semaphore("exports")?;
/// exports.try_set_permits(3).await?; // three exports at a time, fleet-wide
///
/// let permits = exports.acquire(2).await?;
/// assert_eq!(exports.available_permits().await?, 1);
/// assert!(exports.try_acquire(2).await?.is_none());
/// permits.release().await?;
/// assert_eq!(exports.available_permits().await?, 3);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Semaphore {
    session: Session,
    keys: Arc<SemaphoreKeys>,
}

impl fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Semaphore")
            .field("key", &self.keys.key)
            .finish()
    }
}

impl Semaphore {
    /// The semaphore whose Redis key is `key`: the client's key prefix, then the name.
    pub(crate) fn new(session: Session, key: String) -> Self {
        let prefix = &session.core().config().key_prefix;
        let channel = semaphore_channel(prefix, &key);
        Self {
            session,
            keys: Arc::new(SemaphoreKeys {
                key: key.into(),
                channel,
            }),
        }
    }

    /// The semaphore's Redis key: the client's key prefix, if any, followed by its name.
    pub fn key(&self) -> &str {
        &self.keys.key
    }

    /// Waits until `permits` permits are free, and takes them. Waiters of this client are
    /// served in arrival order; across clients, whoever asks when enough are free.
    ///
    /// Cancel-safe: dropping the future leaves no permit taken.
    pub async fn acquire(&self, permits: u32) -> Result<SemaphorePermits> {
        let attempt = self.attempt(permits)?;
        loop {
            let acquired = acquire(attempt.core(), &attempt, Patience::Forever);
            if let Some(taken) = acquired.await? {
                return Ok(self.guard(taken));
            }
        }
    }

    /// Takes `permits` permits if that many are free now (and no waiter of this client
    /// is ahead); `Ok(None)` otherwise.
    pub async fn try_acquire(&self, permits: u32) -> Result<Option<SemaphorePermits>> {
        let attempt = self.attempt(permits)?;
        let acquired = acquire(attempt.core(), &attempt, Patience::None).await?;
        Ok(acquired.map(|taken| self.guard(taken)))
    }

    /// Waits up to `timeout` for `permits` permits; `Ok(None)` if they were not free in
    /// time.
    pub async fn try_acquire_for(
        &self,
        permits: u32,
        timeout: Duration,
    ) -> Result<Option<SemaphorePermits>> {
        let patience = Patience::within(timeout)?;
        let attempt = self.attempt(permits)?;
        let acquired = acquire(attempt.core(), &attempt, patience).await?;
        Ok(acquired.map(|taken| self.guard(taken)))
    }

    /// Gives `permits` permits to the semaphore (taken elsewhere, by Redisson's
    /// `acquire`, or never taken), and wakes waiters. Returns the free count after it.
    /// A guard gives its own permits back when released or dropped.
    pub async fn release(&self, permits: u32) -> Result<i64> {
        let permits = positive("permits", permits)?;
        self.add_permits(i64::from(permits)).await
    }

    /// Adds `permits` free permits (takes them away when negative, which may leave the
    /// count below zero until enough are given back), and wakes waiters. Returns the free
    /// count after it.
    pub async fn add_permits(&self, permits: i64) -> Result<i64> {
        let core = self.session.core();
        core.ensure_open()?;
        add_permits(core, &self.keys, permits).await
    }

    /// Sets the free permits to `permits` if the semaphore has none set yet. Returns
    /// whether it set them.
    pub async fn try_set_permits(&self, permits: u64) -> Result<bool> {
        let permits = i64::try_from(permits).map_err(|_| Error::InvalidArgument {
            what: "permits",
            reason: format!("{permits} is more than a Redis counter holds"),
        })?;
        let core = self.session.core();
        let mut call = ScriptCall::new(&SEMAPHORE_SET, &[&self.keys.key, &self.keys.channel], 2);
        call.arg(permits).arg(core.deployment().publish_command());
        let set: i64 = core.write(&call, &self.keys.key, true).await?;
        Ok(set == 1)
    }

    /// How many permits are free right now (0 when the semaphore has none set).
    pub async fn available_permits(&self) -> Result<i64> {
        let get = redis::cmd("GET").arg(&*self.keys.key).clone();
        let free: Option<String> = self.session.core().query(&get).await?;
        match free {
            None => Ok(0),
            Some(free) => free.parse().map_err(|_| Error::InvalidArgument {
                what: "semaphore",
                reason: format!("{} holds {free:?}, not a permit count", self.keys.key),
            }),
        }
    }

    /// Takes every free permit. Returns how many it took.
    pub async fn drain_permits(&self) -> Result<i64> {
        // Sent once: sent again after a lost reply, it would report 0 for permits the
        // first call took.
        // Permits drained that no replica has are added back, and the call fails: a
        // failover would bring them back while the caller counts them as its own.
        let core = self.session.core();
        core.ensure_open()?;
        let call = ScriptCall::new(&SEMAPHORE_DRAIN, &[&self.keys.key], 0);
        core.take(
            &call,
            &self.keys.key,
            |drained: &i64| *drained > 0,
            |reply| add_back(core, &self.keys, reply.copied()),
        )
        .await
    }

    fn attempt(&self, permits: u32) -> Result<SemaphoreAttempt> {
        Ok(SemaphoreAttempt {
            core: Arc::clone(self.session.core()),
            keys: Arc::clone(&self.keys),
            permits: positive("permits", permits)?,
        })
    }

    fn guard(&self, taken: Taken) -> SemaphorePermits {
        SemaphorePermits {
            taken,
            _session: self.session.clone(),
        }
    }
}

fn positive(what: &'static str, value: u32) -> Result<u32> {
    if value == 0 {
        return Err(Error::InvalidArgument {
            what,
            reason: "must be at least 1".into(),
        });
    }
    Ok(value)
}

/// Permits taken from a [`Semaphore`]. Dropping the guard gives them back, in the
/// background on the client's own runtime; [`SemaphorePermits::release`] does it now and
/// says whether it worked; [`SemaphorePermits::forget`] keeps them taken.
#[must_use = "dropping the permits gives them back at once"]
pub struct SemaphorePermits {
    taken: Taken,
    /// Keeps the client's session running while the permits are held.
    _session: Session,
}

impl fmt::Debug for SemaphorePermits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SemaphorePermits")
            .field("semaphore", &self.taken.key())
            .field("permits", &self.taken.permits())
            .finish()
    }
}

impl SemaphorePermits {
    /// How many permits this guard holds.
    pub fn permits(&self) -> u32 {
        self.taken.permits()
    }

    /// Gives the permits back and wakes waiters. Cancel-safe: once started, it completes
    /// even if this future is dropped.
    pub async fn release(self) -> Result<()> {
        let SemaphorePermits { taken, _session } = self;
        taken.give_back().await
    }

    /// Keeps the permits taken: they are not given back (as tokio's `forget`). Another
    /// caller may give them back later with [`Semaphore::release`].
    pub fn forget(self) {
        let SemaphorePermits { taken, _session } = self;
        taken.forget();
    }
}
