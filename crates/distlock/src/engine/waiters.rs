//! The local waiters of one primitive on one channel, and what a message means for them.
//!
//! Each primitive queues its waiters under its own key ([`Acquire::queue`]): Redisson's
//! layout gives `X` and `{X}` one release channel, and a message does not say which
//! primitive it is for, so each queue applies a message by its own [`WakeRule`].
//!
//! Most rules wake through one `tokio::sync::Notify` per queue, whose `notify_one` wakes
//! the waiter that has waited longest since its last attempt. A semaphore's waiters
//! ([`WakeRule::UpTo`]) are kept in arrival order with the permits each asks for, as
//! tokio's `batch_semaphore` keeps its own: a message that N permits are free wakes the
//! waiters at the head whose asks fit in N, and a waiter keeps its place until it leaves,
//! so one asking for 3 permits is not passed by ones asking for 1 that came after it.
//!
//! [`Acquire::queue`]: crate::engine::acquire::Acquire::queue

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

/// What a message on a channel means for the local waiters of one primitive: a primitive
/// states its rule, the hub applies it to each message. A waiter woken for nothing looks
/// at the primitive, finds it busy and waits again, so a rule that wakes too many costs
/// round trips, never correctness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WakeRule {
    /// Redisson's lock channels: `1` wakes every waiter (a read-write lock's write
    /// release, which may let many readers in), anything else wakes one.
    OneOrAll,
    /// The channel is one waiter's own (a fair lock's queue entry): every message wakes
    /// it, and its payload is kept for the waiter to read (a direct grant carries the
    /// fencing token).
    Addressed,
    /// The message is how many permits are free (a semaphore's): it wakes the waiters at
    /// the head of the queue whose asks fit in it, in arrival order. `0` wakes nobody; a
    /// message that is not a count wakes every waiter.
    UpTo,
    /// Every message wakes every waiter (a latch that opens, or gets a new count).
    All,
}

/// Messages kept for an addressed waiter that has not read them: one channel per waiter
/// gets a handful at most; a flood beyond this keeps the oldest (a grant comes first).
const MAILBOX_CAPACITY: usize = 16;

/// Messages addressed to one waiter, until it reads them.
pub(crate) type Mailbox = Arc<Mutex<Vec<Vec<u8>>>>;

/// A mailbox is only pushed to and emptied whole: a poisoned lock still holds a
/// consistent list.
pub(crate) fn lock_mailbox(mailbox: &Mutex<Vec<Vec<u8>>>) -> MutexGuard<'_, Vec<Vec<u8>>> {
    mailbox
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The local waiters of one primitive.
pub(crate) struct Queue {
    rule: WakeRule,
    /// Every rule but [`WakeRule::UpTo`] wakes its waiters through this.
    wake: Arc<Notify>,
    waiters: usize,
    mailbox: Mailbox,
    /// [`WakeRule::UpTo`]: the waiters in arrival order, with what each asks for.
    tickets: VecDeque<Ticket>,
    next_ticket: u64,
    /// How many handles keep it while no waiter may be in it ([`Queue::keep`]): its
    /// mailbox outlives its waiters.
    kept: usize,
}

struct Ticket {
    id: u64,
    ask: u64,
    wake: Arc<Notify>,
}

/// A waiter's place in a queue: what wakes it, and where its messages are kept.
pub(crate) struct Place {
    pub(crate) wake: Arc<Notify>,
    pub(crate) mailbox: Mailbox,
    /// Its ticket, in a queue that keeps arrival order.
    pub(crate) ticket: Option<u64>,
    /// Other waiters were queued when it joined: it waits for its turn before trying.
    pub(crate) behind_others: bool,
}

impl Queue {
    pub(crate) fn new(rule: WakeRule) -> Self {
        Self {
            rule,
            wake: Arc::new(Notify::new()),
            waiters: 0,
            mailbox: Arc::default(),
            tickets: VecDeque::new(),
            next_ticket: 0,
            kept: 0,
        }
    }

    /// Keeps the queue, and the messages delivered to it, while no waiter is in it: the
    /// channel of a fair lock's owner id between two of its acquisitions, whose next
    /// waiter must find what was published to the id since it was taken up again.
    pub(crate) fn keep(&mut self) -> Mailbox {
        self.kept += 1;
        Arc::clone(&self.mailbox)
    }

    /// Kept by one handle less. Returns true when nothing keeps it and no waiter is in
    /// it: it may go.
    pub(crate) fn unkeep(&mut self) -> bool {
        self.kept = self.kept.saturating_sub(1);
        self.kept == 0 && self.waiters == 0
    }

    /// True while a waiter is in it (a kept queue may have none).
    pub(crate) fn has_waiters(&self) -> bool {
        self.waiters > 0
    }

    /// A new waiter, asking for `ask` (permits; 1 for a lock), joins at the back.
    pub(crate) fn join(&mut self, ask: u64) -> Place {
        self.waiters += 1;
        let behind_others = self.waiters > 1;
        if self.rule != WakeRule::UpTo {
            return Place {
                wake: Arc::clone(&self.wake),
                mailbox: Arc::clone(&self.mailbox),
                ticket: None,
                behind_others,
            };
        }
        self.next_ticket += 1;
        let wake = Arc::new(Notify::new());
        self.tickets.push_back(Ticket {
            id: self.next_ticket,
            ask: ask.max(1),
            wake: Arc::clone(&wake),
        });
        Place {
            wake,
            mailbox: Arc::clone(&self.mailbox),
            ticket: Some(self.next_ticket),
            behind_others,
        }
    }

    /// A waiter leaves. Returns true when it was the last and the queue is not kept: it
    /// may go. A waiter that leaves from the head of an ordered queue may have taken a
    /// wake-up it will not use: the new head is woken to look for itself.
    pub(crate) fn leave(&mut self, ticket: Option<u64>) -> bool {
        self.waiters = self.waiters.saturating_sub(1);
        if let Some(id) = ticket {
            let was_head = self.tickets.front().is_some_and(|head| head.id == id);
            self.tickets.retain(|waiter| waiter.id != id);
            if was_head {
                if let Some(head) = self.tickets.front() {
                    head.wake.notify_one();
                }
            }
        }
        self.waiters == 0 && self.kept == 0
    }

    /// True if `ticket` is the first in line.
    pub(crate) fn is_head(&self, ticket: u64) -> bool {
        self.tickets.front().is_some_and(|head| head.id == ticket)
    }

    /// Applies a message with `payload` to the waiters.
    pub(crate) fn deliver(&self, payload: &[u8]) {
        match self.rule {
            WakeRule::Addressed => {
                let mut mailbox = lock_mailbox(&self.mailbox);
                if mailbox.len() < MAILBOX_CAPACITY {
                    mailbox.push(payload.to_vec());
                }
                drop(mailbox);
                self.wake.notify_waiters();
            }
            WakeRule::OneOrAll if payload == b"1" => self.wake.notify_waiters(),
            WakeRule::OneOrAll => self.wake.notify_one(),
            WakeRule::All => self.wake.notify_waiters(),
            WakeRule::UpTo => {
                let free = std::str::from_utf8(payload)
                    .ok()
                    .and_then(|count| count.trim().parse::<i64>().ok());
                let Some(free) = free else {
                    self.wake_all();
                    return;
                };
                let mut left = free.max(0).unsigned_abs();
                for (position, waiter) in self.tickets.iter().enumerate() {
                    if waiter.ask > left {
                        // Strict arrival order: nobody passes a head that does not fit.
                        // The head itself looks again all the same: its fallback timer
                        // was set from the leases it saw at its last look, and a lease
                        // taken since may end sooner with no message at all (a fixed
                        // lease, a dead holder's).
                        if position == 0 {
                            waiter.wake.notify_one();
                        }
                        break;
                    }
                    left -= waiter.ask;
                    // Kept for a waiter that is mid-attempt, so that it looks again.
                    waiter.wake.notify_one();
                }
            }
        }
    }

    /// Wakes every waiter (messages may have been lost).
    pub(crate) fn wake_all(&self) {
        self.wake.notify_waiters();
        for waiter in &self.tickets {
            waiter.wake.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `place` has a wake-up waiting for it.
    fn woken(place: &Place) -> bool {
        let notified = place.wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable()
    }

    #[test]
    fn permits_wake_the_head_in_arrival_order_and_nobody_passes_it() {
        let mut queue = Queue::new(WakeRule::UpTo);
        let three = queue.join(3);
        let one = queue.join(1);
        let two = queue.join(2);
        assert!(!three.behind_others && one.behind_others);
        // Two permits: the head asks three, so nobody behind it is woken, not even the
        // one whose ask fits; the head looks again (to set its timer afresh).
        queue.deliver(b"2");
        assert!(woken(&three) && !woken(&one) && !woken(&two));
        // Four: the head's three and the next one's one fit; the two do not.
        queue.deliver(b"4");
        assert!(woken(&three) && woken(&one) && !woken(&two));
        // The head leaves: the next in line is woken to look for itself.
        queue.leave(three.ticket);
        assert!(woken(&one));
        queue.leave(one.ticket);
        assert!(woken(&two));
        // A message that is not a count wakes everyone; zero wakes the head alone.
        let three_more = queue.join(3);
        queue.deliver(b"0");
        assert!(woken(&two) && !woken(&three_more));
        queue.deliver(b"x");
        assert!(woken(&two) && woken(&three_more));
        assert!(!queue.leave(two.ticket));
        assert!(queue.leave(three_more.ticket));
    }
}
