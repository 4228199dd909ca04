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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::lease::Lease;
use super::registry::{Entry, Registry, Renewal, RenewalKind, Shared};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::runtime::Background;
use crate::transport::connection::Connection;
use crate::transport::deployment::Deployment;
use crate::transport::replica_sync::SyncSlot;
use crate::transport::script::{LuaScript, ScriptCall};
use crate::transport::Store;

/// The client's renewal scheduler.
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
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
        store: Store,
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
            store,
        });
        background.spawn_service(run(Arc::clone(&shared)));
        Self { shared }
    }

    /// Starts tracking a new lease of `kind` on `key` by `owner`. `sent_at` is when the
    /// command that set the lease was sent; `lease` is what it set; `renew` asks the
    /// scheduler to keep extending it.
    pub(crate) fn track(
        &self,
        kind: &'static RenewalKind,
        key: &Arc<str>,
        owner: &Arc<str>,
        sent_at: Instant,
        lease: Duration,
        renew: bool,
    ) -> Lease {
        let mut entry = Entry {
            kind,
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
        Lease::new(Arc::clone(&self.shared), id)
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

/// One lease to renew.
struct Due {
    id: u64,
    key: Arc<str>,
    owner: Arc<str>,
    kind: &'static RenewalKind,
}

/// Sends one renewal for `batch` (leases of one kind), as the kind says: one result per
/// lease, 1 if still held.
async fn renew(shared: &Shared, batch: &[Due]) -> Result<Vec<i64>> {
    let Some(kind) = batch.first().map(|due| due.kind) else {
        return Ok(Vec::new());
    };
    let renewed = match (&kind.renew, &shared.store) {
        (Renewal::Script(script), Store::Redis) => renew_with_script(shared, script, batch).await?,
        #[cfg(feature = "postgres")]
        (Renewal::Statement(statement), Store::Postgres(link)) => {
            let leases = batch
                .iter()
                .map(|due| (Arc::clone(&due.key), Arc::clone(&due.owner)))
                .collect();
            let renewed = link.renew(statement, shared.lease_ms, leases).await?;
            renewed.into_iter().map(i64::from).collect()
        }
        #[cfg(feature = "etcd")]
        (Renewal::Leases, Store::Etcd(link)) => {
            let leases: Vec<Arc<str>> = batch.iter().map(|due| Arc::clone(&due.owner)).collect();
            let renewed = link.keep_alive(&leases).await?;
            renewed.into_iter().map(i64::from).collect()
        }
        #[cfg(feature = "zk")]
        (Renewal::Nodes, Store::Zk(link)) => {
            let paths: Vec<Arc<str>> = batch.iter().map(|due| Arc::clone(&due.owner)).collect();
            let renewed = link.still_held(&paths).await?;
            renewed.into_iter().map(i64::from).collect()
        }
        #[allow(unreachable_patterns)]
        (_, store) => {
            return Err(Error::Unsupported {
                store: store.name(),
                what: kind.name,
            })
        }
    };
    if renewed.len() != batch.len() {
        return Err(Error::UnexpectedReply {
            script: "renewal",
            detail: "answered with the wrong number of results".into(),
        });
    }
    Ok(renewed)
}

/// [`renew`] on Redis: the kind's script, with a WAIT behind it under replica sync.
async fn renew_with_script(
    shared: &Shared,
    script: &'static LuaScript,
    batch: &[Due],
) -> redis::RedisResult<Vec<i64>> {
    let keys: Vec<&str> = batch.iter().map(|due| &*due.key).collect();
    let mut invocation = ScriptCall::new(script, &keys, 1 + batch.len());
    invocation.arg(shared.lease_ms);
    for due in batch {
        invocation.arg(&*due.owner);
    }
    match shared.synced.get() {
        None => {
            let mut connection = shared.connection.clone();
            invocation.invoke(&mut connection).await
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
            Ok(renewed)
        }
    }
}

/// Starts a renewal of every lease due, in batches, each batch a task of its own. A lease
/// whose previous renewal is still in flight (a hung server, a shard whose replica does
/// not answer) is left out of this round, and only it: the other leases, on healthy
/// servers and shards, are renewed on time whatever one server does.
fn renew_all(shared: &Arc<Shared>) {
    let (batches, skipped) = {
        let mut registry = shared.registry();
        let mut skipped = 0;
        // Grouped by kind (each kind has its script), then by slot on a cluster.
        let mut by_kind: Vec<(&'static RenewalKind, Vec<Due>)> = Vec::new();
        for (id, entry) in registry.entries.iter_mut().filter(|(_, entry)| entry.renew) {
            if entry.renewing {
                skipped += 1;
                continue;
            }
            entry.renewing = true;
            let due = Due {
                id: *id,
                key: Arc::clone(&entry.key),
                owner: Arc::clone(&entry.owner),
                kind: entry.kind,
            };
            match by_kind
                .iter_mut()
                .find(|(kind, _)| std::ptr::eq(*kind, entry.kind))
            {
                Some((_, group)) => group.push(due),
                None => by_kind.push((entry.kind, vec![due])),
            }
        }
        let batches: Vec<Vec<Due>> = by_kind
            .into_iter()
            .flat_map(|(_, group)| {
                shared
                    .deployment
                    .batches(group, shared.batch_size, |due| &due.key)
            })
            .collect();
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
            let ids: Vec<u64> = batch.iter().map(|due| due.id).collect();
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
        Err(err) if err.is_denied() && batch.len() > 1 => {
            // The server refuses a script when it may not touch one of its keys, so one
            // lock whose key the user lost refuses the whole batch. Find which, one by one.
            for due in batch {
                Box::pin(renew_batch(shared, vec![due])).await;
            }
            return;
        }
        Err(err) if err.is_denied() => {
            // The ACL will refuse every later round too: waiting for the deadline would
            // only hide the cause. This lease can no longer be kept.
            if !shared.warned_refused.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    error = %err,
                    "the store's user may not renew a lease (a Redis ACL, a PostgreSQL grant); \
                     the lock is reported lost now; grant the rights listed in distlock's \
                     docs/safety.md"
                );
            }
            let mut registry = shared.registry();
            for due in &batch {
                if let Some(entry) = registry
                    .entries
                    .get_mut(&due.id)
                    .filter(|entry| entry.renew)
                {
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
    for (due, still_held) in batch.into_iter().zip(renewed) {
        let Some(entry) = registry.entries.get_mut(&due.id) else {
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
                key = %due.key,
                owner = %due.owner,
                kind = due.kind.name,
                "renewal found the lease gone or held by another owner; it is lost"
            );
            entry.mark_lost();
        }
    }
}
