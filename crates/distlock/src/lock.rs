//! The lease lock (Redisson's `RLock` layout, with a fencing token per acquisition).
//!
//! Ownership: every acquisition is its own owner, `"<client id>:<n>"` with n never
//! reused, so two acquisitions exclude each other whatever tasks they run in, exactly like
//! two `tokio::sync::Mutex::lock` calls. Re-entry is explicit: [`LockGuard::reenter`]
//! adds a hold to the guard's own holding. The holds of one holding are counted on the
//! server as Redisson counts a thread's, and the client sends the holding's re-entries and
//! releases one at a time, each with the absolute count it wants, so a lost reply can never
//! leave a stray hold behind.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::client::{Client, Core};
use crate::duration::to_millis;
use crate::engine::acquire::{acquire, Acquire, Attempt, AttemptFuture, Patience};
use crate::engine::detach::Detached;
use crate::engine::lease_set::LeaseSet;
use crate::engine::watchdog::Lease;
use crate::error::{is_connection_failure, Error, Result};
use crate::keys::{release_channel, token_key, unlock_latch};
use crate::scripts::{
    ScriptCall, FENCE_ADVANCE, LOCK_ACQUIRE, LOCK_FORCE_UNLOCK, LOCK_REENTER, LOCK_RELEASE,
    LOCK_RENEW,
};

/// The message Redisson publishes when a lock is freed.
const RELEASE_MESSAGE: &str = "0";

/// How many times a release or a re-entry is sent when the reply is lost to a broken
/// connection or a timeout. The unlock latch and absolute hold counts make repeats safe.
pub(crate) const RELEASE_ATTEMPTS: u32 = 3;

/// Pause before repeating a release, times the attempt number.
pub(crate) const RELEASE_RETRY_PAUSE: Duration = Duration::from_millis(25);

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
/// let fixed = lock.clone().with_lease(Duration::from_secs(10));
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
    client: Client,
    name: Arc<str>,
    /// The name's fencing counter and release channel, worked out once per handle rather
    /// than on every acquisition.
    token_key: Arc<str>,
    channel: Arc<str>,
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
    pub(crate) fn new(client: Client, name: String) -> Self {
        let token_key = token_key(client.core().config().fencing_counter, &name).into();
        let channel = release_channel(&name).into();
        Self {
            client,
            name: name.into(),
            token_key,
            channel,
            lease: None,
        }
    }

    /// The lock's name, which is also its Redis key.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Acquire with a fixed lease of `lease`, with no watchdog: the lock frees itself when
    /// the lease runs out, released or not. Checked (non-zero, representable in
    /// milliseconds) when an acquisition starts.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Acquire in watchdog mode (the default).
    pub fn with_watchdog(mut self) -> Self {
        self.lease = None;
        self
    }

    /// Waits until the lock is acquired.
    ///
    /// An error of the first attempt is returned at once (a dead server fails fast). Once
    /// waiting, connection errors (a restart, a failover) are retried with backoff for as
    /// long as it waits; bound the wait with [`Lock::try_lock_for`] or a timeout.
    ///
    /// Cancel-safe: dropping the future leaves no subscription and no lock behind.
    pub async fn lock(&self) -> Result<LockGuard> {
        let attempt = self.attempt()?;
        loop {
            // Waiting forever ends only with the lock; the loop is for the type's sake.
            let acquired = acquire(&attempt.core, &attempt, Patience::Forever);
            if let Some(hold) = acquired.await? {
                return Ok(self.guard(hold));
            }
        }
    }

    /// Tries once; `Ok(None)` if the lock is held, or if other tasks of this client are
    /// already waiting for it (it never takes the lock ahead of them).
    pub async fn try_lock(&self) -> Result<Option<LockGuard>> {
        let attempt = self.attempt()?;
        let acquired = acquire(&attempt.core, &attempt, Patience::None).await?;
        Ok(acquired.map(|hold| self.guard(hold)))
    }

    /// Waits up to `timeout`; `Ok(None)` if the lock could not be had in that time. A zero
    /// timeout tries once.
    pub async fn try_lock_for(&self, timeout: Duration) -> Result<Option<LockGuard>> {
        let patience = Patience::within(timeout)?;
        let attempt = self.attempt()?;
        let acquired = acquire(&attempt.core, &attempt, patience).await?;
        Ok(acquired.map(|hold| self.guard(hold)))
    }

    /// True if anyone holds the lock.
    pub async fn is_locked(&self) -> Result<bool> {
        let exists = redis::cmd("EXISTS").arg(&*self.name).clone();
        let count: i64 = self.client.core().query(&exists).await?;
        Ok(count == 1)
    }

    /// How long the current lease has left on the server, or `None` if the lock is free.
    pub async fn remaining_ttl(&self) -> Result<Option<Duration>> {
        let pttl = redis::cmd("PTTL").arg(&*self.name).clone();
        let pttl: i64 = self.client.core().query(&pttl).await?;
        Ok(match pttl {
            -2 => None,
            // A key without expiry: not written by distlock or Redisson.
            -1 => Some(Duration::MAX),
            millis => Some(Duration::from_millis(millis.unsigned_abs())),
        })
    }

    /// Deletes the lock whoever holds it and wakes a waiter. Returns whether a lock was
    /// deleted. For operators: the holder is not told, beyond its lost signal firing at its
    /// next renewal.
    pub async fn force_unlock(&self) -> Result<bool> {
        let channel = &self.channel;
        let deleted: i64 = self
            .client
            .core()
            .request(|mut connection| {
                let mut unlock = ScriptCall::new(&LOCK_FORCE_UNLOCK, &[&self.name, channel], 2);
                unlock
                    .arg(RELEASE_MESSAGE)
                    .arg(self.client.core().deployment().publish_command());
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
    /// they are accepted at once. Tokens must stay below 2^53.
    pub async fn advance_fencing_counter(&self, floor: u64) -> Result<u64> {
        if floor >= 1 << 53 {
            return Err(Error::InvalidConfig {
                what: "fencing-counter floor",
                reason: format!("must be below 2^53, not {floor}"),
            });
        }
        let counter: i64 = self
            .client
            .core()
            .request(|mut connection| {
                let mut advance = ScriptCall::new(&FENCE_ADVANCE, &[&self.token_key], 1);
                advance.arg(floor);
                async move { advance.invoke(&mut connection).await }
            })
            .await?;
        Ok(counter.max(0).unsigned_abs())
    }

    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    /// The fixed lease this lock is taken with; `None` in watchdog mode.
    pub(crate) fn fixed_lease(&self) -> Option<Duration> {
        self.lease
    }

    pub(crate) fn guard(&self, hold: Hold) -> LockGuard {
        LockGuard {
            hold,
            _client: self.client.clone(),
        }
    }

    /// One acquisition of this lock, for the engine (or a composite primitive) to try.
    pub(crate) fn attempt(&self) -> Result<LockAttempt> {
        let (lease, renew) = match self.lease {
            Some(lease) => (lease, false),
            None => (self.client.core().config().watchdog_timeout, true),
        };
        Ok(LockAttempt {
            core: Arc::clone(self.client.core()),
            name: Arc::clone(&self.name),
            token_key: Arc::clone(&self.token_key),
            channel: Arc::clone(&self.channel),
            lease,
            lease_ms: to_millis("lease", lease)?,
            renew,
        })
    }
}

/// One acquisition, ready to be tried as often as the engine needs.
pub(crate) struct LockAttempt {
    core: Arc<Core>,
    name: Arc<str>,
    token_key: Arc<str>,
    channel: Arc<str>,
    lease: Duration,
    lease_ms: u64,
    renew: bool,
}

impl LockAttempt {
    /// The lease each acquisition sets.
    pub(crate) fn lease(&self) -> Duration {
        self.lease
    }

    /// The lock's release channel.
    pub(crate) fn channel_arc(&self) -> &Arc<str> {
        &self.channel
    }
}

impl Acquire for LockAttempt {
    type Guard = Hold;

    fn attempt(&self) -> AttemptFuture<Hold> {
        let core = Arc::clone(&self.core);
        let name = Arc::clone(&self.name);
        let token_key = Arc::clone(&self.token_key);
        let channel = Arc::clone(&self.channel);
        let (lease, lease_ms, renew) = (self.lease, self.lease_ms, self.renew);
        Box::pin(async move {
            let owner = core.next_owner();
            let mut connection = core.connection();
            let sent_at = Instant::now();
            let mut call = ScriptCall::new(&LOCK_ACQUIRE, &[&name, &token_key], 2);
            call.arg(lease_ms).arg(&*owner);
            let reply = match core.synced() {
                None => call.invoke::<i64>(&mut connection).await,
                Some(synced) => match call.invoke_synced::<i64>(synced).await {
                    Ok((token, acks)) if token >= 1 && !acks.enough() => {
                        // No replica has it: a failover now would hand the lock to
                        // someone else while this owner trusts it. Give it back.
                        abandon(&core, &name, &channel, &owner);
                        return Err(Error::NotReplicated {
                            name: name.to_string(),
                            acknowledged: acks.acknowledged,
                            required: acks.required,
                            timeout: synced.policy().timeout,
                        });
                    }
                    Err(err) if crate::cluster_link::never_sent(&err) => {
                        return Err(Error::NotReplicated {
                            name: name.to_string(),
                            acknowledged: 0,
                            required: synced.policy().replicas,
                            timeout: synced.policy().timeout,
                        });
                    }
                    other => other.map(|(reply, _)| reply),
                },
            };
            let reply = match reply {
                Ok(reply) => reply,
                Err(err) => {
                    if is_connection_failure(&err) {
                        // The script may have run: give up whatever this owner took.
                        abandon(&core, &name, &channel, &owner);
                    }
                    return Err(err.into());
                }
            };
            match reply {
                token @ 1.. => {
                    let lease_entry = core.watchdog().track(&name, &owner, sent_at, lease, renew);
                    let holding = Arc::new(Holding {
                        core,
                        name,
                        owner,
                        channel,
                        token: token.unsigned_abs(),
                        guards: AtomicU32::new(1),
                        state: tokio::sync::Mutex::new(HoldState {
                            holds: 1,
                            ended: false,
                            lease,
                            lease_ms,
                        }),
                        lease_entry,
                    });
                    Ok(Attempt::Acquired(Hold::new(holding)))
                }
                0 => Ok(Attempt::Busy { retry_after: None }),
                negative => Ok(Attempt::Busy {
                    retry_after: Some(Duration::from_millis((-1 - negative).unsigned_abs())),
                }),
            }
        })
    }

    fn channel(&self) -> &str {
        &self.channel
    }
}

/// Sends, in the background, a release for an owner that may or may not hold the lock (an
/// attempt whose reply was lost). Harmless if it holds nothing.
fn abandon(core: &Arc<Core>, name: &Arc<str>, channel: &Arc<str>, owner: &Arc<str>) {
    let (core_for_task, name, channel, owner) = (
        Arc::clone(core),
        Arc::clone(name),
        Arc::clone(channel),
        Arc::clone(owner),
    );
    core.background().spawn(async move {
        let mut connection = core_for_task.connection();
        let outcome = ScriptCall::new(&LOCK_RELEASE, &[&name, &channel, &name], 7)
            .arg(&*owner)
            .arg(0)
            .arg(1)
            .arg(RELEASE_MESSAGE)
            .arg(0)
            .arg(0)
            .arg(core_for_task.deployment().publish_command())
            .invoke::<i64>(&mut connection)
            .await;
        match outcome {
            Ok(0..) => tracing::debug!(lock = %name, "gave up a hold whose reply was lost"),
            Ok(_) => {}
            Err(err) => tracing::warn!(
                error = %err,
                lock = %name,
                "could not give up an acquisition whose reply was lost; it expires with its lease"
            ),
        }
    });
}

/// One acquisition's state, shared by its guard and the guards of its re-entries.
struct Holding {
    core: Arc<Core>,
    name: Arc<str>,
    owner: Arc<str>,
    channel: Arc<str>,
    token: u64,
    /// Guards alive and not yet released: read synchronously when a guard is dropped, to
    /// stop renewing the moment the last one goes.
    guards: AtomicU32,
    /// Re-entries and releases of this holding run one at a time, so each decides on the
    /// answer to the one before.
    state: tokio::sync::Mutex<HoldState>,
    lease_entry: Lease,
}

struct HoldState {
    /// The hold count the server has, as far as the last answered command says.
    holds: u32,
    /// The holding is over: released, or found lost by a release or re-entry.
    ended: bool,
    /// The lease a partial release sets again: the one the holding was taken with, or
    /// the one it was fixed to later.
    lease: Duration,
    lease_ms: u64,
}

impl Holding {
    fn not_held(&self) -> Error {
        Error::NotHeld {
            name: self.name.to_string(),
            owner: self.owner.to_string(),
        }
    }

    /// One guard fewer. The last one stops the renewal right away, before its release is
    /// even sent: a guard dropped where nothing will ever send that release (a runtime
    /// nobody drives) must not be renewed forever.
    fn guard_gone(&self) {
        if self.guards.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.lease_entry.closing();
        }
    }

    /// Gives back one hold: a partial release while other holds remain, the final release
    /// when this is the last.
    async fn give_back(self: Arc<Self>) -> Result<()> {
        let mut state = self.state.lock().await;
        if state.ended {
            return Err(self.not_held());
        }
        let left = state.holds.saturating_sub(1);
        let latch = (left == 0).then(|| unlock_latch(&self.name, self.core.next_request_id()));
        let mut connection = self.core.connection();
        let background = self.core.background();
        let mut attempt = 1;
        let (outcome, sent_at) = loop {
            let sent_at = Instant::now();
            let latch_key = latch.as_deref().unwrap_or(&self.name);
            let mut call =
                ScriptCall::new(&LOCK_RELEASE, &[&self.name, &self.channel, latch_key], 7);
            call.arg(&*self.owner)
                .arg(left)
                .arg(state.lease_ms)
                .arg(RELEASE_MESSAGE)
                .arg(if latch.is_some() {
                    self.core.config().unlock_latch_ttl_ms
                } else {
                    0
                })
                .arg(if attempt > 1 && latch.is_some() {
                    "1"
                } else {
                    "0"
                })
                .arg(self.core.deployment().publish_command());
            let reply = match self.core.synced() {
                None => {
                    let sent_on_home = connection.routes_home();
                    background
                        .reply_unless_stalled(sent_on_home, call.invoke::<i64>(&mut connection))
                        .await
                }
                Some(synced) => call.invoke_synced::<i64>(synced).await.map(|(reply, acks)| {
                    if !acks.enough() {
                        // Done on the master. A failover before a replica gets it brings
                        // the lock back until its lease runs out: the next holder waits
                        // longer, but no two hold it.
                        tracing::warn!(lock = %self.name, acknowledged = acks.acknowledged, "no replica acknowledged a release in time");
                    }
                    reply
                }),
            };
            match reply {
                Err(err) if attempt < RELEASE_ATTEMPTS && is_connection_failure(&err) => {
                    tracing::debug!(error = %err, attempt, "release reply lost; asking again");
                    // Give a reconnecting connection a moment; repeats are safe.
                    background.pause(RELEASE_RETRY_PAUSE * attempt).await;
                    attempt += 1;
                }
                other => break (other, sent_at),
            }
        };
        state.holds = left;
        match outcome {
            Ok(-1) => {
                state.ended = true;
                self.lease_entry.mark_lost();
                Err(self.not_held())
            }
            Ok(0) => {
                state.ended = true;
                if let Some(latch) = latch {
                    self.core.latches().discard(self.core.background(), latch);
                }
                Ok(())
            }
            Ok(_) => {
                self.lease_entry.extended(sent_at, state.lease);
                Ok(())
            }
            Err(err) => {
                if left == 0 {
                    // Unknown whether it was freed; it is no longer renewed either way,
                    // so the lease runs out.
                    state.ended = true;
                }
                Err(err.into())
            }
        }
    }

    /// Adds a hold to this holding. Only a live guard calls this, so the holding is held
    /// (or was, until a loss the server will report).
    async fn add_hold(self: Arc<Self>) -> Result<Hold> {
        let mut state = self.state.lock().await;
        if state.ended || !self.lease_entry.is_trusted() {
            return Err(self.not_held());
        }
        let holds = state.holds + 1;
        let mut connection = self.core.connection();
        let background = self.core.background();
        let mut attempt = 1;
        let outcome = loop {
            let sent_on_home = connection.routes_home();
            let reply = background
                .reply_unless_stalled(
                    sent_on_home,
                    ScriptCall::new(&LOCK_REENTER, &[&self.name], 2)
                        .arg(&*self.owner)
                        .arg(holds)
                        .invoke::<i64>(&mut connection),
                )
                .await;
            match reply {
                Err(err) if attempt < RELEASE_ATTEMPTS && is_connection_failure(&err) => {
                    // The count is absolute: sending it again cannot add a second hold.
                    background.pause(RELEASE_RETRY_PAUSE * attempt).await;
                    attempt += 1;
                }
                other => break other,
            }
        };
        match outcome? {
            1 => {
                state.holds = holds;
                self.guards.fetch_add(1, Ordering::AcqRel);
                drop(state);
                Ok(Hold::new(self))
            }
            _ => {
                state.ended = true;
                self.lease_entry.mark_lost();
                Err(self.not_held())
            }
        }
    }

    /// Turns a holding the watchdog renews into one with a fixed lease of `lease`,
    /// counted from now: the watchdog stops renewing it (and nothing it sent earlier is
    /// still in flight), then the lease is set on the server, if this owner still holds
    /// it. A MultiLock does this for members with a fixed lease once it holds them all,
    /// so that no member's lease runs out while a later member is awaited.
    async fn fix_lease(&self, lease: Duration) -> Result<()> {
        let lease_ms = to_millis("lease", lease)?;
        let mut state = self.state.lock().await;
        if state.ended || !self.lease_entry.is_trusted() {
            return Err(self.not_held());
        }
        self.lease_entry.stop_renewing().await;
        let mut connection = self.core.connection();
        let sent_at = Instant::now();
        let sent_on_home = connection.routes_home();
        let renewed = self
            .core
            .background()
            .reply_unless_stalled(
                sent_on_home,
                ScriptCall::new(&LOCK_RENEW, &[&self.name], 2)
                    .arg(lease_ms)
                    .arg(&*self.owner)
                    .invoke::<Vec<i64>>(&mut connection),
            )
            .await?;
        if renewed.first() != Some(&1) {
            state.ended = true;
            self.lease_entry.mark_lost();
            return Err(self.not_held());
        }
        state.lease = lease;
        state.lease_ms = lease_ms;
        self.lease_entry.fixed(sent_at, lease);
        Ok(())
    }
}

/// One hold of a holding. Dropping it gives the hold back in the background, on the
/// client's own runtime.
pub(crate) struct Hold {
    holding: Option<Arc<Holding>>,
}

impl Hold {
    fn new(holding: Arc<Holding>) -> Self {
        Self {
            holding: Some(holding),
        }
    }

    fn holding(&self) -> &Holding {
        self.holding_arc()
    }

    fn holding_arc(&self) -> &Arc<Holding> {
        // Only `take` empties it, and that consumes the hold.
        self.holding
            .as_ref()
            .unwrap_or_else(|| unreachable!("a hold is emptied only when consumed"))
    }

    fn take(mut self) -> Arc<Holding> {
        self.holding
            .take()
            .unwrap_or_else(|| unreachable!("a hold is emptied only when consumed"))
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let Some(holding) = self.holding.take() else {
            return;
        };
        holding.guard_gone();
        let core = Arc::clone(&holding.core);
        core.background().spawn(async move {
            let name = Arc::clone(&holding.name);
            if let Err(err) = holding.give_back().await {
                tracing::warn!(lock = %name, error = %err, "background release of a dropped guard failed");
            }
        });
    }
}

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
    hold: Hold,
    /// Keeps the client (and its runtime) running while the lock is held.
    _client: Client,
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
    /// Fixes the lease of a holding taken in watchdog mode to `lease` from now (see
    /// `Holding::fix_lease`). Fails with [`Error::NotHeld`] if it is no longer held.
    pub(crate) async fn fix_lease(&self, lease: Duration) -> Result<()> {
        self.hold.holding().fix_lease(lease).await
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

    /// How many guards of this holding are alive: 1, plus one per live re-entry.
    pub fn hold_count(&self) -> u32 {
        self.hold.holding().guards.load(Ordering::Acquire)
    }

    /// The lock's name.
    pub fn name(&self) -> &str {
        &self.hold.holding().name
    }

    /// The owner this holding is written under, `"<client id>:<n>"`.
    pub fn owner(&self) -> &str {
        &self.hold.holding().owner
    }

    /// How long the lease is sure to last, by the local clock: zero once it is lost.
    pub fn lease_remaining(&self) -> Duration {
        self.hold
            .holding()
            .lease_entry
            .deadline()
            .map(|deadline| deadline.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::ZERO)
    }

    /// True once the lock can no longer be trusted to be held.
    pub fn is_lost(&self) -> bool {
        !self.hold.holding().lease_entry.is_trusted()
    }

    /// Completes as soon as the lock can no longer be trusted to be held: a renewal found
    /// the key gone or owned by another, or the lease deadline came without a successful
    /// renewal. It completes no later than the deadline the local clock computes. It never
    /// completes after a normal release.
    ///
    /// The future watches the local clock itself, so the promise holds even if the
    /// client's background work cannot run.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
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
    /// neither the guard nor other tokens. It costs no task.
    pub fn lost_token(&self) -> CancellationToken {
        self.hold.holding().lease_entry.lost_token()
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
            _client: self._client.clone(),
        })
    }

    /// Releases this hold: one hold fewer; the last hold frees the lock and wakes one
    /// waiter. Fails with [`Error::NotHeld`] if the lease was lost in the meantime.
    ///
    /// Cancel-safe: once started, the release completes even if this future is dropped.
    /// It works after [`Client::shutdown`] too: giving a lock back is always allowed.
    pub async fn release(self) -> Result<()> {
        // The client handle lives until the release is done.
        let LockGuard { hold, _client } = self;
        let holding = hold.take();
        holding.guard_gone();
        let core = Arc::clone(&holding.core);
        Detached::new(core.background(), holding.give_back()).await
    }
}
