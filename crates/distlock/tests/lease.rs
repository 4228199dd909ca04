//! Leases: expiry, the watchdog, the lost-lock signal, and fencing of stale holders.

mod common;

use std::time::Duration;

use common::{bounded, client_with_watchdog, raw, server};
use distlock_testkit::FencedResource;
use redis::AsyncCommands;
use tokio::time::Instant;

const LIMIT: Duration = Duration::from_secs(20);

#[tokio::test]
async fn an_expired_fixed_lease_frees_the_lock_and_signals_its_holder() {
    let server = server().await;
    let client = client_with_watchdog(&server, Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let lease = Duration::from_millis(300);
        let lock = client.lock("expiring").unwrap().with_lease(lease);
        let started = Instant::now();
        let stale = lock.lock().await.unwrap();
        let contender = lock.clone();
        let next =
            tokio::spawn(async move { contender.try_lock_for(Duration::from_secs(5)).await })
                .await
                .unwrap()
                .unwrap()
                .expect("the lease ran out");
        assert!(started.elapsed() >= lease - Duration::from_millis(20));
        assert!(
            stale.is_lost(),
            "the holder must know before the next one holds"
        );
        assert!(next.fencing_token() > stale.fencing_token());
        assert_eq!(
            stale.release().await.unwrap(),
            distlock::ReleaseOutcome::AlreadyLost
        );
        next.release().await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn the_watchdog_keeps_a_lock_for_three_timeouts_and_stops_at_release() {
    let server = server().await;
    let watchdog = Duration::from_millis(600);
    let client = client_with_watchdog(&server, watchdog).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("renewed").unwrap();
        let guard = lock.lock().await.unwrap();
        tokio::time::sleep(watchdog * 3 + watchdog / 2).await;
        assert!(!guard.is_lost());
        assert!(
            common::holds(&mut conn, &guard).await,
            "renewed past three leases"
        );
        let ttl: i64 = conn.pttl("renewed").await.unwrap();
        assert!(
            ttl > 0 && ttl <= 600,
            "lease is the watchdog timeout, got {ttl} ms"
        );

        guard.release().await.unwrap();
        assert_eq!(client.tracked_leases(), 0);
        let before = server.info_commandstats().await.unwrap();
        tokio::time::sleep(watchdog).await; // three renewal intervals
        let after = server.info_commandstats().await.unwrap();
        assert_eq!(
            before.get("evalsha"),
            after.get("evalsha"),
            "no renewal after release"
        );
    })
    .await;
}

#[tokio::test]
async fn a_failed_renewal_does_not_stop_the_watchdog() {
    let server = server().await;
    // Renewals every 500 ms; each may wait 200 ms for its reply.
    let watchdog = Duration::from_millis(1500);
    let client = client_with_watchdog(&server, watchdog).await;
    bounded(LIMIT, async {
        let lock = client.lock("resilient").unwrap();
        let guard = lock.lock().await.unwrap();
        // Stopped past the first renewal (sent at 500 ms, timed out at 700 ms) but not
        // past the lease.
        server.pause().unwrap();
        tokio::time::sleep(Duration::from_millis(850)).await;
        let remaining = guard.lease_remaining();
        server.resume().unwrap();
        assert!(
            remaining < watchdog - watchdog / 3,
            "a renewal must have failed, yet the lease was extended: {remaining:?} left"
        );
        // The next renewals land: the lease is extended again and nothing was lost.
        tokio::time::sleep(watchdog * 2 / 3).await;
        assert!(!guard.is_lost());
        assert!(guard.lease_remaining() > remaining, "renewals resumed");
        assert!(lock.is_locked().await.unwrap());
        guard.release().await.unwrap();
    })
    .await;
}

#[test]
fn lost_fires_even_when_the_clients_runtime_is_gone() {
    let test_runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let server = test_runtime.block_on(server());
    let url = server.url();
    let lease = Duration::from_millis(300);
    // The client and its watchdog live on a runtime that then shuts down.
    let client_runtime = tokio::runtime::Runtime::new().unwrap();
    let (guard, acquired_at) = client_runtime.block_on(async {
        let client = distlock::Client::connect(&url).await.unwrap();
        let started = Instant::now();
        let guard = client
            .lock("orphaned-runtime")
            .unwrap()
            .with_lease(lease)
            .lock()
            .await
            .unwrap();
        (guard, started)
    });
    drop(client_runtime);
    test_runtime.block_on(bounded(LIMIT, async {
        let token = guard.lost_token();
        guard.lost().await;
        assert!(
            acquired_at.elapsed() <= lease,
            "fired {:?} after acquiring",
            acquired_at.elapsed()
        );
        assert!(guard.is_lost());
        tokio::time::timeout(Duration::from_millis(100), token.cancelled())
            .await
            .expect("the token fires too");
    }));
}

#[tokio::test]
async fn lost_fires_before_the_deadline_when_the_key_is_deleted() {
    let server = server().await;
    let watchdog = Duration::from_millis(900);
    let client = client_with_watchdog(&server, watchdog).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("deleted").unwrap();
        let before_acquire = Instant::now();
        let guard = lock.lock().await.unwrap();
        let _: () = conn.del("deleted").await.unwrap();
        guard.lost().await;
        // The deadline is at most one lease after the acquire was sent; the first renewal
        // (a third of the way) already sees the key gone.
        assert!(
            before_acquire.elapsed() < watchdog,
            "{:?}",
            before_acquire.elapsed()
        );
        assert_eq!(
            client.tracked_leases(),
            0,
            "a lost lease is no longer renewed"
        );
    })
    .await;
}

#[tokio::test]
async fn lost_fires_no_later_than_the_deadline_when_the_server_is_paused() {
    let server = server().await;
    let watchdog = Duration::from_millis(600);
    let client = client_with_watchdog(&server, watchdog).await;
    bounded(LIMIT, async {
        let lock = client.lock("paused").unwrap();
        let guard = lock.lock().await.unwrap();
        // Let a renewal or two land, then stop the server.
        tokio::time::sleep(watchdog / 2).await;
        let paused_at = Instant::now();
        server.pause().unwrap();
        guard.lost().await;
        let fired_after = paused_at.elapsed();
        server.resume().unwrap();
        // Every successful renewal was sent before the pause, so the deadline is at most
        // one lease after it.
        assert!(
            fired_after <= watchdog,
            "fired {fired_after:?} after the pause"
        );
        assert!(
            fired_after >= watchdog / 3,
            "fired {fired_after:?} after the pause: too early to be the deadline"
        );
    })
    .await;
}

#[tokio::test]
async fn a_stale_holders_write_is_rejected_by_the_fenced_resource() {
    let server = server().await;
    let client = client_with_watchdog(&server, Duration::from_secs(30)).await;
    let conn = raw(&server).await;
    bounded(LIMIT, async {
        let fenced = FencedResource::new(conn, "fenced:account");
        // A fixed lease behaves like a holder paused past it: nothing renews it.
        let lock = client
            .lock("fenced")
            .unwrap()
            .with_lease(Duration::from_millis(200));
        let stale = lock.lock().await.unwrap();
        assert!(fenced
            .write(stale.fencing_token(), "stale-1")
            .await
            .unwrap());
        stale.lost().await;

        let contender = lock.clone();
        let current = tokio::spawn(async move { contender.lock().await })
            .await
            .unwrap()
            .unwrap();
        assert!(fenced
            .write(current.fencing_token(), "current")
            .await
            .unwrap());
        // The stale holder wakes up and writes with its old token.
        assert!(!fenced
            .write(stale.fencing_token(), "stale-2")
            .await
            .unwrap());
        assert_eq!(fenced.rejected().await.unwrap(), 1);
        assert_eq!(fenced.value().await.unwrap().as_deref(), Some("current"));
        current.release().await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn a_foreign_key_in_a_renewal_batch_loses_only_itself() {
    let server = server().await;
    let watchdog = Duration::from_millis(600);
    let client = client_with_watchdog(&server, watchdog).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let mut guards = Vec::new();
        for name in ["batch:a", "batch:b", "batch:c"] {
            guards.push(client.lock(name).unwrap().lock().await.unwrap());
        }
        // Someone overwrites one lock with a string: same name, wrong type.
        let _: () = redis::pipe()
            .del("batch:b")
            .set("batch:b", "x")
            .query_async(&mut conn)
            .await
            .unwrap();
        guards[1].lost().await;
        tokio::time::sleep(watchdog * 2).await;
        assert!(!guards[0].is_lost() && !guards[2].is_lost());
        for name in ["batch:a", "batch:c"] {
            let ttl: i64 = conn.pttl(name).await.unwrap();
            assert!(ttl > 0, "{name} is still renewed");
        }
    })
    .await;
}
