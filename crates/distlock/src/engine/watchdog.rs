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
    key: String,
    owner: String,
}

struct Entry {
    /// Distinguishes this holding from an earlier one of the same key and owner.
    id: u64,
    /// Guards alive for this key and owner (reentrant acquisitions).
    guards: usize,
    /// How many of them asked for renewal; zero means a fixed lease.
    renewing: usize,
    deadline: Instant,
    lost: CancellationToken,
}

#[derive(Default)]
struct Registry {
    entries: HashMap<LeaseKey, Entry>,
    next_id: u64,
}

struct Shared {
    registry: Mutex<Registry>,
    changed: Notify,
    connection: Connection,
    lease: Duration,
    lease_ms: u64,
    batch_size: usize,
}

/// A guard's stake in a tracked lease.
pub(crate) struct LeaseTicket {
    key: LeaseKey,
    id: u64,
    renewing: bool,
    lost: CancellationToken,
}

impl LeaseTicket {
    /// Cancelled as soon as the lease can no longer be trusted.
    pub(crate) fn lost(&self) -> &CancellationToken {
        &self.lost
    }
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
/// a little faster than ours, and our timer may wake a little late. The same allowance the
/// Redlock algorithm makes (1 % of the lease plus 2 ms).
pub(crate) fn safety_margin(lease: Duration) -> Duration {
    lease / 100 + Duration::from_millis(2)
}

impl Watchdog {
    pub(crate) fn start(
        connection: Connection,
        config: &Config,
        shutdown: CancellationToken,
    ) -> Self {
        let shared = Arc::new(Shared {
            registry: Mutex::new(Registry::default()),
            changed: Notify::new(),
            connection,
            lease: config.watchdog_timeout,
            lease_ms: config.watchdog_timeout_ms,
            batch_size: config.renew_batch_size,
        });
        tokio::spawn(run(Arc::clone(&shared), shutdown));
        Self { shared }
    }

    /// Starts (or joins, for a reentrant acquisition) tracking the lease of `key` held by
    /// `owner`. `sent_at` is when the command that set the lease was sent; `lease` is what
    /// it set. `renew` asks the watchdog to keep extending it.
    pub(crate) fn track(
        &self,
        key: &str,
        owner: &str,
        lease: Duration,
        sent_at: Instant,
        renew: bool,
    ) -> LeaseTicket {
        let lease_key = LeaseKey {
            key: key.to_owned(),
            owner: owner.to_owned(),
        };
        let deadline = sent_at + lease;
        let mut registry = self.shared.registry();
        let Registry { entries, next_id } = &mut *registry;
        let entry = entries.entry(lease_key.clone()).or_insert_with(|| {
            *next_id += 1;
            Entry {
                id: *next_id,
                guards: 0,
                renewing: 0,
                deadline,
                lost: CancellationToken::new(),
            }
        });
        entry.guards += 1;
        // The command just sent set the lease to exactly `lease`, replacing whatever a
        // reentrant holder's earlier acquisition or renewal had set.
        entry.deadline = deadline;
        if renew {
            entry.renewing += 1;
        }
        let ticket = LeaseTicket {
            key: lease_key,
            id: entry.id,
            renewing: renew,
            lost: entry.lost.child_token(),
        };
        drop(registry);
        self.shared.changed.notify_one();
        ticket
    }

    /// Ends a guard's stake. `owner_released` is true when Redis said the owner no longer
    /// holds the lock at all; any other guards of that owner have then lost it.
    pub(crate) fn untrack(&self, ticket: LeaseTicket, owner_released: bool) {
        let mut registry = self.shared.registry();
        let Some(entry) = registry.entries.get_mut(&ticket.key) else {
            return;
        };
        if entry.id != ticket.id {
            return;
        }
        entry.guards = entry.guards.saturating_sub(1);
        if ticket.renewing {
            entry.renewing = entry.renewing.saturating_sub(1);
        }
        if entry.guards == 0 || owner_released {
            if entry.guards > 0 {
                entry.lost.cancel();
            }
            registry.entries.remove(&ticket.key);
        }
    }

    /// The local deadline of the ticket's lease, if it is still tracked.
    pub(crate) fn deadline(&self, ticket: &LeaseTicket) -> Option<Instant> {
        let registry = self.shared.registry();
        registry
            .entries
            .get(&ticket.key)
            .filter(|entry| entry.id == ticket.id)
            .map(|entry| entry.deadline)
    }

    /// Leases tracked right now.
    pub(crate) fn tracked(&self) -> usize {
        self.shared.registry().entries.len()
    }
}

async fn run(shared: Arc<Shared>, shutdown: CancellationToken) {
    let interval = shared.lease / 3;
    let margin_of_renewed = safety_margin(shared.lease);
    let mut next_renewal = Instant::now() + interval;
    loop {
        let (renewing, earliest_deadline) = {
            let registry = shared.registry();
            let renewing = registry.entries.values().any(|entry| entry.renewing > 0);
            let earliest = registry
                .entries
                .values()
                .map(|entry| fire_at(entry, margin_of_renewed))
                .min();
            (renewing, earliest)
        };
        if !renewing {
            // Nothing to renew: the first renewal of a new lease comes a full interval
            // after it was taken.
            next_renewal = Instant::now() + interval;
        }
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
                tokio::spawn(renew_all(Arc::clone(&shared)));
            }
            _ = sleep_until_some(earliest_deadline) => {
                expire_overdue(&shared, margin_of_renewed);
            }
        }
    }
}

fn fire_at(entry: &Entry, margin_of_renewed: Duration) -> Instant {
    // Fixed leases are usually shorter than the watchdog's, so take their margin from the
    // time left; a renewing entry uses the watchdog lease's.
    let margin = if entry.renewing > 0 {
        margin_of_renewed
    } else {
        Duration::from_millis(2)
    };
    entry.deadline.checked_sub(margin).unwrap_or(entry.deadline)
}

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

fn expire_overdue(shared: &Shared, margin_of_renewed: Duration) {
    let now = Instant::now();
    let mut registry = shared.registry();
    registry.entries.retain(|lease, entry| {
        if fire_at(entry, margin_of_renewed) > now {
            return true;
        }
        tracing::warn!(
            lock = %lease.key,
            owner = %lease.owner,
            "lease deadline passed without a successful renewal; the lock is lost"
        );
        entry.lost.cancel();
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
}

async fn renew_batch(shared: &Shared, batch: Vec<(LeaseKey, u64)>) {
    let mut invocation = LOCK_RENEW.prepare_invoke();
    invocation.arg(shared.lease_ms);
    for (lease, _) in &batch {
        invocation.key(&lease.key).arg(&lease.owner);
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
            entry.deadline = entry.deadline.max(deadline);
        } else {
            tracing::warn!(
                lock = %lease.key,
                owner = %lease.owner,
                "renewal found the lock gone or held by another owner; the lock is lost"
            );
            entry.lost.cancel();
            registry.entries.remove(&lease);
        }
    }
}
