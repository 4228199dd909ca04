//! A fair waiter's direct grant read late: after its runtime stalled past the grant's
//! lease, or after the server started evicting keys. Both came from a hostile review; in
//! each the waiter used to return a guard it must not have.

mod common;

use std::time::Duration;

use common::{bounded, client, eventually, raw, server};
use distlock::Error;

const LIMIT: Duration = Duration::from_secs(40);

async fn until_queued(conn: &redis::aio::MultiplexedConnection, name: &str, count: usize) {
    let queue = format!("redisson_lock_queue:{{{name}}}");
    eventually(Duration::from_secs(10), "queued", || {
        let (mut conn, queue) = (conn.clone(), queue.clone());
        async move {
            redis::cmd("LLEN")
                .arg(&queue)
                .query_async::<usize>(&mut conn)
                .await
                .unwrap()
                == count
        }
    })
    .await;
}

/// Only the waiter's runtime stalls; its client's own thread keeps running and receives
/// the grant. When the runtime resumes, the grant's lease has run out and a rival holds
/// the lock: the waiter must not return the dead grant as a guard, and keeps waiting.
#[test]
fn a_waiter_whose_runtime_stalls_past_its_grant_does_not_take_it() {
    let main = common::runtime_with(true, 2);
    main.block_on(async {
        let server = server().await;
        let holder = client(&server).await;
        let rival = client(&server).await;
        let conn = raw(&server).await;
        let url = server.url();
        let stalled = common::runtime_with(true, 2);
        let waiter_client = stalled
            .spawn(async move { distlock::Client::connect(&url).await.unwrap() })
            .await
            .unwrap();
        bounded(LIMIT, async {
            let held = holder.fair_lock("stall-grant").unwrap().lock().await.unwrap();
            let lock = waiter_client
                .fair_lock("stall-grant")
                .unwrap()
                .with_lease(Duration::from_millis(1500));
            let waiting = stalled.spawn(async move {
                let guard = lock.try_lock_for(Duration::from_secs(20)).await;
                guard.map(|guard| guard.map(|guard| (guard.fencing_token(), guard)))
            });
            until_queued(&conn, "stall-grant", 1).await;
            let next = tokio::spawn({
                let lock = rival.fair_lock("stall-grant").unwrap();
                async move { lock.lock().await }
            });
            until_queued(&conn, "stall-grant", 2).await;
            // Both of the waiter's workers sleep past the grant's 1.5 s lease.
            common::block_every_worker(&stalled, 2, Duration::from_millis(3500));
            held.release().await.unwrap();
            // The grant runs out unused; the rival, next in the queue, gets the lock.
            let rivals = next.await.unwrap().unwrap();
            let rival_token = rivals.fencing_token();
            // While the rival holds it, the waiter must still be waiting.
            if let Ok(joined) = tokio::time::timeout(Duration::from_secs(4), waiting).await {
                panic!(
                    "the waiter came back while the rival (token {rival_token}) holds the lock: {:?}",
                    joined.unwrap().map(|got| got.map(|(token, guard)| (token, guard.is_lost())))
                );
            }
            rivals.release().await.unwrap();
        })
        .await;
        std::thread::spawn(move || drop(stalled)).join().unwrap();
    });
}

/// As for the lease lock (connection.rs): a wait that began before the server started
/// evicting keys must not take the lock after it, even by a grant the release script
/// made on the server. The grant is given on, and the waiter told why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_granted_after_eviction_was_turned_on_gives_the_grant_back() {
    let server = server().await;
    let a = client(&server).await;
    let b = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let held = a.fair_lock("e-fair").unwrap().lock().await.unwrap();
        let waiting = {
            let lock = b.fair_lock("e-fair").unwrap();
            tokio::spawn(async move { lock.lock().await })
        };
        until_queued(&conn, "e-fair", 1).await;
        common::set_eviction_policy(&mut conn, "allkeys-lru").await;
        let probe = b.fair_lock("e-fair-probe").unwrap();
        eventually(Duration::from_secs(10), "b sees the policy", || {
            let probe = probe.clone();
            async move { matches!(probe.try_lock().await, Err(Error::EvictionPolicy { .. })) }
        })
        .await;
        held.release().await.unwrap();
        let waited = bounded(Duration::from_secs(5), waiting).await.unwrap();
        assert!(
            matches!(waited, Err(Error::EvictionPolicy { .. })),
            "a fair waiter took the lock on an evicting server: {:?}",
            waited.map(|guard| guard.fencing_token())
        );
        // The grant was given back: nobody holds the lock.
        eventually(Duration::from_secs(5), "the grant given back", || {
            let mut conn = conn.clone();
            async move {
                redis::cmd("EXISTS")
                    .arg("e-fair")
                    .query_async::<i64>(&mut conn)
                    .await
                    .unwrap()
                    == 0
            }
        })
        .await;
    })
    .await;
}
