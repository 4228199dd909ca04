//! Stale guards and re-acquisition by the same owner: an old guard must never release a
//! newer holding, and no hold may be left behind on the server.

mod common;

use std::time::Duration;

use common::{bounded, client, client_with_watchdog, server, until_free};
use distlock::{Error, HolderId};

const LIMIT: Duration = Duration::from_secs(20);

#[tokio::test]
async fn a_stale_guard_cannot_release_the_owners_newer_holding() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("stale-owner").unwrap().with_holder(HolderId(1));
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

        let err = stale.release().await.unwrap_err();
        assert!(matches!(err, Error::NotHeld { .. }), "{err}");
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

#[tokio::test]
async fn a_hold_left_by_a_lost_reply_is_reset_not_counted_on() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = common::raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("orphan-hold").unwrap().with_holder(HolderId(9));
        // What an acquisition whose reply was lost leaves: the owner's field, no guard.
        let _: () = redis::cmd("HSET")
            .arg("orphan-hold")
            .arg(lock.owner())
            .arg(1)
            .query_async(&mut conn)
            .await
            .unwrap();
        let guard = lock.lock().await.unwrap();
        assert_eq!(guard.hold_count(), 1);
        guard.release().await.unwrap();
        assert!(!lock.is_locked().await.unwrap(), "one release frees it");
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
