//! Owner ids a fair lock's waiting acquisitions take up again, each with its channel kept
//! subscribed, as a Redisson client keeps one owner (and one channel) per thread.
//!
//! A fair waiter listens on a channel of its own (`<lock channel>:<owner>`), because that
//! is where a releaser, distlock's or Redisson's, publishes the grant. With a fresh owner
//! per acquisition, every contended acquisition paid a SUBSCRIBE, an UNSUBSCRIBE and a
//! look at the lock for what it could not hear before its subscription was live. An owner
//! id given back here keeps its channel subscribed ([`KeptChannel`]), so the next waiter
//! that takes it up hears every message from before its first attempt, and needs neither.
//!
//! An id is given back only once everything it did on the server has ended *for good*
//! (`OwnerEnd::is_settled`): its wait left the queue and the server said so, or its
//! holding's last release was answered on the first try. Never under replica sync: a
//! write the master answered may still be lost in a failover, bringing the id's old
//! queue entry or hold back. Only ids whose channel is live are kept, at most
//! [`MOST_KEPT`] per lock and client, and a sweep on the client's runtime lets each go
//! once it has been idle for [`IDLE_FOR`]. An id with a call whose outcome is unknown (a
//! lost reply, a retry, an error) is never used again: that call may still land, and
//! would then act on the next acquisition's queue entry or holding. What can still land
//! from a settled id is harmless to its next acquisition:
//! - a grant published to it before its last wait left the queue (the leave gave that
//!   grant on): its token is not above the highest token the next acquisition's first
//!   busy attempt reads, so `FairAttempt::granted` refuses it as stale;
//! - a watchdog renewal sent before its last release: ids are kept apart by lease, so it
//!   sets the lease the next holding of the id is renewed with, from a later moment than
//!   that holding counts its own lease from. It can lengthen the lease on the server,
//!   never shorten it.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use crate::engine::session::Core;
use crate::engine::subscriptions::KeptChannel;

/// How long an id stays kept without being taken up: its channel stays subscribed
/// meanwhile, and the pool's sweep on the client's runtime lets it go then.
const IDLE_FOR: Duration = Duration::from_secs(30);

/// The most ids kept per lock and client: as many as the client had waiting at once, up
/// to this.
const MOST_KEPT: usize = 64;

/// An owner id between two acquisitions, with its channel.
pub(super) struct IdleOwner {
    pub(super) owner: Arc<str>,
    pub(super) kept: KeptChannel,
    /// Ids serve acquisitions with the same lease only (see the module's docs).
    lease_ms: u64,
    renew: bool,
    since: Instant,
}

/// The idle ids of one lock on one client (shared by all its handles there).
#[derive(Default)]
pub(super) struct OwnerPool {
    idle: Mutex<Idle>,
}

#[derive(Default)]
struct Idle {
    /// Oldest first.
    owners: Vec<IdleOwner>,
    /// A sweep is running on the client's runtime.
    sweeping: bool,
}

impl OwnerPool {
    /// The id given back last for acquisitions with this lease, if one is kept.
    pub(super) fn take(&self, lease_ms: u64, renew: bool) -> Option<IdleOwner> {
        let (taken, expired) = {
            let mut idle = self.idle();
            let expired = drain_expired(&mut idle.owners);
            let position = idle
                .owners
                .iter()
                .rposition(|owner| owner.lease_ms == lease_ms && owner.renew == renew);
            (
                position.map(|position| idle.owners.remove(position)),
                expired,
            )
        };
        // Unsubscribed outside the pool's lock.
        drop(expired);
        taken
    }

    /// Keeps `owner` for the next acquisition with the same lease, if its channel is
    /// delivered now (a refused or broken channel would only cost the hub retries), and
    /// starts a sweep that lets it go once it has been idle too long.
    pub(super) fn give_back(
        self: &Arc<Self>,
        core: &Core,
        owner: Arc<str>,
        kept: KeptChannel,
        lease_ms: u64,
        renew: bool,
    ) {
        if !kept.is_live() {
            return;
        }
        let mut idle = self.idle();
        let mut expired = drain_expired(&mut idle.owners);
        if idle.owners.len() >= MOST_KEPT {
            expired.push(idle.owners.remove(0));
        }
        idle.owners.push(IdleOwner {
            owner,
            kept,
            lease_ms,
            renew,
            since: Instant::now(),
        });
        let start_sweep = !std::mem::replace(&mut idle.sweeping, true);
        drop(idle);
        drop(expired);
        if start_sweep {
            core.background().spawn_service(sweep(Sweeping {
                pool: Arc::clone(self),
                running: true,
            }));
        }
    }

    fn idle(&self) -> MutexGuard<'_, Idle> {
        // Only pushed to and removed from whole: a poisoned lock still holds a sound list.
        self.idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The pool's sweep, as it runs. It holds the pool, so the kept ids outlive the lock's
/// handles and serve the next handle made (the client finds the pool by the lock's name):
/// a handler that makes a handle per call reuses them too.
struct Sweeping {
    pool: Arc<OwnerPool>,
    /// Cleared when the sweep ends by itself; a sweep cancelled (at shutdown) clears the
    /// pool's flag when dropped, so that a later give-back starts another.
    running: bool,
}

impl Drop for Sweeping {
    fn drop(&mut self) {
        if self.running {
            self.pool.idle().sweeping = false;
        }
    }
}

/// Lets each of the pool's ids go once it has been idle for [`IDLE_FOR`], waking when the
/// oldest is due, and ends once none is kept.
async fn sweep(mut sweeping: Sweeping) {
    loop {
        let due = {
            let mut idle = sweeping.pool.idle();
            let expired = drain_expired(&mut idle.owners);
            let due = idle.owners.first().map(|oldest| oldest.since + IDLE_FOR);
            if due.is_none() {
                // Decided under the lock: a give-back after this starts a sweep of its own.
                idle.sweeping = false;
                sweeping.running = false;
            }
            drop(idle);
            drop(expired);
            due
        };
        match due {
            Some(due) => tokio::time::sleep_until(due).await,
            None => return,
        }
    }
}

/// Removes the ids kept longer than [`IDLE_FOR`] (the list is oldest first).
fn drain_expired(idle: &mut Vec<IdleOwner>) -> Vec<IdleOwner> {
    let now = Instant::now();
    let fresh = idle
        .iter()
        .position(|owner| now.duration_since(owner.since) < IDLE_FOR)
        .unwrap_or(idle.len());
    idle.drain(..fresh).collect()
}

/// Whether everything an owner id did on the server has ended for good.
pub(super) struct OwnerEnd(AtomicU8);

/// Calls may be under way, or the last one's outcome is not known yet.
const OPEN: u8 = 0;
/// The last call ended it for good: the id may serve another acquisition.
const SETTLED: u8 = 1;
/// A call's outcome is unknown (it may still land): never used again.
const IN_DOUBT: u8 = 2;

impl Default for OwnerEnd {
    fn default() -> Self {
        Self(AtomicU8::new(OPEN))
    }
}

impl OwnerEnd {
    /// A new call is about to be sent (an attempt), after a settled end.
    pub(super) fn reopen(&self) {
        let _ = self
            .0
            .compare_exchange(SETTLED, OPEN, Ordering::AcqRel, Ordering::Acquire);
    }

    /// The server answered the call that ends the id's use (a leave, a final release).
    pub(super) fn settled(&self) {
        let _ = self
            .0
            .compare_exchange(OPEN, SETTLED, Ordering::AcqRel, Ordering::Acquire);
    }

    /// A call's outcome is unknown: for good.
    pub(super) fn in_doubt(&self) {
        self.0.store(IN_DOUBT, Ordering::Release);
    }

    /// True if the id may serve another acquisition.
    pub(super) fn is_settled(&self) -> bool {
        self.0.load(Ordering::Acquire) == SETTLED
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_in_doubt_stays_in_doubt_whatever_settles_later() {
        let end = OwnerEnd::default();
        assert!(!end.is_settled(), "a new id has not ended");
        end.settled();
        assert!(end.is_settled());
        // Taken up again by the same acquisition (a `lock` that queues once more).
        end.reopen();
        assert!(!end.is_settled());
        // A lost reply, then a leave the server answered: the lost call may still land.
        end.in_doubt();
        end.settled();
        end.reopen();
        end.settled();
        assert!(!end.is_settled());
    }
}
