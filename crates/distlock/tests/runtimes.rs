//! The client does not depend on whichever runtime happens to be current: a guard dropped
//! as its runtime ends, or in a runtime nobody drives any more, is released; the pub/sub
//! hub outlives the runtime of the first waiter; a process that returns from main with a
//! guard still alive leaves no lock behind.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::bounded;
use distlock_testkit::RedisServer;
use futures_util::StreamExt;

const LIMIT: Duration = Duration::from_secs(20);

/// How soon a dropped guard must be released, from the moment it is dropped.
const RELEASE_TARGET: Duration = Duration::from_millis(100);

fn runtime(multi_thread: bool) -> tokio::runtime::Runtime {
    let mut builder = if multi_thread {
        tokio::runtime::Builder::new_multi_thread()
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    builder.worker_threads(2).enable_all().build().unwrap()
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
