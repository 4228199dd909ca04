//! The lock's contract on one server: explicit re-entry, ownership, fencing tokens,
//! introspection, and Redisson's data layout.

mod common;

use std::time::Duration;

use common::{bounded, client, raw, server};
use distlock::Error;
use redis::AsyncCommands;

const LIMIT: Duration = Duration::from_secs(20);

#[tokio::test]
async fn reentrant_holds_balance_and_only_the_last_release_frees() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("reentrant").unwrap();
        let first = lock.lock().await.unwrap();
        let second = first.reenter().await.unwrap();
        let third = second.reenter().await.unwrap();
        assert_eq!(third.hold_count(), 3);
        // Redisson's hold count, in the hash, under the holding's owner.
        let on_server: i64 = conn.hget("reentrant", first.owner()).await.unwrap();
        assert_eq!(on_server, 3);
        assert_eq!(
            (second.owner(), third.owner()),
            (first.owner(), first.owner())
        );

        third.release().await.unwrap();
        second.release().await.unwrap();
        assert!(lock.is_locked().await.unwrap(), "one hold is left");
        let on_server: i64 = conn.hget("reentrant", first.owner()).await.unwrap();
        assert_eq!(on_server, 1);

        first.release().await.unwrap();
        assert!(!lock.is_locked().await.unwrap());
        assert_eq!(client.tracked_leases(), 0, "nothing left to renew");
    })
    .await;
}

#[tokio::test]
async fn tasks_exclude_each_other_and_a_guard_can_be_released_elsewhere() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("tasks").unwrap();
        let guard = lock.lock().await.unwrap();
        let other = lock.clone();
        let blocked = tokio::spawn(async move { other.try_lock().await.unwrap().is_none() })
            .await
            .unwrap();
        assert!(blocked, "another task must not re-enter");

        // Released from a different task than the one that acquired it.
        tokio::spawn(async move { guard.release().await })
            .await
            .unwrap()
            .unwrap();
        let other = lock.clone();
        let taken = tokio::spawn(async move { other.try_lock().await.unwrap().is_some() })
            .await
            .unwrap();
        assert!(taken);
    })
    .await;
}

#[tokio::test]
async fn a_reentry_works_from_another_task_and_outlives_the_outer_guard() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("holder").unwrap();
        let outer = lock.lock().await.unwrap();
        let inner = outer.reenter().await.unwrap();
        let inner = tokio::spawn(async move { inner }).await.unwrap();
        assert_eq!(inner.hold_count(), 2);
        outer.release().await.unwrap();
        assert!(lock.is_locked().await.unwrap(), "the re-entry still holds");
        assert!(lock.try_lock().await.unwrap().is_none());
        tokio::spawn(inner.release()).await.unwrap().unwrap();
        assert!(!lock.is_locked().await.unwrap());
    })
    .await;
}

/// A re-entry of a lost holding is refused: its guards were told the lock is gone.
#[tokio::test]
async fn a_lost_holding_cannot_be_reentered() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("lost-reentry").unwrap();
        let outer = lock.lock().await.unwrap();
        assert!(lock.force_unlock().await.unwrap());
        let err = outer.reenter().await.unwrap_err();
        assert!(matches!(err, Error::NotHeld { .. }), "{err}");
        assert!(outer.is_lost());
        assert!(
            !lock.is_locked().await.unwrap(),
            "the re-entry wrote nothing"
        );
    })
    .await;
}

#[tokio::test]
async fn fencing_tokens_strictly_increase_across_holders_and_reentries_keep_theirs() {
    let server = server().await;
    let client = client(&server).await;
    let other_client = common::client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("fenced").unwrap();
        let mut last = 0;
        for round in 0..20 {
            let guard = if round % 2 == 0 {
                lock.lock().await.unwrap()
            } else {
                other_client.lock("fenced").unwrap().lock().await.unwrap()
            };
            assert!(guard.fencing_token() > last, "token went backwards");
            last = guard.fencing_token();
            // The outer guard must not be fenced out by its own nested section.
            let reentered = guard.reenter().await.unwrap();
            assert_eq!(reentered.fencing_token(), guard.fencing_token());
            reentered.release().await.unwrap();
            guard.release().await.unwrap();
        }
    })
    .await;
}

#[tokio::test]
async fn releasing_a_lock_not_held_is_a_typed_error() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("not-held").unwrap();
        let guard = lock.lock().await.unwrap();
        assert!(lock.force_unlock().await.unwrap());
        // Not an error: the caller can tell the two outcomes apart without matching one.
        let outcome = guard.release().await.unwrap();
        assert_eq!(outcome, distlock::ReleaseOutcome::AlreadyLost);
        assert!(outcome.was_lost());
        assert!(
            !lock.force_unlock().await.unwrap(),
            "nothing left to delete"
        );
    })
    .await;
}

#[tokio::test]
async fn dropping_a_guard_releases_in_the_background() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("dropped").unwrap();
        drop(lock.lock().await.unwrap());
        // The waiter is woken by the background release's message, not by the 30 s lease.
        let waiter = client.lock("dropped").unwrap();
        let guard = tokio::spawn(async move { waiter.try_lock_for(Duration::from_secs(5)).await })
            .await
            .unwrap()
            .unwrap()
            .expect("released by the drop");
        guard.release().await.unwrap();
        let exists: bool = conn.exists("dropped").await.unwrap();
        assert!(!exists);
    })
    .await;
}

#[tokio::test]
async fn introspection_reports_the_servers_view() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client
            .lock("inspect")
            .unwrap()
            .with_lease(Duration::from_secs(60));
        assert!(!lock.is_locked().await.unwrap());
        assert_eq!(lock.remaining_ttl().await.unwrap(), None);

        let guard = lock.lock().await.unwrap();
        assert!(lock.is_locked().await.unwrap());
        let ttl = lock.remaining_ttl().await.unwrap().expect("locked");
        assert!(ttl > Duration::from_secs(55) && ttl <= Duration::from_secs(60));
        let local = guard.lease_remaining();
        assert!(local > Duration::from_secs(55) && local <= ttl + Duration::from_millis(5));
        guard.release().await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn data_layout_matches_redisson() {
    let server = server().await;
    // Redisson's RFencedLock keeps one counter per name.
    let client = distlock::Client::builder()
        .fencing_counter(distlock::FencingCounter::PerName)
        .connect(&server.url())
        .await
        .unwrap();
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("layout").unwrap();
        let guard = lock.lock().await.unwrap();
        let fields: Vec<(String, i64)> = conn.hgetall("layout").await.unwrap();
        assert_eq!(fields, vec![(guard.owner().to_owned(), 1)]);
        let (client_id, holder) = guard
            .owner()
            .rsplit_once(':')
            .map(|(a, b)| (a.to_owned(), b.to_owned()))
            .unwrap();
        assert_eq!(client_id, client.id());
        assert!(holder.parse::<u64>().is_ok(), "holder is a decimal id");
        let token: u64 = conn.get("redisson_lock_token:{layout}").await.unwrap();
        assert_eq!(token, guard.fencing_token());
        let ttl: i64 = conn.pttl("redisson_lock_token:{layout}").await.unwrap();
        assert_eq!(ttl, -1, "the token counter never expires");

        // A Redisson client waiting on this lock listens here for the release.
        let mut pubsub = server.client().unwrap().get_async_pubsub().await.unwrap();
        pubsub
            .subscribe("redisson_lock__channel:{layout}")
            .await
            .unwrap();
        guard.release().await.unwrap();
        let message = {
            use futures_util::StreamExt;
            pubsub.on_message().next().await.expect("release message")
        };
        assert_eq!(message.get_payload::<String>().unwrap(), "0");
    })
    .await;
}

/// An operator confirms deleting one holder's lock; by the time the delete is sent the
/// lock may have passed to another holder, whose lock must stay (the distlock command's
/// force-unlock, review B6).
#[tokio::test]
async fn a_force_unlock_for_one_holder_spares_the_next() {
    let server = server().await;
    let client = client(&server).await;
    let lock = client.lock("handed").unwrap();
    let first = lock.try_lock().await.unwrap().expect("free");
    let shown = first.owner().to_owned();
    first.release().await.unwrap();
    let second = lock.try_lock().await.unwrap().expect("free");
    assert!(!lock.force_unlock_held_by(&shown).await.unwrap());
    assert!(
        lock.is_locked().await.unwrap(),
        "the next holder's lock was deleted"
    );
    assert!(lock.force_unlock_held_by(second.owner()).await.unwrap());
    assert!(!lock.is_locked().await.unwrap());
    assert!(matches!(
        lock.force_unlock_held_by("").await,
        Err(distlock::Error::InvalidArgument { .. })
    ));
}
