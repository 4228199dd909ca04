//! A held lease as its holder sees it: trusted or not, until when, and its lost signal.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::registry::{lock_registry, Entry, Registry, Shared};
use crate::deadline_clock;

/// A holding's entry in the watchdog. Dropping it ends the entry without a lost signal:
/// the holding is over.
pub(crate) struct Lease {
    shared: Arc<Shared>,
    id: u64,
}

impl Lease {
    /// The handle on entry `id`, which the scheduler just registered.
    pub(super) fn new(shared: Arc<Shared>, id: u64) -> Self {
        Self { shared, id }
    }

    fn with_entry<T>(&self, f: impl FnOnce(&mut Entry) -> T) -> Option<T> {
        self.shared.registry().entries.get_mut(&self.id).map(f)
    }

    /// A new token, cancelled as soon as the lease can no longer be trusted (already
    /// cancelled if that has happened). Cancelling it affects nobody else.
    ///
    /// The watchdog cancels it when a renewal finds the lock gone, and a timer of its own
    /// cancels it at the deadline: a worker that only checks the token must not act past
    /// the deadline because the client's thread is starved. A timer runs on each runtime
    /// that asked for a token (the worker's, most likely, which is running if the worker
    /// is; a runtime that is no longer driven cannot hold up another's), on the client's
    /// when asked outside one, and each ends with the holding.
    pub(crate) fn lost_token(&self) -> CancellationToken {
        self.signal(true).unwrap_or_else(|| {
            // The holding is over: a token that never fires.
            CancellationToken::new()
        })
    }

    /// A child of the entry's lost signal, made on first use; with `timed`, the signal's
    /// deadline timer is started on the caller's runtime (the client's outside of one) if
    /// it is not running there yet.
    fn signal(&self, timed: bool) -> Option<CancellationToken> {
        let on = if timed {
            match tokio::runtime::Handle::try_current() {
                Ok(current) => Some(current),
                Err(_) => self.shared.registry().runtime.clone(),
            }
        } else {
            None
        };
        signal_of(&self.shared.registry, self.id, on.as_ref())
    }

    /// True while the holding is not known lost and its deadline (less the safety
    /// margin) has not come. Checks the clock itself, so it holds even when the watchdog
    /// task cannot run.
    pub(crate) fn is_trusted(&self) -> bool {
        let now = Instant::now();
        self.with_entry(|entry| entry.is_trusted(now))
            .unwrap_or(false)
    }

    /// Until when the lease is trusted by the local clock (its deadline less the safety
    /// margin, when the lost signal fires), while the holding is trusted.
    pub(crate) fn trusted_until(&self) -> Option<Instant> {
        let now = Instant::now();
        self.with_entry(|entry| entry.is_trusted(now).then(|| entry.fire_at()))
            .flatten()
    }

    /// Completes with `true` when the lease is lost (the watchdog said so, or the local
    /// deadline came), or with `false` when the holding ended without being lost. It
    /// watches the deadline clock itself (a thread that does nothing else), so neither a
    /// watchdog that cannot run nor the awaiting runtime's timer (missing, paused or
    /// busy) delays it, and it spawns nothing.
    pub(crate) fn watch(&self) -> impl Future<Output = bool> + Send + 'static {
        let registry = Arc::clone(&self.shared.registry);
        let id = self.id;
        let signal = self.signal(false).unwrap_or_default();
        async move {
            loop {
                if signal.is_cancelled() {
                    return true;
                }
                let fire = {
                    let mut registry = lock_registry(&registry);
                    if registry.runtime.is_none() {
                        // The client is gone (its shutdown marked every holding lost).
                        return registry.entries.get(&id).is_some_and(|entry| entry.lost);
                    }
                    let Some(entry) = registry.entries.get_mut(&id) else {
                        // The holding is over.
                        return false;
                    };
                    if entry.lost {
                        return true;
                    }
                    let fire = entry.fire_at().into_std();
                    // The standard clock: a paused test clock must not fire the signal.
                    if fire <= std::time::Instant::now() {
                        // Marked here, not only by the watchdog a moment later, so that
                        // is_lost() and every token agree with this future at once.
                        tracing::warn!(lock = %entry.key, owner = %entry.owner, "{}", entry.expiry());
                        entry.mark_lost();
                        return true;
                    }
                    fire
                };
                // A renewal moves the deadline; look again when the old one comes. The
                // holding ending drops the parent signal, which does not cancel this
                // child: the look at the deadline then finds the entry gone.
                // Timed by the deadline clock, which no runtime can hold up: not this
                // one's timer (it may have none, or a paused one), not the clients'
                // thread (it may be starved).
                tokio::select! {
                    _ = signal.cancelled() => return true,
                    _ = deadline_clock::sleep_until(fire) => {}
                }
            }
        }
    }

    /// Stops renewing, at once: the holding's last guard is gone (released or dropped),
    /// and its release is under way. Renewal replies still in flight are ignored from now
    /// on.
    pub(crate) fn closing(&self) {
        self.with_entry(|entry| {
            entry.renew = false;
            entry.closing = true;
        });
    }

    /// A command sent at `sent_at` set the lease to `lease` again (a partial release).
    pub(crate) fn extended(&self, sent_at: Instant, lease: Duration) {
        let now = Instant::now();
        self.with_entry(|entry| entry.apply(sent_at, lease, now));
    }

    /// Stops the watchdog renewing this lease, and waits until no renewal sent before is
    /// still in flight: after this, nothing of the watchdog's can reach the server and
    /// set the lease again. Used before a holding's lease is fixed to a length of its own.
    pub(crate) async fn stop_renewing(&self) {
        self.with_entry(|entry| entry.renew = false);
        loop {
            let batch_ended = self.shared.batch_ended.notified();
            tokio::pin!(batch_ended);
            batch_ended.as_mut().enable();
            if !self.with_entry(|entry| entry.renewing).unwrap_or(false) {
                return;
            }
            batch_ended.await;
        }
    }

    /// A command about to be sent at `sent_at` may set the lease to `lease`: until its
    /// reply says otherwise, the lease is trusted no longer than that, if that is sooner
    /// than the deadline now. The scheduler is told, so the lost signal comes on time.
    pub(crate) fn cap(&self, sent_at: Instant, lease: Duration) {
        let capped = sent_at.checked_add(lease);
        let lowered = self
            .with_entry(|entry| match capped {
                Some(capped) if capped < entry.deadline => {
                    entry.deadline = capped;
                    // The margin is sized by the lease that sets the deadline.
                    entry.lease = lease;
                    true
                }
                _ => false,
            })
            .unwrap_or(false);
        if lowered {
            self.shared.changed.notify_one();
        }
    }

    /// A command sent at `sent_at` fixed the lease to `lease`, which may be shorter than
    /// the deadline before: the scheduler is told, so the lost signal comes on time.
    pub(crate) fn fixed(&self, sent_at: Instant, lease: Duration) {
        self.extended(sent_at, lease);
        self.shared.changed.notify_one();
    }

    /// The server said the owner no longer holds the lock.
    pub(crate) fn mark_lost(&self) {
        self.with_entry(Entry::mark_lost);
    }

    /// True while the holding is neither known lost nor being given back: a message on
    /// its lock's channel is then worth asking the server about.
    pub(crate) fn is_held_and_open(&self) -> bool {
        self.with_entry(|entry| !entry.lost && !entry.closing)
            .unwrap_or(false)
    }

    /// The server said the owner no longer holds the lock, in answer to a question that
    /// may have crossed the holder's own release: once that release has started, the key
    /// being gone is no loss, and nothing is marked. Returns whether it marked the loss.
    pub(crate) fn mark_lost_unless_closing(&self) -> bool {
        self.with_entry(|entry| {
            if entry.closing || entry.lost {
                return false;
            }
            entry.mark_lost();
            true
        })
        .unwrap_or(false)
    }
}

/// A child of entry `id`'s lost signal, made on first use (`None` once the holding is
/// over). With `timer_on`, the signal's deadline timer is started on that runtime if it
/// is not running there yet.
fn signal_of(
    registry: &Arc<Mutex<Registry>>,
    id: u64,
    timer_on: Option<&tokio::runtime::Handle>,
) -> Option<CancellationToken> {
    let (child, start_timer) = {
        let mut locked = lock_registry(registry);
        let entry = locked.entries.get_mut(&id)?;
        let signal = entry.signal.get_or_insert_with(|| {
            let signal = CancellationToken::new();
            if entry.lost {
                signal.cancel();
            }
            signal
        });
        let child = signal.child_token();
        let start_timer = match timer_on {
            Some(runtime) if !entry.lost && !entry.timer_runtimes.contains(&runtime.id()) => {
                entry.timer_runtimes.push(runtime.id());
                let stop = entry
                    .signal_timer
                    .get_or_insert_with(CancellationToken::new)
                    .clone();
                Some((runtime.clone(), stop))
            }
            _ => None,
        };
        (child, start_timer)
    };
    if let Some((runtime, stop)) = start_timer {
        start_signal_timer(registry, id, &runtime, stop);
    }
    Some(child)
}

/// Cancels entry `id`'s lost signal when the deadline (less the margin) comes, unless the
/// holding ends or a renewal moves the deadline first: a task on `on`.
fn start_signal_timer(
    registry: &Arc<Mutex<Registry>>,
    id: u64,
    on: &tokio::runtime::Handle,
    stop: CancellationToken,
) {
    let registry = Arc::clone(registry);
    // Should this task be dropped unfinished (its runtime ended, even before it first
    // ran), the next call to `lost_token` starts another.
    let gone = TimerGone {
        registry: Arc::clone(&registry),
        id,
        runtime: on.id(),
    };
    let timer = async move {
        let _gone = gone;
        loop {
            let fire = {
                let mut registry = lock_registry(&registry);
                if registry.runtime.is_none() {
                    // The client is gone; its shutdown marked every holding lost.
                    return;
                }
                let Some(entry) = registry.entries.get_mut(&id) else {
                    return;
                };
                if entry.lost {
                    return;
                }
                let fire = entry.fire_at().into_std();
                // The standard clock: a paused test clock must not fire the signal.
                if fire <= std::time::Instant::now() {
                    tracing::warn!(lock = %entry.key, owner = %entry.owner, "{}", entry.expiry());
                    entry.mark_lost();
                    return;
                }
                fire
            };
            // The deadline clock needs no timer on `on` (it may have none, or a paused
            // one) and no free clients' thread.
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = deadline_clock::sleep_until(fire) => {}
            }
        }
    };
    on.spawn(timer);
}

/// Clears an entry's record of a lost signal's timer on `runtime` when the timer task ends
/// or is dropped (its runtime ended), so a later `lost_token` there starts another.
struct TimerGone {
    registry: Arc<Mutex<Registry>>,
    id: u64,
    runtime: tokio::runtime::Id,
}

impl Drop for TimerGone {
    fn drop(&mut self) {
        if let Some(entry) = lock_registry(&self.registry).entries.get_mut(&self.id) {
            entry
                .timer_runtimes
                .retain(|runtime| *runtime != self.runtime);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let entry = self.shared.registry().entries.remove(&self.id);
        if let Some(timer) = entry.and_then(|entry| entry.signal_timer) {
            timer.cancel();
        }
    }
}
