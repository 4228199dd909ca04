//! The renewal scheduler: one task per client, on the client's own runtime, keeps every
//! held lease alive and says when one is lost.
//!
//! Each holding is an entry with a *deadline*: the moment its lease may have run out on the
//! server, measured on the local monotonic clock from before the command that last set the
//! lease was sent (the server started its countdown no earlier than that). The task does
//! two jobs:
//!
//! - every third of the watchdog timeout it renews all watchdog-mode entries, one script
//!   call per batch, and moves the deadline of each renewed entry forward;
//! - it fires an entry's *lost* signal when a renewal finds another owner or no key, or
//!   when the deadline (less a margin for clock-rate drift and timer lateness) comes
//!   without a successful renewal. The deadline timer does not wait for a renewal in
//!   flight, so a hanging server cannot delay the signal.
//!
//! An entry lives exactly as long as its holding: a loss marks it, it never removes it,
//! so the holding's release is still sent and the server has the last word. Once a
//! holding's release starts (or its last guard is dropped), the entry stops renewing at
//! once, and renewal replies still in flight are ignored: a renewal that finds the key
//! gone because it was just released is not a loss.
//!
//! A failed renewal is logged and retried on the next tick; nothing stops the loop but the
//! client shutting down. Two things end trust early: a renewal the server's ACL refuses
//! (every later one would be refused too), and the client shutting down (nothing renews a
//! lease after that), which marks every holding lost at once.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::client::Config;
use crate::connection::Connection;
use crate::deployment::Deployment;
use crate::error::is_permission_denied;
use crate::replica_sync::SyncSlot;
use crate::runtime::{sleep_until_on, Background};
use crate::scripts::{ScriptCall, LOCK_RENEW};

struct Entry {
    key: Arc<str>,
    owner: Arc<str>,
    /// The lease the last command set; it sizes the safety margin.
    lease: Duration,
    deadline: Instant,
    /// When the command that set `deadline` was sent: a reply to an older command must
    /// not move the deadline, because the server applied the newer one last.
    set_at: Instant,
    /// Renewed by the watchdog: watchdog mode, not lost, release not started.
    renew: bool,
    /// A renewal of this lease is in flight: the next ticks leave it out until it ends,
    /// and renew the others.
    renewing: bool,
    /// The holding's last guard is gone: its release is under way.
    closing: bool,
    /// Set when the holding is known lost; it is never cleared.
    lost: bool,
    /// The lost signal, created only when asked for: most holdings never are, and a
    /// process may hold many thousands of locks.
    signal: Option<CancellationToken>,
    /// Ends the signal's own deadline timers (see [`Lease::lost_token`]) when the holding
    /// ends.
    signal_timer: Option<CancellationToken>,
    /// The runtimes a deadline timer of the signal runs on: one per runtime that asked for
    /// a token, since a runtime may stop being driven (or end) while another still is.
    timer_runtimes: Vec<tokio::runtime::Id>,
}

impl Entry {
    /// What the lease running out means, for the log: a watchdog lease was not renewed in
    /// time, while a fixed lease simply ran its length (no renewal was ever due).
    fn expiry(&self) -> &'static str {
        if self.renew {
            "lease deadline passed without a successful renewal; the lock is lost"
        } else if self.closing {
            "lease deadline passed while the release was under way; the lock is no longer held"
        } else {
            "the fixed lease ran out while its guard was still held; the lock is lost"
        }
    }

    fn fire_at(&self) -> Instant {
        let margin = safety_margin(self.lease);
        self.deadline.checked_sub(margin).unwrap_or(self.deadline)
    }

    fn is_trusted(&self, now: Instant) -> bool {
        !self.lost && self.fire_at() > now
    }

    /// A command sent at `sent_at` set the lease to `lease` on the server. Ignored for an
    /// older command than the last one applied (the server applied the newer one last).
    /// A lease that stopped being trusted stays lost even if the reply is good news: its
    /// holder may already have acted on the loss, and a lost signal is final.
    fn apply(&mut self, sent_at: Instant, lease: Duration, now: Instant) {
        if self.lost || sent_at <= self.set_at {
            return;
        }
        if self.fire_at() <= now {
            self.mark_lost();
            return;
        }
        self.lease = lease;
        self.deadline = sent_at + lease;
        self.set_at = sent_at;
    }

    fn mark_lost(&mut self) {
        self.lost = true;
        self.renew = false;
        if let Some(signal) = &self.signal {
            signal.cancel();
        }
    }
}

#[derive(Default)]
struct Registry {
    entries: HashMap<u64, Entry>,
    next_id: u64,
    /// When the scheduler will next wake by itself (`None`: only when told). A new lease
    /// wakes it early only if it needs attention before then, so that acquisitions do not
    /// pay for a scheduler pass each.
    wake_at: Option<Instant>,
    /// Whether the scheduler's next wake-up includes a renewal round.
    renewal_scheduled: bool,
    /// The client's runtime, whose clock `Lease::watch` may sleep on. Cleared when the
    /// client is gone: a runtime handle keeps the runtime's driver (and its file
    /// descriptors) alive, and a kept `lost()` future must not.
    runtime: Option<tokio::runtime::Handle>,
}

struct Shared {
    /// Shared on its own with the futures of `Lease::watch`, which may outlive everything
    /// else of the client and must not keep its connections open.
    registry: Arc<Mutex<Registry>>,
    /// The client is shutting down: nothing is renewed any more, so nothing is trusted.
    closed: AtomicBool,
    /// A refused renewal (ACL) is logged as an error once per client, not every round.
    warned_refused: AtomicBool,
    changed: Notify,
    /// Notified whenever a renewal batch ends (its leases' `renewing` goes false).
    batch_ended: Notify,
    connection: Connection,
    lease: Duration,
    lease_ms: u64,
    batch_size: usize,
    /// On a cluster, one renewal script carries the locks of one slot only.
    deployment: Deployment,
    /// With replica sync on, renewals wait for replicas too: a renewal no replica has
    /// would be lost by a failover.
    synced: SyncSlot,
}

impl Shared {
    fn registry(&self) -> MutexGuard<'_, Registry> {
        lock_registry(&self.registry)
    }
}

/// Critical sections only insert, remove or update single entries, so a poisoned lock
/// still guards a consistent map.
fn lock_registry(registry: &Mutex<Registry>) -> MutexGuard<'_, Registry> {
    registry
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A holding's entry in the watchdog. Dropping it ends the entry without a lost signal:
/// the holding is over.
pub(crate) struct Lease {
    shared: Arc<Shared>,
    id: u64,
}

impl Lease {
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
    /// deadline timer is started if it is not running yet.
    fn signal(&self, timed: bool) -> Option<CancellationToken> {
        // The timer runs on the caller's runtime, or the client's outside of one.
        let runtime = match tokio::runtime::Handle::try_current() {
            Ok(current) => Some(current),
            Err(_) => self.shared.registry().runtime.clone(),
        };
        let (child, start_timer) = self.with_entry(|entry| {
            let signal = entry.signal.get_or_insert_with(|| {
                let signal = CancellationToken::new();
                if entry.lost {
                    signal.cancel();
                }
                signal
            });
            let child = signal.child_token();
            let start_timer = match &runtime {
                Some(runtime)
                    if timed && !entry.lost && !entry.timer_runtimes.contains(&runtime.id()) =>
                {
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
        })?;
        if let Some((runtime, stop)) = start_timer {
            self.start_signal_timer(&runtime, stop);
        }
        Some(child)
    }

    /// Cancels the lost signal when the deadline (less the margin) comes, unless the
    /// holding ends or a renewal moves the deadline first.
    fn start_signal_timer(&self, on: &tokio::runtime::Handle, stop: CancellationToken) {
        let registry = Arc::clone(&self.shared.registry);
        let id = self.id;
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
                let (fire, runtime) = {
                    let mut registry = lock_registry(&registry);
                    let runtime = registry.runtime.clone();
                    let Some(entry) = registry.entries.get_mut(&id) else {
                        return;
                    };
                    if entry.lost {
                        return;
                    }
                    let fire = entry.fire_at();
                    if fire <= Instant::now() {
                        tracing::warn!(lock = %entry.key, owner = %entry.owner, "{}", entry.expiry());
                        entry.mark_lost();
                        return;
                    }
                    match runtime {
                        Some(runtime) => (fire, runtime),
                        // The client is gone; its shutdown marked every holding lost.
                        None => return,
                    }
                };
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = sleep_until_on(&runtime, fire) => {}
                }
            }
        };
        on.spawn(timer);
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
    /// watches the clock itself, so a watchdog that cannot run delays nothing, and it
    /// spawns nothing.
    pub(crate) fn watch(&self) -> impl Future<Output = bool> + Send + 'static {
        let registry = Arc::clone(&self.shared.registry);
        let id = self.id;
        // The future watches the clock itself: no timer task for it.
        let signal = self.signal(false).unwrap_or_default();
        async move {
            loop {
                if signal.is_cancelled() {
                    return true;
                }
                let (fire, runtime) = {
                    let registry = lock_registry(&registry);
                    match (registry.entries.get(&id), &registry.runtime) {
                        (Some(entry), _) if entry.lost => return true,
                        (Some(entry), Some(runtime)) => (entry.fire_at(), runtime.clone()),
                        // The holding is over (or the client with it).
                        _ => return false,
                    }
                };
                if fire <= Instant::now() {
                    return true;
                }
                // A renewal moves the deadline; look again when the old one comes. The
                // holding ending drops the parent signal, which does not cancel this
                // child: the look at the deadline then finds the entry gone.
                // Timed on a clock that is driven wherever this is polled (another
                // executor, a `block_on` of a busy runtime): see `sleep_until_on`.
                tokio::select! {
                    _ = signal.cancelled() => return true,
                    _ = sleep_until_on(&runtime, fire) => {}
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

/// The client's renewal scheduler.
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
}

/// How long before the computed deadline the lost signal fires: the server's clock may run
/// a little faster than ours (1 % of the lease, Redlock's drift allowance), and this task
/// may wake a little late on a busy machine (5 ms; tokio's timer alone rounds to 1 ms).
/// Firing early is safe; firing late is not.
pub(crate) fn safety_margin(lease: Duration) -> Duration {
    lease / 100 + Duration::from_millis(5)
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // The client is gone: `lost()` futures kept by the user must not keep its runtime.
        self.shared.registry().runtime = None;
    }
}

impl Watchdog {
    pub(crate) fn start(
        connection: Connection,
        config: &Config,
        background: &Background,
        deployment: Deployment,
        synced: SyncSlot,
    ) -> Self {
        let shared = Arc::new(Shared {
            registry: Arc::new(Mutex::new(Registry {
                runtime: Some(background.handle().clone()),
                ..Registry::default()
            })),
            closed: AtomicBool::new(false),
            warned_refused: AtomicBool::new(false),
            changed: Notify::new(),
            batch_ended: Notify::new(),
            connection,
            lease: config.watchdog_timeout,
            lease_ms: config.watchdog_timeout_ms,
            batch_size: config.renew_batch_size,
            deployment,
            synced,
        });
        background.spawn_service(run(Arc::clone(&shared)));
        Self { shared }
    }

    /// Starts tracking a new holding of `key` by `owner`. `sent_at` is when the command
    /// that set the lease was sent; `lease` is what it set; `renew` asks the watchdog to
    /// keep extending it.
    pub(crate) fn track(
        &self,
        key: &Arc<str>,
        owner: &Arc<str>,
        sent_at: Instant,
        lease: Duration,
        renew: bool,
    ) -> Lease {
        let mut entry = Entry {
            key: Arc::clone(key),
            owner: Arc::clone(owner),
            lease,
            deadline: sent_at + lease,
            set_at: sent_at,
            renew,
            renewing: false,
            closing: false,
            lost: false,
            signal: None,
            signal_timer: None,
            timer_runtimes: Vec::new(),
        };
        let fire = entry.fire_at();
        let mut registry = self.shared.registry();
        // Read under the registry lock `close` marks entries under: a lease tracked during
        // a shutdown is either marked by it or sees the flag.
        if self.shared.closed.load(Ordering::Acquire) {
            entry.mark_lost();
        }
        registry.next_id += 1;
        let id = registry.next_id;
        registry.entries.insert(id, entry);
        let needs_renewal_round = renew && !registry.renewal_scheduled;
        let needs_earlier_wake = registry.wake_at.is_none_or(|wake_at| fire < wake_at);
        drop(registry);
        if needs_renewal_round || needs_earlier_wake {
            self.shared.changed.notify_one();
        }
        Lease {
            shared: Arc::clone(&self.shared),
            id,
        }
    }

    /// The client is shutting down and nothing will renew a lease again: every holding is
    /// lost from now on, and so is any tracked later (an acquisition that was in flight).
    pub(crate) fn close(&self) {
        let mut registry = self.shared.registry();
        self.shared.closed.store(true, Ordering::Release);
        // A holding whose release is under way is not lost: its release decides.
        for entry in registry.entries.values_mut().filter(|entry| !entry.closing) {
            entry.mark_lost();
        }
    }

    /// Holdings tracked right now that have a guard and are renewed or trusted.
    pub(crate) fn tracked(&self) -> usize {
        let now = Instant::now();
        self.shared
            .registry()
            .entries
            .values()
            .filter(|entry| !entry.closing && (entry.renew || entry.is_trusted(now)))
            .count()
    }
}

async fn run(shared: Arc<Shared>) {
    let interval = shared.lease / 3;
    let mut next_renewal = Instant::now() + interval;
    loop {
        let (renewing, earliest_deadline) = {
            let mut registry = shared.registry();
            let renewing = registry.entries.values().any(|entry| entry.renew);
            let earliest = registry
                .entries
                .values()
                .filter(|entry| !entry.lost)
                .map(Entry::fire_at)
                .min();
            if !renewing {
                // Nothing to renew: the first renewal of a new lease comes a full
                // interval after it was taken.
                next_renewal = Instant::now() + interval;
            }
            // Published under the same lock `track` reads it with, so a lease tracked
            // after this pass either was seen by it or sees these values.
            registry.renewal_scheduled = renewing;
            registry.wake_at = match (renewing, earliest) {
                (true, Some(earliest)) => Some(earliest.min(next_renewal)),
                (true, None) => Some(next_renewal),
                (false, earliest) => earliest,
            };
            (renewing, earliest)
        };
        let changed = shared.changed.notified();
        tokio::select! {
            _ = changed => {}
            _ = tokio::time::sleep_until(next_renewal), if renewing => {
                next_renewal += interval;
                let now = Instant::now();
                if next_renewal < now {
                    next_renewal = now + interval;
                }
                renew_all(&shared);
            }
            _ = sleep_until_some(earliest_deadline) => {
                expire_overdue(&shared);
            }
        }
    }
}

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

fn expire_overdue(shared: &Shared) {
    let now = Instant::now();
    let mut registry = shared.registry();
    for entry in registry.entries.values_mut() {
        if entry.lost || entry.fire_at() > now {
            continue;
        }
        tracing::warn!(
            lock = %entry.key,
            owner = %entry.owner,
            "{}",
            entry.expiry()
        );
        entry.mark_lost();
    }
}

/// One lease to renew: the entry's id, its key and its owner.
type Due = (u64, Arc<str>, Arc<str>);

/// Sends one renewal script for `batch`: one result per lock, 1 if still held.
async fn renew(shared: &Shared, batch: &[Due]) -> redis::RedisResult<Vec<i64>> {
    let keys: Vec<&str> = batch.iter().map(|(_, key, _)| &**key).collect();
    let mut invocation = ScriptCall::new(&LOCK_RENEW, &keys, 1 + batch.len());
    invocation.arg(shared.lease_ms);
    for (_, _, owner) in batch {
        invocation.arg(&**owner);
    }
    let renewed: Vec<i64> = match shared.synced.get() {
        None => {
            let mut connection = shared.connection.clone();
            invocation.invoke(&mut connection).await?
        }
        Some(synced) => {
            let (renewed, acks) = invocation.invoke_synced(synced).await?;
            if !acks.enough() {
                // Not extended as far as a failover is concerned: keep the old deadline.
                return Err(redis::RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "{} of {} replica(s) acknowledged the renewal",
                        acks.acknowledged, acks.required
                    ),
                )));
            }
            renewed
        }
    };
    if renewed.len() != batch.len() {
        return Err(redis::RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "renewal script answered with the wrong number of results",
        )));
    }
    Ok(renewed)
}

/// Starts a renewal of every lease due, in batches, each batch a task of its own. A lease
/// whose previous renewal is still in flight (a hung server, a shard whose replica does
/// not answer) is left out of this round, and only it: the other leases, on healthy
/// servers and shards, are renewed on time whatever one server does.
fn renew_all(shared: &Arc<Shared>) {
    let (batches, skipped) = {
        let mut registry = shared.registry();
        let mut skipped = 0;
        let mut due = Vec::new();
        for (id, entry) in registry.entries.iter_mut().filter(|(_, entry)| entry.renew) {
            if entry.renewing {
                skipped += 1;
                continue;
            }
            entry.renewing = true;
            due.push((*id, Arc::clone(&entry.key), Arc::clone(&entry.owner)));
        }
        let batches = shared
            .deployment
            .batches(due, shared.batch_size, |(_, key, _)| key);
        (batches, skipped)
    };
    if skipped > 0 {
        tracing::warn!(
            locks = skipped,
            "their previous renewal is still in flight; leaving them out of this round"
        );
    }
    for batch in batches {
        let shared = Arc::clone(shared);
        tokio::spawn(async move {
            let ids: Vec<u64> = batch.iter().map(|(id, _, _)| *id).collect();
            renew_batch(&shared, batch).await;
            let mut registry = shared.registry();
            for id in ids {
                if let Some(entry) = registry.entries.get_mut(&id) {
                    entry.renewing = false;
                }
            }
            drop(registry);
            shared.batch_ended.notify_waiters();
        });
    }
}

async fn renew_batch(shared: &Shared, batch: Vec<Due>) {
    let sent_at = Instant::now();
    let renewed = match renew(shared, &batch).await {
        Ok(renewed) => renewed,
        Err(err) if is_permission_denied(&err) && batch.len() > 1 => {
            // The server refuses a script when it may not touch one of its keys, so one
            // lock whose key the user lost refuses the whole batch. Find which, one by one.
            for due in batch {
                Box::pin(renew_batch(shared, vec![due])).await;
            }
            return;
        }
        Err(err) if is_permission_denied(&err) => {
            // The ACL will refuse every later round too: waiting for the deadline would
            // only hide the cause. This lease can no longer be kept.
            if !shared.warned_refused.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    error = %err,
                    "the Redis user may not renew a lease (ACL); the lock is reported lost \
                     now; grant the rights listed in distlock's docs/safety.md"
                );
            }
            let mut registry = shared.registry();
            for (id, _, _) in &batch {
                if let Some(entry) = registry.entries.get_mut(id).filter(|entry| entry.renew) {
                    entry.mark_lost();
                }
            }
            return;
        }
        Err(err) => {
            tracing::warn!(
                error = %err,
                locks = batch.len(),
                "lease renewal failed; retrying next tick, lost signals fire at the deadline"
            );
            return;
        }
    };
    let now = Instant::now();
    let mut registry = shared.registry();
    for ((id, key, owner), still_held) in batch.into_iter().zip(renewed) {
        let Some(entry) = registry.entries.get_mut(&id) else {
            continue;
        };
        if !entry.renew {
            // The release started (a renewal that finds the key gone is no loss), or the
            // holding is already known lost.
            continue;
        }
        if still_held == 1 {
            entry.apply(sent_at, shared.lease, now);
        } else {
            tracing::warn!(
                lock = %key,
                owner = %owner,
                "renewal found the lock gone or held by another owner; the lock is lost"
            );
            entry.mark_lost();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review: a fixed lease that simply ran out was logged as "passed without a
    /// successful renewal", though no renewal was ever due.
    #[test]
    fn the_log_says_which_kind_of_lease_ran_out() {
        let now = Instant::now();
        let entry = |renew: bool, closing: bool| Entry {
            key: "k".into(),
            owner: "o".into(),
            lease: Duration::from_secs(1),
            deadline: now,
            set_at: now,
            renew,
            renewing: false,
            closing,
            lost: false,
            signal: None,
            signal_timer: None,
            timer_runtimes: Vec::new(),
        };
        assert!(entry(true, false)
            .expiry()
            .contains("without a successful renewal"));
        assert!(entry(false, false).expiry().contains("fixed lease ran out"));
        assert!(!entry(false, false).expiry().contains("renewal"));
        assert!(entry(false, true)
            .expiry()
            .contains("release was under way"));
    }
}
