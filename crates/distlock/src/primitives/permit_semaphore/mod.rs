//! The permit semaphore (Redisson's `RPermitExpirableSemaphore` layout): permits that are
//! leases. The count of free permits is at the name, as a plain semaphore's, and a sorted
//! set, `{name}:timeout`, scores each taken permit's id with the time its lease runs out;
//! every script gives expired permits back first.
//!
//! Beyond Redisson, whose permits simply expire: a permit taken in watchdog mode (the
//! default) is renewed by the client's renewal scheduler, beside its locks, so it lasts as
//! long as its holder lives and comes back by itself within the lease when the holder
//! dies. Each permit has the lost signal a lock has, and a guard gives its permits back
//! when released or dropped.

mod held;
pub(crate) mod scripts;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use held::{Held, PermitAttempt};

use crate::duration::to_millis;
use crate::engine::acquire::{acquire, Patience};
use crate::engine::lease_set::LeaseSet;
use crate::engine::session::Session;
use crate::error::{Error, Result};
use crate::primitives::keys::{permit_timeouts, semaphore_channel};
use crate::primitives::lock::ReleaseOutcome;
use crate::primitives::semaphore::{
    parse_count, set_permits, PermitsSet, Semaphore, SemaphoreKeys,
};
use crate::transport::script::ScriptCall;
use scripts::PERMIT_TOTAL;

/// A permit semaphore's keys and channel, worked out once per handle.
pub(crate) struct PermitKeys {
    pub(crate) count: Arc<str>,
    pub(crate) timeouts: Arc<str>,
    pub(crate) channel: String,
}

/// A handle on one named permit semaphore: permits that are leases. Cheap to clone.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = distlock_testkit::RedisServer::start().await?;
/// # let client = distlock::Client::connect(&server.url()).await?;
/// let gpus = client.permit_semaphore("gpus")?;
/// assert!(gpus.try_set_permits(4).await?.is_set());
/// assert_eq!(gpus.total_permits().await?, 4);
///
/// // Renewed while held; back by itself within the watchdog timeout if this process dies.
/// let permits = gpus.acquire(2).await?;
/// assert_eq!(gpus.available_permits().await?, 2);
/// assert_eq!(gpus.total_permits().await?, 4); // taken permits still count
/// tokio::select! {
///     _ = permits.lost() => eprintln!("a permit was lost: stop using the GPUs"),
///     _ = tokio::time::sleep(std::time::Duration::from_millis(10)) => {}
/// }
/// permits.release().await?;
/// assert_eq!(gpus.available_permits().await?, 4);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PermitSemaphore {
    session: Session,
    keys: Arc<PermitKeys>,
    lease: Option<Duration>,
}

impl fmt::Debug for PermitSemaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PermitSemaphore")
            .field("key", &self.keys.count)
            .field("lease", &self.lease)
            .finish()
    }
}

impl PermitSemaphore {
    /// The most permits one call may ask for. Each permit is a lease with an id of its
    /// own, sent in the acquisition's script call and renewed one by one: an ask for
    /// millions would build a call of hundreds of megabytes before Redis could answer.
    /// More is refused with [`Error::InvalidArgument`].
    pub const MAX_PERMITS_PER_CALL: i64 = 10_000;

    /// The permit semaphore whose Redis key is `key`: the client's key prefix, then the
    /// name.
    pub(crate) fn new(session: Session, key: String) -> Self {
        let prefix = &session.core().config().key_prefix;
        let keys = PermitKeys {
            timeouts: permit_timeouts(prefix, &key).into(),
            channel: semaphore_channel(prefix, &key),
            count: key.into(),
        };
        Self {
            session,
            keys: Arc::new(keys),
            lease: None,
        }
    }

    /// The semaphore's Redis key: the client's key prefix, if any, followed by its name.
    pub fn key(&self) -> &str {
        &self.keys.count
    }

    /// A handle whose permits take a fixed lease of `lease`, never renewed: each comes
    /// back by itself when its lease runs out, given back or not.
    pub fn with_lease(&self, lease: Duration) -> PermitSemaphore {
        PermitSemaphore {
            lease: Some(lease),
            ..self.clone()
        }
    }

    /// A handle whose permits are renewed while held (the default).
    pub fn with_watchdog(&self) -> PermitSemaphore {
        PermitSemaphore {
            lease: None,
            ..self.clone()
        }
    }

    /// Waits until `permits` permits are free, and takes them, each a lease.
    /// Cancel-safe: dropping the future leaves no permit taken. `permits` must be in
    /// `1..=`[`MAX_PERMITS_PER_CALL`](Self::MAX_PERMITS_PER_CALL).
    pub async fn acquire(&self, permits: i64) -> Result<LeasedPermits> {
        let attempt = self.attempt(permits)?;
        loop {
            let acquired = acquire(attempt.core(), &attempt, Patience::Forever);
            if let Some(held) = acquired.await? {
                return Ok(self.guard(held));
            }
        }
    }

    /// Takes `permits` permits if that many are free now; `Ok(None)` otherwise.
    pub async fn try_acquire(&self, permits: i64) -> Result<Option<LeasedPermits>> {
        let attempt = self.attempt(permits)?;
        let acquired = acquire(attempt.core(), &attempt, Patience::None).await?;
        Ok(acquired.map(|held| self.guard(held)))
    }

    /// Waits up to `timeout` for `permits` permits; `Ok(None)` if they were not free in
    /// time.
    pub async fn try_acquire_for(
        &self,
        permits: i64,
        timeout: Duration,
    ) -> Result<Option<LeasedPermits>> {
        let patience = Patience::within(timeout)?;
        let attempt = self.attempt(permits)?;
        let acquired = acquire(attempt.core(), &attempt, patience).await?;
        Ok(acquired.map(|held| self.guard(held)))
    }

    /// Sets the permits to `permits`, all free, if the semaphore has no count yet, and
    /// says what it did: [`PermitsSet::Set`], or [`PermitsSet::Kept`] with the total it
    /// found and kept (free permits plus permits taken, as
    /// [`total_permits`](Self::total_permits) reads it), read in the same script. Every
    /// user of one semaphore should ask for the same count: compare `found` with yours.
    /// `permits` must not be negative.
    pub async fn try_set_permits(&self, permits: i64) -> Result<PermitsSet> {
        let found = set_permits(
            self.session.core(),
            &self.semaphore_keys(),
            Some(&self.keys.timeouts),
            permits,
        )
        .await?;
        Ok(match found {
            None => PermitsSet::Set,
            Some((free, taken)) => PermitsSet::Kept {
                found: free.saturating_add(taken),
            },
        })
    }

    /// The semaphore's total permits: the free ones plus the ones taken and not given
    /// back yet (a permit whose lease ran out counts once, whether or not it is back in
    /// the free count yet). 0 when the semaphore has no count. One script, reading both
    /// keys at one moment.
    pub async fn total_permits(&self) -> Result<i64> {
        let keys: [&str; 2] = [&self.keys.count, &self.keys.timeouts];
        let call = ScriptCall::new(&PERMIT_TOTAL, &keys, 0);
        let (free, taken): (Option<String>, i64) = self
            .session
            .core()
            .request(|mut connection| {
                let call = &call;
                async move { call.invoke(&mut connection).await }
            })
            .await?;
        Ok(parse_count(&self.keys.count, free.as_deref())?.saturating_add(taken))
    }

    /// Adds `permits` free permits (takes them away when negative), and wakes waiters.
    /// Returns the free count after it.
    pub async fn add_permits(&self, permits: i64) -> Result<i64> {
        self.counter().add_permits(permits).await
    }

    /// How many permits are free right now. Permits whose lease ran out come back at the
    /// next acquisition or release, and are not counted until then.
    pub async fn available_permits(&self) -> Result<i64> {
        self.counter().available_permits().await
    }

    /// The free count, as a plain semaphore of the same name sees it (the same key and
    /// channel).
    fn counter(&self) -> Semaphore {
        Semaphore::new(self.session.clone(), self.keys.count.to_string())
    }

    /// The free count's key and channel, as a plain semaphore's.
    fn semaphore_keys(&self) -> SemaphoreKeys {
        SemaphoreKeys {
            key: Arc::clone(&self.keys.count),
            channel: self.keys.channel.clone(),
        }
    }

    fn attempt(&self, permits: i64) -> Result<PermitAttempt> {
        if !(1..=Self::MAX_PERMITS_PER_CALL).contains(&permits) {
            return Err(Error::InvalidArgument {
                what: "permits",
                reason: format!(
                    "{permits} is not in 1..={} (PermitSemaphore::MAX_PERMITS_PER_CALL)",
                    Self::MAX_PERMITS_PER_CALL
                ),
            });
        }
        let core = self.session.core();
        let (lease, renew) = match self.lease {
            Some(lease) => (lease, false),
            None => (core.config().watchdog_timeout, true),
        };
        // In range, checked above.
        let permits = u32::try_from(permits).unwrap_or(1);
        Ok(PermitAttempt {
            core: Arc::clone(core),
            keys: Arc::clone(&self.keys),
            permits,
            lease,
            lease_ms: to_millis("lease", lease)?,
            renew,
        })
    }

    fn guard(&self, held: Held) -> LeasedPermits {
        LeasedPermits {
            held,
            _session: self.session.clone(),
        }
    }
}

/// Permits taken from a [`PermitSemaphore`], each a lease. Dropping the guard gives them
/// back, in the background on the client's own runtime.
#[must_use = "dropping the permits gives them back at once"]
pub struct LeasedPermits {
    held: Held,
    /// Keeps the client's session running while the permits are held.
    _session: Session,
}

impl fmt::Debug for LeasedPermits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeasedPermits")
            .field("semaphore", &self.held.key())
            .field("permits", &self.held.ids().len())
            .finish()
    }
}

impl LeasedPermits {
    /// How many permits this guard holds.
    pub fn permits(&self) -> i64 {
        // At most MAX_PERMITS_PER_CALL ids.
        i64::try_from(self.held.ids().len()).unwrap_or(i64::MAX)
    }

    /// The permits' ids, as they are in the semaphore's `{name}:timeout` set.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.held.ids().iter().map(|id| &**id)
    }

    /// True once any of the permits can no longer be trusted to be held.
    pub fn is_lost(&self) -> bool {
        !self.leases().is_trusted()
    }

    /// Asks the server whether every permit is still this guard's (one round trip), as
    /// [`LockGuard::verify`](crate::LockGuard::verify) does for a lock: false, and the
    /// lost signal fired, when one is gone (its lease ran out on the server, the
    /// semaphore was deleted, or the server restarted without its data).
    pub async fn verify(&self) -> Result<bool> {
        self.held.verify().await
    }

    /// How long every permit is sure to last, by the local clock; zero once one is lost.
    pub fn lease_remaining(&self) -> Duration {
        self.leases().remaining()
    }

    /// Completes as soon as any of the permits can no longer be trusted to be held (a
    /// renewal found it reclaimed, or its lease deadline came without a renewal), as
    /// [`LockGuard::lost`](crate::LockGuard::lost) does for a lock. Never after a normal
    /// release.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        self.leases().lost()
    }

    /// The same signal as [`LeasedPermits::lost`], as a token to hand to other tasks.
    pub fn lost_token(&self) -> CancellationToken {
        self.leases().lost_token()
    }

    /// Gives the permits back and wakes waiters. [`ReleaseOutcome::AlreadyLost`] says a
    /// permit's lease had run out before (it came back to the count by itself).
    /// Cancel-safe: once started, it completes even if this future is dropped.
    pub async fn release(self) -> Result<ReleaseOutcome> {
        let LeasedPermits { held, _session } = self;
        let taken = held.ids().len();
        let back = held.give_back().await?;
        Ok(if back == taken {
            ReleaseOutcome::Released
        } else {
            ReleaseOutcome::AlreadyLost
        })
    }

    fn leases(&self) -> LeaseSet<'_> {
        let background = self.held.core().map(|core| core.background());
        let leases = self.held.leases();
        LeaseSet::new(leases.iter(), leases.len(), background)
    }
}
