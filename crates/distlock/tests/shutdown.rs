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
    // A task cancels the release (sent on the runtime's own connection), then keeps the
    // only worker busy, so nothing drives that connection.
    let (cancelled_tx, cancelled_rx) = std::sync::mpsc::channel();
    home.spawn(async move {
        cancel_after_first_poll(guard.release()).await;
        let _ = cancelled_tx.send(());
        std::thread::sleep(Duration::from_secs(4));
    });
    cancelled_rx.recv_timeout(LIMIT).unwrap();
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
            tokio::select! {
                _ = &mut waiter => unreachable!("the lock is held by another client"),
                _ = &mut subscribed => {}
            }
            // Its attempt after subscribing may still be on its way: polled a moment
            // longer, the waiter settles between attempts (an attempt in flight is work
            // shutdown rightly waits for; a cold run once parked it mid-attempt, 3 s).
            tokio::select! {
                _ = &mut waiter => unreachable!("the lock is held by another client"),
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
            // The `lock()` future stays alive, parked, while this branch shuts down.
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

/// A release whose first attempt finds its connection killed pauses before asking again;
/// its caller gives up during that pause, and then blocks (or drops) its runtime. The
/// release is finished on the client's thread, whose pause must not wait on the caller's
/// timer (blocked: never fires; dropped: panics when polled).
fn release_cancelled_during_its_retry_pause(drop_the_callers_runtime: bool) {
    let server = runtime(true, 2).block_on(common::server());
    let mut caller = Some(runtime(false, 1));
    let name = if drop_the_callers_runtime {
        "pause-dropped"
    } else {
        "pause-blocked"
    };
    let (client, guard) = caller.as_ref().unwrap().block_on(async {
        let client = common::client(&server).await;
        let guard = client.lock(name).unwrap().lock().await.unwrap();
        (client, guard)
    });
    let mut admin = sync_connection(&server);
    let _: i64 = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"])
        .query(&mut admin)
        .unwrap();
    caller.as_ref().unwrap().block_on(async {
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_millis(10), guard.release()).await;
        })
        .await
        .unwrap();
    });
    if drop_the_callers_runtime {
        drop(caller.take());
    }
    // Synchronous from here: the caller's runtime (if any) is not driven.
    assert!(
        key_becomes(&mut admin, name, false, Duration::from_secs(1)),
        "the release taken over during its pause did not complete"
    );
    drop(caller);
    runtime(false, 1).block_on(client.shutdown());
}

#[test]
fn a_release_cancelled_during_its_retry_pause_completes_while_the_callers_runtime_is_blocked() {
    release_cancelled_during_its_retry_pause(false);
}

#[test]
fn a_release_cancelled_during_its_retry_pause_completes_after_the_callers_runtime_is_dropped() {
    release_cancelled_during_its_retry_pause(true);
}

/// The last handle dropped in a `LocalSet` task on a multi-thread runtime: polled by the
/// `block_on` thread, not a worker. No panic, and the lock of the guard dropped with it
/// is freed.
#[test]
fn the_last_handle_dropped_in_a_local_set_task_releases_and_does_not_panic() {
    let server = runtime(true, 2).block_on(common::server());
    let url = server.url();
    let local = tokio::task::LocalSet::new();
    let outcome = local.block_on(&runtime(true, 2), async move {
        let client = distlock::Client::connect(&url).await.unwrap();
        let guard = client.lock("local-set").unwrap().lock().await.unwrap();
        tokio::task::spawn_local(async move {
            drop(guard);
            drop(client);
        })
        .await
    });
    assert!(
        outcome.is_ok(),
        "dropping the last handle panicked: {outcome:?}"
    );
    assert!(
        key_becomes(
            &mut sync_connection(&server),
            "local-set",
            false,
            Duration::from_secs(1)
        ),
        "the dropped guard's lock was not freed"
    );
}

/// A `lost()` future kept after everything else of the client is gone (a spawned watcher
/// whose guard was released normally never completes) must not keep the client's
/// connections open.
#[test]
fn a_kept_lost_future_does_not_keep_the_clients_connections() {
    let server = runtime(true, 2).block_on(common::server());
    let mut admin = sync_connection(&server);
    let connected = |admin: &mut redis::Connection| -> i64 {
        let info: String = redis::cmd("INFO").arg("clients").query(admin).unwrap();
        info.lines()
            .find_map(|line| line.strip_prefix("connected_clients:"))
            .and_then(|count| count.trim().parse().ok())
            .unwrap()
    };
    let before = connected(&mut admin);
    // The runtime that connected stays up, as a service's does.
    let home = runtime(true, 2);
    let kept = home.block_on(async {
        let client = common::client(&server).await;
        let guard = client.lock("watched").unwrap().lock().await.unwrap();
        let lost = guard.lost();
        guard.release().await.unwrap();
        client.shutdown().await;
        // Kept, not awaited: a watcher whose guard was released normally.
        Some(lost)
    });
    let give_up = Instant::now() + Duration::from_secs(2);
    while connected(&mut admin) > before && Instant::now() < give_up {
        std::thread::sleep(Duration::from_millis(5));
    }
    let left = connected(&mut admin) - before;
    drop(kept);
    drop(home);
    assert_eq!(
        left, 0,
        "connections still open while only a lost() future is kept"
    );
}

/// A re-entry in flight when shutdown starts fails with `Error::Shutdown` and gives its
/// hold back, as acquisitions do.
#[test]
fn a_reentry_in_flight_at_shutdown_fails_and_gives_its_hold_back() {
    let server = runtime(true, 2).block_on(common::server());
    let home = runtime(true, 2);
    let client = home.block_on(common::client(&server));
    let guard = home.block_on(async {
        client
            .lock("reentry-at-shutdown")
            .unwrap()
            .lock()
            .await
            .unwrap()
    });
    let owner = guard.owner().to_owned();
    server.pause().unwrap();
    let reentering = home.spawn(async move {
        let nested = guard.reenter().await.map(drop);
        (nested, guard)
    });
    // The re-entry is sent (to the paused server) before shutdown starts.
    std::thread::sleep(Duration::from_millis(50));
    let stopper = client.clone();
    let stopping = std::thread::spawn(move || runtime(false, 1).block_on(stopper.shutdown()));
    std::thread::sleep(Duration::from_millis(50));
    server.resume().unwrap();
    let (nested, guard) = home.block_on(reentering).unwrap();
    stopping.join().unwrap();
    assert!(
        matches!(nested, Err(Error::Shutdown)),
        "a re-entry across shutdown: {nested:?}"
    );
    let mut admin = sync_connection(&server);
    let give_up = Instant::now() + Duration::from_secs(1);
    let holds = loop {
        let holds: i64 = redis::cmd("HGET")
            .arg("reentry-at-shutdown")
            .arg(&owner)
            .query(&mut admin)
            .unwrap();
        if holds == 1 || Instant::now() >= give_up {
            break holds;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(holds, 1, "the refused re-entry's hold was not given back");
    drop(guard);
}
