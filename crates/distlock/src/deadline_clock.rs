//! A clock for the lost signal's deadline that no runtime can hold up: one thread of its
//! own, sleeping on the standard clock, that wakes the futures waiting for a deadline.
//!
//! The lost signal must fire at its deadline wherever it is awaited: in a task, in the
//! body of `#[tokio::main]` (a `block_on`), on a runtime built without `enable_time`, on
//! one whose test clock is paused (`start_paused`), and while the clients' background
//! thread is starved. A tokio timer belongs to one runtime and fails one of those cases:
//! the awaiting runtime's timer may be missing (a sleep panics) or paused (it jumps
//! ahead while the runtime is idle, firing the signal with the lock still held), and the
//! clients' runtime may be busy. This thread does nothing but keep deadlines, so it is
//! late only when the whole process is.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

/// The thread's shared state: who waits for which deadline.
struct Clock {
    /// Waiting futures by (deadline, sleep id): the first is the next to wake.
    sleepers: Mutex<BTreeMap<(Instant, u64), Waker>>,
    /// Signalled when a sooner deadline is added.
    changed: Condvar,
}

impl Clock {
    fn sleepers(&self) -> MutexGuard<'_, BTreeMap<(Instant, u64), Waker>> {
        // A waker that panicked while the lock was held leaves nothing half-written.
        self.sleepers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The thread's loop: wake everything due, then sleep until the next deadline or a
    /// sooner one is added.
    fn run(&self) {
        let mut sleepers = self.sleepers();
        loop {
            let now = Instant::now();
            while let Some(entry) = sleepers.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                entry.remove().wake();
            }
            sleepers = match sleepers.keys().next() {
                Some(&(next, _)) => {
                    let wait = next.saturating_duration_since(now);
                    self.changed
                        .wait_timeout(sleepers, wait)
                        .map(|(guard, _)| guard)
                        .unwrap_or_else(|poisoned| poisoned.into_inner().0)
                }
                None => self
                    .changed
                    .wait(sleepers)
                    .unwrap_or_else(PoisonError::into_inner),
            };
        }
    }
}

/// The process's deadline clock, its thread started on first use; `None` if the thread
/// could not be started (the caller then relies on its other clocks).
fn clock() -> Option<&'static Clock> {
    static CLOCK: OnceLock<Option<&'static Clock>> = OnceLock::new();
    *CLOCK.get_or_init(|| {
        let clock: &'static Clock = Box::leak(Box::new(Clock {
            sleepers: Mutex::new(BTreeMap::new()),
            changed: Condvar::new(),
        }));
        match std::thread::Builder::new()
            .name("distlock-deadlines".into())
            .spawn(move || clock.run())
        {
            Ok(_) => Some(clock),
            Err(err) => {
                tracing::warn!(error = %err, "could not start the deadline clock's thread; lost signals keep time on the clients' thread only");
                None
            }
        }
    })
}

/// Completes at `deadline` by the standard clock, woken by the deadline clock's thread.
/// Needs no runtime and no timer driver.
pub(crate) fn sleep_until(deadline: Instant) -> DeadlineSleep {
    static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    DeadlineSleep {
        deadline,
        id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        registered: false,
    }
}

/// The future of [`sleep_until`].
pub(crate) struct DeadlineSleep {
    deadline: Instant,
    id: u64,
    registered: bool,
}

impl Future for DeadlineSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= self.deadline {
            self.unregister();
            return Poll::Ready(());
        }
        let Some(clock) = clock() else {
            return Poll::Pending;
        };
        let key = (self.deadline, self.id);
        let mut sleepers = clock.sleepers();
        let sooner = sleepers.keys().next().is_none_or(|first| key < *first);
        // A later poll replaces the waker: one entry per sleep, removed when dropped.
        sleepers.insert(key, cx.waker().clone());
        drop(sleepers);
        self.registered = true;
        if sooner {
            clock.changed.notify_one();
        }
        Poll::Pending
    }
}

impl DeadlineSleep {
    fn unregister(&mut self) {
        if std::mem::take(&mut self.registered) {
            if let Some(clock) = clock() {
                clock.sleepers().remove(&(self.deadline, self.id));
            }
        }
    }
}

impl Drop for DeadlineSleep {
    fn drop(&mut self) {
        self.unregister();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A deadline is kept by a future polled with no runtime at all, and a dropped sleep
    /// leaves nothing behind.
    #[test]
    fn a_deadline_is_kept_without_a_runtime() {
        let start = Instant::now();
        futures_executor_block_on(sleep_until(start + Duration::from_millis(50)));
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(50) && took < Duration::from_secs(2),
            "{took:?}"
        );
        let dropped = sleep_until(Instant::now() + Duration::from_secs(60));
        drop(dropped);
    }

    /// A minimal executor: polls `future` on this thread, parking until woken.
    fn futures_executor_block_on<F: Future>(future: F) -> F::Output {
        struct Unpark(std::thread::Thread);
        impl std::task::Wake for Unpark {
            fn wake(self: std::sync::Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        let mut future = std::pin::pin!(future);
        loop {
            if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
                return output;
            }
            std::thread::park();
        }
    }
}
