//! Who holds a lock inside one client: by default the current tokio task.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// Identifies a holder within one [`Client`](crate::Client). Together with the client's id
/// it forms the lock owner, `"<client uuid>:<holder id>"`, which is where Redisson puts a
/// Java thread id.
///
/// Two acquisitions by the same holder re-enter the lock; two by different holders exclude
/// each other. By default the holder is the current tokio task, so tasks exclude each other
/// the way threads do in Redisson. Give an explicit holder with
/// [`Lock::with_holder`](crate::Lock::with_holder) when a lock must be re-entered from
/// several tasks, or to keep ids stable across a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HolderId(
    /// The id, written in decimal after the client id in the owner string.
    pub u64,
);

/// Ids handed to code that runs outside any task (inside `block_on`, or the future of
/// `#[tokio::main]`) start here, far above any task id a process will reach, and stay below
/// `i64::MAX` because Redisson parses thread ids as Java longs.
const THREAD_HOLDER_BASE: u64 = 1 << 62;

impl HolderId {
    /// The holder of the code that calls this: the current tokio task, or, outside a
    /// task, the current thread.
    pub fn current() -> Self {
        match tokio::task::try_id() {
            // A task id's text form is its number; fall back to the thread below if a
            // future tokio ever changes that.
            Some(id) => id
                .to_string()
                .parse()
                .map(HolderId)
                .unwrap_or_else(|_| Self::current_thread()),
            None => Self::current_thread(),
        }
    }

    fn current_thread() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        thread_local! {
            static THREAD_ID: u64 = THREAD_HOLDER_BASE + NEXT.fetch_add(1, Ordering::Relaxed);
        }
        HolderId(THREAD_ID.with(|id| *id))
    }
}

impl fmt::Display for HolderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tasks_get_distinct_holders_and_keep_them() {
        let a = tokio::spawn(async { (HolderId::current(), HolderId::current()) });
        let b = tokio::spawn(async { HolderId::current() });
        let (a1, a2) = a.await.expect("task a");
        let b = b.await.expect("task b");
        assert_eq!(a1, a2);
        assert_ne!(a1, b);
        assert!(a1.0 < THREAD_HOLDER_BASE);
    }

    #[test]
    fn outside_a_task_the_thread_is_the_holder() {
        let here = HolderId::current();
        assert_eq!(here, HolderId::current());
        let there = std::thread::spawn(HolderId::current)
            .join()
            .expect("thread");
        assert_ne!(here, there);
        assert!(here.0 >= THREAD_HOLDER_BASE);
    }
}
