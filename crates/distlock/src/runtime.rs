//! The client's own runtime: a thread with a current-thread tokio runtime, started at
//! connect, on which every piece of background work runs: the watchdog, the pub/sub hub,
//! the releases of dropped guards, and the connection that carries them.
//!
//! Why a thread of its own rather than whatever runtime is current: a guard is dropped
//! wherever the user's code happens to be, often as a runtime ends (the end of
//! `#[tokio::main]`, a job run in `block_on`) or in a runtime nobody drives any more. Work
//! spawned there never runs. Work spawned here always does, until the client shuts down.
//!
//! Shutting down waits for the background releases already started (they are tracked),
//! then stops the services and lets the thread end. The last handle on a client does this
//! when it is dropped, waiting a bounded time, so a program that returns from `main` with
//! a guard still alive has released it before the process exits.

use std::future::Future;
use std::sync::{mpsc, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{Error, Result};

pub(crate) struct Background {
    handle: Handle,
    thread: ThreadId,
    /// Background releases and other work that must finish before the client stops.
    tasks: TaskTracker,
    /// Cancelled to stop the long-lived services (watchdog, hub) and end the thread.
    stop: CancellationToken,
    /// Receives once the thread has ended.
    finished: Mutex<Option<mpsc::Receiver<()>>>,
}

impl Background {
    /// Starts the thread and its runtime.
    pub(crate) fn start() -> Result<Self> {
        let stop = CancellationToken::new();
        let (handle_tx, handle_rx) = mpsc::channel();
        let (finished_tx, finished_rx) = mpsc::channel();
        let thread_stop = stop.clone();
        let thread = std::thread::Builder::new()
            .name("distlock".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(err) => {
                        let _ = handle_tx.send(Err(err));
                        return;
                    }
                };
                let _ = handle_tx.send(Ok(runtime.handle().clone()));
                runtime.block_on(thread_stop.cancelled());
                // Dropping the runtime drops whatever is left (idle services).
                drop(runtime);
                let _ = finished_tx.send(());
            })
            .map_err(Error::Runtime)?;
        let handle = match handle_rx.recv() {
            Ok(Ok(handle)) => handle,
            Ok(Err(err)) => return Err(Error::Runtime(err)),
            Err(_) => {
                return Err(Error::Runtime(std::io::Error::other(
                    "the background thread ended before its runtime started",
                )))
            }
        };
        Ok(Self {
            handle,
            thread: thread.thread().id(),
            tasks: TaskTracker::new(),
            stop,
            finished: Mutex::new(Some(finished_rx)),
        })
    }

    pub(crate) fn handle(&self) -> &Handle {
        &self.handle
    }

    /// True when called from the background thread itself.
    pub(crate) fn is_current_thread(&self) -> bool {
        std::thread::current().id() == self.thread
    }

    /// Runs `work` on the client's runtime; shutdown waits for it.
    pub(crate) fn spawn<F>(&self, work: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        if self.tasks.is_closed() {
            // Shutting down: finish it all the same, but nobody waits for it any more.
            self.handle.spawn(work);
        } else {
            self.tasks.spawn_on(work, &self.handle);
        }
    }

    /// Sleeps for `duration` on the client's runtime's clock. Code that may finish on this
    /// runtime after its caller has gone (a cancelled release) must not wait on a timer of
    /// the caller's runtime: that runtime may be blocked, or never driven again.
    pub(crate) async fn pause(&self, duration: Duration) {
        // An error means this runtime is gone: nothing left to wait for.
        let _ = self.handle.spawn(tokio::time::sleep(duration)).await;
    }

    /// Runs a long-lived service on the client's runtime until shutdown.
    pub(crate) fn spawn_service<F>(&self, service: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let stop = self.stop.clone();
        self.handle.spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = service => {}
            }
        });
    }

    /// Cancelled when the client shuts down.
    pub(crate) fn stopping(&self) -> &CancellationToken {
        &self.stop
    }

    /// Waits for started background work, then stops the services and the thread.
    pub(crate) async fn shutdown(&self) {
        self.tasks.close();
        let tasks = self.tasks.clone();
        // Waited for on the background runtime itself: the caller's runtime may be a
        // different one, and the tracked tasks run there.
        let drained = self.handle.spawn(async move { tasks.wait().await });
        let _ = drained.await;
        self.stop.cancel();
    }

    /// [`Background::shutdown`] for a synchronous caller (the last handle's `Drop`),
    /// waiting at most `limit`. From the background thread itself it cannot wait: it only
    /// starts the shutdown.
    pub(crate) fn shutdown_blocking(&self, limit: Duration) {
        self.tasks.close();
        let tasks = self.tasks.clone();
        let stop = self.stop.clone();
        self.handle.spawn(async move {
            let _ = tokio::time::timeout(limit, tasks.wait()).await;
            stop.cancel();
        });
        if self.is_current_thread() {
            // Waiting here would stop the very thread that has to do the work.
            return;
        }
        let finished = self
            .finished
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(finished) = finished {
            // The margin covers the runtime's own teardown after the wait above.
            let _ = finished.recv_timeout(limit + Duration::from_millis(200));
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        // A client that failed halfway through connecting never shut down: let the thread
        // end instead of parking forever.
        self.stop.cancel();
    }
}
