//! Every acquisition is its own holder, whatever task it runs in: futures joined or
//! selected in one task, a `lock()` cancelled and retried at once, a guard moved to another
//! task. Each of these once shared a lock that should have excluded.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::{bounded, client, server};
use distlock_testkit::ExclusionChecker;
use futures_util::stream::{FuturesUnordered, StreamExt};

const LIMIT: Duration = Duration::from_secs(30);

/// A read-sleep-write section under `lock`: loses an update unless it excludes.
async fn read_pause_write(
    lock: &distlock::Lock,
    counter: &AtomicU64,
    checker: &ExclusionChecker,
    who: &str,
) {
    let guard = lock.lock().await.unwrap();
    let hold = checker.enter(guard.fencing_token(), who);
    let seen = counter.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(20)).await;
    counter.store(seen + 1, Ordering::SeqCst);
    hold.finish();
    guard.release().await.unwrap();
}

#[tokio::test]
async fn joined_futures_of_one_task_exclude_each_other() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("joined").unwrap();
        let counter = AtomicU64::new(0);
        let checker = ExclusionChecker::new();
        tokio::join!(
            read_pause_write(&lock, &counter, &checker, "a"),
            read_pause_write(&lock, &counter, &checker, "b"),
        );
        let report = checker.report();
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(counter.load(Ordering::SeqCst), 2, "an update was lost");
    })
    .await;
}

#[tokio::test]
async fn many_futures_unordered_in_one_task_never_overlap() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("unordered").unwrap();
        let counter = AtomicU64::new(0);
        let checker = ExclusionChecker::new();
        let names: Vec<String> = (0..8).map(|n| format!("f{n}")).collect();
        let mut sections: FuturesUnordered<_> = names
            .iter()
            .map(|who| read_pause_write(&lock, &counter, &checker, who))
            .collect();
        while sections.next().await.is_some() {}
        let report = checker.report();
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(counter.load(Ordering::SeqCst), 8, "an update was lost");
    })
    .await;
}

/// Two first acquisitions of one lock in flight at once from one task: whichever wins,
/// the other must wait, and once the winner releases, the second guard must really hold
/// the lock (another client is kept out), not a hold the first release deleted.
#[tokio::test]
async fn a_second_guard_of_one_task_survives_the_first_ones_release() {
    let server = server().await;
    let client = client(&server).await;
    let rival = common::client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("two-in-flight").unwrap();
        let rival_lock = rival.lock("two-in-flight").unwrap();
        for round in 0..20 {
            // Both bounded: whichever wins holds until the join ends, so the other must
            // time out. (An unbounded `lock()` would wait forever if it lost.)
            let (first, second) = tokio::join!(
                lock.try_lock_for(Duration::from_millis(300)),
                lock.try_lock_for(Duration::from_millis(100))
            );
            match (first.unwrap(), second.unwrap()) {
                (Some(first), Some(second)) => {
                    // Only possible if the two shared the lock.
                    first.release().await.unwrap();
                    let stolen = rival_lock.try_lock().await.unwrap();
                    assert!(
                        stolen.is_none(),
                        "round {round}: both guards held, and after one release a rival \
                         took the lock while the other guard looked healthy (lost: {})",
                        second.is_lost()
                    );
                    second.release().await.unwrap();
                    panic!("round {round}: two guards of one lock at once");
                }
                (Some(winner), None) | (None, Some(winner)) => {
                    winner.release().await.unwrap();
                }
                (None, None) => panic!("round {round}: a free lock went to neither"),
            }
        }
    })
    .await;
}

#[tokio::test]
async fn a_lock_call_retried_after_a_timeout_does_not_share_the_first_ones_hold() {
    let server = server().await;
    let client = client(&server).await;
    let rival = common::client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("retried").unwrap();
        let rival_lock = rival.lock("retried").unwrap();
        for round in 0..40 {
            // Give up on the first call while its attempt may be in flight, retry at once.
            let first = tokio::time::timeout(Duration::from_micros(50), lock.lock()).await;
            let guard = match first {
                Ok(guard) => guard.unwrap(),
                Err(_) => lock.lock().await.unwrap(),
            };
            // Whatever the abandoned call did in the background, this guard holds alone:
            // a rival must not get in while it is alive.
            let stolen = rival_lock.try_lock().await.unwrap();
            assert!(stolen.is_none(), "round {round}: a rival took a held lock");
            guard.release().await.unwrap();
            common::until_free(&lock).await;
        }
    })
    .await;
}

#[tokio::test]
async fn a_guard_moved_to_another_task_still_excludes_the_task_that_took_it() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("moved").unwrap();
        let guard = lock.lock().await.unwrap();
        let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
        let holder = tokio::spawn(async move {
            let _ = release_rx.await;
            guard.release().await
        });
        // The task that acquired no longer holds anything: its guard lives elsewhere.
        let again = lock.try_lock().await.unwrap();
        let reentered = again.is_some();
        if let Some(again) = again {
            again.release().await.unwrap();
        }
        let _ = release_tx.send(());
        holder.await.unwrap().unwrap();
        assert!(
            !reentered,
            "the original task entered while the moved guard held"
        );
    })
    .await;
}

#[tokio::test]
async fn select_between_two_acquisitions_yields_one_real_holder() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("selected").unwrap();
        let held = lock.lock().await.unwrap();
        // While a guard of this task is alive, neither branch may win.
        let raced = tokio::select! {
            got = lock.try_lock() => got.unwrap().is_some(),
            got = lock.try_lock_for(Duration::from_millis(50)) => got.unwrap().is_some(),
        };
        assert!(!raced, "a second acquisition entered a held lock");
        held.release().await.unwrap();
    })
    .await;
}
