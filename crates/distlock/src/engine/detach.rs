//! Run-to-completion for operations whose effect on Redis must not be cut in half.
//!
//! Dropping a future that has sent a script but not read its reply would leave Redis
//! changed and the caller unaware: an acquisition nobody will release, a release whose
//! hold nobody will give back. [`Detached`] wraps such a future. While the caller polls it,
//! it runs in the caller's task at no extra cost; if the caller drops it after it started,
//! the rest of it is handed to a task on the client's own runtime (never the caller's,
//! which may be ending), and whatever it yields is dropped there (a guard dropped that way
//! releases its lock). Until it completes, it counts as background work the client's
//! shutdown waits for.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio_util::task::task_tracker::TaskTrackerToken;

use crate::runtime::Background;

/// A started future that finishes even if its caller stops waiting.
pub(crate) struct Detached<'a, T: Send + 'static> {
    future: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
    started: bool,
    /// Set while the future is being polled: still set in `drop` means that poll panicked,
    /// and a future that panicked must not be resumed.
    polling: bool,
    runtime: &'a Background,
    /// The client's shutdown waits for this operation, even while its caller polls it.
    _in_flight: TaskTrackerToken,
}

impl<'a, T: Send + 'static> Detached<'a, T> {
    pub(crate) fn new(
        runtime: &'a Background,
        future: impl Future<Output = T> + Send + 'static,
    ) -> Self {
        Self::from_boxed(runtime, Box::pin(future))
    }

    /// Wraps a future that is boxed already, without boxing it again.
    pub(crate) fn from_boxed(
        runtime: &'a Background,
        future: Pin<Box<dyn Future<Output = T> + Send>>,
    ) -> Self {
        Self {
            future: Some(future),
            started: false,
            polling: false,
            _in_flight: runtime.in_flight(),
            runtime,
        }
    }
}

impl<T: Send + 'static> Future for Detached<'_, T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = &mut *self;
        this.started = true;
        let Some(future) = this.future.as_mut() else {
            // Polled after completion: a caller bug, but not worth a panic in a lock.
            return Poll::Pending;
        };
        this.polling = true;
        let poll = future.as_mut().poll(cx);
        this.polling = false;
        if poll.is_ready() {
            this.future = None;
        }
        poll
    }
}

impl<T: Send + 'static> Drop for Detached<'_, T> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else {
            return;
        };
        // Never started: nothing was sent, nothing to finish.
        if !self.started {
            return;
        }
        if self.polling {
            // Dropped while unwinding from a panic in its own poll: its state is unknown.
            tracing::error!("a lock operation panicked mid-flight; it is not resumed");
            return;
        }
        self.runtime.spawn(async move {
            drop(future.await);
        });
    }
}
