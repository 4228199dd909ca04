//! Holdings and their holds: an old guard never releases a newer holding, re-entries and
//! releases of one holding are serialized, a lost reply leaves no stray hold, and a
//! re-entry neither changes the fencing token nor shortens the lease.

mod common;

use std::time::Duration;

use common::{bounded, client, client_with_watchdog, raw, server, until_free};
use redis::AsyncCommands;

const LIMIT: Duration = Duration::from_secs(20);

#[tokio::test]
async fn a_stale_guard_cannot_release_the_owners_newer_holding() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("stale-owner").unwrap();
        let stale = lock
            .clone()
            .with_lease(Duration::from_millis(150))
            .lock()
            .await
            .unwrap();
        stale.lost().await;
        let current = lock.lock().await.unwrap();
        assert_eq!(current.hold_count(), 1, "a new holding, not a reentry");
        assert!(stale.is_lost());

        assert_eq!(
            stale.release().await.unwrap(),
            distlock::ReleaseOutcome::AlreadyLost
        );
        assert!(
            lock.is_locked().await.unwrap(),
            "the newer holding survives"
        );
        assert!(!current.is_lost());
        current.release().await.unwrap();
        assert!(!lock.is_locked().await.unwrap());
    })
    .await;
}

#[tokio::test]
async fn dropping_and_relocking_at_once_leaves_no_hold_behind() {
    let server = server().await;
    let client = client_with_watchdog(&server, Duration::from_millis(600)).await;
    bounded(LIMIT, async {
        let lock = client.lock("relock").unwrap();
        for _ in 0..100 {
            // The dropped guard's release races the next acquisition.
            drop(lock.lock().await.unwrap());
            let guard = lock.lock().await.unwrap();
            assert!(!guard.is_lost());
            guard.release().await.unwrap();
        }
        until_free(&lock).await;
        assert_eq!(client.tracked_leases(), 0);
    })
    .await;
}

/// A re-entry whose replies are all lost (the server paused past every retry) fails, but
/// the server applies it later. The holding's last release must still free the lock,
/// not leave it held for the rest of the lease by a hold nobody has.
#[tokio::test]
async fn a_reentry_whose_reply_was_lost_leaves_no_stray_hold() {
    let server = server().await;
    // Replies wait 200 ms; a re-entry is sent up to three times.
    let client = client_with_watchdog(&server, Duration::from_secs(30)).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("stray-hold").unwrap();
        let outer = lock.lock().await.unwrap();
        server.pause().unwrap();
        let reentry = outer.reenter().await;
        server.resume().unwrap();
        assert!(reentry.is_err(), "every reply was lost, yet {reentry:?}");
        // The paused server has now run the re-entries it had queued.
        let on_server: i64 = conn.hget("stray-hold", outer.owner()).await.unwrap();
        assert_eq!(on_server, 2, "the lost re-entry did reach the server");
        assert_eq!(outer.hold_count(), 1);
        outer.release().await.unwrap();
        assert!(
            !lock.is_locked().await.unwrap(),
            "a stray hold kept the lock after its last release"
        );
    })
    .await;
}

/// Re-entries and releases of one holding in flight at once from one task: each must see
/// the answer to the one before, so the count on the server stays exact.
#[tokio::test]
async fn concurrent_reentries_and_releases_of_one_holding_keep_an_exact_count() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("exact-count").unwrap();
        let outer = lock.lock().await.unwrap();
        let nested: Vec<_> = futures_util::future::join_all((0..10).map(|_| outer.reenter()))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(outer.hold_count(), 11);
        let on_server: i64 = conn.hget("exact-count", outer.owner()).await.unwrap();
        assert_eq!(on_server, 11);
        let (mut first_half, second_half): (Vec<_>, Vec<_>) = nested
            .into_iter()
            .enumerate()
            .partition(|(n, _)| n % 2 == 0);
        // Releases and fresh re-entries interleaved.
        let more = first_half.pop().map(|(_, guard)| guard).unwrap();
        let (released, again) = tokio::join!(
            futures_util::future::join_all(second_half.into_iter().map(|(_, g)| g.release())),
            more.reenter(),
        );
        assert!(released.iter().all(Result::is_ok));
        let again = again.unwrap();
        let on_server: i64 = conn.hget("exact-count", outer.owner()).await.unwrap();
        assert_eq!(on_server, i64::from(outer.hold_count()));
        for (_, guard) in first_half {
            guard.release().await.unwrap();
        }
        more.release().await.unwrap();
        again.release().await.unwrap();
        assert!(lock.is_locked().await.unwrap(), "the outer hold is left");
        outer.release().await.unwrap();
        assert!(!lock.is_locked().await.unwrap());
    })
    .await;
}

/// A re-entry leaves the lease alone (in watchdog mode too). A partial release leaves a
/// fixed lease where it was: `with_lease` promises the lock frees itself when that lease
/// runs out, and a holding that kept re-entering would otherwise never expire (issue 21).
#[tokio::test]
async fn reentry_never_moves_the_lease_nor_does_a_partial_release_of_a_fixed_one() {
    let server = server().await;
    let client = client_with_watchdog(&server, Duration::from_secs(5)).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let watched = client.lock("lease-watched").unwrap();
        let outer = watched.lock().await.unwrap();
        let inner = outer.reenter().await.unwrap();
        let pttl: i64 = conn.pttl("lease-watched").await.unwrap();
        assert!(
            pttl > 4_500,
            "a re-entry shortened a 5 s watchdog lease to {pttl} ms"
        );
        inner.release().await.unwrap();
        outer.release().await.unwrap();

        let fixed = client
            .lock("lease-fixed")
            .unwrap()
            .with_lease(Duration::from_millis(1_500));
        let outer = fixed.lock().await.unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
        let inner = outer.reenter().await.unwrap();
        let before: i64 = conn.pttl("lease-fixed").await.unwrap();
        assert!(
            before <= 900,
            "a re-entry extended the lease to {before} ms"
        );
        inner.release().await.unwrap();
        let after: i64 = conn.pttl("lease-fixed").await.unwrap();
        assert!(
            after <= 900,
            "a partial release reset the fixed lease to {after} ms"
        );
        assert!(
            outer.lease_remaining() <= Duration::from_millis(900),
            "the local deadline stays too: {:?}",
            outer.lease_remaining()
        );
        outer.release().await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn a_zero_timeout_still_tries_once() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("zero-wait").unwrap();
        let guard = lock
            .try_lock_for(Duration::ZERO)
            .await
            .unwrap()
            .expect("free lock");
        guard.release().await.unwrap();
    })
    .await;
}

/// A partial release whose reply is lost is sent again; the repeat must succeed (a partial
/// release writes no latch, so there is no cached answer to read).
#[tokio::test]
async fn a_partial_release_retried_after_a_lost_reply_succeeds() {
    let server = server().await;
    // Replies wait 200 ms; a release is sent up to three times, 25 and 50 ms apart.
    let client = client_with_watchdog(&server, Duration::from_secs(30)).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("partial-retry").unwrap();
        let outer = lock.lock().await.unwrap();
        let inner = outer.reenter().await.unwrap();
        server.pause().unwrap();
        let release = tokio::spawn(inner.release());
        // Past the first attempt's timeout, inside the retries.
        tokio::time::sleep(Duration::from_millis(300)).await;
        server.resume().unwrap();
        let outcome = release.await.unwrap();
        assert!(
            outcome.is_ok(),
            "a retried partial release said {outcome:?}"
        );
        let on_server: i64 = conn.hget("partial-retry", outer.owner()).await.unwrap();
        assert_eq!(on_server, 1);
        outer.release().await.unwrap();
        assert!(!lock.is_locked().await.unwrap());
    })
    .await;
}
