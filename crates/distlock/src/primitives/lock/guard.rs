//! The guard of a lease lock: proof of one hold, with the holding's token, lease and
//! lost signal, and the calls a holder makes (re-enter, extend, verify, release).

use std::fmt;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::holding::{Hold, LeaseMode, ReleaseOutcome};
use crate::engine::detach::Detached;
use crate::engine::lease_set::LeaseSet;
use crate::engine::session::Session;
use crate::error::Result;

/// Proof of one hold on a [`Lock`].
///
/// Release it with [`LockGuard::release`] to learn whether the release worked; dropping
/// it releases in the background instead, on the client's own runtime (never blocking,
/// never panicking, and never depending on the runtime it is dropped in). A guard may be
/// moved to another task and released there.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = distlock_testkit::RedisServer::start().await?;
/// # let client = distlock::Client::connect(&server.url()).await?;
/// let guard = client.lock("ledger")?.lock().await?;
/// let token = guard.fencing_token(); // hand this to the store you write
///
/// // Hand the lost signal to a worker; it stops when the lease is lost.
/// let lost = guard.lost_token();
/// let worker = tokio::spawn(async move {
///     tokio::select! {
///         _ = lost.cancelled() => "stopped: lease lost",
///         _ = tokio::time::sleep(std::time::Duration::from_millis(10)) => "finished",
///     }
/// });
/// assert_eq!(worker.await?, "finished");
///
/// // A nested section takes a hold of its own on the same holding.
/// let nested = guard.reenter().await?;
/// assert_eq!((nested.fencing_token(), nested.hold_count()), (token, 2));
/// nested.release().await?;
///
/// // Released from another task than the one that acquired it.
/// tokio::spawn(guard.release()).await??;
/// client.shutdown().await;
/// # Ok(())
/// # }
/// ```
#[must_use = "dropping the guard releases the lock at once"]
pub struct LockGuard {
    pub(super) hold: Hold,
    /// Keeps the client's session (and its runtime) running while the lock is held.
    pub(super) _session: Session,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let holding = self.hold.holding();
        f.debug_struct("LockGuard")
            .field("name", &holding.name)
            .field("owner", &holding.owner)
            .field("token", &holding.token)
            .field("holds", &self.hold_count())
            .finish()
    }
}

impl LockGuard {
    /// The guard of `hold`, keeping `session` open while it lives.
    pub(crate) fn from_hold(hold: Hold, session: Session) -> Self {
        Self {
            hold,
            _session: session,
        }
    }

    /// Fixes the lease of a holding taken in watchdog mode to `lease` from now (see
    /// `Holding::fix_lease`). Fails with [`Error::NotHeld`] if it is no longer held.
    pub(crate) async fn fix_lease(&self, lease: Duration) -> Result<()> {
        self.hold
            .holding()
            .set_fixed_lease(lease, LeaseMode::FixedOrWatchdog)
            .await
    }
}

/// Makes each of `guards` listen on its lock's channel, as asking a guard for its lost
/// signal does (see [`LockGuard::lost`]): a MultiLock's or RedLock's lost signal is made
/// of its members'.
pub(crate) fn listen_for_unlock(guards: &[LockGuard]) {
    for guard in guards {
        guard.hold.holding_arc().watch_for_unlock();
    }
}

/// The leases of `guards` as one, trusted while `quorum` of them are (a MultiLock's
/// guards, all of them; a RedLock's, a majority).
pub(crate) fn lease_set(guards: &[LockGuard], quorum: usize) -> LeaseSet<'_> {
    let background = guards
        .first()
        .map(|first| first.hold.holding().core.background());
    LeaseSet::new(
        guards.iter().map(|guard| &guard.hold.holding().lease_entry),
        quorum,
        background,
    )
}

impl LockGuard {
    /// The fencing token of this holding: larger than that of every earlier acquisition of
    /// the same lock name. Re-entries share their holding's token. Pass it to the resource
    /// you write, and have the resource refuse writes with a smaller token.
    pub fn fencing_token(&self) -> u64 {
        self.hold.holding().token
    }

    /// The fencing token as an `i64`, for a SQL `BIGINT` column. Exact: a token never
    /// exceeds `i64::MAX`, because Redis counters are signed 64-bit integers.
    pub fn fencing_token_i64(&self) -> i64 {
        // A token is parsed from a Redis integer, so it fits; saturating keeps the type
        // honest without a panic path.
        i64::try_from(self.hold.holding().token).unwrap_or(i64::MAX)
    }

    /// How many guards of this holding are alive: 1, plus one per live re-entry.
    pub fn hold_count(&self) -> u32 {
        self.hold.holding().guards.load(Ordering::Acquire)
    }

    /// The lock's name, as given to [`Client::lock`] (without the client's key prefix).
    pub fn name(&self) -> &str {
        let holding = self.hold.holding();
        let prefix = holding.core.config().key_prefix.len();
        holding.name.get(prefix..).unwrap_or(&holding.name)
    }

    /// The lock's Redis key (the client's key prefix, then the name).
    pub(crate) fn key(&self) -> &str {
        &self.hold.holding().name
    }

    /// The owner this holding is written under, `"<client id>:<n>"`.
    pub fn owner(&self) -> &str {
        &self.hold.holding().owner
    }

    /// How long the lease is sure to last, by the local clock: until the lost signal
    /// fires (the deadline less a margin for clock drift); zero once it is lost.
    pub fn lease_remaining(&self) -> Duration {
        self.hold
            .holding()
            .lease_entry
            .trusted_until()
            .map(|deadline| deadline.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::ZERO)
    }

    /// True once the lock can no longer be trusted to be held.
    pub fn is_lost(&self) -> bool {
        !self.hold.holding().lease_entry.is_trusted()
    }

    /// Completes as soon as the lock can no longer be trusted to be held. It never
    /// completes after a normal release.
    ///
    /// A loss is noticed in one of these ways, and no later than this:
    ///
    /// | how it is noticed | when |
    /// |---|---|
    /// | the lease deadline comes without a renewal (a server or network that does not answer, a fixed lease that ran its length) | at the deadline, less a margin of 1 % + 5 ms, by the local clock |
    /// | a release message on the lock's channel (a force-unlock: distlock's [`Lock::force_unlock`](crate::Lock::force_unlock), Redisson's `forceUnlock`, or any DEL followed by that message), after which the server says the holding no longer owns the lock | about a round trip after the message: 0.5–0.7 ms on loopback (`lost_signal.rs::a_raw_delete_and_publish_fires_the_lost_signal_as_soon_as_its_message_comes`), as a waiter notices a release; once this signal was asked for ([`lost`](LockGuard::lost) or [`lost_token`](LockGuard::lost_token)), in watchdog and fixed mode alike |
    /// | a watchdog renewal finds the key gone or another owner (deleted without a message, evicted, a failover that lost it) | at the next renewal: every third of the watchdog timeout (10 s by default) |
    /// | a renewal the server's ACL refuses | at that renewal |
    /// | [`LockGuard::verify`], [`reenter`](LockGuard::reenter), [`extend`](LockGuard::extend) or a release finds it gone | when that call's reply comes |
    /// | the client shuts down | at once |
    ///
    /// Asking for the signal (this call, or [`LockGuard::lost_token`]) makes the holding
    /// listen on the lock's channel until it ends: the client's one subscription per
    /// channel, shared with the lock's waiters (whose wake-ups it does not take), and one
    /// HEXISTS when it starts and per message. [`LockGuard::is_lost`] alone starts
    /// nothing, and sees a force-unlock only once the signal was asked for.
    ///
    /// A fixed lease is never renewed, so a lock deleted under it without a message is
    /// noticed only at its deadline or by one of the calls above. To notice sooner, call
    /// [`LockGuard::verify`] before a step that must not run without the lock (one round
    /// trip), or shorten the watchdog timeout
    /// ([`ClientBuilder::watchdog_timeout`](crate::ClientBuilder::watchdog_timeout)).
    ///
    /// It keeps time wherever it is awaited: in a task, directly in a `block_on` body (the
    /// body of `#[tokio::main]`, as in the README), or outside any runtime. The deadline
    /// is kept by a thread of distlock's that does nothing else, on the standard clock,
    /// not by the awaiting runtime's timer (which may be missing, paused or busy) nor by
    /// the clients' background thread (which may be starved)
    /// (`starved.rs::lost_awaited_in_a_tokio_main_body_fires_at_the_deadline_while_the_clients_thread_is_starved`,
    /// `runtimes.rs::lost_awaited_in_a_tokio_main_body_fires_at_the_deadline_while_every_worker_is_blocked`).
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        self.hold.holding_arc().watch_for_unlock();
        let watch = self.hold.holding().lease_entry.watch();
        async move {
            if !watch.await {
                // A normal release is not a loss: never complete.
                std::future::pending::<()>().await;
            }
        }
    }

    /// The same signal as [`LockGuard::lost`], as a token to hand to other tasks. Each
    /// call gives a new token: cancelling it yourself (to stop a worker, say) affects
    /// neither the guard nor other tokens.
    ///
    /// Like [`LockGuard::lost`], it makes the holding listen on the lock's channel, so a
    /// force-unlock cancels it about a round trip after its message.
    ///
    /// It is cancelled by the lease deadline itself, not only by the client's watchdog: the
    /// first call starts one small task on the caller's runtime (the client's own when
    /// called outside one), woken at the deadline by distlock's deadline clock (so that
    /// runtime needs no timer), which ends with the holding.
    pub fn lost_token(&self) -> CancellationToken {
        self.hold.holding_arc().watch_for_unlock();
        self.hold.holding().lease_entry.lost_token()
    }

    /// Asks the server, now, whether this holding still owns the lock: one round trip.
    /// `Ok(false)` means it is lost, and the lost signal has fired. Use it before a step
    /// that must not run without the lock, to notice a deletion or force-unlock before the
    /// next renewal (or, for a fixed lease, before the deadline).
    ///
    /// `Ok(true)` says the server had it when it answered; the lease may still run out
    /// right after. The fencing token is what protects a store.
    pub async fn verify(&self) -> Result<bool> {
        self.hold.holding().verify().await
    }

    /// Sets the fixed lease of this holding to run out `lease` from now (it may shorten
    /// it too), if it is still this holding's on the server. The local deadline,
    /// [`LockGuard::lease_remaining`] and the lost signal move with it.
    ///
    /// Fails with [`Error::NotHeld`] if the lock is no longer this holding's (the lost
    /// signal has then fired), and with [`Error::InvalidConfig`] for a holding in
    /// watchdog mode, which the watchdog renews.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = distlock_testkit::RedisServer::start().await?;
    /// # let client = distlock::Client::connect(&server.url()).await?;
    /// use std::time::Duration;
    ///
    /// let lock = client.lock("import")?.with_lease(Duration::from_secs(10));
    /// let guard = lock.lock().await?;
    /// // The import takes longer than planned: ask for another minute.
    /// guard.extend(Duration::from_secs(60)).await?;
    /// assert!(guard.lease_remaining() > Duration::from_secs(50));
    /// guard.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn extend(&self, lease: Duration) -> Result<()> {
        self.hold
            .holding()
            .set_fixed_lease(lease, LeaseMode::Fixed)
            .await
    }

    /// Gives up this guard without releasing its hold: the lock stays taken on the server
    /// until its lease runs out, and nothing is kept alive on the client (no renewal, no
    /// release, no handle on the client). Returns how long the lease is sure to last, by
    /// the local clock.
    ///
    /// For a job that must run at most once per period across hosts: take the lock with
    /// a fixed lease of one period, do the work, and leave the lock to expire, so no host
    /// runs it again before the period ends, whatever its clock says. In watchdog mode the
    /// lock expires within the watchdog timeout of its last renewal.
    ///
    /// Other guards of the same holding (re-entries) stay valid; the hold left here keeps
    /// the lock taken after they are released.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = distlock_testkit::RedisServer::start().await?;
    /// # let client = distlock::Client::connect(&server.url()).await?;
    /// use std::time::Duration;
    ///
    /// let hourly = client.lock("cron:hourly-report")?.with_lease(Duration::from_secs(3600));
    /// if let Some(guard) = hourly.try_lock().await? {
    ///     // ... run the report ...
    ///     guard.leave_to_expire();
    /// }
    /// // Until the hour is up, no host takes it again.
    /// assert!(hourly.try_lock().await?.is_none());
    /// # Ok(())
    /// # }
    /// ```
    pub fn leave_to_expire(self) -> Duration {
        let remaining = self.lease_remaining();
        let LockGuard { hold, _session } = self;
        // The hold is taken out without its release; its count stays on the server. The
        // last guard gone stops the renewal, and dropping the holding ends its entry.
        hold.take().guard_gone();
        remaining
    }

    /// Takes one more hold on this guard's holding, for a nested section: the returned
    /// guard has the same fencing token and owner, and the lock stays held until every
    /// guard of the holding is released. The lease is left as it is (a re-entry never
    /// shortens it).
    ///
    /// Fails with [`Error::NotHeld`] if the holding was lost. Cancel-safe: a re-entry
    /// cancelled in flight gives its hold back.
    pub async fn reenter(&self) -> Result<LockGuard> {
        let holding = Arc::clone(self.hold.holding_arc());
        let core = Arc::clone(&holding.core);
        // Counted as work in flight before the check, so a shutdown cannot slip between.
        let reentering = Detached::new(core.background(), holding.add_hold());
        core.ensure_open()?;
        let hold = reentering.await?;
        // A shutdown that started while the hold was being taken: give it back (dropping
        // it does) rather than hand out a hold nothing will renew.
        core.ensure_open()?;
        Ok(LockGuard {
            hold,
            _session: self._session.clone(),
        })
    }

    /// Releases this hold: one hold fewer; the last hold frees the lock and wakes one
    /// waiter. [`ReleaseOutcome::AlreadyLost`] says the lease had been lost in the
    /// meantime (nothing was changed then); an error says the server could not be asked
    /// (the lock then frees itself when its lease runs out, as nothing renews it).
    ///
    /// Cancel-safe: once started, the release completes even if this future is dropped.
    /// It works after [`Client::shutdown`] too: giving a lock back is always allowed.
    pub async fn release(self) -> Result<ReleaseOutcome> {
        // The client handle lives until the release is done.
        let LockGuard { hold, _session } = self;
        let holding = hold.take();
        holding.guard_gone();
        let core = Arc::clone(&holding.core);
        Detached::new(core.background(), holding.give_back()).await
    }
}
