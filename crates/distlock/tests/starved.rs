//! A client whose background thread cannot run. Its own test binary: the thread is shared
//! by every client of the process, and stalling it would slow the other tests' clients.

mod common;

use std::time::{Duration, Instant};

use common::{bounded, client, server};

const LIMIT: Duration = Duration::from_secs(20);

/// Asks `guard` for a lost token in `runtime`, from a thread of its own (as a sync
/// wrapper's `block_on` would), and lets go of the token at once.
fn token_asked_in(runtime: &tokio::runtime::Runtime, guard: &distlock::LockGuard) {
    std::thread::scope(|scope| {
        scope
            .spawn(|| runtime.block_on(async { drop(guard.lost_token()) }))
            .join()
            .unwrap();
    });
}

/// Stalls the client's background thread and checks that a token asked for now fires
/// within `limit` all the same: by its own timer on this runtime.
async fn fires_while_stalled(
    client: &distlock::Client,
    guard: &distlock::LockGuard,
    limit: Duration,
) {
    let token = guard.lost_token();
    let started = Instant::now();
    client.stall_background_for_tests(Duration::from_millis(2_000));
    token.cancelled().await;
    let fired = started.elapsed();
    assert!(fired < limit, "fired after {fired:?}");
}

/// A guard on `name` with a fixed lease of `lease`.
async fn held(client: &distlock::Client, name: &str, lease: Duration) -> distlock::LockGuard {
    let lock = client.lock(name).unwrap();
    lock.with_lease(lease).lock().await.unwrap()
}

/// Review: only the watchdog task cancelled `lost_token()`, so a worker checking the
/// token alone acted past the deadline while the client's thread was starved.
#[tokio::test]
async fn the_lost_token_fires_at_the_deadline_while_the_clients_thread_is_starved() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let guard = held(&client, "starved", Duration::from_millis(300)).await;
        fires_while_stalled(&client, &guard, Duration::from_millis(600)).await;
        assert!(guard.is_lost());
    })
    .await;
}

/// Review: only the first `lost_token()` call started the deadline timer, on its caller's
/// runtime; when that runtime ended, later tokens had no timer of their own.
#[tokio::test]
async fn the_deadline_timer_restarts_after_the_runtime_that_ran_it_ended() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let guard = held(&client, "timer-runtime", Duration::from_millis(400)).await;
        let brief = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        token_asked_in(&brief, &guard);
        // `brief` ends, with the timer task it ran (from a thread: a runtime may not be
        // dropped inside another's task).
        std::thread::spawn(move || drop(brief)).join().unwrap();
        fires_while_stalled(&client, &guard, Duration::from_millis(700)).await;
    })
    .await;
}

/// Second review: `lost_token()` asked once in a runtime that stays alive but is never
/// driven again parked the only deadline timer there; later tokens had none running.
#[tokio::test]
async fn a_runtime_nobody_drives_does_not_hold_up_the_lost_token() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let guard = held(&client, "idle-runtime", Duration::from_millis(300)).await;
        let idle = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        token_asked_in(&idle, &guard);
        fires_while_stalled(&client, &guard, Duration::from_millis(700)).await;
        std::thread::spawn(move || drop(idle)).join().unwrap();
    })
    .await;
}

/// A multi-thread runtime, as `#[tokio::main]` builds one.
fn tokio_main_runtime(workers: usize) -> tokio::runtime::Runtime {
    common::runtime_with(true, workers)
}

/// Issue 30, 4.1: README's first example awaits `guard.lost()` in the body of
/// `#[tokio::main]`, which is a `block_on`, not a task. There the future kept time on the
/// clients' thread alone, so it came as late as that thread was starved (2 s here, for a
/// 300 ms lease).
#[test]
fn lost_awaited_in_a_tokio_main_body_fires_at_the_deadline_while_the_clients_thread_is_starved() {
    let runtime = tokio_main_runtime(2);
    runtime.block_on(async {
        let server = server().await;
        let client = client(&server).await;
        let guard = held(&client, "main-body", Duration::from_millis(300)).await;
        let started = Instant::now();
        client.stall_background_for_tests(Duration::from_millis(2_000));
        bounded(LIMIT, guard.lost()).await;
        let fired = started.elapsed();
        eprintln!("lost() in a block_on body, clients' thread stalled: fired after {fired:?}");
        assert!(fired < Duration::from_millis(600), "fired after {fired:?}");
    });
}
