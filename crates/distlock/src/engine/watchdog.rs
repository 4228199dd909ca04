//! The renewal scheduler: one task per client keeps every held lease alive and says when
//! one is lost.
//!
//! Each held lock is an entry with a *deadline*: the moment its lease may have run out on
//! the server, measured on the local monotonic clock from before the command that last set
//! the lease was sent (the server started its countdown no earlier than that). The task
//! does two jobs:
//!
//! - every third of the watchdog timeout it renews all watchdog-mode entries, one script
//!   call per batch, and moves the deadline of each renewed entry forward;
//! - it cancels an entry's *lost* token when a renewal finds another owner or no key, or
//!   when the deadline (less a margin for clock-rate drift and timer lateness) comes
//!   without a successful renewal. The deadline timer does not wait for a renewal in
//!   flight, so a hanging server cannot delay the signal.
//!
//! A failed renewal is logged and retried on the next tick; nothing stops the loop but the
//! client going away.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::future::join_all;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::client::Config;
use crate::connection::Connection;
use crate::scripts::LOCK_RENEW;

/// One held lease, as the watchdog knows it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct LeaseKey {
    key: Arc<str>,
    owner: Arc<str>,
}

struct Entry {
    /// Distinguishes this holding from an earlier one of the same key and owner.
    id: u64,
    /// Guards alive for this key and owner (reentrant acquisitions).
    guards: usize,
    /// How many of them asked for renewal; zero means a fixed lease.
    renewing: usize,
    /// The lease the last command set; it sizes the safety margin.
    lease: Duration,
    deadline: Instant,
    /// When the command that set `deadline` was sent: a reply to an older command must
    /// not move the deadline, because the server applied the newer one last.
    set_at: Instant,
    /// Created only when a guard asks for the lost signal: most guards never do, and a
    /// process may hold many thousands of locks.
    lost: Option<CancellationToken>,
}

impl Entry {
    /// Fires the lost signal of every guard of this holding. The caller removes the entry.
    fn signal_lost(&self) {
        if let Some(lost) = &self.lost {
            lost.cancel();
        }
    }
}

#[derive(Default)]
struct Registry {
    entries: HashMap<LeaseKey, Entry>,
    next_id: u64,
    /// When the scheduler will next wake by itself (`None`: only when told). A new lease
    /// wakes it early only if it needs attention before then, so that acquisitions do not
    /// pay for a scheduler pass each.
    wake_at: Option<Instant>,
    /// Whether the scheduler's next wake-up includes a renewal round.
    renewal_scheduled: bool,
}

struct Shared {
    registry: Mutex<Registry>,
    /// Set while a renewal round is in flight: a hung server must not collect a new
    /// round every tick.
    renewing_now: std::sync::atomic::AtomicBool,
    changed: Notify,
    connection: Connection,
    lease: Duration,
    lease_ms: u64,
    batch_size: usize,
}

/// A guard's stake in a tracked lease. Dropping it (a guard dropped outside a runtime, a
/// release future dropped on a runtime that shuts down) ends the stake, so no lease is
/// renewed for a guard that no longer exists.
pub(crate) struct LeaseTicket {
    shared: Arc<Shared>,
    key: LeaseKey,
    id: u64,
    renewing: bool,
    closed: bool,
}

impl LeaseTicket {
    /// A token cancelled as soon as the lease can no longer be trusted (already cancelled
    /// if that has happened).
    pub(crate) fn lost_token(&self) -> CancellationToken {
        let mut registry = self.shared.registry();
        match registry.entries.get_mut(&self.key) {
            Some(entry) if entry.id == self.id => entry
                .lost
                .get_or_insert_with(CancellationToken::new)
                .clone(),
            _ => {
                let lost = CancellationToken::new();
                lost.cancel();
                lost
            }
        }
    }

    /// True while this ticket's holding is the one the watchdog tracks: not lost, not
    /// replaced by a newer holding of the same owner.
    pub(crate) fn is_current(&self) -> bool {
        self.shared
            .registry()
            .entries
            .get(&self.key)
            .is_some_and(|entry| entry.id == self.id)
    }

    /// True while the holding is current and its deadline (less the safety margin) has
    /// not come. Checks the clock itself, so it holds even when the watchdog task cannot
    /// run (its runtime shut down, or is starved).
    pub(crate) fn is_trusted(&self) -> bool {
        self.shared
            .registry()
            .entries
            .get(&self.key)
            .is_some_and(|entry| entry.id == self.id && fire_at(entry) > Instant::now())
    }

    /// Completes with `true` when the lease is lost (the watchdog said so, or the local
    /// deadline came), or with `false` when the holding ended without being lost (it was
    /// released). It watches the clock itself, not only the watchdog, so a watchdog that
    /// cannot run delays nothing.
    pub(crate) fn watch(&self) -> impl std::future::Future<Output = bool> + Send + 'static {
        let shared = Arc::clone(&self.shared);
        let key = self.key.clone();
        let id = self.id;
        let lost = self.lost_token();
        async move {
            loop {
                if lost.is_cancelled() {
                    return true;
                }
                let fire = {
                    let registry = shared.registry();
                    match registry.entries.get(&key) {
                        Some(entry) if entry.id == id => fire_at(entry),
                        // Gone without the lost signal: released.
                        _ => return false,
                    }
                };
                if fire <= Instant::now() {
                    return true;
                }
                // A renewal moves the deadline; look again when the old one comes.
                tokio::select! {
                    _ = lost.cancelled() => return true,
                    _ = tokio::time::sleep_until(fire) => {}
                }
            }
        }
    }

    /// The local deadline of the lease, if the holding is current.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.shared
            .registry()
            .entries
            .get(&self.key)
            .filter(|entry| entry.id == self.id)
            .map(|entry| entry.deadline)
    }

    /// Ends this guard's stake. `owner_released` is true when Redis said the owner no
    /// longer holds the lock at all; any other guards of that owner have then lost it.
    pub(crate) fn close(mut self, owner_released: bool) {
        self.close_inner(owner_released);
    }

    fn close_inner(&mut self, owner_released: bool) {
        if std::mem::replace(&mut self.closed, true) {
            return;
        }
        let mut registry = self.shared.registry();
        let Some(entry) = registry.entries.get_mut(&self.key) else {
            return;
        };
        if entry.id != self.id {
            return;
        }
        entry.guards = entry.guards.saturating_sub(1);
        if self.renewing {
            entry.renewing = entry.renewing.saturating_sub(1);
        }
        if entry.guards == 0 || owner_released {
            if entry.guards > 0 {
                entry.signal_lost();
            }
            registry.entries.remove(&self.key);
        }
    }
}

impl Drop for LeaseTicket {
    fn drop(&mut self) {
        self.close_inner(false);
    }
}

/// What an acquisition reported, for [`Watchdog::track`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Acquired {
    pub(crate) sent_at: Instant,
    pub(crate) lease: Duration,
    pub(crate) holds: u32,
    pub(crate) renew: bool,
}

/// The client's renewal scheduler.
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
}

impl Shared {
    fn registry(&self) -> MutexGuard<'_, Registry> {
        // Critical sections only insert, remove or update single entries, so a poisoned
        // lock still guards a consistent map.
        self.registry
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// How long before the computed deadline the lost signal fires: the server's clock may run
/// a little faster than ours (1 % of the lease, Redlock's drift allowance), and this task
/// may wake a little late on a busy machine (5 ms; tokio's timer alone rounds to 1 ms).
/// Firing early is safe; firing late is not.
pub(crate) fn safety_margin(lease: Duration) -> Duration {
    lease / 100 + Duration::from_millis(5)
}

impl Watchdog {
    pub(crate) fn start(
        connection: Connection,
        config: &Config,
        shutdown: CancellationToken,
    ) -> Self {
        let shared = Arc::new(Shared {
            registry: Mutex::new(Registry::default()),
            renewing_now: std::sync::atomic::AtomicBool::new(false),
            changed: Notify::new(),
            connection,
            lease: config.watchdog_timeout,
            lease_ms: config.watchdog_timeout_ms,
            batch_size: config.renew_batch_size,
        });
        tokio::spawn(run(Arc::clone(&shared), shutdown));
        Self { shared }
    }

    /// Whether this client tracks a live holding of `key` by `owner` (current, deadline
    /// not reached): the acquire script re-enters only such a holding, and resets any other
    /// hold count of the owner.
    pub(crate) fn holds(&self, key: &Arc<str>, owner: &Arc<str>) -> bool {
        let lease_key = LeaseKey {
            key: Arc::clone(key),
            owner: Arc::clone(owner),
        };
        // A holding past its deadline is lost, even before this task gets to remove it.
        self.shared
            .registry()
            .entries
            .get(&lease_key)
            .is_some_and(|entry| fire_at(entry) > Instant::now())
    }

    /// Starts tracking the lease of `key` held by `owner`, or joins the tracked holding for
    /// a reentrant acquisition. `sent_at` is when the command that set the lease was sent;
    /// `lease` is what it set; `holds` is the owner's hold count it reported (1 means a new
    /// holding: any older local holding of the same owner is over). `renew` asks the
    /// watchdog to keep extending it.
    pub(crate) fn track(
        &self,
        key: &Arc<str>,
        owner: &Arc<str>,
        acquired: Acquired,
    ) -> LeaseTicket {
        let lease_key = LeaseKey {
            key: Arc::clone(key),
            owner: Arc::clone(owner),
        };
        let deadline = acquired.sent_at + acquired.lease;
        let mut registry = self.shared.registry();
        let Registry {
            entries, next_id, ..
        } = &mut *registry;
        if acquired.holds == 1 {
            if let Some(stale) = entries.remove(&lease_key) {
                // Redis counts one hold: the guards of the older holding hold nothing.
                stale.signal_lost();
            }
        }
        let entry = entries.entry(lease_key.clone()).or_insert_with(|| {
            *next_id += 1;
            Entry {
                id: *next_id,
                guards: 0,
                renewing: 0,
                lease: acquired.lease,
                deadline,
                set_at: acquired.sent_at,
                lost: None,
            }
        });
        entry.guards += 1;
        // The command just sent set the lease to exactly `lease`, replacing whatever a
        // reentrant holder's earlier acquisition or renewal had set.
        entry.lease = acquired.lease;
        entry.deadline = deadline;
        entry.set_at = acquired.sent_at;
        if acquired.renew {
            entry.renewing += 1;
        }
        let ticket = LeaseTicket {
            shared: Arc::clone(&self.shared),
            key: lease_key,
            id: entry.id,
            renewing: acquired.renew,
            closed: false,
        };
        let fire = fire_at(entry);
        let needs_renewal_round = acquired.renew && !registry.renewal_scheduled;
        let needs_earlier_wake = registry.wake_at.is_none_or(|wake_at| fire < wake_at);
        drop(registry);
        if needs_renewal_round || needs_earlier_wake {
            self.shared.changed.notify_one();
        }
        ticket
    }

    /// Leases tracked right now.
    pub(crate) fn tracked(&self) -> usize {
        self.shared.registry().entries.len()
    }
}

async fn run(shared: Arc<Shared>, shutdown: CancellationToken) {
    let interval = shared.lease / 3;
    let mut next_renewal = Instant::now() + interval;
    loop {
        let (renewing, earliest_deadline) = {
            let mut registry = shared.registry();
            let renewing = registry.entries.values().any(|entry| entry.renewing > 0);
            let earliest = registry.entries.values().map(fire_at).min();
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
            _ = shutdown.cancelled() => return,
            _ = changed => {}
            _ = tokio::time::sleep_until(next_renewal), if renewing => {
                next_renewal += interval;
                let now = Instant::now();
                if next_renewal < now {
                    next_renewal = now + interval;
                }
                if !shared.renewing_now.swap(true, std::sync::atomic::Ordering::AcqRel) {
                    tokio::spawn(renew_all(Arc::clone(&shared)));
                } else {
                    tracing::warn!("previous renewal round still in flight; skipping this tick");
                }
            }
            _ = sleep_until_some(earliest_deadline) => {
                expire_overdue(&shared);
            }
        }
    }
}

fn fire_at(entry: &Entry) -> Instant {
    let margin = safety_margin(entry.lease);
    entry.deadline.checked_sub(margin).unwrap_or(entry.deadline)
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
    registry.entries.retain(|lease, entry| {
        if fire_at(entry) > now {
            return true;
        }
        tracing::warn!(
            lock = %lease.key,
            owner = %lease.owner,
            "lease deadline passed without a successful renewal; the lock is lost"
        );
        entry.signal_lost();
        false
    });
}

async fn renew_all(shared: Arc<Shared>) {
    let batches: Vec<Vec<(LeaseKey, u64)>> = {
        let registry = shared.registry();
        let due: Vec<(LeaseKey, u64)> = registry
            .entries
            .iter()
            .filter(|(_, entry)| entry.renewing > 0)
            .map(|(key, entry)| (key.clone(), entry.id))
            .collect();
        due.chunks(shared.batch_size).map(<[_]>::to_vec).collect()
    };
    join_all(batches.into_iter().map(|batch| renew_batch(&shared, batch))).await;
    shared
        .renewing_now
        .store(false, std::sync::atomic::Ordering::Release);
}

async fn renew_batch(shared: &Shared, batch: Vec<(LeaseKey, u64)>) {
    let mut invocation = LOCK_RENEW.prepare_invoke();
    invocation.arg(shared.lease_ms);
    for (lease, _) in &batch {
        invocation.key(&*lease.key).arg(&*lease.owner);
    }
    let mut connection = shared.connection.clone();
    let sent_at = Instant::now();
    let reply = invocation.invoke_async::<Vec<i64>>(&mut connection).await;
    let renewed = match reply {
        Ok(renewed) if renewed.len() == batch.len() => renewed,
        Ok(renewed) => {
            tracing::error!(
                expected = batch.len(),
                got = renewed.len(),
                "renewal script answered with the wrong number of results; retrying next tick"
            );
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
    let deadline = sent_at + shared.lease;
    let mut registry = shared.registry();
    for ((lease, id), still_held) in batch.into_iter().zip(renewed) {
        let Some(entry) = registry.entries.get_mut(&lease) else {
            continue;
        };
        if entry.id != id {
            continue;
        }
        if still_held == 1 {
            if sent_at > entry.set_at {
                entry.lease = shared.lease;
                entry.deadline = deadline;
                entry.set_at = sent_at;
            }
        } else {
            tracing::warn!(
                lock = %lease.key,
                owner = %lease.owner,
                "renewal found the lock gone or held by another owner; the lock is lost"
            );
            entry.signal_lost();
            registry.entries.remove(&lease);
        }
    }
}
