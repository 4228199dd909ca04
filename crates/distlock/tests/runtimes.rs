//! The client does not depend on whichever runtime happens to be current: a guard dropped
//! as its runtime ends, or in a runtime nobody drives any more, is released; the pub/sub
//! hub outlives the runtime of the first waiter; a process that returns from main with a
//! guard still alive leaves no lock behind.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{bounded, cancel_after_first_poll, key_becomes, sync_connection};
use distlock_testkit::RedisServer;
use futures_util::StreamExt;

const LIMIT: Duration = Duration::from_secs(20);

/// How soon a dropped guard must be released, from the moment it is dropped.
const RELEASE_TARGET: Duration = Duration::from_millis(100);

fn runtime(multi_thread: bool) -> tokio::runtime::Runtime {
    common::runtime_with(multi_thread, 2)
}

/// A pub/sub connection that has confirmed its subscription to `name`'s release channel.
async fn release_messages(server: &RedisServer, name: &str) -> redis::aio::PubSub {
    let mut pubsub = server.client().unwrap().get_async_pubsub().await.unwrap();
    pubsub
        .subscribe(format!("redisson_lock__channel:{{{name}}}"))
        .await
        .unwrap();
    pubsub
}

/// Runs one job per runtime flavour: the client lives on a long-lived runtime, the job
/// runs in `block_on` on a runtime of its own that ends with the job, and the job's guard
/// is dropped as the job returns. The release must reach Redis within the target.
fn dropped_at_the_end_of_block_on(job_multi_thread: bool) {
    let main = runtime(true);
    let server = main.block_on(common::server());
    // A fixed 3 s lease: if the release is lost, the lock stays for all of it.
    let client = main.block_on(common::client(&server));
    let name = if job_multi_thread {
        "job-multi"
    } else {
        "job-current"
    };
    let mut messages = main.block_on(release_messages(&server, name));
    let job = runtime(job_multi_thread);
    let lock = client
        .lock(name)
        .unwrap()
        .with_lease(Duration::from_secs(3));
    let dropped_at = job.block_on(async {
        let _guard = lock.lock().await.unwrap();
        // ... the job's work; the guard is dropped as the job returns ...
        Instant::now()
    });
    drop(job);
    main.block_on(bounded(LIMIT, async {
        let released = tokio::time::timeout(Duration::from_secs(5), messages.on_message().next())
            .await
            .is_ok();
        let after = dropped_at.elapsed();
        assert!(released, "no release within 5 s of the drop");
        assert!(
            after <= RELEASE_TARGET,
            "released {after:?} after the drop, target {RELEASE_TARGET:?}"
        );
        assert!(!lock.is_locked().await.unwrap());
    }));
}

#[test]
fn a_guard_dropped_as_a_current_thread_job_ends_is_released_at_once() {
    dropped_at_the_end_of_block_on(false);
}

#[test]
fn a_guard_dropped_as_a_multi_thread_job_ends_is_released_at_once() {
    dropped_at_the_end_of_block_on(true);
}

#[test]
fn a_guard_dropped_in_an_idle_runtime_is_released_not_renewed() {
    let main = runtime(true);
    let server = main.block_on(common::server());
    let client = main.block_on(common::client_with_watchdog(
        &server,
        Duration::from_millis(300),
    ));
    let mut messages = main.block_on(release_messages(&server, "idle"));
    let idle = runtime(false);
    let lock = client.lock("idle").unwrap();
    let guard = idle.block_on(lock.lock()).unwrap();
    // Dropped inside the idle runtime's context: nothing will ever drive that runtime again.
    let dropped_at = {
        let _inside = idle.enter();
        drop(guard);
        Instant::now()
    };
    main.block_on(bounded(LIMIT, async {
        // Three watchdog periods: a lock still renewed would outlive them.
        let released = tokio::time::timeout(Duration::from_secs(1), messages.on_message().next())
            .await
            .is_ok();
        assert!(released, "the dropped guard's lock was never released");
        assert!(dropped_at.elapsed() <= Duration::from_secs(1));
        assert!(!lock.is_locked().await.unwrap());
        assert_eq!(client.tracked_leases(), 0, "nothing is renewed any more");
    }));
    drop(idle);
}

#[test]
fn waiting_still_wakes_on_release_after_the_first_waiters_runtime_ended() {
    let main = runtime(true);
    let server = main.block_on(common::server());
    let client = main.block_on(common::client(&server));
    let rival = main.block_on(common::client(&server));
    let lock = client.lock("hub").unwrap();
    let rival_lock = rival
        .lock("hub")
        .unwrap()
        .with_lease(Duration::from_secs(5));
    // The first wait of this client happens on a runtime that then ends.
    let held = main.block_on(rival_lock.lock()).unwrap();
    let first_job = runtime(false);
    let waiter = lock.clone();
    let handle = first_job.spawn(async move { waiter.lock().await.map(drop) });
    main.block_on(async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        held.release().await.unwrap();
    });
    first_job.block_on(handle).unwrap().unwrap();
    drop(first_job);
    main.block_on(bounded(LIMIT, async {
        common::until_free(&lock).await;
        // Now a release must still wake a waiter of this client within a round trip or
        // two, not after the 5 s lease.
        for round in 0..3 {
            let held = rival_lock.lock().await.unwrap();
            let waiter = lock.clone();
            let waiting = tokio::spawn(async move {
                let guard = waiter.lock().await.unwrap();
                let got_it = Instant::now();
                guard.release().await.unwrap();
                got_it
            });
            // Let the waiter subscribe and find the lock busy.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let released_at = Instant::now();
            held.release().await.unwrap();
            let handoff = waiting.await.unwrap().duration_since(released_at);
            assert!(
                handoff < Duration::from_millis(250),
                "round {round}: handoff took {handoff:?}"
            );
        }
    }));
}

/// The child: a `#[tokio::main]`-style program that takes a lock and returns from main
/// with the guard (and the client) still alive.
#[test]
#[ignore = "run by main_returning_with_a_guard_leaves_no_lock as a child process"]
fn child_returns_from_main_holding() {
    let Ok(url) = std::env::var("DISTLOCK_CHILD_URL") else {
        return;
    };
    runtime(true).block_on(async {
        let client = distlock::Client::connect(&url).await.unwrap();
        let lock = client.lock("main-returns").unwrap();
        let _guard = lock.lock().await.unwrap();
        println!("acquired");
    });
}

#[test]
fn main_returning_with_a_guard_leaves_no_lock() {
    let main = runtime(true);
    let server = main.block_on(common::server());
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_returns_from_main_holding",
            "--ignored",
            "--nocapture",
        ])
        .env("DISTLOCK_CHILD_URL", server.url())
        .stdout(Stdio::piped())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success(), "child failed: {stdout}");
    assert!(
        stdout.contains("acquired"),
        "child never acquired: {stdout}"
    );
    main.block_on(async {
        let mut conn = server.connection().await.unwrap();
        let exists: i64 = redis::cmd("EXISTS")
            .arg("main-returns")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(exists, 0, "the lock outlived the process that held it");
    });
}

/// The child of `the_last_handle_dropped_in_a_task_is_released_before_the_process_exits`:
/// a task takes a lock, waits for the parent's go (the parent cuts its connections
/// meanwhile), then drops its guard and the last client handle; main returns at once.
#[test]
#[ignore = "run by the_last_handle_dropped_in_a_task_is_released_before_the_process_exits"]
fn child_drops_the_last_handle_in_a_task() {
    let Ok(url) = std::env::var("DISTLOCK_CHILD_URL") else {
        return;
    };
    runtime(true).block_on(async {
        tokio::spawn(async move {
            let client = distlock::Client::connect(&url).await.unwrap();
            let guard = client.lock("task-drops").unwrap().lock().await.unwrap();
            println!("acquired");
            let mut go = String::new();
            let _ = std::io::stdin().read_line(&mut go);
            drop(guard);
            drop(client);
        })
        .await
        .unwrap();
    });
}

/// The last handle dropped in a task of a multi-thread runtime does not block the task;
/// the wait for its releases moves to the runtime's blocking pool, which the runtime's
/// end waits for. With its connections cut at the drop, the process must still not exit
/// before the release reaches the server.
#[test]
fn the_last_handle_dropped_in_a_task_is_released_before_the_process_exits() {
    use std::io::{BufRead, Write};
    let main = runtime(true);
    let server = main.block_on(common::server());
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_drops_the_last_handle_in_a_task",
            "--ignored",
            "--nocapture",
        ])
        .env("DISTLOCK_CHILD_URL", server.url())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("acquired") {
        line.clear();
        assert!(
            stdout.read_line(&mut line).unwrap() > 0,
            "child never acquired"
        );
    }
    // Every connection of the child is cut: its release must reconnect and ask again,
    // which takes longer than returning from main.
    let mut conn = sync_connection(&server);
    let _: i64 = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"])
        .query(&mut conn)
        .unwrap();
    writeln!(child.stdin.take().unwrap(), "go").unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "child failed: {status}");
    assert!(
        key_becomes(&mut conn, "task-drops", false, Duration::ZERO),
        "the process exited before the release of its last handle was sent"
    );
}

/// Watches `name`'s release channel from a thread of its own (so it runs while the test's
/// runtimes are blocked) and sends the moment of the first release message.
fn release_watcher(server: &RedisServer, name: &str) -> std::sync::mpsc::Receiver<Instant> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (released_tx, released_rx) = std::sync::mpsc::channel();
    let client = server.client().unwrap();
    let channel = format!("redisson_lock__channel:{{{name}}}");
    std::thread::spawn(move || {
        runtime(false).block_on(async move {
            let mut pubsub = client.get_async_pubsub().await.unwrap();
            pubsub.subscribe(channel).await.unwrap();
            ready_tx.send(()).unwrap();
            if pubsub.on_message().next().await.is_some() {
                let _ = released_tx.send(Instant::now());
            }
        });
    });
    ready_rx.recv_timeout(LIMIT).expect("watcher subscribed");
    released_rx
}

/// The fencing tokens handed out so far on the server, over all counters.
fn tokens_issued(conn: &mut redis::Connection) -> u64 {
    let counters: Vec<String> = redis::cmd("KEYS")
        .arg("distlock_fence:*")
        .query(conn)
        .unwrap();
    counters
        .iter()
        .map(|key| redis::cmd("GET").arg(key).query::<u64>(conn).unwrap())
        .sum()
}

/// A release cancelled on a current_thread runtime, which then blocks on synchronous work
/// (here: waiting for the release itself), still reaches Redis at once: it must not wait
/// for that runtime to be driven again.
fn cancelled_release_on_a_blocked_runtime(multi_thread: bool) {
    let main = runtime(true);
    let server = main.block_on(common::server());
    let released = release_watcher(&server, "cancelled-release");
    runtime(multi_thread).block_on(async {
        let client = common::client(&server).await;
        let guard = client
            .lock("cancelled-release")
            .unwrap()
            .lock()
            .await
            .unwrap();
        let cancelled_at = Instant::now();
        cancel_after_first_poll(guard.release()).await;
        // Synchronous work on this runtime's thread.
        let released_at = released.recv_timeout(Duration::from_secs(3));
        let after = released_at.map(|at| at.duration_since(cancelled_at));
        assert!(
            matches!(after, Ok(after) if after <= RELEASE_TARGET),
            "release published {after:?} after it was cancelled, target {RELEASE_TARGET:?}"
        );
        client.shutdown().await;
    });
}

#[test]
fn a_cancelled_release_completes_while_its_current_thread_runtime_is_blocked() {
    cancelled_release_on_a_blocked_runtime(false);
}

/// The same with a multi-thread runtime, one of whose workers blocks.
#[test]
fn a_cancelled_release_completes_while_a_multi_thread_worker_is_blocked() {
    cancelled_release_on_a_blocked_runtime(true);
}

/// A release cancelled just before the last client handle is dropped: the drop flushes it
/// quickly, and no lock is left for its lease.
#[test]
fn a_cancelled_release_is_flushed_by_dropping_the_last_handle() {
    let main = runtime(true);
    let server = main.block_on(common::server());
    let mut conn = sync_connection(&server);
    runtime(false).block_on(async {
        let client = common::client(&server).await;
        let guard = client.lock("flushed").unwrap().lock().await.unwrap();
        cancel_after_first_poll(guard.release()).await;
        let dropping = Instant::now();
        drop(client);
        let blocked = dropping.elapsed();
        assert!(
            blocked < Duration::from_secs(1),
            "dropping the last handle blocked {blocked:?}"
        );
    });
    assert!(
        key_becomes(&mut conn, "flushed", false, Duration::ZERO),
        "the lock outlived its cancelled release and the client"
    );
}

/// A `lock()` cancelled after its attempt was sent, on a current_thread runtime that then
/// blocks: the attempt's outcome is settled on the client's own runtime (it acquired, so
/// it releases), and another client is not kept waiting by a lock nobody wanted.
#[test]
fn a_cancelled_acquisition_is_settled_while_its_runtime_is_blocked() {
    let main = runtime(true);
    let server = main.block_on(common::server());
    let mut conn = sync_connection(&server);
    runtime(false).block_on(async {
        let client = common::client(&server).await;
        let lock = client.lock("cancelled-acquire").unwrap();
        cancel_after_first_poll(lock.lock()).await;
        // Synchronous work from here on: this runtime is not driven. The attempt takes
        // the lock (a token is issued), and its guard, which nobody will ever see, must
        // release it.
        let give_up = Instant::now() + Duration::from_millis(500);
        let settled = loop {
            let acquired = tokens_issued(&mut conn) == 1;
            if acquired && key_becomes(&mut conn, "cancelled-acquire", false, Duration::ZERO) {
                break true;
            }
            if Instant::now() >= give_up {
                break false;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(
            settled,
            "the cancelled attempt did not run and release while its runtime was blocked \
             (tokens issued: {}, lock present: {})",
            tokens_issued(&mut conn),
            key_becomes(&mut conn, "cancelled-acquire", true, Duration::ZERO)
        );
        client.shutdown().await;
    });
}

/// `Handle::block_on` on another thread, with the handle of the current_thread runtime
/// that connected, while that runtime's own thread is blocked: the call completes (tokio
/// cannot drive that runtime's connections from there; the client must not need it to).
#[test]
fn handle_block_on_works_while_the_connecting_runtime_is_blocked() {
    let main = runtime(true);
    let server = main.block_on(common::server());
    let home = runtime(false);
    let client = home.block_on(common::client(&server));
    let lock = client.lock("handle-block-on").unwrap();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    home.block_on(async {
        let handle = tokio::runtime::Handle::current();
        std::thread::spawn(move || {
            let acquired = handle
                .block_on(lock.try_lock())
                .map(|guard| guard.is_some());
            let _ = done_tx.send(acquired);
        });
        // This runtime's thread waits synchronously for that thread.
        let outcome = done_rx.recv_timeout(Duration::from_secs(3));
        assert!(
            matches!(outcome, Ok(Ok(true))),
            "try_lock through the blocked runtime's handle: {outcome:?}"
        );
    });
    home.block_on(client.shutdown());
}

/// `shutdown()` sends the releases of guards dropped just before it, and re-entries'
/// partial releases, before it returns.
#[test]
fn shutdown_flushes_the_releases_of_dropped_guards() {
    let main = runtime(true);
    let server = main.block_on(common::server());
    let mut conn = sync_connection(&server);
    runtime(false).block_on(async {
        let client = common::client(&server).await;
        let mut guards = Vec::new();
        for n in 0..50 {
            guards.push(
                client
                    .lock(format!("flush-{n}"))
                    .unwrap()
                    .lock()
                    .await
                    .unwrap(),
            );
        }
        let nested = guards[0].reenter().await.unwrap();
        drop(guards);
        drop(nested);
        bounded(LIMIT, client.shutdown()).await;
    });
    let left: Vec<String> = redis::cmd("KEYS").arg("flush-*").query(&mut conn).unwrap();
    assert!(left.is_empty(), "locks left after shutdown: {left:?}");
}

/// After `shutdown()`, every call on the client, its locks and its live guards fails with
/// `Error::Shutdown`, whichever runtime it is made from.
fn calls_after_shutdown_fail_alike(home_multi_thread: bool) {
    let server = runtime(true).block_on(common::server());
    let home = runtime(home_multi_thread);
    let foreign = runtime(false);
    let client = home.block_on(common::client(&server));
    let lock = client.lock("after-shutdown").unwrap();
    let guards = home.block_on(async {
        let first = client.lock("held-1").unwrap().lock().await.unwrap();
        let second = client.lock("held-2").unwrap().lock().await.unwrap();
        client.shutdown().await;
        [first, second]
    });
    for (runtime, guard) in [&home, &foreign].into_iter().zip(guards) {
        runtime.block_on(async {
            let outcomes = [
                format!("{:?}", lock.try_lock().await.map(|guard| guard.is_some())),
                format!("{:?}", lock.is_locked().await),
                format!("{:?}", lock.remaining_ttl().await),
                format!("{:?}", lock.force_unlock().await),
                format!("{:?}", guard.reenter().await.map(drop)),
            ];
            assert!(
                outcomes.iter().all(|outcome| outcome.contains("Shutdown")),
                "calls after shutdown: {outcomes:?}"
            );
            // Giving back is always allowed: the lock is freed.
            let name = guard.name().to_owned();
            let released = guard.release().await;
            assert!(released.is_ok(), "release after shutdown: {released:?}");
            assert!(
                key_becomes(&mut sync_connection(&server), &name, false, Duration::ZERO),
                "{name} is still held after its release"
            );
            let mut connection = client.connection();
            let ping = redis::cmd("PING")
                .query_async::<String>(&mut connection)
                .await;
            assert!(
                matches!(&ping, Err(err) if err.to_string().contains("shut down")),
                "the client's connection after shutdown: {ping:?}"
            );
        });
    }
}

#[test]
fn calls_after_shutdown_fail_alike_from_a_current_thread_home() {
    calls_after_shutdown_fail_alike(false);
}

#[test]
fn calls_after_shutdown_fail_alike_from_a_multi_thread_home() {
    calls_after_shutdown_fail_alike(true);
}

/// A release cancelled on a multi-thread runtime every worker of which is stuck in
/// synchronous work: the connection it was sent on is driven by those workers, and the
/// release must not wait for them.
#[test]
fn a_cancelled_release_completes_while_every_multi_thread_worker_is_blocked() {
    let main = runtime(true);
    let server = main.block_on(common::server());
    let released = release_watcher(&server, "every-worker");
    let home = runtime(true);
    let client = home.block_on(common::client(&server));
    let guard = home.block_on(async { client.lock("every-worker").unwrap().lock().await.unwrap() });
    // One worker is stuck; the task that cancels the release then blocks the other one.
    common::block_every_worker(&home, 1, Duration::from_secs(2));
    let (cancelled_tx, cancelled_rx) = std::sync::mpsc::channel();
    home.spawn(async move {
        cancel_after_first_poll(guard.release()).await;
        let _ = cancelled_tx.send(Instant::now());
        std::thread::sleep(Duration::from_secs(2));
    });
    let cancelled_at = cancelled_rx.recv_timeout(LIMIT).unwrap();
    let after = released
        .recv_timeout(Duration::from_secs(3))
        .map(|at| at.duration_since(cancelled_at));
    assert!(
        matches!(after, Ok(after) if after <= Duration::from_millis(250)),
        "release published {after:?} after it was cancelled, while the workers were blocked"
    );
    home.block_on(client.shutdown());
}

/// A waiting call through `Handle::block_on` on another thread, while the current_thread
/// runtime that connected is blocked: its waits must run on a clock that is driven.
fn waiting_through_the_handle_of_a_blocked_runtime(bounded_wait: bool) {
    let main = runtime(true);
    let server = main.block_on(common::server());
    let home = runtime(false);
    let client = home.block_on(common::client(&server));
    let holder = main.block_on(common::client(&server));
    let _held = main.block_on(async {
        holder
            .lock("handle-wait")
            .unwrap()
            .with_lease(Duration::from_millis(300))
            .lock()
            .await
            .unwrap()
    });
    let lock = client.lock("handle-wait").unwrap();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    home.block_on(async {
        let handle = tokio::runtime::Handle::current();
        std::thread::spawn(move || {
            let outcome = if bounded_wait {
                handle
                    .block_on(lock.try_lock_for(Duration::from_millis(100)))
                    .map(|guard| guard.is_none())
            } else {
                handle.block_on(lock.lock()).map(|_| true)
            };
            let _ = done_tx.send(outcome);
        });
        let outcome = done_rx.recv_timeout(Duration::from_secs(3));
        assert!(
            matches!(outcome, Ok(Ok(true))),
            "waiting through the blocked runtime's handle: {outcome:?}"
        );
    });
    home.block_on(client.shutdown());
    main.block_on(holder.shutdown());
}

#[test]
fn try_lock_for_through_the_handle_of_a_blocked_runtime_times_out() {
    waiting_through_the_handle_of_a_blocked_runtime(true);
}

#[test]
fn lock_through_the_handle_of_a_blocked_runtime_gets_the_lock_when_the_lease_ends() {
    waiting_through_the_handle_of_a_blocked_runtime(false);
}

/// `Handle::block_on` from a thread of its own while the only worker of the multi-thread
/// runtime that connected is busy: the call must not go over that runtime's connection,
/// which nothing drives until the worker is free. (From a `spawn_blocking` task it still
/// does: see docs/safety.md.)
#[test]
fn handle_block_on_from_another_thread_works_while_every_worker_is_busy() {
    let main = runtime(true);
    let server = main.block_on(common::server());
    let home = common::runtime_with(true, 1);
    let client = home.block_on(common::client(&server));
    let holder = main.block_on(common::client(&server));
    let _held = main.block_on(async { holder.lock("busy-workers").unwrap().lock().await.unwrap() });
    let busy = client.lock("busy-workers").unwrap();
    let free = client.lock("free-while-busy").unwrap();
    common::block_every_worker(&home, 1, Duration::from_secs(3));
    let handle = home.handle().clone();
    let (waited, took, taken, total) = std::thread::spawn(move || {
        let started = Instant::now();
        let waited = handle
            .block_on(busy.try_lock_for(Duration::from_millis(200)))
            .map(|guard| guard.is_none());
        let took = started.elapsed();
        let taken = handle
            .block_on(free.try_lock())
            .map(|guard| guard.is_some());
        (waited, took, taken, started.elapsed())
    })
    .join()
    .unwrap();
    assert!(
        matches!(waited, Ok(true)) && took < Duration::from_secs(1),
        "try_lock_for(200 ms) on a held lock: {waited:?} after {took:?}"
    );
    assert!(
        matches!(taken, Ok(true)) && total < Duration::from_secs(1),
        "try_lock on a free lock: {taken:?}, {total:?} in all"
    );
    home.block_on(client.shutdown());
    main.block_on(holder.shutdown());
}

/// Polls `future` to completion on the calling thread, with no tokio runtime: another
/// executor, as a library user might bring.
fn block_on_without_tokio<F: std::future::Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut context = std::task::Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let std::task::Poll::Ready(output) = future.as_mut().poll(&mut context) {
            return output;
        }
        std::thread::park();
    }
}

/// Every call works from an executor that is not tokio, the lost signal included: it
/// fires when a fixed lease runs out.
#[test]
fn a_guard_and_its_lost_signal_work_outside_tokio() {
    let main = runtime(true);
    let server = main.block_on(common::server());
    let client = main.block_on(common::client(&server));
    let lock = client
        .lock("outside-tokio")
        .unwrap()
        .with_lease(Duration::from_millis(300));
    let outcome = std::thread::spawn(move || {
        let guard = block_on_without_tokio(lock.lock()).unwrap();
        let started = Instant::now();
        block_on_without_tokio(guard.lost());
        (started.elapsed(), block_on_without_tokio(guard.release()))
    })
    .join();
    let (fired_after, released) = outcome.expect("the thread without tokio panicked");
    // It fires a safety margin (8 ms here) before the deadline, never after it.
    assert!(
        fired_after >= Duration::from_millis(250) && fired_after < Duration::from_millis(300),
        "lost() fired {fired_after:?} into a 300 ms lease"
    );
    // The server may still have the lease's last milliseconds: either answer is right.
    assert!(released.is_ok(), "{released:?}");
    main.block_on(client.shutdown());
}

/// A guard on `name` with a fixed lease of `lease`.
async fn held_for(client: &distlock::Client, name: &str, lease: Duration) -> distlock::LockGuard {
    let lock = client.lock(name).unwrap();
    lock.with_lease(lease).lock().await.unwrap()
}

/// Issue 30, 4.1, the other way round from `starved.rs` (where the clients' thread is
/// stalled): every worker of the awaiting runtime is busy, so that runtime's
/// timers cannot fire; the clients' thread fires the signal, and `lost()` in the
/// `block_on` body (whose thread is free) completes on time.
#[test]
fn lost_awaited_in_a_tokio_main_body_fires_at_the_deadline_while_every_worker_is_blocked() {
    let runtime = common::runtime_with(true, 1);
    runtime.block_on(async {
        let server = common::server().await;
        let client = common::client(&server).await;
        let guard = held_for(&client, "main-body-busy", Duration::from_millis(300)).await;
        let started = Instant::now();
        common::block_every_worker(&runtime, 1, Duration::from_millis(2_000));
        // No timeout of this runtime's here: its timers are stalled with its worker.
        guard.lost().await;
        let fired = started.elapsed();
        eprintln!("lost() in a block_on body, every worker blocked: fired after {fired:?}");
        assert!(fired < Duration::from_millis(600), "fired after {fired:?}");
    });
}

/// A current-thread runtime busy on its own thread, awaited through its handle from
/// another thread (as a sync wrapper does): the future is polled, but nothing drives that
/// runtime's timers; the clients' thread fires the signal on time.
#[test]
fn lost_awaited_through_the_handle_of_a_busy_current_thread_runtime_fires_on_time() {
    let runtime = common::runtime_with(false, 1);
    let (server, client, guard) = runtime.block_on(async {
        let server = common::server().await;
        let client = common::client(&server).await;
        let guard = held_for(&client, "busy-current", Duration::from_millis(300)).await;
        (server, client, guard)
    });
    let handle = runtime.handle().clone();
    let (busy_tx, busy_rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        // The runtime's own thread, busy in its own `block_on` for 2 s.
        scope.spawn(|| {
            runtime.block_on(async {
                let _ = busy_tx.send(());
                std::thread::sleep(Duration::from_millis(2_000));
            })
        });
        busy_rx.recv().unwrap();
        let started = Instant::now();
        handle.block_on(guard.lost());
        let fired = started.elapsed();
        eprintln!("lost() through a busy current-thread runtime's handle: fired after {fired:?}");
        assert!(fired < Duration::from_millis(600), "fired after {fired:?}");
    });
    drop((guard, client, server));
}
