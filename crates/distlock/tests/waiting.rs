//! Waiting: woken by the release, one shared subscription, and cancellation safety.

mod common;

use std::time::Duration;

use common::{bounded, client, raw, server, until_free, until_subscribers};
use redis::AsyncCommands;
use tokio::time::Instant;

const LIMIT: Duration = Duration::from_secs(20);
const CHANNEL: &str = "redisson_lock__channel:{wait}";

#[tokio::test]
async fn a_release_wakes_the_waiter_long_before_the_lease_ends() {
    let server = server().await;
    let holder_client = client(&server).await;
    let waiter_client = client(&server).await;
    let conn = raw(&server).await;
    bounded(LIMIT, async {
        let held = holder_client.lock("wait").unwrap().lock().await.unwrap();
        let lock = waiter_client.lock("wait").unwrap();
        let waiter = tokio::spawn(async move {
            let guard = lock.lock().await.unwrap();
            (Instant::now(), guard)
        });
        until_subscribers(&conn, CHANNEL, 1).await;
        held.release().await.unwrap();
        let released_at = Instant::now();
        let (acquired_at, guard) = waiter.await.unwrap();
        let handoff = acquired_at.duration_since(released_at);
        // The holder's lease was 30 s; only the release message explains this.
        assert!(
            handoff < Duration::from_millis(500),
            "handoff took {handoff:?}"
        );
        guard.release().await.unwrap();
        until_subscribers(&conn, CHANNEL, 0).await;
    })
    .await;
}

#[tokio::test]
async fn local_waiters_share_one_subscription_and_all_get_the_lock() {
    let server = server().await;
    let client = client(&server).await;
    let conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("wait").unwrap();
        let held = lock.lock().await.unwrap();
        let waiters: Vec<_> = (0..5)
            .map(|_| {
                let lock = lock.clone();
                tokio::spawn(async move {
                    let guard = lock.lock().await.unwrap();
                    let token = guard.fencing_token();
                    guard.release().await.unwrap();
                    token
                })
            })
            .collect();
        until_subscribers(&conn, CHANNEL, 1).await;
        held.release().await.unwrap();
        let mut tokens = Vec::new();
        for waiter in waiters {
            tokens.push(waiter.await.unwrap());
        }
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), 5, "every waiter held it once");
    })
    .await;
}

#[tokio::test]
async fn a_cancelled_wait_leaves_no_subscription_and_no_lock() {
    let server = server().await;
    let client = client(&server).await;
    let conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("wait").unwrap();
        let held = lock.lock().await.unwrap();
        let contender = lock.clone();
        let outcome = tokio::spawn(async move {
            let timed_out = tokio::time::timeout(Duration::from_millis(150), contender.lock())
                .await
                .is_err();
            let gave_up = contender
                .try_lock_for(Duration::from_millis(150))
                .await
                .unwrap()
                .is_none();
            (timed_out, gave_up)
        })
        .await
        .unwrap();
        assert_eq!(outcome, (true, true));
        until_subscribers(&conn, CHANNEL, 0).await;
        held.release().await.unwrap();
        assert!(
            !lock.is_locked().await.unwrap(),
            "the cancelled waiter took nothing"
        );
    })
    .await;
}

#[tokio::test]
async fn cancelling_an_attempt_in_flight_never_leaves_the_lock_held() {
    let server = server().await;
    let client = common::client_with_watchdog(&server, Duration::from_secs(30)).await;
    let conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("inflight").unwrap();
        // The server is stopped, so the attempt is sent and its reply cannot come: the
        // caller gives up exactly while the attempt is in flight.
        server.pause().unwrap();
        let gave_up = tokio::time::timeout(Duration::from_millis(100), lock.lock()).await;
        assert!(
            gave_up.is_err(),
            "no reply can arrive from a stopped server"
        );
        server.resume().unwrap();
        // The server now runs the attempt: the lock is taken...
        common::eventually(Duration::from_secs(5), "the orphaned attempt ran", || {
            let mut conn = conn.clone();
            async move { common::fencing_counters(&mut conn).await == vec![1] }
        })
        .await;
        // ...and the orphaned guard releases it.
        until_free(&lock).await;
        assert_eq!(client.tracked_leases(), 0);
    })
    .await;
}

#[tokio::test]
async fn a_cancelled_release_still_releases() {
    let server = server().await;
    let client = common::client_with_watchdog(&server, Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let lock = client.lock("cancelled-release").unwrap();
        let guard = lock.lock().await.unwrap();
        // Dropped while its script waits on a stopped server.
        server.pause().unwrap();
        let gave_up = tokio::time::timeout(Duration::from_millis(100), guard.release()).await;
        assert!(gave_up.is_err());
        server.resume().unwrap();
        until_free(&lock).await;
        assert_eq!(client.tracked_leases(), 0, "nothing left renewing");
    })
    .await;
}

/// `try_lock` does not jump the local queue: while a task of this client waits for the
/// lock, a try from another task answers "busy" instead of taking it first.
#[tokio::test]
async fn try_lock_does_not_jump_the_local_queue() {
    let server = server().await;
    let client = client(&server).await;
    let rival = common::client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("queue-jump").unwrap();
        let held = rival.lock("queue-jump").unwrap().lock().await.unwrap();
        let waiter = lock.clone();
        let waiting = tokio::spawn(async move { waiter.lock().await.unwrap().release().await });
        until_subscribers(&conn, "redisson_lock__channel:{queue-jump}", 1).await;
        // Free the lock without announcing it: the queued waiter does not know yet.
        let _: () = conn.del("queue-jump").await.unwrap();
        let jumped = lock.try_lock().await.unwrap();
        let jumped_ahead = jumped.is_some();
        if let Some(guard) = jumped {
            guard.release().await.unwrap();
        }
        // Now announce the release, as a releasing holder would.
        let _: () = conn
            .publish("redisson_lock__channel:{queue-jump}", "0")
            .await
            .unwrap();
        waiting.await.unwrap().unwrap();
        drop(held);
        assert!(
            !jumped_ahead,
            "try_lock took the lock ahead of a queued waiter"
        );
    })
    .await;
}

/// Review: `X` and `{X}` share a release channel (Redisson's rule), and local waiters
/// queued by channel, so `try_lock` on a free `{X}` answered busy while a task waited on
/// `X`, and a release of `{X}` woke the `X` waiter instead of the `{X}` one, which slept
/// up to a whole lease. Waiters now queue by lock.
#[tokio::test]
async fn locks_that_share_a_release_channel_queue_apart() {
    let server = server().await;
    let holder = client(&server).await;
    let waiters = client(&server).await;
    let conn = raw(&server).await;
    bounded(LIMIT, async {
        let held_plain = holder.lock("shared").unwrap().lock().await.unwrap();
        let plain = waiters.lock("shared").unwrap();
        let plain_waiter = tokio::spawn(async move { plain.lock().await });
        until_subscribers(&conn, "redisson_lock__channel:{shared}", 1).await;

        // `{shared}` is free: nobody queues for it, whatever waits on `shared`.
        let braced = waiters.lock("{shared}").unwrap();
        let free = braced.try_lock().await.unwrap();
        free.expect("a free lock answered busy behind another lock's waiter")
            .release()
            .await
            .unwrap();

        // A release of `{shared}` wakes its own waiter, not the older `shared` one.
        let held_braced = holder.lock("{shared}").unwrap().lock().await.unwrap();
        let braced_waiter = tokio::spawn(async move { braced.lock().await });
        // The waiter joins the client's existing subscription, which the server cannot
        // show; give it time to park (if it has not, it finds the lock free: no false
        // failure, only a weaker run).
        tokio::time::sleep(Duration::from_millis(300)).await;
        held_braced.release().await.unwrap();
        let released_at = Instant::now();
        let guard = bounded(Duration::from_secs(3), braced_waiter)
            .await
            .unwrap()
            .unwrap();
        let handoff = released_at.elapsed();
        assert!(
            handoff < Duration::from_millis(500),
            "the {{shared}} waiter took {handoff:?}"
        );
        assert!(!plain_waiter.is_finished(), "`shared` is still held");
        guard.release().await.unwrap();
        held_plain.release().await.unwrap();
        bounded(Duration::from_secs(3), plain_waiter)
            .await
            .unwrap()
            .unwrap()
            .release()
            .await
            .unwrap();
    })
    .await;
}
