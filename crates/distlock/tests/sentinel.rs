//! On a real Sentinel deployment (a master, 2 replicas, 3 sentinels on loopback): the
//! client follows failovers, and the known unsafe case (a lock written to the master only,
//! then a failover) double-grants without replica sync and never with it.

mod common;

use std::time::{Duration, Instant};

use common::bounded;
use distlock::{Client, Error, ReplicaSync};
use distlock_testkit::SentinelGroup;

const LIMIT: Duration = Duration::from_secs(60);
/// Trials per failover: each is a lock name client A tries first and client B second.
const TRIALS: usize = 20;

async fn sentinel_client(group: &SentinelGroup, sync: ReplicaSync) -> Client {
    Client::builder()
        .replica_sync(sync)
        .response_timeout(Duration::from_millis(500))
        .connection_timeout(Duration::from_millis(500))
        .connect(&group.sentinel_url())
        .await
        .expect("connect through the sentinels")
}

/// Tries until an attempt is not refused by a connection error (the failover may still be
/// under way); returns how long that took.
async fn first_acquisition(client: &Client, name: &str, since: Instant) -> Duration {
    loop {
        match client.lock(name).unwrap().try_lock().await {
            Ok(Some(guard)) => {
                let took = since.elapsed();
                guard.release().await.unwrap();
                return took;
            }
            Ok(None) => panic!("{name} is held by nobody"),
            Err(err) if err.is_connection_error() => {
                assert!(
                    since.elapsed() < LIMIT,
                    "no acquisition after {LIMIT:?}: {err}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(err) => panic!("{err}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_and_waiters_follow_a_failover() {
    let mut group = SentinelGroup::start().await.expect("start sentinel group");
    let client = sentinel_client(&group, ReplicaSync::Auto).await;
    let guard = client.lock("before").unwrap().lock().await.unwrap();
    guard.release().await.unwrap();

    let killed_at = Instant::now();
    let old = group.kill_master().await.unwrap();
    let took = bounded(LIMIT, first_acquisition(&client, "after", killed_at)).await;
    eprintln!("sentinel failover: first acquisition {took:?} after the master was killed");
    let new = group.wait_for_new_master(old, LIMIT).await.unwrap();
    assert_ne!(new, old);

    // A waiter on the new master is woken by the release, not by its fallback timer.
    let held = client.lock("handoff").unwrap().lock().await.unwrap();
    let waiter = {
        let lock = client.lock("handoff").unwrap();
        tokio::spawn(async move {
            let guard = lock.lock().await.unwrap();
            let woken = Instant::now();
            guard.release().await.unwrap();
            woken
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    held.release().await.unwrap();
    let woken = bounded(LIMIT, waiter).await.unwrap();
    assert!(
        woken.duration_since(released) < Duration::from_millis(200),
        "the waiter was not woken by the release: {:?}",
        woken.duration_since(released)
    );
}

/// Client A takes `TRIALS` locks while the replicas cannot receive them; the master dies
/// and a replica is promoted; client B asks for the same locks. A double grant is a lock
/// B gets while A still holds and trusts it.
async fn double_grants_after_a_lossy_failover(sync: ReplicaSync) -> (usize, usize) {
    let mut group = SentinelGroup::start().await.expect("start sentinel group");
    let a = sentinel_client(&group, sync).await;
    group.cut_replica_links().await.unwrap();
    let names: Vec<String> = (0..TRIALS).map(|n| format!("trial:{n}")).collect();
    let attempts = names.iter().map(|name| {
        let lock = a.lock(name.clone()).unwrap();
        async move { lock.try_lock().await }
    });
    let outcomes = futures_util::future::join_all(attempts).await;
    let mut held = Vec::new();
    for outcome in outcomes {
        match outcome {
            Ok(Some(guard)) => held.push(guard),
            Ok(None) => panic!("a trial lock was busy"),
            Err(Error::NotReplicated { acknowledged, .. }) => assert_eq!(acknowledged, 0),
            Err(err) => panic!("unexpected: {err}"),
        }
    }
    let old = group.kill_master().await.unwrap();
    group.heal_replica_links().unwrap();
    group.wait_for_new_master(old, LIMIT).await.unwrap();

    let b = sentinel_client(&group, sync).await;
    let mut double = 0;
    for (name, guard) in names.iter().zip(&held) {
        assert_eq!(guard.name(), name);
    }
    for name in &names {
        let got = bounded(
            LIMIT,
            b.lock(name.clone())
                .unwrap()
                .try_lock_for(Duration::from_secs(2)),
        )
        .await
        .unwrap();
        if got.is_some()
            && held
                .iter()
                .any(|guard| guard.name() == name && !guard.is_lost())
        {
            double += 1;
        }
    }
    (held.len(), double)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lossy_failover_double_grants_without_replica_sync_and_never_with_it() {
    let (held_unsynced, double_unsynced) =
        double_grants_after_a_lossy_failover(ReplicaSync::Off).await;
    let (held_synced, double_synced) =
        double_grants_after_a_lossy_failover(ReplicaSync::Replicas {
            count: 1,
            timeout: Duration::from_millis(100),
        })
        .await;
    eprintln!(
        "lossy failover, {TRIALS} trials each: without sync A held {held_unsynced} and \
         {double_unsynced} were granted twice; with sync A held {held_synced} and \
         {double_synced} were granted twice"
    );
    // The control: without sync, every lock A took is handed out again.
    assert_eq!(held_unsynced, TRIALS);
    assert_eq!(double_unsynced, TRIALS);
    // With sync, A's acquisitions failed instead (no replica acknowledged), so nothing is
    // granted twice.
    assert_eq!(held_synced, 0);
    assert_eq!(double_synced, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unacknowledged_acquisition_leaves_no_lock_behind() {
    let mut group = SentinelGroup::start().await.expect("start sentinel group");
    let client = sentinel_client(
        &group,
        ReplicaSync::Replicas {
            count: 1,
            timeout: Duration::from_millis(100),
        },
    )
    .await;
    group.cut_replica_links().await.unwrap();
    let outcome = client.lock("unreplicated").unwrap().try_lock().await;
    group.heal_replica_links().unwrap();
    assert!(
        matches!(outcome, Err(Error::NotReplicated { .. })),
        "{outcome:?}"
    );
    // Given back on the master.
    let lock = client.lock("unreplicated").unwrap();
    common::eventually(
        Duration::from_secs(5),
        "the rolled-back lock is gone",
        || async { !lock.is_locked().await.unwrap_or(true) },
    )
    .await;
    // Once the replicas are back, acquisitions are acknowledged again.
    let guard = bounded(LIMIT, lock.try_lock_for(Duration::from_secs(10)))
        .await
        .unwrap()
        .expect("acquired once replicas acknowledge");
    guard.release().await.unwrap();
}
