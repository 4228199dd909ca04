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
//!
//! On PostgreSQL (`postgres.rs`) an acquisition is one row with its permits and its own
//! expiry, and on etcd (`etcd.rs`) one key in the semaphore's queue, valued with its
//! permits; either is a holding like a lock's, and the API is the same.

#[cfg(feature = "etcd")]
mod etcd;
mod held;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
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
#[cfg(any(feature = "postgres", feature = "etcd"))]
use crate::primitives::lock::LockGuard;
use crate::primitives::lock::ReleaseOutcome;
#[cfg(any(feature = "postgres", feature = "etcd"))]
use crate::primitives::semaphore::check_total;
use crate::primitives::semaphore::{
    parse_count, set_permits, PermitsSet, Semaphore, SemaphoreKeys,
};
use crate::transport::script::ScriptCall;
#[cfg(any(feature = "postgres", feature = "etcd"))]
use crate::transport::Store;
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
        loop {
            if let Some(taken) = self.take(permits, Patience::Forever).await? {
                return Ok(taken);
            }
        }
    }

    /// Takes `permits` permits if that many are free now; `Ok(None)` otherwise.
    pub async fn try_acquire(&self, permits: i64) -> Result<Option<LeasedPermits>> {
        self.take(permits, Patience::None).await
    }

    /// Waits up to `timeout` for `permits` permits; `Ok(None)` if they were not free in
    /// time.
    pub async fn try_acquire_for(
        &self,
        permits: i64,
        timeout: Duration,
    ) -> Result<Option<LeasedPermits>> {
        let patience = Patience::within(timeout)?;
        self.take(permits, patience).await
    }

    /// One acquisition through the engine, with the store's own attempt.
    async fn take(&self, permits: i64, patience: Patience) -> Result<Option<LeasedPermits>> {
        let attempt = self.attempt(permits)?;
        #[cfg(feature = "postgres")]
        if let Store::Postgres(link) = self.session.core().store() {
            let attempt = postgres::PgPermitAttempt::new(
                Arc::clone(&attempt.core),
                link.clone(),
                Arc::clone(&self.keys.count),
                attempt.permits,
                (attempt.lease, attempt.lease_ms, attempt.renew),
            );
            let acquired = acquire(attempt.core(), &attempt, patience).await?;
            return Ok(acquired.map(|hold| self.holding(hold, permits)));
        }
        #[cfg(feature = "etcd")]
        if let Store::Etcd(link) = self.session.core().store() {
            let attempt = crate::primitives::lock::etcd::EtcdAttempt::permits(
                Arc::clone(&attempt.core),
                link.clone(),
                Arc::clone(&self.keys.count),
                attempt.core.next_owner(),
                attempt.permits,
                (attempt.lease, attempt.renew),
            );
            let acquired = acquire(attempt.core(), &attempt, patience).await?;
            return Ok(acquired.map(|hold| self.holding(hold, permits)));
        }
        let acquired = acquire(attempt.core(), &attempt, patience).await?;
        Ok(acquired.map(|held| self.guard(held)))
    }

    /// The guard of permits held as a holding (on a store other than Redis).
    #[cfg(any(feature = "postgres", feature = "etcd"))]
    fn holding(&self, hold: crate::primitives::lock::Hold, permits: i64) -> LeasedPermits {
        LeasedPermits {
            held: Permits::Holding {
                guard: LockGuard::from_hold(hold, self.session.clone()),
                // In range: checked by `attempt`.
                permits: u32::try_from(permits).unwrap_or(1),
            },
            _session: self.session.clone(),
        }
    }

    /// Sets the permits to `permits`, all free, if the semaphore has no count yet, and
    /// says what it did: [`PermitsSet::Set`], or [`PermitsSet::Kept`] with the total it
    /// found and kept (free permits plus permits taken, as
    /// [`total_permits`](Self::total_permits) reads it), read in the same script. Every
    /// user of one semaphore should ask for the same count: compare `found` with yours.
    /// `permits` must not be negative.
    pub async fn try_set_permits(&self, permits: i64) -> Result<PermitsSet> {
        #[cfg(feature = "postgres")]
        if let Store::Postgres(link) = self.session.core().store() {
            check_total(permits)?;
            let found = postgres::set_permits(link, &self.keys.count, permits).await?;
            return Ok(match found {
                None => PermitsSet::Set,
                Some(found) => PermitsSet::Kept { found },
            });
        }
        #[cfg(feature = "etcd")]
        if let Store::Etcd(link) = self.session.core().store() {
            check_total(permits)?;
            let found = etcd::set_permits(link, &self.keys.count, permits).await?;
            return Ok(match found {
                None => PermitsSet::Set,
                Some(found) => PermitsSet::Kept { found },
            });
        }
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
        #[cfg(feature = "postgres")]
        if let Store::Postgres(link) = self.session.core().store() {
            return Ok(postgres::counts(link, &self.keys.count).await?.0);
        }
        #[cfg(feature = "etcd")]
        if let Store::Etcd(link) = self.session.core().store() {
            return Ok(etcd::counts(link, &self.keys.count).await?.0);
        }
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
        #[cfg(feature = "postgres")]
        if let Store::Postgres(link) = self.session.core().store() {
            self.session.core().ensure_open()?;
            return postgres::add_permits(link, &self.keys.count, permits).await;
        }
        #[cfg(feature = "etcd")]
        if let Store::Etcd(link) = self.session.core().store() {
            self.session.core().ensure_open()?;
            return etcd::add_permits(link, &self.keys.count, permits).await;
        }
        self.counter().add_permits(permits).await
    }

    /// How many permits are free right now. On Redis, permits whose lease ran out come
    /// back at the next acquisition or release, and are not counted until then; on
    /// PostgreSQL they count as free at once.
    pub async fn available_permits(&self) -> Result<i64> {
        #[cfg(feature = "postgres")]
        if let Store::Postgres(link) = self.session.core().store() {
            let (total, taken) = postgres::counts(link, &self.keys.count).await?;
            return Ok(total.saturating_sub(taken));
        }
        #[cfg(feature = "etcd")]
        if let Store::Etcd(link) = self.session.core().store() {
            let (total, taken) = etcd::counts(link, &self.keys.count).await?;
            return Ok(total.saturating_sub(taken));
        }
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
            held: Permits::Redis(held),
            _session: self.session.clone(),
        }
    }
}

/// Permits taken from a [`PermitSemaphore`], each a lease. Dropping the guard gives them
/// back, in the background on the client's own runtime.
#[must_use = "dropping the permits gives them back at once"]
pub struct LeasedPermits {
    held: Permits,
    /// Keeps the client's session running while the permits are held.
    _session: Session,
}

/// The permits a guard holds, as its store keeps them.
enum Permits {
    /// Redis: one lease per permit, each with its own id.
    Redis(Held),
    /// Another store: one holding for the acquisition, with its permits.
    #[cfg(any(feature = "postgres", feature = "etcd"))]
    Holding { guard: LockGuard, permits: u32 },
}

impl fmt::Debug for LeasedPermits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let semaphore = match &self.held {
            Permits::Redis(held) => held.key(),
            #[cfg(any(feature = "postgres", feature = "etcd"))]
            Permits::Holding { guard, .. } => guard.name(),
        };
        f.debug_struct("LeasedPermits")
            .field("semaphore", &semaphore)
            .field("permits", &self.permits())
            .finish()
    }
}

impl LeasedPermits {
    /// How many permits this guard holds.
    pub fn permits(&self) -> i64 {
        match &self.held {
            // At most MAX_PERMITS_PER_CALL ids.
            Permits::Redis(held) => i64::try_from(held.ids().len()).unwrap_or(i64::MAX),
            #[cfg(any(feature = "postgres", feature = "etcd"))]
            Permits::Holding { permits, .. } => i64::from(*permits),
        }
    }

    /// The permits' ids: on Redis, one per permit, as they are in the semaphore's
    /// `{name}:timeout` set; on PostgreSQL, the acquisition's one id (its row's owner).
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        let ids: Vec<&str> = match &self.held {
            Permits::Redis(held) => held.ids().iter().map(|id| &**id).collect(),
            #[cfg(any(feature = "postgres", feature = "etcd"))]
            Permits::Holding { guard, .. } => vec![guard.owner()],
        };
        ids.into_iter()
    }

    /// True once any of the permits can no longer be trusted to be held.
    pub fn is_lost(&self) -> bool {
        match &self.held {
            Permits::Redis(_) => !self.leases().is_trusted(),
            #[cfg(any(feature = "postgres", feature = "etcd"))]
            Permits::Holding { guard, .. } => guard.is_lost(),
        }
    }

    /// Asks the server whether every permit is still this guard's (one round trip), as
    /// [`LockGuard::verify`](crate::LockGuard::verify) does for a lock: false, and the
    /// lost signal fired, when one is gone (its lease ran out on the server, the
    /// semaphore was deleted, or the server restarted without its data).
    pub async fn verify(&self) -> Result<bool> {
        match &self.held {
            Permits::Redis(held) => held.verify().await,
            #[cfg(any(feature = "postgres", feature = "etcd"))]
            Permits::Holding { guard, .. } => guard.verify().await,
        }
    }

    /// How long every permit is sure to last, by the local clock; zero once one is lost.
    pub fn lease_remaining(&self) -> Duration {
        match &self.held {
            Permits::Redis(_) => self.leases().remaining(),
            #[cfg(any(feature = "postgres", feature = "etcd"))]
            Permits::Holding { guard, .. } => guard.lease_remaining(),
        }
    }

    /// Completes as soon as any of the permits can no longer be trusted to be held (a
    /// renewal found it reclaimed, or its lease deadline came without a renewal), as
    /// [`LockGuard::lost`](crate::LockGuard::lost) does for a lock. Never after a normal
    /// release.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let lost: std::pin::Pin<Box<dyn Future<Output = ()> + Send>> = match &self.held {
            Permits::Redis(_) => Box::pin(self.leases().lost()),
            #[cfg(any(feature = "postgres", feature = "etcd"))]
            Permits::Holding { guard, .. } => Box::pin(guard.lost()),
        };
        lost
    }

    /// The same signal as [`LeasedPermits::lost`], as a token to hand to other tasks.
    pub fn lost_token(&self) -> CancellationToken {
        match &self.held {
            Permits::Redis(_) => self.leases().lost_token(),
            #[cfg(any(feature = "postgres", feature = "etcd"))]
            Permits::Holding { guard, .. } => guard.lost_token(),
        }
    }

    /// Gives the permits back and wakes waiters. [`ReleaseOutcome::AlreadyLost`] says a
    /// permit's lease had run out before (it came back to the count by itself).
    /// Cancel-safe: once started, it completes even if this future is dropped.
    pub async fn release(self) -> Result<ReleaseOutcome> {
        let LeasedPermits { held, _session } = self;
        match held {
            Permits::Redis(held) => {
                let taken = held.ids().len();
                let back = held.give_back().await?;
                Ok(if back == taken {
                    ReleaseOutcome::Released
                } else {
                    ReleaseOutcome::AlreadyLost
                })
            }
            #[cfg(any(feature = "postgres", feature = "etcd"))]
            Permits::Holding { guard, .. } => guard.release().await,
        }
    }

    /// The Redis permits' leases (none on another store).
    fn leases(&self) -> LeaseSet<'_> {
        let (background, leases) = match &self.held {
            Permits::Redis(held) => (held.core().map(|core| core.background()), held.leases()),
            #[cfg(any(feature = "postgres", feature = "etcd"))]
            Permits::Holding { .. } => (None, &[][..]),
        };
        LeaseSet::new(leases.iter(), leases.len(), background)
    }
}
