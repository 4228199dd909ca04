//! The renewal scheduler's shared state: one entry per held lease, each with its deadline,
//! its renewal kind and its lost signal, in one registry per client.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::engine::observe;
use crate::transport::connection::Connection;
use crate::transport::deployment::Deployment;
use crate::transport::replica_sync::SyncSlot;
use crate::transport::script::LuaScript;
use crate::transport::Store;

/// How one kind of lease is renewed: a primitive registers its kind (a lock hold, a read
/// hold, a semaphore permit) and the scheduler renews every lease of that kind the same
/// way, one call per batch of leases of the kind (and, on a cluster, of one slot).
pub(crate) struct RenewalKind {
    /// For the log: what a lease of this kind is.
    pub(crate) name: &'static str,
    pub(crate) renew: Renewal,
}

/// What renews a batch of leases of one kind, on the client's store.
pub(crate) enum Renewal {
    /// A Redis script. `KEYS[i]` is the i-th lease's key, `ARGV[1]` the lease to set in
    /// milliseconds and `ARGV[1 + i]` the i-th lease's owner; it answers one integer per
    /// lease, 1 if the owner still held it (and its lease is set again), anything else if
    /// not.
    Script(&'static LuaScript),
    /// A PostgreSQL statement. `$1` is the lease in milliseconds (a double), `$2` the
    /// names and `$3` the owners (text arrays); it answers a row `(name, owner)` for each
    /// lease still held (and set again).
    #[cfg(feature = "postgres")]
    Statement(&'static str),
    /// etcd leases: each lease's owner is the id (hex) of the etcd lease its key is
    /// attached to, and one keepalive per distinct lease renews every key on it.
    #[cfg(feature = "etcd")]
    Leases,
    /// ZooKeeper nodes: each lease's owner is the path of its ephemeral node. The
    /// session's own heartbeats keep every node alive; a renewal reads the batch's nodes
    /// in one multi-read, and a node found (still of the current session) proves the
    /// session lived when the read was sent.
    #[cfg(feature = "zk")]
    Nodes,
}

pub(super) struct Entry {
    pub(super) kind: &'static RenewalKind,
    pub(super) key: Arc<str>,
    pub(super) owner: Arc<str>,
    /// The lease the last command set; it sizes the safety margin.
    pub(super) lease: Duration,
    pub(super) deadline: Instant,
    /// When the command that set `deadline` was sent: a reply to an older command must
    /// not move the deadline, because the server applied the newer one last.
    pub(super) set_at: Instant,
    /// Renewed by the watchdog: watchdog mode, not lost, release not started.
    pub(super) renew: bool,
    /// A renewal of this lease is in flight: the next ticks leave it out until it ends,
    /// and renew the others.
    pub(super) renewing: bool,
    /// The holding's last guard is gone: its release is under way.
    pub(super) closing: bool,
    /// Set when the holding is known lost; it is never cleared.
    pub(super) lost: bool,
    /// The lost signal, created only when asked for: most holdings never are, and a
    /// process may hold many thousands of locks.
    pub(super) signal: Option<CancellationToken>,
    /// Ends the signal's own deadline timers (see [`Lease::lost_token`]) when the holding
    /// ends.
    pub(super) signal_timer: Option<CancellationToken>,
    /// The runtimes a deadline timer of the signal runs on: one per runtime that asked for
    /// a token, since a runtime may stop being driven (or end) while another still is.
    pub(super) timer_runtimes: Vec<tokio::runtime::Id>,
}

impl Entry {
    /// What the lease running out means, for the log: a watchdog lease was not renewed in
    /// time, while a fixed lease simply ran its length (no renewal was ever due).
    pub(super) fn expiry(&self) -> &'static str {
        if self.renew {
            "lease deadline passed without a successful renewal; the lock is lost"
        } else if self.closing {
            "lease deadline passed while the release was under way; the lock is no longer held"
        } else {
            "the fixed lease ran out while its guard was still held; the lock is lost"
        }
    }

    pub(super) fn fire_at(&self) -> Instant {
        let margin = safety_margin(self.lease);
        self.deadline.checked_sub(margin).unwrap_or(self.deadline)
    }

    pub(super) fn is_trusted(&self, now: Instant) -> bool {
        !self.lost && self.fire_at() > now
    }

    /// A command sent at `sent_at` set the lease to `lease` on the server. Ignored for an
    /// older command than the last one applied (the server applied the newer one last).
    /// A lease that stopped being trusted stays lost even if the reply is good news: its
    /// holder may already have acted on the loss, and a lost signal is final.
    pub(super) fn apply(&mut self, sent_at: Instant, lease: Duration, now: Instant) {
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

    pub(super) fn mark_lost(&mut self) {
        if !self.lost && !self.closing {
            observe::lost(self.kind.name);
        }
        self.lost = true;
        self.renew = false;
        if let Some(signal) = &self.signal {
            signal.cancel();
        }
    }
}

#[derive(Default)]
pub(super) struct Registry {
    pub(super) entries: HashMap<u64, Entry>,
    pub(super) next_id: u64,
    /// When the scheduler will next wake by itself (`None`: only when told). A new lease
    /// wakes it early only if it needs attention before then, so that acquisitions do not
    /// pay for a scheduler pass each.
    pub(super) wake_at: Option<Instant>,
    /// Whether the scheduler's next wake-up includes a renewal round.
    pub(super) renewal_scheduled: bool,
    /// The client's runtime, whose clock `Lease::watch` may sleep on. Cleared when the
    /// client is gone: a runtime handle keeps the runtime's driver (and its file
    /// descriptors) alive, and a kept `lost()` future must not.
    pub(super) runtime: Option<tokio::runtime::Handle>,
}

pub(super) struct Shared {
    /// Shared on its own with the futures of `Lease::watch`, which may outlive everything
    /// else of the client and must not keep its connections open.
    pub(super) registry: Arc<Mutex<Registry>>,
    /// The client is shutting down: nothing is renewed any more, so nothing is trusted.
    pub(super) closed: AtomicBool,
    /// A refused renewal (ACL) is logged as an error once per client, not every round.
    pub(super) warned_refused: AtomicBool,
    pub(super) changed: Notify,
    /// Notified whenever a renewal batch ends (its leases' `renewing` goes false).
    pub(super) batch_ended: Notify,
    pub(super) connection: Connection,
    pub(super) lease: Duration,
    pub(super) lease_ms: u64,
    pub(super) batch_size: usize,
    /// On a cluster, one renewal script carries the locks of one slot only.
    pub(super) deployment: Deployment,
    /// With replica sync on, renewals wait for replicas too: a renewal no replica has
    /// would be lost by a failover.
    pub(super) synced: SyncSlot,
    /// The store the leases are on (Redis renewals go over `connection`).
    pub(super) store: Store,
}

impl Shared {
    pub(super) fn registry(&self) -> MutexGuard<'_, Registry> {
        lock_registry(&self.registry)
    }
}

/// Critical sections only insert, remove or update single entries, so a poisoned lock
/// still guards a consistent map.
pub(super) fn lock_registry(registry: &Mutex<Registry>) -> MutexGuard<'_, Registry> {
    registry
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How long before the computed deadline the lost signal fires: the server's clock may run
/// a little faster than ours (1 % of the lease, Redlock's drift allowance), and this task
/// may wake a little late on a busy machine (5 ms; tokio's timer alone rounds to 1 ms).
/// Firing early is safe; firing late is not.
pub(crate) fn safety_margin(lease: Duration) -> Duration {
    lease / 100 + Duration::from_millis(5)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review: a fixed lease that simply ran out was logged as "passed without a
    /// successful renewal", though no renewal was ever due.
    #[test]
    fn the_log_says_which_kind_of_lease_ran_out() {
        let now = Instant::now();
        static SCRIPT: LuaScript = LuaScript::new("return {}");
        static KIND: RenewalKind = RenewalKind {
            name: "test",
            renew: Renewal::Script(&SCRIPT),
        };
        let entry = |renew: bool, closing: bool| Entry {
            kind: &KIND,
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
