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
//! ([`OwnerEnd::Settled`]): its wait left the queue and the server said so, or its
//! holding's last release was answered on the first try. An id with a call whose outcome
//! is unknown (a lost reply, a retry, an error) is never used again: that call may still
//! land, and would then act on the next acquisition's queue entry or holding. What can
//! still land from a settled id is harmless to its next acquisition:
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

use crate::engine::subscriptions::KeptChannel;

/// How long an id stays kept without being taken up: its channel stays subscribed meanwhile.
const IDLE_FOR: Duration = Duration::from_secs(30);

/// The most ids kept per lock handle: as many as its client had waiting at once, up to this.
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

/// The idle ids of one lock handle (and its clones).
#[derive(Default)]
pub(super) struct OwnerPool {
    idle: Mutex<Vec<IdleOwner>>,
}

impl OwnerPool {
    /// The id given back last for acquisitions with this lease, if one is kept.
    pub(super) fn take(&self, lease_ms: u64, renew: bool) -> Option<IdleOwner> {
        let (taken, expired) = {
            let mut idle = self.idle();
            let expired = drain_expired(&mut idle);
            let position = idle
                .iter()
                .rposition(|owner| owner.lease_ms == lease_ms && owner.renew == renew);
            (position.map(|position| idle.swap_remove(position)), expired)
        };
        // Unsubscribed outside the pool's lock.
        drop(expired);
        taken
    }

    /// Keeps `owner` for the next acquisition with the same lease.
    pub(super) fn give_back(&self, owner: Arc<str>, kept: KeptChannel, lease_ms: u64, renew: bool) {
        let mut idle = self.idle();
        let mut expired = drain_expired(&mut idle);
        if idle.len() >= MOST_KEPT {
            expired.push(idle.remove(0));
        }
        idle.push(IdleOwner {
            owner,
            kept,
            lease_ms,
            renew,
            since: Instant::now(),
        });
        drop(idle);
        drop(expired);
    }

    fn idle(&self) -> MutexGuard<'_, Vec<IdleOwner>> {
        // Only pushed to and removed from whole: a poisoned lock still holds a sound list.
        self.idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Removes the ids kept longer than [`IDLE_FOR`], oldest first in the list.
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
