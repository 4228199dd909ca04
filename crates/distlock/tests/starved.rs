//! A client whose background thread cannot run. Its own test binary: the thread is shared
//! by every client of the process, and stalling it would slow the other tests' clients.

mod common;

use std::time::{Duration, Instant};

use common::{bounded, client, server};

const LIMIT: Duration = Duration::from_secs(20);

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
        let token = guard.lost_token();
        let started = Instant::now();
        client.stall_background_for_tests(Duration::from_millis(2_000));
        token.cancelled().await;
        let fired = started.elapsed();
        assert!(fired < Duration::from_millis(600), "fired after {fired:?}");
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
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let brief = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    brief.block_on(async { drop(guard.lost_token()) });
                    // `brief` ends here, with the timer task it ran.
                })
                .join()
                .unwrap();
        });
        let token = guard.lost_token();
        let started = Instant::now();
        client.stall_background_for_tests(Duration::from_millis(2_000));
        token.cancelled().await;
        let fired = started.elapsed();
        assert!(fired < Duration::from_millis(700), "fired after {fired:?}");
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
        std::thread::scope(|scope| {
            scope
                .spawn(|| idle.block_on(async { drop(guard.lost_token()) }))
                .join()
                .unwrap();
        });
        let token = guard.lost_token();
        let started = Instant::now();
        client.stall_background_for_tests(Duration::from_millis(2_000));
        token.cancelled().await;
        let fired = started.elapsed();
        assert!(fired < Duration::from_millis(700), "fired after {fired:?}");
        // A runtime may not be dropped inside another's task.
        std::thread::spawn(move || drop(idle)).join().unwrap();
    })
    .await;
}
