//! Run-to-completion for operations whose effect on Redis must not be cut in half.
//!
//! Dropping a future that has sent a script but not read its reply would leave Redis
//! changed and the caller unaware: an acquisition nobody will release, a release whose
//! ticket nobody will close. [`Detached`] wraps such a future. While the caller polls it, it
//! runs in the caller's task at no extra cost; if the caller drops it after it started,
//! the rest of it is handed to a new task, and whatever it yields is dropped there (a guard
//! dropped that way releases its lock).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A started future that finishes even if its caller stops waiting.
pub(crate) struct Detached<T: Send + 'static> {
    future: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
    started: bool,
}

impl<T: Send + 'static> Detached<T> {
    pub(crate) fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        Self::from_boxed(Box::pin(future))
    }

    /// Wraps a future that is boxed already, without boxing it again.
    pub(crate) fn from_boxed(future: Pin<Box<dyn Future<Output = T> + Send>>) -> Self {
        Self {
            future: Some(future),
            started: false,
        }
    }
}

impl<T: Send + 'static> Future for Detached<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        self.started = true;
        let Some(future) = self.future.as_mut() else {
            // Polled after completion: a caller bug, but not worth a panic in a lock.
            return Poll::Pending;
        };
        match future.as_mut().poll(cx) {
            Poll::Ready(output) => {
                self.future = None;
                Poll::Ready(output)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: Send + 'static> Drop for Detached<T> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else {
            return;
        };
        // Never started: nothing was sent, nothing to finish.
        if !self.started {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    drop(future.await);
                });
            }
            Err(_) => tracing::warn!(
                "an operation was cancelled outside a tokio runtime and cannot be finished; \
                 any lock it took frees itself when its lease ends"
            ),
        }
    }
}
