//! The lost signal fires when, and only when, a holding can no longer be trusted: never
//! because a user cancelled their copy, never for a normal release, and it costs no task
//! per token.

mod common;

use std::time::{Duration, Instant};

use common::{bounded, client, client_with_watchdog, raw, server, subscribers, until_subscribers};

const LIMIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn cancelling_a_lost_token_does_not_mark_the_guard_lost() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("child-token").unwrap();
        let guard = lock.lock().await.unwrap();
        let workers_token = guard.lost_token();
        let other_token = guard.lost_token();
        // The user stops their worker with the token they were given.
        workers_token.cancel();
        assert!(!guard.is_lost(), "a user's cancel is not a lost lease");
        assert!(!other_token.is_cancelled(), "other tokens are untouched");
        let lost = tokio::time::timeout(Duration::from_millis(50), guard.lost()).await;
        assert!(lost.is_err(), "lost() fired after a user's cancel");
        guard.release().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "current_thread")]
async fn lost_tokens_cost_no_task_and_nothing_outlives_the_release() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("many-tokens").unwrap();
        let metrics = tokio::runtime::Handle::current().metrics();
        let before = metrics.num_alive_tasks();
        let guard = lock.lock().await.unwrap();
        let tokens: Vec<_> = (0..10_000).map(|_| guard.lost_token()).collect();
        let during = metrics.num_alive_tasks();
        guard.release().await.unwrap();
        assert!(
            during <= before + 2,
            "10,000 tokens left {} tasks alive on the caller's runtime",
            during - before
        );
        assert!(
            tokens.iter().all(|token| !token.is_cancelled()),
            "a released guard's tokens never fire"
        );
    })
    .await;
}

/// Releases land right around renewals (a 60 ms lease renews every 20 ms), so renewal
/// replies arrive after the release. None of them may be read as a loss.
#[tokio::test]
async fn a_normal_release_never_fires_lost() {
    let server = server().await;
    let client = client_with_watchdog(&server, Duration::from_millis(60)).await;
    bounded(LIMIT, async {
        let lock = client.lock("release-vs-renewal").unwrap();
        let mut fired = 0;
        for round in 0..300u64 {
            let guard = lock.lock().await.unwrap();
            let token = guard.lost_token();
            // Vary the hold over a renewal period so releases meet renewals in flight.
            tokio::time::sleep(Duration::from_micros(19_000 + (round % 20) * 100)).await;
            guard.release().await.unwrap();
            // A renewal reply still on its way gets a few milliseconds to arrive.
            tokio::time::sleep(Duration::from_millis(2)).await;
            if token.is_cancelled() {
                fired += 1;
            }
        }
        assert_eq!(fired, 0, "lost fired after {fired} of 300 normal releases");
    })
    .await;
}

/// How soon after a force-unlock a holder must notice it: a waiter notices a release in
/// about a millisecond on loopback; the watchdog's next renewal is 10 s away here.
const NOTICED_WITHIN: Duration = Duration::from_millis(200);

/// The channel a lock's releases and force-unlocks are announced on (Redisson's name).
fn lock_channel(name: &str) -> String {
    format!("redisson_lock__channel:{{{name}}}")
}

/// Issue 30, 4.2: a worker pool that "stops when the lock is lost" kept working up to a
/// renewal interval after a force-unlock (8 to 775 ms with renewals once a second; up to
/// 10 s with the default watchdog), overlapping the next holder. The force-unlock's
/// message on the lock's channel now makes the holder ask the server at once.
#[tokio::test]
async fn a_force_unlock_fires_the_lost_signal_as_soon_as_its_message_comes() {
    let server = server().await;
    let holder = client(&server).await;
    let operator = client(&server).await;
    bounded(LIMIT, async {
        let guard = holder.lock("force-unlocked").unwrap().lock().await.unwrap();
        let lost = guard.lost();
        let token = guard.lost_token();
        let started = Instant::now();
        let forced = operator.lock("force-unlocked").unwrap();
        assert!(
            forced.force_unlock().await.unwrap(),
            "the operator deleted the lock"
        );
        let noticed = tokio::time::timeout(Duration::from_secs(2), lost).await;
        let gap = started.elapsed();
        eprintln!("force_unlock right after the acquisition: lost() after {gap:?}");
        assert!(
            noticed.is_ok(),
            "lost() had not fired 2 s after a force-unlock"
        );
        assert!(
            gap < NOTICED_WITHIN,
            "lost() came {gap:?} after the force-unlock"
        );
        assert!(token.is_cancelled() && guard.is_lost());
        assert!(guard.release().await.unwrap().was_lost());
    })
    .await;
}

/// The same with Redisson's own force unlock (DEL, then PUBLISH of the release message,
/// as one transaction), sent raw while the holder is listening; five times, for the gap.
#[tokio::test]
async fn a_raw_delete_and_publish_fires_the_lost_signal_as_soon_as_its_message_comes() {
    let server = server().await;
    let holder = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = holder.lock("deleted-raw").unwrap();
        let mut gaps = Vec::new();
        for _ in 0..5 {
            let guard = lock.lock().await.unwrap();
            let token = guard.lost_token();
            until_subscribers(&conn, &lock_channel("deleted-raw"), 1).await;
            let started = Instant::now();
            let _: () = redis::pipe()
                .atomic()
                .cmd("DEL")
                .arg("deleted-raw")
                .ignore()
                .cmd("PUBLISH")
                .arg(lock_channel("deleted-raw"))
                .arg("0")
                .ignore()
                .query_async(&mut conn)
                .await
                .unwrap();
            let noticed = tokio::time::timeout(Duration::from_secs(2), token.cancelled()).await;
            assert!(
                noticed.is_ok(),
                "the lost token was not cancelled 2 s after DEL+PUBLISH"
            );
            gaps.push(started.elapsed());
            assert!(guard.release().await.unwrap().was_lost());
        }
        eprintln!("DEL+PUBLISH while listening: lost after {gaps:?}");
        let worst = gaps.iter().max().copied().unwrap_or_default();
        assert!(
            worst < NOTICED_WITHIN,
            "lost came {worst:?} after DEL+PUBLISH"
        );
    })
    .await;
}

/// Listening costs no wake-up of the lock's waiters, fires nothing on the holder's own
/// release (which publishes on the same channel), and leaves no subscription behind.
#[tokio::test]
async fn a_listening_holder_takes_no_wake_up_and_leaves_no_subscription() {
    let server = server().await;
    let holder = client(&server).await;
    let conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = holder.lock("listened").unwrap();
        let guard = lock.lock().await.unwrap();
        let token = guard.lost_token();
        until_subscribers(&conn, &lock_channel("listened"), 1).await;
        // A waiter of the same client shares the channel, and is woken by the release.
        let mut waiter = tokio::spawn({
            let lock = lock.clone();
            async move {
                let guard = lock.lock().await.unwrap();
                guard.release().await.unwrap();
            }
        });
        let waiting = tokio::time::timeout(Duration::from_millis(100), &mut waiter).await;
        assert!(waiting.is_err(), "the waiter waits while the lock is held");
        let nested = guard.reenter().await.unwrap();
        nested.release().await.unwrap();
        guard.release().await.unwrap();
        bounded(Duration::from_secs(2), waiter)
            .await
            .expect("the waiter's task");
        assert!(
            !token.is_cancelled(),
            "a normal release fired the lost signal"
        );
        until_subscribers(&conn, &lock_channel("listened"), 0).await;
        let mut conn = conn.clone();
        assert_eq!(subscribers(&mut conn, &lock_channel("listened")).await, 0);
    })
    .await;
}
