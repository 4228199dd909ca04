//! One acquisition's state on the client (a *holding*), shared by its guard and the guards
//! of its re-entries: its hold count, its lease, and the commands that change them
//! (re-entry, release, extension, verification), sent one at a time.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::hold_ops::{self, HoldOps, ReleaseArgs};
use crate::config::{RELEASE_ATTEMPTS, RELEASE_RETRY_PAUSE};
use crate::duration::to_millis;
use crate::engine::renewal::lease::Lease;
use crate::engine::session::Core;
use crate::engine::subscriptions::WakeRule;
use crate::error::{Error, Result};
use crate::primitives::keys::unlock_latch;

/// A new holding of `name` by `owner` with fencing token `token`, tracked by the renewal
/// scheduler from `sent_at` (when the command that set its lease of `lease` was sent, or
/// a time known to be earlier), renewed when `renew`.
pub(crate) struct Acquired {
    pub(crate) core: Arc<Core>,
    pub(crate) name: Arc<str>,
    pub(crate) owner: Arc<str>,
    pub(crate) release: Arc<dyn HoldOps>,
    pub(crate) token: u64,
    pub(crate) sent_at: Instant,
    pub(crate) lease: Duration,
    pub(crate) lease_ms: u64,
    pub(crate) renew: bool,
}

impl Acquired {
    /// The first hold of the new holding.
    pub(crate) fn into_hold(self) -> Hold {
        let Acquired {
            core,
            name,
            owner,
            release,
            token,
            sent_at,
            lease,
            lease_ms,
            renew,
        } = self;
        tracing::debug!(key = %name, owner = %owner, token, fixed = !renew, ?lease, "held");
        let (kind, renewed_as) = release.renewal(&owner);
        let lease_entry = core
            .watchdog()
            .track(kind, &name, &renewed_as, sent_at, lease, renew);
        Hold::new(Arc::new(Holding {
            core,
            name,
            owner,
            release,
            token,
            guards: AtomicU32::new(1),
            state: tokio::sync::Mutex::new(HoldState {
                holds: 1,
                ended: false,
                lease,
                lease_ms,
                fixed: !renew,
            }),
            lease_entry,
            unlock_watch: OnceLock::new(),
        }))
    }
}

/// One acquisition's state, shared by its guard and the guards of its re-entries.
pub(super) struct Holding {
    pub(super) core: Arc<Core>,
    pub(super) name: Arc<str>,
    pub(super) owner: Arc<str>,
    /// How its calls reach the store: the lease lock's scripts, another primitive's, or
    /// another store's statements.
    pub(super) release: Arc<dyn HoldOps>,
    pub(super) token: u64,
    /// Guards alive and not yet released: read synchronously when a guard is dropped, to
    /// stop renewing the moment the last one goes.
    pub(super) guards: AtomicU32,
    /// Re-entries and releases of this holding run one at a time, so each decides on the
    /// answer to the one before.
    pub(super) state: tokio::sync::Mutex<HoldState>,
    pub(super) lease_entry: Lease,
    /// Stops the listener on the lock's channel (see [`Holding::watch_for_unlock`]), once
    /// one was started: when the last guard goes, or the holding is dropped.
    pub(super) unlock_watch: OnceLock<CancellationToken>,
}

impl Drop for Holding {
    fn drop(&mut self) {
        if let Some(stop) = self.unlock_watch.get() {
            stop.cancel();
        }
    }
}

pub(super) struct HoldState {
    /// The hold count the server has, as far as the last answered command says.
    pub(super) holds: u32,
    /// The holding is over: released, or found lost by a release or re-entry.
    pub(super) ended: bool,
    /// The lease a partial release of a watchdog-mode holding sets again.
    pub(super) lease: Duration,
    pub(super) lease_ms: u64,
    /// The lease is fixed (taken with one, or fixed later): nothing renews it, and
    /// nothing but [`LockGuard::extend`] moves its deadline, so a partial release leaves
    /// it as it is.
    pub(super) fixed: bool,
}

impl Holding {
    pub(super) fn not_held(&self) -> Error {
        Error::NotHeld {
            name: self.name.to_string(),
            owner: self.owner.to_string(),
        }
    }

    /// One guard fewer. The last one stops the renewal right away, before its release is
    /// even sent: a guard dropped where nothing will ever send that release (a runtime
    /// nobody drives) must not be renewed forever.
    pub(super) fn guard_gone(&self) {
        if self.guards.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.lease_entry.closing();
            if let Some(stop) = self.unlock_watch.get() {
                stop.cancel();
            }
        }
    }

    /// Listens on the lock's channel from now until the holding ends (once per holding;
    /// later calls do nothing), so that a force-unlock, or any deletion announced there,
    /// fires the lost signal as soon as its message comes rather than at the next
    /// renewal. Each message costs one question to the server (HEXISTS), and so does the
    /// start (a message sent before the listener joined is not heard).
    ///
    /// The listener shares the client's one subscription per channel with the lock's
    /// waiters, in a queue of its own, so it takes no wake-up from them. It runs on the
    /// client's runtime and holds the holding only weakly.
    pub(super) fn watch_for_unlock(self: &Arc<Self>) {
        let Some(channel) = self.release.unlock_channel() else {
            return;
        };
        if self.unlock_watch.get().is_some() {
            return;
        }
        let stop = CancellationToken::new();
        if self.unlock_watch.set(stop.clone()).is_err() {
            // Another call started it meanwhile.
            return;
        }
        if self.guards.load(Ordering::Acquire) == 0 || !self.lease_entry.is_held_and_open() {
            return;
        }
        let core = Arc::clone(&self.core);
        let holding = Arc::downgrade(self);
        let channel = channel.to_owned();
        // A queue of its own on the channel: the waiters' queue is keyed by the lock's
        // name, and an owner id (a client id and a number) is no lock's name.
        let queue = format!("holder {}", self.owner);
        self.core.background().spawn_service(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = listen_for_unlock(core, holding, channel, queue) => {}
            }
        });
    }

    /// After a message on the lock's channel: asks the server whether this owner still
    /// holds the lock, and marks the holding lost if not. Returns whether to keep
    /// listening.
    async fn still_held_after_message(&self) -> bool {
        // A question that fails (a timeout, a dropped connection) is asked again until it
        // is answered: the message that prompted it comes once, and a deleted lock sends
        // no other, so dropping it would leave the loss to the next renewal.
        let mut pause = Duration::from_millis(20);
        loop {
            if !self.lease_entry.is_held_and_open() {
                return false;
            }
            match self.ask_server().await {
                Ok(true) => return true,
                Ok(false) => {
                    if self.lease_entry.mark_lost_unless_closing() {
                        tracing::warn!(
                            lock = %self.name,
                            owner = %self.owner,
                            "the lock's channel announced a release, and the server says this \
                             holding no longer owns the lock (force-unlocked or deleted); the lock is lost"
                        );
                    }
                    return false;
                }
                Err(err) => {
                    tracing::debug!(lock = %self.name, error = %err, "could not ask whether a lock announced on its channel is still held; asking again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    /// Whether the server says this owner holds the lock (one round trip).
    async fn ask_server(&self) -> Result<bool> {
        self.release
            .verify(&self.core, &self.name, &self.owner)
            .await
    }

    /// Gives back one hold: a partial release while other holds remain, the final release
    /// when this is the last.
    pub(super) async fn give_back(self: Arc<Self>) -> Result<ReleaseOutcome> {
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
        let background = self.core.background();
        let mut attempt = 1;
        let (outcome, sent_at) = loop {
            let sent_at = Instant::now();
            let latch_key = latch.as_deref().unwrap_or(&self.name);
            let args = ReleaseArgs {
                left,
                // A fixed lease keeps its deadline; 0 tells the script to leave it.
                lease_ms: if state.fixed { 0 } else { state.lease_ms },
                latch_ttl_ms: if latch.is_some() {
                    self.core.config().unlock_latch_ttl_ms
                } else {
                    0
                },
                retry: attempt > 1 && latch.is_some(),
                publish: self.core.deployment().publish_command(),
            };
            let reply = hold_ops::release(
                &*self.release,
                &self.core,
                &self.name,
                &self.owner,
                latch_key,
                &args,
            )
            .await;
            match reply {
                Err(err) if attempt < RELEASE_ATTEMPTS && err.is_connection_error() => {
                    tracing::debug!(error = %err, attempt, "release reply lost; asking again");
                    // Give a reconnecting connection a moment; repeats are safe.
                    background.pause(RELEASE_RETRY_PAUSE * attempt).await;
                    attempt += 1;
                }
                other => break (other, sent_at),
            }
        };
        state.holds = left;
        match (&outcome, attempt) {
            (Ok(-1 | 0), 1) => self.release.settled(),
            (Ok(_), 1) => {}
            _ => self.release.unsettled(),
        }
        match outcome {
            Ok(-1) => {
                state.ended = true;
                self.lease_entry.mark_lost();
                Ok(ReleaseOutcome::AlreadyLost)
            }
            Ok(0) => {
                state.ended = true;
                if let Some(latch) = latch {
                    self.release.released(&self.core, latch);
                }
                Ok(ReleaseOutcome::Released)
            }
            Ok(_) => {
                // Trusted longer only where the partial release set the lease again.
                if !state.fixed && self.release.partial_release_renews() {
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
                Err(err)
            }
        }
    }

    /// Adds a hold to this holding. Only a live guard calls this, so the holding is held
    /// (or was, until a loss the server will report).
    pub(super) async fn add_hold(self: Arc<Self>) -> Result<Hold> {
        let mut state = self.state.lock().await;
        if state.ended || !self.lease_entry.is_trusted() {
            return Err(self.not_held());
        }
        let holds = state.holds + 1;
        let background = self.core.background();
        let mut attempt = 1;
        let outcome = loop {
            let reply = self
                .release
                .reenter(&self.core, &self.name, &self.owner, holds, state.lease_ms)
                .await;
            match reply {
                Err(err) if attempt < RELEASE_ATTEMPTS && err.is_connection_error() => {
                    // The count is absolute: sending it again cannot add a second hold.
                    background.pause(RELEASE_RETRY_PAUSE * attempt).await;
                    attempt += 1;
                }
                other => break other,
            }
        };
        if attempt > 1 || outcome.is_err() {
            self.release.unsettled();
        }
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
    pub(super) async fn set_fixed_lease(&self, lease: Duration, from: LeaseMode) -> Result<()> {
        let lease_ms = to_millis("lease", lease)?;
        let mut state = self.state.lock().await;
        if state.ended || !self.lease_entry.is_trusted() {
            return Err(self.not_held());
        }
        // Its renewals, sent and to come, now set a lease of another length.
        self.release.unsettled();
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
        let sent_at = Instant::now();
        // Trusted no longer than the new lease from before it was sent, whatever becomes
        // of the call: a lease that shortens it may reach the server even if the reply is
        // lost or this future is dropped, and the holder must not trust the old deadline
        // while another client can take the lock.
        self.lease_entry.cap(sent_at, lease);
        let renewed = self
            .release
            .extend(&self.core, &self.name, &self.owner, lease_ms)
            .await?;
        if !renewed {
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
    pub(super) async fn verify(&self) -> Result<bool> {
        if !self.lease_entry.is_trusted() {
            return Ok(false);
        }
        let held = self.ask_server().await?;
        if !held {
            tracing::warn!(lock = %self.name, owner = %self.owner, "the server says this holding no longer owns the lock; the lock is lost");
            self.lease_entry.mark_lost();
        }
        Ok(held && self.lease_entry.is_trusted())
    }
}

/// Listens on `channel` for a holding: at the start and at each message, asks whether
/// it is still held; ends when it is not, when the holding is over, or when stopped.
async fn listen_for_unlock(
    core: Arc<Core>,
    holding: Weak<Holding>,
    channel: String,
    queue: String,
) {
    let subscription = core
        .subscriptions()
        .subscribe(&channel, &queue, WakeRule::All, 1)
        .await;
    loop {
        let woken = subscription.notified();
        tokio::pin!(woken);
        // Enabled before asking, so a message that comes while the question is out is
        // not missed.
        woken.as_mut().enable();
        let Some(holding) = holding.upgrade() else {
            return;
        };
        if !holding.still_held_after_message().await {
            return;
        }
        drop(holding);
        woken.await;
    }
}

/// Which holdings [`Holding::set_fixed_lease`] may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LeaseMode {
    /// Only a fixed lease: extending a watchdog-mode holding is a mistake.
    Fixed,
    /// A fixed lease, or a watchdog-mode holding turned into one.
    FixedOrWatchdog,
}

/// One hold of a holding. Dropping it gives the hold back in the background, on the
/// client's own runtime.
pub(crate) struct Hold {
    pub(super) holding: Option<Arc<Holding>>,
}

impl Hold {
    pub(super) fn new(holding: Arc<Holding>) -> Self {
        Self {
            holding: Some(holding),
        }
    }

    /// The fencing token of the holding.
    pub(crate) fn token(&self) -> u64 {
        self.holding().token
    }

    pub(super) fn holding(&self) -> &Holding {
        self.holding_arc()
    }

    pub(super) fn holding_arc(&self) -> &Arc<Holding> {
        // Only `take` empties it, and that consumes the hold.
        self.holding
            .as_ref()
            .unwrap_or_else(|| unreachable!("a hold is emptied only when consumed"))
    }

    pub(super) fn take(mut self) -> Arc<Holding> {
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
