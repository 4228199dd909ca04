//! On a real Redis Cluster (3 masters, 3 replicas on loopback): exclusion on names spread
//! over every master, a slot migrating under held and awaited locks, failovers of the
//! shard that holds a lock, and replica sync per shard through a lossy failover.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::bounded;
use distlock::{Client, Error, ReplicaSync};
use distlock_testkit::{ExclusionChecker, RedisCluster};

const LIMIT: Duration = Duration::from_secs(60);
/// Locks taken through each lossy failover.
const TRIALS: usize = 20;

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

/// Calls of `command` on node `node`, from INFO commandstats.
async fn calls_on(cluster: &RedisCluster, node: usize, command: &str) -> u64 {
    info(cluster, node, "commandstats")
        .await
        .lines()
        .find_map(|line| line.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next()?.parse::<u64>().ok())
        .unwrap_or(0)
}

/// Calls of `command` on every master, from INFO commandstats.
async fn calls_on_masters(cluster: &RedisCluster, command: &str) -> u64 {
    let mut total = 0;
    for node in cluster.nodes().await.unwrap() {
        if node.role == distlock_testkit::ClusterRole::Master {
            total += calls_on(cluster, node.index, command).await;
        }
    }
    total
}

/// Runs `rounds` lock cycles, each under 500 ms, and checks that node `node` was sent no
/// WAIT meanwhile: a master with no replica listed is not waited for, nor refused.
async fn cycles_without_wait<F, Fut>(cluster: &RedisCluster, node: usize, rounds: usize, cycle: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = distlock::Result<distlock::ReleaseOutcome>>,
{
    let before = calls_on(cluster, node, "wait").await;
    for _ in 0..rounds {
        let started = Instant::now();
        assert_eq!(cycle().await.unwrap(), distlock::ReleaseOutcome::Released);
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "a cycle on a master without replicas waited: {:?}",
            started.elapsed()
        );
    }
    assert_eq!(
        calls_on(cluster, node, "wait").await,
        before,
        "a master without replicas was sent WAIT"
    );
}

/// A hash tag whose slot master `master` serves.
async fn tag_served_by(cluster: &RedisCluster, master: usize) -> String {
    for n in 0..1_000 {
        let tag = format!("shard{n}");
        let slot = cluster.key_slot(&tag).await.unwrap();
        if cluster.master_for_slot(slot).await.unwrap() == master {
            return tag;
        }
    }
    panic!("no tag of the first thousand lands on master {master}");
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
/// else gets it. With replica sync (the default here), a kill leaves the promoted master
/// without a replica, and the holder's renewals go on there without a WAIT. (A kill
/// *before* the replica has the write: see
/// `a_lossy_failover_double_grants_without_replica_sync_and_never_with_it`.)
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

/// Client A (with `sync`) takes `TRIALS` locks of master `master`'s shard while the
/// master's replica cannot receive them; the master is killed and the replica promoted;
/// client B, without sync, asks for the same locks on the new master. A double grant is a
/// lock B gets while A still holds and trusts it. Returns (locks A held, granted twice).
async fn double_grants_after_a_lossy_failover(
    cluster: &mut RedisCluster,
    master: usize,
    sync: ReplicaSync,
) -> (usize, usize) {
    let tag = tag_served_by(cluster, master).await;
    let a = Client::builder()
        .replica_sync(sync)
        .connect(&cluster.url())
        .await
        .expect("connect");
    let names: Vec<String> = (0..TRIALS)
        .map(|n| format!("{{{tag}}}:trial:{n}"))
        .collect();
    let replica = cluster.cut_replica_link(master).await.unwrap();
    let held = common::take_while_unreplicated(&a, &names).await;
    cluster
        .failover_by_kill_after_cut(master, replica)
        .await
        .unwrap();

    let b = Client::builder()
        .replica_sync(ReplicaSync::Off)
        .connect(&cluster.url())
        .await
        .expect("connect");
    let (got, double) = common::double_grants(&b, &names, &held).await;
    // The locks are free on the new master in every case: lost with the old master's
    // data, or never granted (given back) under sync.
    assert_eq!(got, names.len(), "the second client did not get every lock");
    (held.len(), double)
}

/// The known unsafe case on a cluster, once per shard: without sync, every lock taken
/// after the replica link was cut is granted again after the failover (the control); with
/// sync, explicit or the default `Auto`, the acquisitions failed instead, so nothing is.
/// Under `Auto` the frozen replica is flagged as failing while A waits, and still counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lossy_failover_double_grants_without_replica_sync_and_never_with_it() {
    let mut cluster = RedisCluster::start().await.expect("start cluster");
    let unsynced = double_grants_after_a_lossy_failover(&mut cluster, 0, ReplicaSync::Off).await;
    let fast_sync = ReplicaSync::Replicas {
        count: 1,
        timeout: Duration::from_millis(100),
    };
    let synced = double_grants_after_a_lossy_failover(&mut cluster, 1, fast_sync).await;
    let auto = double_grants_after_a_lossy_failover(&mut cluster, 2, ReplicaSync::Auto).await;
    eprintln!(
        "lossy cluster failover, {TRIALS} trials each (held by A, granted twice): \
         without sync {unsynced:?}, with sync {synced:?}, with Auto {auto:?}"
    );
    assert_eq!(
        unsynced,
        (TRIALS, TRIALS),
        "the control did not double-grant"
    );
    assert_eq!(synced, (0, 0));
    assert_eq!(auto, (0, 0));
}

/// Under `ReplicaSync::Auto`, each shard is decided by itself. A lock write waits for a
/// replica where the cluster lists one. A master promoted after a kill has none until its
/// predecessor rejoins: its locks are granted without a WAIT (no failover could lose
/// them) rather than refused, and once the old master is back as its replica, its writes
/// wait again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_sync_waits_per_shard_for_the_replicas_the_cluster_lists() {
    let mut cluster = RedisCluster::start().await.expect("start cluster");
    let client = cluster_client(&cluster, Duration::from_secs(10)).await;
    let tag = tag_served_by(&cluster, 0).await;
    let name = format!("{{{tag}}}:per-shard");
    let cycle = || async {
        let guard = client.lock(name.as_str()).unwrap().try_lock().await?;
        guard.expect("free").release().await
    };

    let before = calls_on(&cluster, 0, "wait").await;
    cycle().await.unwrap();
    assert_eq!(
        calls_on(&cluster, 0, "wait").await,
        before + 2,
        "the acquisition and the release each wait for the replica"
    );

    let promoted = cluster.failover_by_kill(0).await.unwrap();
    let started = Instant::now();
    loop {
        match cycle().await {
            Ok(outcome) => {
                assert_eq!(outcome, distlock::ReleaseOutcome::Released);
                break;
            }
            Err(err) if err.is_connection_error() && started.elapsed() < LIMIT => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(err) => panic!("no lock cycle on the promoted master: {err}"),
        }
    }
    cycles_without_wait(&cluster, promoted, 5, cycle).await;

    // The old master rejoins as the promoted one's replica: once the client's map is 5 s
    // old, it is read again before the next write, which then waits for the replica.
    cluster.restart(0).await.unwrap();
    let before = calls_on(&cluster, promoted, "wait").await;
    common::eventually(
        Duration::from_secs(8),
        "lock writes wait for the rejoined replica",
        || async { cycle().await.is_ok() && calls_on(&cluster, promoted, "wait").await > before },
    )
    .await;
}

/// Under `ReplicaSync::Auto`, the WAIT follows the master a write reaches, not the one
/// the client's map named. Master 0's replica is moved to master 1, so master 0 has none;
/// then a slot moves from master 0 to master 1. The client's next write there, sent to
/// the old owner and redirected, waits for the new owner's replica. (Review: the count was
/// decided before the send, and a write judged to need no WAIT followed its redirection
/// without one.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_redirected_to_a_master_with_a_replica_waits_for_it() {
    let cluster = RedisCluster::start().await.expect("start cluster");
    let (bare, with_replicas) = (0, 1);
    let moved_replica = cluster.replica_of(bare).await.unwrap();
    let target_id = cluster.node_id(with_replicas).unwrap().to_owned();
    let mut conn = cluster.node_connection(moved_replica).await.unwrap();
    let () = redis::cmd("CLUSTER")
        .arg("REPLICATE")
        .arg(&target_id)
        .query_async(&mut conn)
        .await
        .unwrap();
    // Every node must see it: the client reads CLUSTER NODES from any of them.
    let replica_id = cluster.node_id(moved_replica).unwrap().to_owned();
    common::eventually(
        Duration::from_secs(20),
        "every node sees the replica follow its new master",
        || async {
            for node in 0..cluster.ports().len() {
                let Ok(mut conn) = cluster.node_connection(node).await else {
                    return false;
                };
                let view: String = match redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query_async(&mut conn)
                    .await
                {
                    Ok(view) => view,
                    Err(_) => return false,
                };
                let follows = view.lines().any(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    fields.first() == Some(&replica_id.as_str())
                        && fields.get(3) == Some(&target_id.as_str())
                });
                if !follows {
                    return false;
                }
            }
            true
        },
    )
    .await;

    let tag = tag_served_by(&cluster, bare).await;
    let name = format!("{{{tag}}}:moving");
    let slot = cluster.key_slot(&name).await.unwrap();
    let client = cluster_client(&cluster, Duration::from_secs(10)).await;
    let cycle = || async {
        let guard = client.lock(name.as_str()).unwrap().try_lock().await?;
        guard.expect("free").release().await
    };
    cycles_without_wait(&cluster, bare, 1, cycle).await;

    cluster.migrate_slot(slot, with_replicas).await.unwrap();
    let before = calls_on(&cluster, with_replicas, "wait").await;
    cycle().await.unwrap();
    assert_eq!(
        calls_on(&cluster, with_replicas, "wait").await,
        before + 2,
        "the acquisition and the release on the new owner each wait for its replicas"
    );

    // And back: redirected to the master without replicas, the cycle sends no WAIT and
    // is not refused (it used to wait for one replica there and fail NotReplicated).
    cluster.migrate_slot(slot, bare).await.unwrap();
    cycles_without_wait(&cluster, bare, 1, cycle).await;
}

/// Review (runtime attack): with one shard's replica frozen and 24 tasks hammering that
/// shard, a lock held on another shard was lost: the watchdog's round waited for the
/// frozen shard's renewal, and skipped every tick meanwhile. Now each lease's renewal is
/// in flight on its own, so the healthy shard's lock stays held, while the frozen shard's
/// is lost at its deadline and nothing there is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_replica_of_one_shard_does_not_starve_another_shards_renewals() {
    let cluster = RedisCluster::start().await.expect("start cluster");
    let lease = Duration::from_secs(3);
    let client = cluster_client(&cluster, lease).await;
    let (frozen_tag, healthy_tag) = (
        tag_served_by(&cluster, 0).await,
        tag_served_by(&cluster, 1).await,
    );
    let on_frozen = client
        .lock(format!("{{{frozen_tag}}}:held"))
        .unwrap()
        .lock()
        .await
        .unwrap();
    let on_healthy = client
        .lock(format!("{{{healthy_tag}}}:held"))
        .unwrap()
        .lock()
        .await
        .unwrap();
    let replica = cluster.replica_of(0).await.unwrap();
    cluster.pause(replica).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let granted = Arc::new(AtomicUsize::new(0));
    let hammer: Vec<_> = (0..24)
        .map(|n| {
            let lock = client.lock(format!("{{{frozen_tag}}}:hammer:{n}")).unwrap();
            let (stop, granted) = (Arc::clone(&stop), Arc::clone(&granted));
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(Some(guard)) = lock.try_lock().await {
                        granted.fetch_add(1, Ordering::SeqCst);
                        let _ = guard.release().await;
                    }
                }
            })
        })
        .collect();
    // Three leases' worth of time on the healthy shard.
    let healthy_lost = tokio::time::timeout(lease * 3, on_healthy.lost())
        .await
        .is_ok();
    let frozen_lost = tokio::time::timeout(Duration::from_millis(500), on_frozen.lost())
        .await
        .is_ok();
    stop.store(true, Ordering::Relaxed);
    common::join_bounded(LIMIT, hammer).await;
    cluster.resume(replica).unwrap();
    assert!(!healthy_lost, "the lock on the healthy shard was lost");
    assert!(
        frozen_lost,
        "the frozen shard's lock is still trusted past its lease"
    );
    assert_eq!(
        granted.load(Ordering::SeqCst),
        0,
        "granted on the frozen shard"
    );
    on_healthy.release().await.unwrap();
}

/// Review (runtime attack): `try_lock_for(300 ms)` against a frozen replica made its
/// first synced attempt (1 s of WAIT), then a second one after its deadline had passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patient_call_makes_no_attempt_after_its_deadline() {
    let cluster = RedisCluster::start().await.expect("start cluster");
    let client = cluster_client(&cluster, Duration::from_secs(30)).await;
    let tag = tag_served_by(&cluster, 0).await;
    let lock = client.lock(format!("{{{tag}}}:deadline")).unwrap();
    let replica = cluster.replica_of(0).await.unwrap();
    let before = calls_on(&cluster, 0, "wait").await;
    cluster.pause(replica).unwrap();
    let outcome = bounded(LIMIT, lock.try_lock_for(Duration::from_millis(300))).await;
    cluster.resume(replica).unwrap();
    assert!(
        matches!(outcome, Err(Error::NotReplicated { .. })),
        "{outcome:?}"
    );
    // A second attempt would have finished, WAIT and all, before the call returned.
    assert_eq!(
        calls_on(&cluster, 0, "wait").await,
        before + 1,
        "a second attempt after the deadline"
    );
}

/// Review (runtime attack): a waiter whose lock's slot moved to another master was not
/// woken by the release (Redis drops a slot's sharded subscriptions when the slot moves,
/// and the hub did not subscribe again); it got the lock only when the lease hint ran
/// out, 20 s later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_a_release_after_its_slot_moved() {
    let cluster = RedisCluster::start().await.expect("start cluster");
    let lease = Duration::from_secs(20);
    let (a, b) = (
        cluster_client(&cluster, lease).await,
        cluster_client(&cluster, lease).await,
    );
    let tag = tag_served_by(&cluster, 0).await;
    let name = format!("{{{tag}}}:wake");
    let slot = cluster.key_slot(&name).await.unwrap();
    let holder = a.lock(name.as_str()).unwrap().lock().await.unwrap();
    let waiting = b.lock(name.as_str()).unwrap();
    let waiter = tokio::spawn(async move {
        let guard = waiting.lock().await.unwrap();
        let got_at = Instant::now();
        guard.release().await.unwrap();
        got_at
    });
    // Waits until node `node` has a sharded subscription (the waiter's).
    let subscribed_on = |node: usize, what: &'static str| {
        let cluster = &cluster;
        async move {
            let conn = cluster.node_connection(node).await.unwrap();
            common::eventually(Duration::from_secs(5), what, || {
                let mut conn = conn.clone();
                async move {
                    redis::cmd("PUBSUB")
                        .arg("SHARDCHANNELS")
                        .query_async::<Vec<String>>(&mut conn)
                        .await
                        .is_ok_and(|channels| !channels.is_empty())
                }
            })
            .await;
        }
    };
    subscribed_on(0, "the waiter subscribed").await;
    cluster.migrate_slot(slot, 1).await.unwrap();
    subscribed_on(1, "subscribed again on the new owner").await;
    let released_at = Instant::now();
    holder.release().await.unwrap();
    let got_at = bounded(LIMIT, waiter).await.unwrap();
    let took = got_at.saturating_duration_since(released_at);
    assert!(took < Duration::from_secs(2), "woken only after {took:?}");
}

/// A user who may not run CLUSTER NODES (an ACL) still locks: the replica counts are
/// unknown, so every write waits for one replica, and the map is asked for at most once
/// per 5 s, not before every write. A frozen replica still refuses the grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_cluster_nodes_waits_everywhere_without_a_map_read_per_write() {
    let cluster = RedisCluster::start().await.expect("start cluster");
    for node in 0..cluster.ports().len() {
        let mut conn = cluster.node_connection(node).await.unwrap();
        let () = redis::cmd("ACL")
            .arg(&[
                "SETUSER",
                "app",
                "on",
                ">pw",
                "~*",
                "&*",
                "+@all",
                "-cluster|nodes",
            ])
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let hosts: Vec<String> = cluster
        .ports()
        .iter()
        .map(|port| format!("127.0.0.1:{port}"))
        .collect();
    let client = bounded(
        LIMIT,
        Client::connect(&format!("redis+cluster://app:pw@{}", hosts.join(","))),
    )
    .await
    .expect("connect as app");
    let tag = tag_served_by(&cluster, 1).await;
    let lock = client.lock(format!("{{{tag}}}:acl")).unwrap();
    let cycle = || async {
        let guard = lock.try_lock().await.unwrap().expect("free");
        guard.release().await.unwrap();
    };
    cycle().await;
    let map_reads = || async {
        let mut reads = 0;
        for node in 0..cluster.ports().len() {
            reads += calls_on(&cluster, node, "cluster|slots").await;
        }
        reads
    };
    let (reads_before, waits_before) = (map_reads().await, calls_on(&cluster, 1, "wait").await);
    let started = Instant::now();
    let cycles = 150;
    bounded(LIMIT, async {
        for _ in 0..cycles {
            cycle().await;
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
    })
    .await;
    let took = started.elapsed();
    let reads = map_reads().await - reads_before;
    assert_eq!(
        calls_on(&cluster, 1, "wait").await - waits_before,
        2 * cycles,
        "every acquisition and release waits for a replica"
    );
    assert!(
        reads <= took.as_secs() / 5 + 2,
        "{reads} map reads in {took:?}: read per write"
    );
    let replica = cluster.replica_of(1).await.unwrap();
    cluster.pause(replica).unwrap();
    let refused = bounded(LIMIT, lock.try_lock()).await;
    cluster.resume(replica).unwrap();
    assert!(
        matches!(refused, Err(Error::NotReplicated { .. })),
        "granted with the replica frozen: {:?}",
        refused.map(|guard| guard.is_some())
    );
}

/// The mixes a Cluster adds to issue 21's settings: a key prefix (every helper key must
/// share its lock's slot, or scripts fail with CROSSSLOT) with a name of its own hash tag
/// and without, and two fencing-counter settings on one lock (the other setting's
/// counter is read as an undeclared key of the slot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_prefix_and_mixed_counter_settings_work_on_a_cluster() {
    let cluster = RedisCluster::start().await.expect("start cluster");
    let prefixed = Client::builder()
        .key_prefix("app:")
        .connect(&cluster.url())
        .await
        .unwrap();
    let per_name = Client::builder()
        .fencing_counter(distlock::FencingCounter::PerName)
        .connect(&cluster.url())
        .await
        .unwrap();
    let per_slot = cluster_client(&cluster, Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        for name in ["orders", "{user:7}:cart"] {
            let lock = prefixed.lock(name).unwrap();
            let guard = lock.lock().await.unwrap();
            guard.reenter().await.unwrap().release().await.unwrap();
            assert!(guard.verify().await.unwrap());
            // A waiter is woken on the prefixed channel.
            let waiting = {
                let lock = lock.clone();
                tokio::spawn(async move { lock.try_lock_for(Duration::from_secs(10)).await })
            };
            // Time to subscribe (a sharded channel's subscribers are not counted where
            // a test can read them simply); a waiter not yet parked finds the lock free
            // and passes the check below anyway.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let released_at = Instant::now();
            assert_eq!(
                guard.release().await.unwrap(),
                distlock::ReleaseOutcome::Released
            );
            let next = bounded(LIMIT, waiting).await.unwrap().unwrap();
            assert!(
                released_at.elapsed() < Duration::from_secs(2),
                "{name}: the waiter was not woken"
            );
            next.expect("handed over").release().await.unwrap();
            assert!(lock.advance_fencing_counter(50).await.unwrap() >= 50);
            assert!(lock.force_unlock().await.is_ok());
        }
        let mut tokens = Vec::new();
        for round in 0..8 {
            let client = if round % 2 == 0 { &per_name } else { &per_slot };
            let guard = client.lock("{mixed}:lock").unwrap().lock().await.unwrap();
            tokens.push(guard.fencing_token());
            guard.release().await.unwrap();
        }
        assert!(
            tokens.windows(2).all(|pair| pair[0] < pair[1]),
            "tokens not strictly increasing on a cluster: {tokens:?}"
        );
    })
    .await;
}

/// The lock family on a cluster (sharded pub/sub on Redis 7): a fair lock's direct
/// handoff, a semaphore and a permit semaphore woken by their free count, a latch woken
/// when it opens, a read-write lock; and a latch name whose own hash tag would put its
/// channel in another slot is refused rather than failing every call with CROSSSLOT.
#[tokio::test]
async fn the_lock_family_works_on_a_cluster() {
    let cluster = RedisCluster::start().await.expect("start cluster");
    let a = cluster_client(&cluster, Duration::from_secs(5)).await;
    let b = cluster_client(&cluster, Duration::from_secs(5)).await;
    bounded(Duration::from_secs(60), async {
        // Fair lock: the release hands the lock to the queued waiter.
        let held = a.fair_lock("fam:fair").unwrap().lock().await.unwrap();
        let next = tokio::spawn({
            let lock = b.fair_lock("fam:fair").unwrap();
            async move { lock.lock().await }
        });
        let fair = a.fair_lock("fam:fair").unwrap();
        common::eventually(Duration::from_secs(10), "queued", || {
            let fair = fair.clone();
            async move { fair.queued().await.unwrap() == 1 }
        })
        .await;
        let token = held.fencing_token();
        held.release().await.unwrap();
        let granted = next.await.unwrap().unwrap();
        assert!(granted.fencing_token() > token);
        granted.release().await.unwrap();

        // Semaphore: a waiter woken by the release's free count.
        let pool = a.semaphore("fam:pool").unwrap();
        assert!(pool.try_set_permits(1).await.unwrap().is_set());
        let taken = pool.acquire(1).await.unwrap();
        let waiting = tokio::spawn({
            let pool = b.semaphore("fam:pool").unwrap();
            async move { pool.acquire(1).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        let released_at = Instant::now();
        taken.release().await.unwrap();
        waiting.await.unwrap().unwrap().release().await.unwrap();
        assert!(
            released_at.elapsed() < Duration::from_millis(500),
            "{:?}",
            released_at.elapsed()
        );

        // Permit semaphore.
        let gpus = a.permit_semaphore("fam:gpus").unwrap();
        assert!(gpus.try_set_permits(2).await.unwrap().is_set());
        let permits = gpus.acquire(2).await.unwrap();
        assert!(b
            .permit_semaphore("fam:gpus")
            .unwrap()
            .try_acquire(1)
            .await
            .unwrap()
            .is_none());
        permits.release().await.unwrap();
        assert_eq!(gpus.available_permits().await.unwrap(), 2);

        // Latch.
        let latch = a.count_down_latch("fam:latch").unwrap();
        latch.try_set_count(1).await.unwrap();
        let waiter = tokio::spawn({
            let latch = b.count_down_latch("fam:latch").unwrap();
            async move { latch.wait_for(Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        latch.count_down().await.unwrap();
        assert!(waiter.await.unwrap().unwrap());
        assert!(matches!(
            a.count_down_latch("{t}a"),
            Err(Error::InvalidName { .. })
        ));

        // Read-write lock.
        let rw = a.rw_lock("fam:rw").unwrap();
        let reader = rw.read().await.unwrap();
        assert!(b
            .rw_lock("fam:rw")
            .unwrap()
            .try_write()
            .await
            .unwrap()
            .is_none());
        let writing = tokio::spawn({
            let rw = b.rw_lock("fam:rw").unwrap();
            async move { rw.write().await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        reader.release().await.unwrap();
        writing.await.unwrap().unwrap().release().await.unwrap();
    })
    .await;
}
