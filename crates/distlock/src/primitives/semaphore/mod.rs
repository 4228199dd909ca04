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
//!
//! Every permit count in both semaphores' APIs is an `i64`: what a call asks for, what a
//! guard holds, what is free, the total, and what `add_permits` adds. The count lives in
//! Redis as a signed 64-bit integer, and the free count can go below zero
//! (`add_permits` with a negative number, or Redisson's `reducePermits`, while permits are
//! taken), so `i64` is the one type that holds every count the server can answer with;
//! one type means no conversions between what was asked, what is held and what is read.
//! An ask below 1 is refused with [`Error::InvalidArgument`].

mod attempt;
pub(crate) mod scripts;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use attempt::{add_back, add_permits, SemaphoreAttempt, Taken};
use scripts::{SEMAPHORE_DRAIN, SEMAPHORE_SET};

use crate::engine::acquire::{acquire, Patience};
use crate::engine::session::{Core, Session};
use crate::error::{Error, Result};
use crate::primitives::keys::semaphore_channel;
use crate::transport::script::ScriptCall;

/// A semaphore's key and channel, worked out once per handle.
pub(crate) struct SemaphoreKeys {
    pub(crate) key: Arc<str>,
    pub(crate) channel: String,
}

/// What [`Semaphore::try_set_permits`] and
/// [`PermitSemaphore::try_set_permits`](crate::PermitSemaphore::try_set_permits) did: a
/// semaphore's count is set once, by the first caller, and later calls keep it.
#[must_use = "the semaphore may have kept an earlier count: check it"]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PermitsSet {
    /// The semaphore had no count: it now has the permits asked for, all free.
    Set,
    /// The semaphore had a count already, and keeps it: nothing was written. `found` is
    /// that count: for a [`Semaphore`], its free permits, the only count it keeps; for a
    /// [`PermitSemaphore`](crate::PermitSemaphore), its total (free permits, plus permits
    /// taken and not given back yet, as
    /// [`total_permits`](crate::PermitSemaphore::total_permits) reads it).
    Kept {
        /// The count the semaphore has (see above).
        found: i64,
    },
}

impl PermitsSet {
    /// True if this call set the count.
    pub fn is_set(self) -> bool {
        self == PermitsSet::Set
    }
}

/// A handle on one named semaphore. Cheap to clone; takes nothing by itself.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = distlock_testkit::RedisServer::start().await?;
/// # let client = distlock::Client::connect(&server.url()).await?;
/// let exports = client.semaphore("exports")?;
/// // Three exports at a time, fleet-wide; the first caller sets the count.
/// if let distlock::PermitsSet::Kept { found } = exports.try_set_permits(3).await? {
///     println!("kept the count set earlier: {found} free");
/// }
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
    /// `permits` must be at least 1.
    pub async fn acquire(&self, permits: i64) -> Result<SemaphorePermits> {
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
    pub async fn try_acquire(&self, permits: i64) -> Result<Option<SemaphorePermits>> {
        let attempt = self.attempt(permits)?;
        let acquired = acquire(attempt.core(), &attempt, Patience::None).await?;
        Ok(acquired.map(|taken| self.guard(taken)))
    }

    /// Waits up to `timeout` for `permits` permits; `Ok(None)` if they were not free in
    /// time.
    pub async fn try_acquire_for(
        &self,
        permits: i64,
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
    pub async fn release(&self, permits: i64) -> Result<i64> {
        let permits = positive("permits", permits)?;
        self.add_permits(permits).await
    }

    /// Adds `permits` free permits (takes them away when negative, which may leave the
    /// count below zero until enough are given back), and wakes waiters. Returns the free
    /// count after it.
    pub async fn add_permits(&self, permits: i64) -> Result<i64> {
        let core = self.session.core();
        core.ensure_open()?;
        add_permits(core, &self.keys, permits).await
    }

    /// Sets the free permits to `permits` if the semaphore has none set yet, and says
    /// what it did: [`PermitsSet::Set`], or [`PermitsSet::Kept`] with the free count it
    /// found and kept (an earlier caller's count, less the permits taken now). `permits`
    /// must not be negative. A call whose connection dropped before the reply is sent
    /// once more, and may then report `Kept` with the count it set itself: compare
    /// `found` with yours rather than treat `Kept` as a conflict.
    pub async fn try_set_permits(&self, permits: i64) -> Result<PermitsSet> {
        set_permits(self.session.core(), &self.keys, None, permits)
            .await
            .map(|found| found.map(|(free, _)| free))
            .map(|found| match found {
                None => PermitsSet::Set,
                Some(found) => PermitsSet::Kept { found },
            })
    }

    /// How many permits are free right now (0 when the semaphore has none set).
    pub async fn available_permits(&self) -> Result<i64> {
        let get = redis::cmd("GET").arg(&*self.keys.key).clone();
        let free: Option<String> = self.session.core().query(&get).await?;
        parse_count(&self.keys.key, free.as_deref())
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

    fn attempt(&self, permits: i64) -> Result<SemaphoreAttempt> {
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

fn positive(what: &'static str, value: i64) -> Result<i64> {
    if value < 1 {
        return Err(Error::InvalidArgument {
            what,
            reason: format!("{value} is not a number of permits: must be at least 1"),
        });
    }
    Ok(value)
}

/// A semaphore's count as stored at `key` (`None`: no count, 0).
pub(crate) fn parse_count(key: &str, stored: Option<&str>) -> Result<i64> {
    match stored {
        None => Ok(0),
        Some(count) => count.parse().map_err(|_| Error::InvalidArgument {
            what: "semaphore",
            reason: format!("{key} holds {count:?}, not a permit count"),
        }),
    }
}

/// Sets the count at `keys` to `permits` if it has none (`semaphore_set.lua`). Returns
/// `None` when it set it, or the count it kept: the free count, and the permits taken
/// in `timeouts` (a permit semaphore's set; 0 without one).
pub(crate) async fn set_permits(
    core: &Core,
    keys: &SemaphoreKeys,
    timeouts: Option<&str>,
    permits: i64,
) -> Result<Option<(i64, i64)>> {
    check_total(permits)?;
    let mut script_keys: Vec<&str> = vec![&keys.key, &keys.channel];
    script_keys.extend(timeouts);
    let mut call = ScriptCall::new(&SEMAPHORE_SET, &script_keys, 2);
    call.arg(permits).arg(core.deployment().publish_command());
    let (set, free, taken): (i64, Option<String>, i64) = core.write(&call, &keys.key, true).await?;
    if set == 1 {
        return Ok(None);
    }
    let free = parse_count(&keys.key, free.as_deref())?;
    Ok(Some((free, taken)))
}

/// Refuses a negative count for [`Semaphore::try_set_permits`] and
/// [`PermitSemaphore::try_set_permits`](crate::PermitSemaphore::try_set_permits).
pub(crate) fn check_total(permits: i64) -> Result<()> {
    if permits < 0 {
        return Err(Error::InvalidArgument {
            what: "permits",
            reason: format!("{permits} is negative; a semaphore starts with 0 or more"),
        });
    }
    Ok(())
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
    pub fn permits(&self) -> i64 {
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
