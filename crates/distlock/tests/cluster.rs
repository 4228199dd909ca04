//! On a real Redis Cluster (3 masters, 3 replicas on loopback): exclusion on names spread
//! over every master, a slot migrating under held and awaited locks, and failovers of the
//! shard that holds a lock.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use distlock::Client;
use distlock_testkit::{ExclusionChecker, RedisCluster};

const LIMIT: Duration = Duration::from_secs(60);

async fn cluster_client(cluster: &RedisCluster, watchdog: Duration) -> Client {
    Client::builder()
        .watchdog_timeout(watchdog)
        .connect(&cluster.url())
        .await
        .expect("connect to the cluster")
}

/// One section of a node's INFO.
async fn info(cluster: &RedisCluster, node: usize, section: &str) -> String {
    let mut conn = cluster.node_connection(node).await.unwrap();
    redis::cmd("INFO")
        .arg(section)
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// Calls of `command` on every master, from INFO commandstats.
async fn calls_on_masters(cluster: &RedisCluster, command: &str) -> u64 {
    let mut total = 0;
    for node in cluster.nodes().await.unwrap() {
        if node.role != distlock_testkit::ClusterRole::Master {
            continue;
        }
        let stats = info(cluster, node.index, "commandstats").await;
        total += stats
            .lines()
            .find_map(|line| line.strip_prefix(&format!("cmdstat_{command}:calls=")))
            .and_then(|rest| rest.split(',').next()?.parse::<u64>().ok())
            .unwrap_or(0);
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contenders_on_names_over_every_master_never_overlap() {
    let cluster = RedisCluster::start().await.expect("start cluster");
    // One client by seed list, one by a single node's plain URL (found to be a cluster).
    let by_seeds = cluster_client(&cluster, Duration::from_secs(10)).await;
    let by_node = Client::connect(&cluster.seed_urls()[4])
        .await
        .expect("connect");
    let names: Vec<String> = (0..12).map(|n| format!("spread:{n}")).collect();
    let mut masters = HashSet::new();
    for name in &names {
        let slot = cluster.key_slot(name).await.unwrap();
        masters.insert(cluster.master_for_slot(slot).await.unwrap());
    }
    assert_eq!(masters.len(), 3, "the names do not cover every master");

    let checkers: HashMap<String, ExclusionChecker> = names
        .iter()
        .map(|name| (name.clone(), ExclusionChecker::new()))
        .collect();
    let mut tasks = Vec::new();
    for name in &names {
        for contender in 0..8 {
            let client = if contender % 2 == 0 {
                by_seeds.clone()
            } else {
                by_node.clone()
            };
            let checker = checkers[name].clone();
            let lock = client.lock(name.clone()).unwrap();
            tasks.push(tokio::spawn(async move {
                for _ in 0..4 {
                    let guard = lock.lock().await.unwrap();
                    let hold = checker.enter(guard.fencing_token(), format!("c{contender}"));
                    tokio::task::yield_now().await;
                    hold.finish();
                    guard.release().await.unwrap();
                }
            }));
        }
    }
    common::join_bounded(LIMIT, tasks).await;
    for (name, checker) in &checkers {
        let report = checker.report();
        assert_eq!(report.holds, 32, "{name}");
        assert!(report.is_clean(), "{name}: {report}");
    }
    // Releases went out with sharded pub/sub, to the owning shard only.
    assert!(calls_on_masters(&cluster, "spublish").await >= 12 * 32 - 12);
    assert_eq!(calls_on_masters(&cluster, "publish").await, 0);
    assert!(calls_on_masters(&cluster, "ssubscribe").await > 0);
}

/// A final release leaves an unlock latch, which the client deletes in batches. On a
/// cluster one UNLINK may name keys of one slot only, so the batch is split by slot and
/// each part sent to its slot's master: every latch of releases over every master is gone
/// soon after, and none was refused as CROSSSLOT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unlock_latches_over_every_master_are_deleted() {
    let cluster = RedisCluster::start().await.expect("start cluster");
    let client = cluster_client(&cluster, Duration::from_secs(10)).await;
    let mut tasks = Vec::new();
    for n in 0..24 {
        let lock = client.lock(format!("latched:{n}")).unwrap();
        tasks.push(tokio::spawn(async move {
            for _ in 0..20 {
                let guard = lock.try_lock().await.unwrap().expect("uncontended");
                guard.release().await.unwrap();
            }
        }));
    }
    for task in tasks {
        common::bounded(LIMIT, task).await.unwrap();
    }
    assert!(calls_on_masters(&cluster, "unlink").await > 0);
    common::eventually(Duration::from_secs(5), "every latch deleted", || async {
        let mut left = 0;
        for node in cluster.nodes().await.unwrap() {
            let mut conn = cluster.node_connection(node.index).await.unwrap();
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg("redisson_unlock_latch:*")
                .query_async(&mut conn)
                .await
                .unwrap();
            left += keys.len();
        }
        left == 0
    })
    .await;
    for node in cluster.nodes().await.unwrap() {
        let errors = info(&cluster, node.index, "errorstats").await;
        assert!(
            !errors.contains("CROSSSLOT"),
            "node {}: {errors}",
            node.index
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_migrating_under_held_and_awaited_locks_loses_and_doubles_nothing() {
    let cluster = RedisCluster::start().await.expect("start cluster");
    let client = cluster_client(&cluster, Duration::from_secs(2)).await;
    let other = cluster_client(&cluster, Duration::from_secs(2)).await;
    let name = "migrating";
    let slot = cluster.key_slot(name).await.unwrap();
    let source = cluster.master_for_slot(slot).await.unwrap();
    let target = cluster
        .nodes()
        .await
        .unwrap()
        .into_iter()
        .find(|node| node.role == distlock_testkit::ClusterRole::Master && node.index != source)
        .map(|node| node.index)
        .expect("another master");

    let checker = ExclusionChecker::new();
    let holder = client.lock(name).unwrap().lock().await.unwrap();
    let first_hold = checker.enter(holder.fencing_token(), "holder");
    let mut waiters = Vec::new();
    for waiter in 0..4 {
        let lock = if waiter % 2 == 0 { &client } else { &other }
            .lock(name)
            .unwrap();
        let checker = checker.clone();
        waiters.push(tokio::spawn(async move {
            let guard = lock.lock().await.unwrap();
            let hold = checker.enter(guard.fencing_token(), format!("w{waiter}"));
            tokio::time::sleep(Duration::from_millis(20)).await;
            hold.finish();
            guard.release().await.unwrap();
        }));
    }
    let migration = cluster
        .begin_slot_migration(slot, target)
        .await
        .unwrap()
        .expect("the slot moves");
    let moved = migration.move_keys().await.unwrap();
    assert!(moved >= 1, "the held lock's keys were not in the slot");
    // Held across the move: the lock is still the holder's, and nobody else gets it
    // (the rival's attempt is redirected to the target, which has the lock).
    assert!(!holder.is_lost());
    assert!(other
        .lock(name)
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .is_none());
    migration.finish().await.unwrap();
    // Renewed on the new owner: the holder still trusts it, one lease period later.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        !holder.is_lost(),
        "the lease was not renewed after the slot moved"
    );
    first_hold.finish();
    holder.release().await.unwrap();
    common::join_bounded(LIMIT, waiters).await;
    let report = checker.report();
    assert_eq!(report.holds, 5, "a waiter never got the lock");
    assert!(report.is_clean(), "{report}");
    // Still usable after the move, by a client that learns the new owner from MOVED.
    let guard = other
        .lock(name)
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("free");
    guard.release().await.unwrap();
}

/// What a failover of the shard holding a lock does. An orderly `CLUSTER FAILOVER` lets
/// the replica catch up first, and a kill after the replica has the lock's write loses
/// nothing either: the holder keeps its lock, renews it on the new master, and nobody
/// else gets it. (A kill *before* the replica has the write loses the lock: replica sync
/// is not offered on a cluster yet; see docs/deployment.md.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shard_holding_a_lock_fails_over_and_the_holder_keeps_it() {
    let mut cluster = RedisCluster::start().await.expect("start cluster");
    // A lease longer than a failover takes (a kill: about 3.5 s here, with a 1 s node
    // timeout); a shorter one runs out while no master serves the slot.
    let lease = Duration::from_secs(10);
    let client = cluster_client(&cluster, lease).await;
    let rival = cluster_client(&cluster, lease).await;
    let name = "failing-over";
    let slot = cluster.key_slot(name).await.unwrap();

    for by_kill in [false, true] {
        let master = cluster.master_for_slot(slot).await.unwrap();
        let guard = client.lock(name).unwrap().lock().await.unwrap();
        let lost = guard.lost();
        let replica = cluster.replica_of(master).await.unwrap();
        replica_has_key(&cluster, replica, name).await;

        let started = Instant::now();
        if by_kill {
            cluster.failover_by_kill(master).await.unwrap();
        } else {
            cluster.manual_failover(master).await.unwrap();
        }
        // The first acquisition on the new master: another name of the same slot.
        let probe = format!("{{{name}}}:probe");
        let acquired = loop {
            match rival.lock(probe.clone()).unwrap().try_lock().await {
                Ok(Some(guard)) => break guard,
                Ok(None) => panic!("the probe lock is held by nobody"),
                Err(err) if err.is_connection_error() => {
                    assert!(
                        started.elapsed() < LIMIT,
                        "no acquisition after {LIMIT:?}: {err}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(err) => panic!("{err}"),
            }
        };
        let failover_time = started.elapsed();
        acquired.release().await.unwrap();
        eprintln!(
            "cluster failover ({}): first acquisition {failover_time:?} after it started",
            if by_kill { "kill" } else { "CLUSTER FAILOVER" }
        );

        assert!(
            rival
                .lock(name)
                .unwrap()
                .try_lock()
                .await
                .unwrap()
                .is_none(),
            "lock lost in the failover"
        );
        // The next renewal (every third of the lease) lands on the new master.
        tokio::select! {
            _ = lost => panic!("the holder lost its lock after the failover"),
            _ = tokio::time::sleep(lease / 3 + Duration::from_millis(500)) => {}
        }
        let left = rival.lock(name).unwrap().remaining_ttl().await.unwrap();
        assert!(
            left.is_some_and(|left| left > lease - lease / 3),
            "not renewed on the new master: {left:?} left"
        );
        guard.release().await.unwrap();
        if by_kill {
            // Bring the killed node back, as a replica, for the harness's health.
            cluster.restart(master).await.unwrap();
        }
    }
}

/// Waits until `replica` has `key` (asked with READONLY, bounded).
async fn replica_has_key(cluster: &RedisCluster, replica: usize, key: &str) {
    let mut conn = cluster.node_connection(replica).await.unwrap();
    let _: () = redis::cmd("READONLY").query_async(&mut conn).await.unwrap();
    common::eventually(Duration::from_secs(5), "the replica has the lock", || {
        let mut conn = conn.clone();
        async move {
            redis::cmd("EXISTS")
                .arg(key)
                .query_async::<i64>(&mut conn)
                .await
                .unwrap_or(0)
                == 1
        }
    })
    .await;
}
