//! The lost signal fires when, and only when, a holding can no longer be trusted: never
//! because a user cancelled their copy, never for a normal release, and it costs no task
//! per token.

mod common;

use std::time::Duration;

use common::{bounded, client, client_with_watchdog, server};

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
