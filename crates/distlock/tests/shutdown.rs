//! `Client::shutdown` and the last handle's drop end everything the client started, in
//! bounded time, whatever state the caller's runtime is in: guards still alive are told
//! their lease is lost, waiters stop waiting, and a release cancelled on a runtime that
//! then stalls still reaches Redis.

mod common;

use std::time::{Duration, Instant};

use common::{
    block_every_worker, bounded, cancel_after_first_poll, key_becomes, raw,
    runtime_with as runtime, sync_connection, until_subscribers,
};
use distlock::Error;

const LIMIT: Duration = Duration::from_secs(20);

/// After `shutdown()` nothing renews a live guard, so no guard is trusted any more: its
/// lost signal fires at once, through every form of it, taken before or after.
fn shutdown_fires_the_lost_signal(multi_thread: bool) {
    let server = runtime(true, 2).block_on(common::server());
    runtime(multi_thread, 2).block_on(async {
        let client = common::client(&server).await;
        let guard = client
            .lock("live-at-shutdown")
            .unwrap()
            .lock()
            .await
            .unwrap();
        let token_before = guard.lost_token();
        let lost_before = guard.lost();
        client.shutdown().await;
        let token_after = guard.lost_token();
        assert!(guard.is_lost(), "a guard is still trusted after shutdown");
        assert!(
            token_before.is_cancelled(),
            "a lost token taken before shutdown did not fire"
        );
        assert!(
            token_after.is_cancelled(),
            "a lost token taken after shutdown did not fire"
        );
        bounded(Duration::from_secs(1), lost_before).await;
        bounded(Duration::from_secs(1), guard.lost()).await;
    });
}

#[test]
fn shutdown_fires_the_lost_signal_of_live_guards_on_a_current_thread_runtime() {
    shutdown_fires_the_lost_signal(false);
}

#[test]
fn shutdown_fires_the_lost_signal_of_live_guards_on_a_multi_thread_runtime() {
    shutdown_fires_the_lost_signal(true);
}

/// A `lock()` waiting when its client shuts down fails with `Error::Shutdown` at once,
/// and never takes the lock afterwards.
fn shutdown_ends_waiters(multi_thread: bool) {
    let server = runtime(true, 2).block_on(common::server());
    runtime(multi_thread, 2).block_on(async {
        let holder = common::client(&server).await;
        let held = holder.lock("awaited").unwrap().lock().await.unwrap();
        let client = common::client(&server).await;
        let lock = client.lock("awaited").unwrap();
        let waiter =
            tokio::spawn(async move { lock.lock().await.map(|guard| guard.fencing_token()) });
        let admin = raw(&server).await;
        until_subscribers(&admin, "redisson_lock__channel:{awaited}", 1).await;
        let shutting_down = Instant::now();
        bounded(LIMIT, client.shutdown()).await;
        let outcome = bounded(Duration::from_secs(2), waiter).await.unwrap();
        let took = shutting_down.elapsed();
        assert!(
            matches!(outcome, Err(Error::Shutdown)),
            "the waiter got {outcome:?}"
        );
        assert!(
            took < Duration::from_millis(500),
            "the waiter ended {took:?} after shutdown"
        );
        // The holder's release must free the lock for good: the shut-down client's waiter
        // is gone, and takes nothing.
        held.release().await.unwrap();
        let mut admin = admin.clone();
        let tokens: Vec<u64> = {
            let counters: Vec<String> = redis::cmd("KEYS")
                .arg("distlock_fence:*")
                .query_async(&mut admin)
                .await
                .unwrap();
            let mut tokens = Vec::new();
            for counter in counters {
                tokens.push(
                    redis::cmd("GET")
                        .arg(counter)
                        .query_async(&mut admin)
                        .await
                        .unwrap(),
                );
            }
            tokens
        };
        assert_eq!(
            tokens.iter().sum::<u64>(),
            1,
            "a token was issued after shutdown"
        );
        holder.shutdown().await;
    });
}

#[test]
fn shutdown_ends_waiters_on_a_current_thread_runtime() {
    shutdown_ends_waiters(false);
}

#[test]
fn shutdown_ends_waiters_on_a_multi_thread_runtime() {
    shutdown_ends_waiters(true);
}

/// A release cancelled in a task of a one-worker runtime, then the last handle dropped in
/// that same task: the drop blocks the only worker, which drives the connection the
/// release was sent on. The release must not wait for it.
#[test]
fn dropping_the_last_handle_on_a_one_worker_runtime_flushes_a_cancelled_release() {
    let server = runtime(true, 2).block_on(common::server());
    let url = server.url();
    let blocked = runtime(true, 1).block_on(async move {
        tokio::spawn(async move {
            let client = distlock::Client::connect(&url).await.unwrap();
            let guard = client.lock("one-worker").unwrap().lock().await.unwrap();
            cancel_after_first_poll(guard.release()).await;
            let dropping = Instant::now();
            drop(client);
            dropping.elapsed()
        })
        .await
        .unwrap()
    });
    assert!(
        blocked < Duration::from_secs(1),
        "dropping the last handle blocked {blocked:?}"
    );
    // The drop does not wait on the worker it runs on; the release follows at once.
    let gone = key_becomes(
        &mut sync_connection(&server),
        "one-worker",
        false,
        Duration::from_millis(500),
    );
    assert!(
        gone,
        "the lock outlived its cancelled release and the client"
    );
}

/// `shutdown()` from another thread while every worker of the runtime that connected is
/// stuck in synchronous work, with a release cancelled there: it returns in bounded time
/// and the lock is freed.
#[test]
fn shutdown_is_bounded_while_the_connecting_runtime_is_stalled() {
    let server = runtime(true, 2).block_on(common::server());
    let home = runtime(true, 1);
    let client = home.block_on(common::client(&server));
    let guard = home.block_on(async { client.lock("stalled-home").unwrap().lock().await.unwrap() });
    block_every_worker(&home, 1, Duration::from_secs(4));
    home.block_on(cancel_after_first_poll(guard.release()));
    let shutting_down = Instant::now();
    let stopper = client.clone();
    let returned = std::thread::spawn(move || {
        runtime(false, 1).block_on(async {
            tokio::time::timeout(Duration::from_secs(3), stopper.shutdown())
                .await
                .is_ok()
        })
    })
    .join()
    .unwrap();
    let took = shutting_down.elapsed();
    assert!(
        returned && took < Duration::from_secs(1),
        "shutdown returned: {returned}, after {took:?}"
    );
    assert!(
        key_becomes(
            &mut sync_connection(&server),
            "stalled-home",
            false,
            Duration::ZERO
        ),
        "the cancelled release did not reach Redis by the end of shutdown"
    );
    home.shutdown_background();
}

/// A `lock()` cancelled after its command reached a paused server, then the last handle
/// dropped in a task of a one-worker runtime: that drop must not keep the only worker
/// from reading the reply (the attempt took the lock, and must give it back), nor block.
#[test]
fn a_cancelled_lock_then_the_last_handle_dropped_on_a_one_worker_runtime_leaves_no_lock() {
    let server = std::sync::Arc::new(runtime(true, 2).block_on(common::server()));
    let paused = std::sync::Arc::clone(&server);
    let url = server.url();
    let blocked = runtime(true, 1).block_on(async move {
        tokio::spawn(async move {
            let client = distlock::Client::connect(&url).await.unwrap();
            let lock = client.lock("cancelled-lock").unwrap();
            paused.pause().unwrap();
            {
                let mut acquiring = std::pin::pin!(lock.lock());
                assert!(futures_util::poll!(acquiring.as_mut()).is_pending());
                // Let the connection write the command to the (paused) server.
                for _ in 0..20 {
                    tokio::task::yield_now().await;
                }
            }
            let resumer = std::sync::Arc::clone(&paused);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                resumer.resume().unwrap();
            });
            let dropping = Instant::now();
            drop(lock);
            drop(client);
            dropping.elapsed()
        })
        .await
        .unwrap()
    });
    assert!(
        blocked < Duration::from_secs(1),
        "dropping the last handle blocked {blocked:?}"
    );
    assert!(
        key_becomes(
            &mut sync_connection(&server),
            "cancelled-lock",
            false,
            Duration::from_secs(1)
        ),
        "the cancelled acquisition took the lock and nobody gave it back"
    );
}

/// A `lock()` future alive but parked (pinned outside a `select!` loop, not polled while
/// the loop shuts down) holds nothing in flight: shutdown must not wait for it.
#[test]
fn shutdown_does_not_wait_for_a_parked_waiter() {
    let server = runtime(true, 2).block_on(common::server());
    for multi_thread in [false, true] {
        let took = runtime(multi_thread, 2).block_on(async {
            let holder = common::client(&server).await;
            let _held = holder.lock("parked").unwrap().lock().await.unwrap();
            let client = common::client(&server).await;
            let lock = client.lock("parked").unwrap();
            let admin = raw(&server).await;
            let waiter = lock.lock();
            tokio::pin!(waiter);
            let subscribed = until_subscribers(&admin, "redisson_lock__channel:{parked}", 1);
            tokio::pin!(subscribed);
            // The `lock()` future stays alive, parked, while this branch shuts down.
            tokio::select! {
                _ = &mut waiter => unreachable!("the lock is held by another client"),
                _ = &mut subscribed => {}
            }
            let shutting_down = Instant::now();
            bounded(LIMIT, client.shutdown()).await;
            let took = shutting_down.elapsed();
            holder.shutdown().await;
            took
        });
        assert!(
            took < Duration::from_millis(500),
            "multi_thread={multi_thread}: shutdown waited {took:?} for a parked waiter"
        );
    }
}

/// An acquisition still in flight when shutdown's time bound runs out (the server and
/// every worker of the caller's runtime stalled) takes the lock after shutdown returned:
/// it is given back all the same.
#[test]
fn an_acquisition_that_completes_after_shutdown_gave_up_is_given_back() {
    let server = runtime(true, 2).block_on(common::server());
    let home = runtime(true, 2);
    let client = home
        .block_on(
            distlock::Client::builder()
                .response_timeout(Duration::from_millis(300))
                .connect(&server.url()),
        )
        .unwrap();
    let lock = client.lock("late").unwrap();
    server.pause().unwrap();
    let attempt = home.spawn(async move { lock.try_lock().await.map(|guard| guard.is_some()) });
    std::thread::sleep(Duration::from_millis(100));
    block_every_worker(&home, 2, Duration::from_secs(3));
    let stopper = client.clone();
    let took = std::thread::spawn(move || {
        let shutting_down = Instant::now();
        runtime(false, 1).block_on(stopper.shutdown());
        shutting_down.elapsed()
    })
    .join()
    .unwrap();
    server.resume().unwrap();
    let outcome = home.block_on(async { bounded(LIMIT, attempt).await.unwrap() });
    assert!(
        matches!(outcome, Err(Error::Shutdown) | Err(Error::Redis(_))),
        "an acquisition that completed after shutdown was handed out: {outcome:?} (shutdown took {took:?})"
    );
    assert!(
        key_becomes(
            &mut sync_connection(&server),
            "late",
            false,
            Duration::from_secs(2)
        ),
        "the late acquisition's lock was left on the server"
    );
    home.shutdown_background();
}

/// Giving back is always allowed: a re-entry released as shutdown starts, and its outer
/// guard dropped during the drain, free the lock; so does a release after shutdown.
#[test]
fn releases_still_free_their_locks_during_and_after_shutdown() {
    let server = runtime(true, 2).block_on(common::server());
    runtime(true, 2).block_on(async {
        let client = common::client(&server).await;
        let outer = client
            .lock("nested-at-shutdown")
            .unwrap()
            .lock()
            .await
            .unwrap();
        let nested = outer.reenter().await.unwrap();
        let after = client.lock("released-after").unwrap().lock().await.unwrap();
        let (_, nested_release) = tokio::join!(client.shutdown(), async {
            let released = nested.release().await;
            drop(outer);
            released
        });
        assert!(nested_release.is_ok(), "{nested_release:?}");
        let released_after = after.release().await;
        assert!(released_after.is_ok(), "{released_after:?}");
        let mut conn = sync_connection(&server);
        for name in ["nested-at-shutdown", "released-after"] {
            assert!(
                key_becomes(&mut conn, name, false, Duration::from_secs(1)),
                "{name} is still held after its guards were released"
            );
        }
    });
}
