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
use crate::keys::{release_channel, token_key, token_key_of_other, unlock_latch};
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
    client: Client,
    /// The lock's Redis key: its name after the client's key prefix.
    name: Arc<str>,
    /// The name's fencing counter, the counter the other [`FencingCounter`] setting would
    /// use (read by every acquisition, so a mixed fleet never repeats a token) and its
    /// release channel, worked out once per handle rather than on every acquisition.
    token_key: Arc<str>,
    other_token_key: Arc<str>,
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
    /// The lock whose Redis key is `key`: the client's key prefix, then the name.
    pub(crate) fn new(client: Client, key: String) -> Self {
        let config = client.core().config();
        let (counter, prefix) = (config.fencing_counter, &*config.key_prefix);
        let token_key = token_key(counter, prefix, &key).into();
        let other_token_key = token_key_of_other(counter, prefix, &key).into();
        let channel = release_channel(prefix, &key).into();
        Self {
            client,
            name: key.into(),
            token_key,
            other_token_key,
            channel,
            lease: None,
        }
    }

    /// The lock's name, as given to [`Client::lock`]. Its Redis key is the client's key
    /// prefix followed by the name ([`Lock::key`]).
    pub fn name(&self) -> &str {
        let prefix = self.client.core().config().key_prefix.len();
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

    /// Waits up to `timeout`; `Ok(None)` if the lock was held by others until then. If the
    /// last attempt before the timeout failed instead (the server unreachable, or no
    /// replica acknowledging a grant under replica sync), that error is returned, so a
    /// free lock is never reported busy. A zero timeout tries once.
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
        let counter: u64 = self
            .client
            .core()
            .request(|mut connection| {
                let mut advance = ScriptCall::new(&FENCE_ADVANCE, &[&self.token_key], 1);
                advance.arg(floor);
                async move { advance.invoke(&mut connection).await }
            })
            .await?;
        Ok(counter)
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
            other_token_key: Arc::clone(&self.other_token_key),
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
    other_token_key: Arc<str>,
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
        let other_token_key = Arc::clone(&self.other_token_key);
        let channel = Arc::clone(&self.channel);
        let (lease, lease_ms, renew) = (self.lease, self.lease_ms, self.renew);
        // The lease is counted from when the attempt was made, not from when it ran: a
        // RedLock makes its masters' attempts right after it starts its clock, and their
        // deadlines must not run past the validity it computes from that clock.
        let sent_at = Instant::now();
        Box::pin(async move {
            // Checked here too, for composites that try a lock on several servers (a
            // RedLock's masters) without the engine: each server's own policy counts.
            core.ensure_keys_stay()?;
            let owner = core.next_owner();
            let mut connection = core.connection();
            let mut call = ScriptCall::new(&LOCK_ACQUIRE, &[&name, &token_key], 3);
            call.arg(lease_ms).arg(&*owner).arg(&*other_token_key);
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
                    #[cfg(feature = "cluster")]
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
                            fixed: !renew,
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

    fn queue(&self) -> &str {
        &self.name
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
    /// The lease a partial release of a watchdog-mode holding sets again.
    lease: Duration,
    lease_ms: u64,
    /// The lease is fixed (taken with one, or fixed later): nothing renews it, and
    /// nothing but [`LockGuard::extend`] moves its deadline, so a partial release leaves
    /// it as it is.
    fixed: bool,
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
    async fn give_back(self: Arc<Self>) -> Result<ReleaseOutcome> {
        let mut state = self.state.lock().await;
        if state.ended {
            // Only a loss ends a holding that still has a guard to release.
            return Ok(ReleaseOutcome::AlreadyLost);
        }
        let left = state.holds.saturating_sub(1);
        let latch = (left == 0).then(|| {
            let prefix = &self.core.config().key_prefix;
            unlock_latch(prefix, &self.name, self.core.next_request_id())
        });
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
                // A fixed lease keeps its deadline; "0" tells the script to leave it.
                .arg(if state.fixed { 0 } else { state.lease_ms })
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
                Ok(ReleaseOutcome::AlreadyLost)
            }
            Ok(0) => {
                state.ended = true;
                if let Some(latch) = latch {
                    self.core.latches().discard(self.core.background(), latch);
                }
                Ok(ReleaseOutcome::Released)
            }
            Ok(_) => {
                if !state.fixed {
                    self.lease_entry.extended(sent_at, state.lease);
                }
                Ok(ReleaseOutcome::Released)
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

    /// Sets a fixed lease of `lease`, counted from now, if this owner still holds the
    /// lock: the server's expiry, the local deadline and the lost signal move together.
    ///
    /// A holding the watchdog renews is turned into a fixed one when `from` allows it:
    /// the watchdog stops renewing it (and nothing it sent earlier is still in flight)
    /// before the lease is set. A MultiLock does this for members with a fixed lease once
    /// it holds them all, so that no member's lease runs out while a later member is
    /// awaited. [`LockGuard::extend`] allows fixed holdings only.
    async fn set_fixed_lease(&self, lease: Duration, from: LeaseMode) -> Result<()> {
        let lease_ms = to_millis("lease", lease)?;
        let mut state = self.state.lock().await;
        if state.ended || !self.lease_entry.is_trusted() {
            return Err(self.not_held());
        }
        if !state.fixed {
            if from == LeaseMode::Fixed {
                return Err(Error::InvalidConfig {
                    what: "LockGuard::extend",
                    reason: "this holding is in watchdog mode, which the watchdog renews; \
                             extend applies to a fixed lease (Lock::with_lease)"
                        .into(),
                });
            }
            self.lease_entry.stop_renewing().await;
        }
        let mut connection = self.core.connection();
        let sent_at = Instant::now();
        // Trusted no longer than the new lease from before it was sent, whatever becomes
        // of the call: a lease that shortens it may reach the server even if the reply is
        // lost or this future is dropped, and the holder must not trust the old deadline
        // while another client can take the lock.
        self.lease_entry.cap(sent_at, lease);
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
        state.fixed = true;
        self.lease_entry.fixed(sent_at, lease);
        // An extension whose reply came after the old deadline passed: the server has
        // the new lease, but the holder may already have acted on the loss, and a lost
        // signal is final. (A MultiLock member fixed to a lease shorter than a round trip
        // is handed out lost, as a Lock with that lease would be.)
        if from == LeaseMode::Fixed && !self.lease_entry.is_trusted() {
            return Err(self.not_held());
        }
        Ok(())
    }

    /// Asks the server whether this owner still holds the lock; marks the holding lost
    /// (firing its lost signal) if not.
    async fn verify(&self) -> Result<bool> {
        if !self.lease_entry.is_trusted() {
            return Ok(false);
        }
        let exists = redis::cmd("HEXISTS")
            .arg(&*self.name)
            .arg(&*self.owner)
            .clone();
        let held = match self.core.query::<bool>(&exists).await {
            Ok(held) => held,
            // Another kind of key at the lock's name: certainly not this holding's.
            Err(Error::Redis(err)) if err.code() == Some("WRONGTYPE") => false,
            Err(err) => return Err(err),
        };
        if !held {
            tracing::warn!(lock = %self.name, owner = %self.owner, "the server says this holding no longer owns the lock; the lock is lost");
            self.lease_entry.mark_lost();
        }
        Ok(held && self.lease_entry.is_trusted())
    }
}

/// Which holdings [`Holding::set_fixed_lease`] may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeaseMode {
    /// Only a fixed lease: extending a watchdog-mode holding is a mistake.
    Fixed,
    /// A fixed lease, or a watchdog-mode holding turned into one.
    FixedOrWatchdog,
}

/// What [`LockGuard::release`] found on the server. Both are normal outcomes: a program
/// that reacted to [`LockGuard::lost`] already can release and go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The hold was given back; the last hold of a holding freed the lock and woke a
    /// waiter.
    Released,
    /// The lock was no longer this holding's when the release came (its lease ran out, or
    /// it was deleted or force-unlocked), so nothing was changed on the server. The lost
    /// signal has fired. Work done under the lock since the loss was not protected by it;
    /// the fencing token is what protects a store from it.
    AlreadyLost,
}

impl ReleaseOutcome {
    /// True if the lock had been lost before the release.
    pub fn was_lost(self) -> bool {
        self == ReleaseOutcome::AlreadyLost
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
            match holding.give_back().await {
                Ok(ReleaseOutcome::Released) => {}
                Ok(ReleaseOutcome::AlreadyLost) => {
                    tracing::debug!(lock = %name, "a dropped guard's lock was already lost");
                }
                Err(err) => {
                    tracing::warn!(lock = %name, error = %err, "background release of a dropped guard failed");
                }
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
        self.hold
            .holding()
            .set_fixed_lease(lease, LeaseMode::FixedOrWatchdog)
            .await
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
    /// | a watchdog renewal finds the key gone or another owner (deleted, force-unlocked, evicted, a failover that lost it) | at the next renewal: every third of the watchdog timeout (10 s by default) |
    /// | a renewal the server's ACL refuses | at that renewal |
    /// | [`LockGuard::verify`], [`reenter`](LockGuard::reenter), [`extend`](LockGuard::extend) or a release finds it gone | when that call's reply comes |
    /// | the client shuts down | at once |
    ///
    /// A fixed lease is never renewed, so a lock deleted under it is noticed only at its
    /// deadline or by one of the calls above. To notice sooner, call
    /// [`LockGuard::verify`] before a step that must not run without the lock (one round
    /// trip), or shorten the watchdog timeout
    /// ([`ClientBuilder::watchdog_timeout`](crate::ClientBuilder::watchdog_timeout)).
    ///
    /// Awaited in a task, the future watches that runtime's clock itself, so the promise
    /// holds even if the clients' background thread cannot run. Awaited directly in a
    /// `block_on` body (the body of `#[tokio::main]`), it keeps time on the background
    /// thread instead, and comes late if that thread is starved; spawn it, or use
    /// [`LockGuard::lost_token`], to be independent of it.
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
    /// neither the guard nor other tokens.
    ///
    /// It is cancelled by the lease deadline itself, not only by the client's watchdog: the
    /// first call starts one small timer task on the caller's runtime (the client's own
    /// when called outside one), which ends with the holding.
    pub fn lost_token(&self) -> CancellationToken {
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
        let LockGuard { hold, _client } = self;
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
            _client: self._client.clone(),
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
        let LockGuard { hold, _client } = self;
        let holding = hold.take();
        holding.guard_gone();
        let core = Arc::clone(&holding.core);
        Detached::new(core.background(), holding.give_back()).await
    }
}
