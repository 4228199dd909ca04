//! The clients' own runtime: a thread with a current-thread tokio runtime, started at the
//! first connect, on which every piece of background work runs: the watchdogs, the pub/sub
//! hubs, the releases of dropped guards, and the connections that carry them.
//!
//! One thread serves every client of the process (a five-master RedLock has five clients,
//! and used to start five threads). Each client keeps its own tracker of work and its own
//! services, so shutting one down touches no other. The thread ends when the last part of
//! the last client is dropped, and the next connect starts another.
//!
//! Why a thread of its own rather than whatever runtime is current: a guard is dropped
//! wherever the user's code happens to be, often as a runtime ends (the end of
//! `#[tokio::main]`, a job run in `block_on`) or in a runtime nobody drives any more. Work
//! spawned there never runs. Work spawned here always does.
//!
//! Shutting down waits (a bounded time) for the background work already started (it is
//! tracked), then stops the services. The thread itself lives as long as anything of the
//! client does (a guard, an operation still in flight somewhere), so that giving a lock
//! back always has somewhere to run, even after a shutdown; it ends when the client's
//! last part is dropped. The last handle on a client shuts it down when it is dropped, so
//! a program that returns from `main` with a guard still alive has released it before the
//! process exits.

use std::future::Future;
use std::sync::{mpsc, Arc, Mutex, Weak};
use std::thread::ThreadId;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::task_tracker::TaskTrackerToken;
use tokio_util::task::{AbortOnDropHandle, TaskTracker};

use crate::error::{Error, Result};

pub(crate) struct Background {
    handle: Handle,
    thread: ThreadId,
    /// Background releases and other work that shutdown waits for.
    tasks: TaskTracker,
    /// Cancelled at shutdown: stops the long-lived services (watchdog, hub).
    services: CancellationToken,
    /// Cancelled when a shutdown starts: work that waits to batch (latch deletions) goes
    /// at once instead of holding the shutdown up.
    draining: CancellationToken,
    /// Keeps the shared thread running while this client has a part alive.
    _shared: Arc<SharedThread>,
}

/// The thread every client's background work runs on, while any client holds it.
struct SharedThread {
    handle: Handle,
    thread: ThreadId,
    /// Cancelled when the last client lets go: ends the thread.
    stop: CancellationToken,
}

impl Drop for SharedThread {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The running shared thread, if a client holds it.
static SHARED_THREAD: Mutex<Weak<SharedThread>> = Mutex::new(Weak::new());

impl Background {
    /// Joins the shared thread, starting it if no client runs it now.
    pub(crate) fn start() -> Result<Self> {
        let shared = {
            // The lock only guards a pointer: a poisoned one is still consistent.
            let mut slot = SHARED_THREAD
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            match slot.upgrade() {
                Some(running) => running,
                None => {
                    let started = Arc::new(SharedThread::start()?);
                    *slot = Arc::downgrade(&started);
                    started
                }
            }
        };
        Ok(Self {
            handle: shared.handle.clone(),
            thread: shared.thread,
            tasks: TaskTracker::new(),
            services: CancellationToken::new(),
            draining: CancellationToken::new(),
            _shared: shared,
        })
    }
}

impl SharedThread {
    /// Starts the thread and its runtime.
    fn start() -> Result<Self> {
        let stop = CancellationToken::new();
        let (handle_tx, handle_rx) = mpsc::channel();
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
            stop,
        })
    }
}

impl Background {
    pub(crate) fn handle(&self) -> &Handle {
        &self.handle
    }

    /// True when called from the background thread itself.
    pub(crate) fn is_current_thread(&self) -> bool {
        std::thread::current().id() == self.thread
    }

    /// Runs `work` on the client's runtime; shutdown waits for it (work spawned while a
    /// shutdown is draining is waited for too).
    pub(crate) fn spawn<F>(&self, work: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.tasks.spawn_on(work, &self.handle);
    }

    /// Counts as started background work until dropped: shutdown waits for operations in
    /// flight in a caller's task (an acquisition whose reply is on its way must be able to
    /// give the lock back before the client stops).
    pub(crate) fn in_flight(&self) -> TaskTrackerToken {
        self.tasks.token()
    }

    /// Sleeps for `duration` on the client's runtime's clock. Code that may finish on this
    /// runtime after its caller has gone (a cancelled release) must not wait on a timer of
    /// the caller's runtime: that runtime may be blocked, or never driven again.
    ///
    /// Always this runtime's timer, even when the caller's would do: a pause inside a
    /// cancellable operation may be taken over by this runtime halfway, and a timer of the
    /// caller's runtime, polled here after that runtime is gone, panics.
    pub(crate) async fn pause(&self, duration: Duration) {
        sleep_on_client_clock(&self.handle, Instant::now() + duration).await;
    }

    /// Sleeps until `deadline` on a clock that is driven where the caller is polled; see
    /// [`sleep_until_on`].
    pub(crate) async fn sleep_until(&self, deadline: Instant) {
        sleep_until_on(&self.handle, deadline).await;
    }

    /// Sleeps until `deadline`, if there is one; otherwise never completes.
    pub(crate) async fn sleep_until_some(&self, deadline: Option<Instant>) {
        match deadline {
            Some(deadline) => self.sleep_until(deadline).await,
            None => std::future::pending().await,
        }
    }

    /// Awaits a reply to a command that was sent on the connection driven by the caller's
    /// runtime (`sent_on_home`). While the caller's task polls it, it waits as long as the
    /// command's own response timeout allows. Once the caller has gone and the rest of the
    /// operation runs here, the reply still depends on the caller's runtime, which may be
    /// stalled (every worker busy, or blocked waiting for this very client): it then gets
    /// [`STALLED_HOME_GRACE`] on this runtime's clock and fails as a timeout, so that the
    /// operation sends its idempotent retry on this runtime's own connection.
    pub(crate) async fn reply_unless_stalled<T>(
        &self,
        sent_on_home: bool,
        reply: impl Future<Output = redis::RedisResult<T>>,
    ) -> redis::RedisResult<T> {
        if !sent_on_home {
            return reply.await;
        }
        let mut reply = std::pin::pin!(reply);
        let handed_over = std::future::poll_fn(|cx| match reply.as_mut().poll(cx) {
            std::task::Poll::Ready(outcome) => std::task::Poll::Ready(Some(outcome)),
            // Polled on this thread: the caller is gone; stop waiting on its runtime alone.
            std::task::Poll::Pending if self.is_current_thread() => std::task::Poll::Ready(None),
            std::task::Poll::Pending => std::task::Poll::Pending,
        })
        .await;
        if let Some(outcome) = handed_over {
            return outcome;
        }
        // Created here, on this runtime: the timer is this runtime's.
        match tokio::time::timeout(STALLED_HOME_GRACE, reply).await {
            Ok(outcome) => outcome,
            Err(_) => Err(redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no reply on the caller's runtime's connection after the caller went away",
            ))),
        }
    }

    /// Runs a long-lived service on the client's runtime until shutdown.
    pub(crate) fn spawn_service<F>(&self, service: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let services = self.services.clone();
        self.handle.spawn(async move {
            tokio::select! {
                _ = services.cancelled() => {}
                _ = service => {}
            }
        });
    }

    /// Cancelled when the client's services stop (at shutdown).
    /// Cancelled once a shutdown has started.
    pub(crate) fn draining(&self) -> CancellationToken {
        self.draining.clone()
    }

    pub(crate) fn stopping(&self) -> &CancellationToken {
        &self.services
    }

    /// Waits for started background work, at most `limit`, by the client's clock (the
    /// caller's runtime may be a different one, or stalled), then stops the services.
    pub(crate) async fn shutdown(&self, limit: Duration) {
        let _ = self.drain(limit).await;
    }

    /// [`Background::shutdown`] for a synchronous caller (the last handle's `Drop`),
    /// waiting at most `limit`. From the background thread itself it cannot wait: it only
    /// starts the shutdown.
    pub(crate) fn shutdown_blocking(&self, limit: Duration) {
        let (drained_tx, drained_rx) = mpsc::channel();
        let drain = self.drain(limit);
        self.handle.spawn(async move {
            let _ = drain.await;
            let _ = drained_tx.send(());
        });
        if self.is_current_thread() {
            // Waiting here would stop the very thread that has to do the work.
            return;
        }
        // The margin covers the hop back from the client's thread.
        let wait = move || {
            let _ = drained_rx.recv_timeout(limit + Duration::from_millis(200));
        };
        match Handle::try_current() {
            // In a task of a multi-thread runtime, blocking this worker could stall the
            // very work being waited for: that runtime may drive the connection it was
            // sent on, with this worker its only one. The wait moves to the runtime's
            // blocking pool instead, which the runtime's shutdown waits for, so a program
            // still does not exit before its releases are sent.
            Ok(current)
                if current.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
                    && tokio::task::try_id().is_some() =>
            {
                drop(current.spawn_blocking(wait));
            }
            _ => wait(),
        }
    }

    /// Closes the tracker, and returns the task that waits for it and then stops the
    /// services: spawned on the client's runtime, so it runs whatever the caller does.
    fn drain(&self, limit: Duration) -> tokio::task::JoinHandle<()> {
        self.draining.cancel();
        self.tasks.close();
        let tasks = self.tasks.clone();
        let services = self.services.clone();
        self.handle.spawn(async move {
            let _ = tokio::time::timeout(limit, tasks.wait()).await;
            services.cancel();
        })
    }
}

/// How long the rest of an operation handed over by a departed caller waits for a reply
/// on the caller's runtime's connection before retrying on the client's own. A reply on a
/// healthy loopback connection takes well under a millisecond; the retry is idempotent.
pub(crate) const STALLED_HOME_GRACE: Duration = Duration::from_millis(20);

/// Sleeps until `deadline` on a clock that is sure to be driven while the caller waits.
///
/// The engine's waits and timeouts use this: a caller may be polled where its own
/// runtime's timers never fire. `Handle::block_on` of a current-thread runtime, from
/// another thread while that runtime's own thread is busy elsewhere, polls the future but
/// drives no timer; outside any runtime there is no timer at all. In those cases the
/// sleep is a task on the runtime behind `handle` (the client's), aborted if the caller
/// stops waiting.
///
/// Inside a task (of any runtime) and on the client's own runtime, the caller's timer is
/// used: whatever polls a task also drives its runtime's timers (a worker that runs out of
/// work parks on the driver; a current-thread runtime runs tasks only from `block_on`),
/// and a sleep task on the client's runtime costs a wake-up of its thread on every wait,
/// which slowed the contended bench's handoffs. A future polled by `block_on` itself is
/// not a task, and gets the client's clock.
pub(crate) async fn sleep_until_on(handle: &Handle, deadline: Instant) {
    let local_timer_is_driven = Handle::try_current()
        .is_ok_and(|current| current.id() == handle.id() || tokio::task::try_id().is_some());
    if local_timer_is_driven {
        tokio::time::sleep_until(deadline).await;
        return;
    }
    sleep_on_client_clock(handle, deadline).await;
}

/// Sleeps until `deadline` on the timer of the runtime behind `handle`: directly when
/// called there, otherwise as a task there, aborted if the caller stops waiting.
async fn sleep_on_client_clock(handle: &Handle, deadline: Instant) {
    if Handle::try_current().is_ok_and(|current| current.id() == handle.id()) {
        tokio::time::sleep_until(deadline).await;
        return;
    }
    // The timer is made inside the task: `sleep_until` binds to the timer of the runtime
    // it is called on.
    let sleeping = AbortOnDropHandle::new(handle.spawn(async move {
        tokio::time::sleep_until(deadline).await;
    }));
    if sleeping.await.is_err() {
        // The client's runtime is gone (the client was dropped while this was pending):
        // fall back on the caller's timer if it has one, rather than return early and
        // have the caller spin.
        if Handle::try_current().is_ok() {
            tokio::time::sleep_until(deadline).await;
        } else {
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        // The client's last part is gone: its services stop. The thread ends with the
        // last client's (`SharedThread`).
        self.services.cancel();
    }
}
