//! Fixed leases on ZooKeeper (`Lock::with_lease`): a holding that ends at its lease's
//! end by the ensemble's clock, outlives its client, moves with `extend`, and frees the
//! lock at once when released; and the examples, which take fixed leases, run unchanged.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock::ReleaseOutcome;
use distlock_testkit::ExclusionChecker;

use super::common::{self, bounded, join_bounded};
use super::{client_at, ensemble, queue_len, LIMIT};

/// The programs in examples/ run on ZooKeeper unchanged but for the URL (they read it
/// from REDIS_URL, as on Redis): cron_once and fenced_write take fixed leases.
/// `cargo build -p distlock --features zk --examples` builds them first.
#[tokio::test]
async fn the_examples_run_unchanged_on_zookeeper() {
    let zk = ensemble(1).await;
    common::examples::all_run_unchanged(&zk.url(), Some("zk"));
}

/// A fixed lease ends on time, by itself: another client gets the lock only once it is
/// over, with a larger token, after the holder's lost signal fired; the holder's release
/// then finds it lost.
#[tokio::test]
async fn a_fixed_lease_frees_the_lock_at_its_end_and_not_before() {
    let zk = ensemble(1).await;
    let holder = client_at(&zk.url(), Duration::from_secs(30)).await;
    let other = client_at(&zk.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let lease = Duration::from_secs(1);
        let asked_at = Instant::now();
        let guard = holder
            .lock("zk:fixed-lease")
            .unwrap()
            .with_lease(lease)
            .lock()
            .await
            .unwrap();
        let lost = guard.lost_token();
        let lock = other.lock("zk:fixed-lease").unwrap();
        assert!(lock.try_lock().await.unwrap().is_none());
        assert!(lock.is_locked().await.unwrap());
        assert_eq!(lock.owners().await.unwrap(), vec![guard.owner().to_owned()]);
        let left = lock.remaining_ttl().await.unwrap().expect("held");
        assert!(left <= lease && left > lease / 2, "{left:?}");
        let next = lock
            .with_lease(Duration::from_secs(5))
            .lock()
            .await
            .unwrap();
        let after = asked_at.elapsed();
        // The ensemble's clock (mtime, in whole milliseconds) judges the end.
        assert!(after >= lease - Duration::from_millis(5), "{after:?}");
        assert!(after < lease + Duration::from_secs(2), "{after:?}");
        assert!(
            lost.is_cancelled(),
            "another client held before the lost signal"
        );
        assert!(next.fencing_token() > guard.fencing_token());
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
        assert_eq!(next.release().await.unwrap(), ReleaseOutcome::Released);
        assert!(!lock.is_locked().await.unwrap());
    })
    .await;
}

/// A fixed lease left to expire is a node of its own, not of the holder's session: it
/// keeps the lock after its client shut down (a cron job's process exits), until the
/// lease ends.
#[tokio::test]
async fn a_fixed_lease_left_to_expire_outlives_its_client() {
    let zk = ensemble(1).await;
    let other = client_at(&zk.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let lease = Duration::from_secs(3);
        let holder = client_at(&zk.url(), Duration::from_secs(2)).await;
        let asked_at = Instant::now();
        let guard = holder
            .lock("zk:left-fixed")
            .unwrap()
            .with_lease(lease)
            .lock()
            .await
            .unwrap();
        let token = guard.fencing_token();
        let left = guard.leave_to_expire();
        assert!(left > Duration::from_secs(2), "{left:?}");
        holder.shutdown().await;
        drop(holder);
        let lock = other.lock("zk:left-fixed").unwrap();
        assert!(lock.try_lock().await.unwrap().is_none());
        assert!(lock.is_locked().await.unwrap());
        let next = lock.lock().await.unwrap();
        let after = asked_at.elapsed();
        assert!(after >= lease - Duration::from_millis(5), "{after:?}");
        assert!(after < lease + Duration::from_secs(2), "{after:?}");
        assert!(next.fencing_token() > token);
        next.release().await.unwrap();
    })
    .await;
}

/// An extension moves a fixed lease's end (a waiter still waits past the old one), and
/// a release wakes the waiter at once, well before the lease would have ended.
#[tokio::test]
async fn extend_moves_a_fixed_leases_end_and_a_release_wakes_a_waiter_at_once() {
    let zk = ensemble(1).await;
    let holder = client_at(&zk.url(), Duration::from_secs(30)).await;
    let other = client_at(&zk.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let taken_at = Instant::now();
        let guard = holder
            .lock("zk:extended")
            .unwrap()
            .with_lease(Duration::from_secs(1))
            .lock()
            .await
            .unwrap();
        let token = guard.fencing_token();
        let again = guard.reenter().await.unwrap();
        assert_eq!(again.release().await.unwrap(), ReleaseOutcome::Released);
        guard.extend(Duration::from_secs(4)).await.unwrap();
        let lock = other
            .lock("zk:extended")
            .unwrap()
            .with_lease(Duration::from_secs(5));
        let mut waiter = tokio::spawn(async move { lock.lock().await.unwrap() });
        // Past the first lease's end, the waiter still waits, and the holder holds.
        let old_end = taken_at + Duration::from_millis(1500);
        assert!(
            tokio::time::timeout_at(old_end.into(), &mut waiter)
                .await
                .is_err(),
            "the waiter got the lock at the end of the lease before the extension"
        );
        assert!(guard.verify().await.unwrap());
        let released_at = Instant::now();
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
        let next = bounded(Duration::from_secs(10), waiter).await.unwrap();
        assert!(
            released_at.elapsed() < Duration::from_millis(700),
            "woken {:?} after the release: not by it",
            released_at.elapsed()
        );
        assert!(next.fencing_token() > token);
        assert_eq!(next.release().await.unwrap(), ReleaseOutcome::Released);
    })
    .await;
}

/// A watchdog-mode waiter queued behind a fixed-lease holding gets the lock when the
/// lease ends, and keeps it (renewed) as any watchdog-mode holding.
#[tokio::test]
async fn a_watchdog_waiter_behind_a_fixed_lease_gets_the_lock_at_its_end() {
    let zk = ensemble(1).await;
    let holder = client_at(&zk.url(), Duration::from_secs(30)).await;
    let other = client_at(&zk.url(), Duration::from_secs(2)).await;
    bounded(LIMIT, async {
        let lease = Duration::from_secs(1);
        let asked_at = Instant::now();
        let guard = holder
            .lock("zk:mixed")
            .unwrap()
            .with_lease(lease)
            .lock()
            .await
            .unwrap();
        let lock = other.lock("zk:mixed").unwrap();
        let waiter = tokio::spawn(async move { lock.lock().await.unwrap() });
        let next = bounded(Duration::from_secs(10), waiter).await.unwrap();
        let after = asked_at.elapsed();
        assert!(after >= lease - Duration::from_millis(5), "{after:?}");
        assert!(after < lease + Duration::from_secs(2), "{after:?}");
        assert!(next.fencing_token() > guard.fencing_token());
        // Past its session timeout, it still holds.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(next.verify().await.unwrap());
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
        assert_eq!(next.release().await.unwrap(), ReleaseOutcome::Released);
    })
    .await;
}

/// Fixed-lease and watchdog-mode holders of one lock on two clients never overlap, and
/// their tokens grow: each fixed-lease holding is a node of its own, yet holds in its
/// queue's order.
#[tokio::test]
async fn fixed_and_watchdog_holders_never_overlap_and_their_tokens_grow() {
    let zk = ensemble(1).await;
    let clients = [
        client_at(&zk.url(), Duration::from_secs(10)).await,
        client_at(&zk.url(), Duration::from_secs(10)).await,
    ];
    let checker = Arc::new(ExclusionChecker::new());
    let count = Arc::new(std::sync::Mutex::new(0_u64));
    let mut tasks = Vec::new();
    for (c, client) in clients.iter().enumerate() {
        for t in 0..3 {
            let lock = client.lock("zk:mixed-contended").unwrap();
            let (checker, count) = (Arc::clone(&checker), Arc::clone(&count));
            tasks.push(tokio::spawn(async move {
                for round in 0..6 {
                    let lock = if (c + t + round) % 2 == 0 {
                        lock.with_lease(Duration::from_secs(20))
                    } else {
                        lock.with_watchdog()
                    };
                    let guard = lock.lock().await.unwrap();
                    let hold = checker.enter(guard.fencing_token(), format!("{c}/{t}"));
                    let read = *count.lock().unwrap();
                    tokio::task::yield_now().await;
                    *count.lock().unwrap() = read + 1;
                    hold.finish();
                    assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
                }
            }));
        }
    }
    join_bounded(LIMIT, tasks).await;
    let report = checker.report();
    assert_eq!(report.holds, 36);
    assert!(report.overlaps.is_empty(), "{:?}", report.overlaps);
    assert!(
        report.token_regressions.is_empty(),
        "{:?}",
        report.token_regressions
    );
    assert_eq!(*count.lock().unwrap(), 36, "an update was lost");
}

/// A waiter queued before a fixed-lease holding was made (its node is older than that
/// holding's node) still gets a larger token when it holds after it: the holding's
/// token is its waiter's node's czxid, not the zxid of the write that made it.
#[tokio::test]
async fn a_waiter_queued_before_a_fixed_lease_was_taken_gets_a_larger_token_after_it() {
    let zk = ensemble(1).await;
    let first = client_at(&zk.url(), Duration::from_secs(30)).await;
    let fixed = client_at(&zk.url(), Duration::from_secs(30)).await;
    let last = client_at(&zk.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let name = "zk:queued-before";
        let guard = first.lock(name).unwrap().lock().await.unwrap();
        let lock = fixed
            .lock(name)
            .unwrap()
            .with_lease(Duration::from_millis(500));
        let taking = tokio::spawn(async move { lock.lock().await.unwrap() });
        while queue_len(&zk, name).await < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let lock = last.lock(name).unwrap();
        let waiting = tokio::spawn(async move { lock.lock().await.unwrap() });
        while queue_len(&zk, name).await < 3 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let token = guard.fencing_token();
        guard.release().await.unwrap();
        let held = bounded(Duration::from_secs(10), taking).await.unwrap();
        assert!(held.fencing_token() > token);
        let fixed_token = held.fencing_token();
        held.leave_to_expire();
        let next = bounded(Duration::from_secs(10), waiting).await.unwrap();
        assert!(
            next.fencing_token() > fixed_token,
            "{} after {fixed_token}",
            next.fencing_token()
        );
        next.release().await.unwrap();
    })
    .await;
}
