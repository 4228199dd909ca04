//! Tests of the multi-process topologies: a Redis Cluster and a Sentinel group, made of
//! real `redis-server` processes.

use std::error::Error;
use std::future::Future;
use std::time::Duration;

use distlock_testkit::{ClusterRole, RedisCluster, SentinelGroup};
use redis::AsyncCommands;

type TestResult = Result<(), Box<dyn Error>>;

/// Upper bound for any single test, so a wedged topology fails the test instead of
/// hanging the suite. Generous against the few seconds each takes alone, because the
/// tests run in parallel on a small machine.
const TEST_LIMIT: Duration = Duration::from_secs(90);
/// Bound on Sentinel's failover: 1 s to notice, an election, a promotion.
const FAILOVER_LIMIT: Duration = Duration::from_secs(30);

async fn bounded(test: impl Future<Output = TestResult>) -> TestResult {
    tokio::time::timeout(TEST_LIMIT, test)
        .await
        .map_err(|_| format!("test did not finish within {TEST_LIMIT:?}"))?
}

/// Blocks until `replicas` replicas of the node behind `conn` acknowledged every write
/// made *on this connection* before it (WAIT on another connection proves nothing), so a
/// failover afterwards cannot lose them.
async fn wait_replicated(
    conn: &mut redis::aio::MultiplexedConnection,
    replicas: usize,
) -> TestResult {
    let acked: usize = redis::cmd("WAIT")
        .arg(replicas)
        .arg(5000)
        .query_async(conn)
        .await?;
    if acked < replicas {
        return Err(format!("only {acked} of {replicas} replicas acknowledged").into());
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_starts_with_every_slot_covered_and_serves_a_cluster_client() -> TestResult {
    bounded(async {
        let cluster = RedisCluster::start().await?;
        assert_eq!(cluster.seed_urls().len(), 6);

        let nodes = cluster.nodes().await?;
        assert_eq!(nodes.len(), 6, "{nodes:?}");
        let masters: Vec<_> = nodes
            .iter()
            .filter(|node| node.role == ClusterRole::Master)
            .collect();
        assert_eq!(masters.len(), 3, "{nodes:?}");
        let covered: usize = masters
            .iter()
            .flat_map(|master| master.slots.iter())
            .map(|range| usize::from(range.end() - range.start()) + 1)
            .sum();
        assert_eq!(covered, 16384);
        for master in &masters {
            let replica = cluster.replica_of(master.index).await?;
            let info = &nodes[replica];
            assert_eq!(info.role, ClusterRole::Replica);
            assert_eq!(info.master_id.as_deref(), Some(master.id.as_str()));
            assert!(info.slots.is_empty());
        }

        let mut conn = cluster.client()?.get_async_connection().await?;
        let () = conn.set("greeting", "hello").await?;
        let seen: Option<String> = conn.get("greeting").await?;
        assert_eq!(seen.as_deref(), Some("hello"));

        // The key is where the harness says its slot is.
        let slot = cluster.key_slot("greeting").await?;
        let owner = cluster.master_for_slot(slot).await?;
        let mut direct = cluster.node_connection(owner).await?;
        let seen: Option<String> = direct.get("greeting").await?;
        assert_eq!(seen.as_deref(), Some("hello"));
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_shard_cluster_serves_every_slot_from_one_master_and_fails_over() -> TestResult {
    bounded(async {
        let cluster = RedisCluster::start_single_shard().await?;
        let nodes = cluster.nodes().await?;
        assert_eq!(nodes.len(), 2, "{nodes:?}");
        assert_eq!(nodes[0].role, ClusterRole::Master);
        let covered: usize = nodes[0]
            .slots
            .iter()
            .map(|range| usize::from(range.end() - range.start()) + 1)
            .sum();
        assert_eq!(covered, 16384);
        assert_eq!(cluster.replica_of(0).await?, 1);

        let mut conn = cluster.client()?.get_async_connection().await?;
        let () = conn.set("greeting", "hello").await?;
        // The replica takes over with the data: it was replicating.
        let promoted = cluster.manual_failover(0).await?;
        assert_eq!(promoted, 1);
        let mut direct = cluster.node_connection(1).await?;
        let seen: Option<String> = direct.get("greeting").await?;
        assert_eq!(seen.as_deref(), Some("hello"));
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_by_kill_promotes_the_replica_and_the_old_master_rejoins() -> TestResult {
    bounded(async {
        let mut cluster = RedisCluster::start().await?;
        let slot = cluster.key_slot("survivor").await?;
        let owner = cluster.master_for_slot(slot).await?;
        // Written straight to the owner because WAIT only covers the writes of the
        // connection it is sent on.
        let mut at_owner = cluster.node_connection(owner).await?;
        let () = at_owner.set("survivor", "kept").await?;
        wait_replicated(&mut at_owner, 1).await?;
        let replica = cluster.replica_of(owner).await?;

        let promoted = cluster.failover_by_kill(owner).await?;

        assert_eq!(promoted, replica);
        assert!(!cluster.is_up(owner));
        assert_eq!(cluster.master_for_slot(slot).await?, promoted);
        let mut fresh = cluster.client()?.get_async_connection().await?;
        let seen: Option<String> = fresh.get("survivor").await?;
        assert_eq!(seen.as_deref(), Some("kept"));

        cluster.restart(owner).await?;
        let nodes = cluster.nodes().await?;
        assert_eq!(nodes[owner].role, ClusterRole::Replica, "{nodes:?}");
        assert_eq!(
            nodes[owner].master_id.as_deref(),
            Some(cluster.node_id(promoted)?)
        );
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_manual_failover_switches_roles_and_a_paused_node_is_skipped() -> TestResult {
    bounded(async {
        let cluster = RedisCluster::start().await?;
        let slot = cluster.key_slot("switch").await?;
        let owner = cluster.master_for_slot(slot).await?;
        let replica = cluster.replica_of(owner).await?;

        let promoted = cluster.manual_failover(owner).await?;

        assert_eq!(promoted, replica);
        assert_eq!(cluster.master_for_slot(slot).await?, promoted);
        assert_eq!(cluster.replica_of(promoted).await?, owner);

        // A frozen replica answers nothing, but the harness still reads the topology
        // from the other nodes, and the node answers again once resumed.
        cluster.pause(owner)?;
        assert!(!cluster.is_up(owner));
        let ping = async {
            let mut conn = cluster.node_connection(owner).await?;
            redis::cmd("PING").query_async::<String>(&mut conn).await?;
            Ok::<_, Box<dyn Error>>(())
        };
        let answer = tokio::time::timeout(Duration::from_millis(300), ping).await;
        assert!(answer.is_err(), "a paused node answered: {answer:?}");
        assert_eq!(cluster.master_for_slot(slot).await?, promoted);
        cluster.resume(owner)?;
        cluster.wait_until_healthy(Duration::from_secs(20)).await?;
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_slot_migration_redirects_with_ask_then_moved_and_keeps_the_key() -> TestResult {
    bounded(async {
        let cluster = RedisCluster::start().await?;
        let mut conn = cluster.client()?.get_async_connection().await?;
        let () = conn.set("{moving}a", "1").await?;
        let () = conn.set("{moving}b", "2").await?;
        let slot = cluster.key_slot("{moving}a").await?;
        let source = cluster.master_for_slot(slot).await?;
        let target = cluster
            .nodes()
            .await?
            .into_iter()
            .find(|node| node.role == ClusterRole::Master && node.index != source)
            .map(|node| node.index)
            .ok_or("no second master")?;

        let migration = cluster
            .begin_slot_migration(slot, target)
            .await?
            .ok_or("slot already at the target")?;
        assert_eq!(migration.source_port(), cluster.port(source)?);
        assert_eq!(migration.target_port(), cluster.port(target)?);
        assert_eq!(migration.move_keys().await?, 2);

        // Half-migrated: the source no longer has the keys and sends clients on with ASK,
        // which the cluster client follows.
        let mut at_source = cluster.node_connection(source).await?;
        let redirected = at_source.get::<_, Option<String>>("{moving}a").await;
        match redirected {
            Err(err) => assert_eq!(err.code(), Some("ASK"), "{err}"),
            Ok(value) => return Err(format!("source still served the key: {value:?}").into()),
        }
        let seen: Option<String> = conn.get("{moving}a").await?;
        assert_eq!(seen.as_deref(), Some("1"));
        // A key created now lands on the target, and is moved by nobody.
        let () = conn.set("{moving}c", "3").await?;

        migration.finish().await?;

        assert_eq!(cluster.master_for_slot(slot).await?, target);
        let redirected = at_source.get::<_, Option<String>>("{moving}b").await;
        match redirected {
            Err(err) => assert_eq!(err.code(), Some("MOVED"), "{err}"),
            Ok(value) => return Err(format!("source still served the key: {value:?}").into()),
        }
        for (key, value) in [("{moving}a", "1"), ("{moving}b", "2"), ("{moving}c", "3")] {
            let seen: Option<String> = conn.get(key).await?;
            assert_eq!(seen.as_deref(), Some(value), "{key}");
        }

        // Moving back in one call.
        cluster.migrate_slot(slot, source).await?;
        assert_eq!(cluster.master_for_slot(slot).await?, source);
        let seen: Option<String> = conn.get("{moving}c").await?;
        assert_eq!(seen.as_deref(), Some("3"));
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_group_replaces_a_killed_master() -> TestResult {
    bounded(async {
        let mut group = SentinelGroup::start().await?;
        assert_eq!(group.master_name(), "mymaster");
        assert_eq!(group.sentinel_urls().len(), 3);
        let ports = group.sentinel_ports();
        assert_eq!(
            group.sentinel_url(),
            format!(
                "redis+sentinel://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}/mymaster",
                ports[0], ports[1], ports[2]
            )
        );
        let old = group.master_port().await?;
        assert_eq!(old, group.server_ports()[0]);
        let replicas = group.replica_ports().await?;
        assert_eq!(replicas.len(), 2);

        let mut master = redis::Client::open(format!("redis://127.0.0.1:{old}/"))?
            .get_multiplexed_async_connection()
            .await?;
        let () = master.set("replicated", "yes").await?;
        wait_replicated(&mut master, 2).await?;

        assert_eq!(group.kill_master().await?, old);
        let new = group.wait_for_new_master(old, FAILOVER_LIMIT).await?;

        assert!(replicas.contains(&new), "{new} not in {replicas:?}");
        assert_eq!(group.master_port().await?, new);
        let mut promoted = redis::Client::open(format!("redis://127.0.0.1:{new}/"))?
            .get_multiplexed_async_connection()
            .await?;
        let seen: Option<String> = promoted.get("replicated").await?;
        assert_eq!(seen.as_deref(), Some("yes"));
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_after_cut_replica_links_loses_the_acknowledged_write() -> TestResult {
    bounded(async {
        let mut group = SentinelGroup::start().await?;
        let old = group.master_port().await?;
        let mut master = redis::Client::open(format!("redis://127.0.0.1:{old}/"))?
            .get_multiplexed_async_connection()
            .await?;
        let () = master.set("before-cut", "replicated").await?;
        wait_replicated(&mut master, 2).await?;

        group.cut_replica_links().await?;
        // Client A's lock: acknowledged by the master, seen by no replica.
        let () = master.set("lock", "client-a").await?;
        let seen: Option<String> = master.get("lock").await?;
        assert_eq!(seen.as_deref(), Some("client-a"));

        group.kill_master().await?;
        group.heal_replica_links()?;
        let new = group.wait_for_new_master(old, FAILOVER_LIMIT).await?;

        let mut promoted = redis::Client::open(format!("redis://127.0.0.1:{new}/"))?
            .get_multiplexed_async_connection()
            .await?;
        let lost: Option<String> = promoted.get("lock").await?;
        assert_eq!(lost, None, "the write after the cut reached the new master");
        let kept: Option<String> = promoted.get("before-cut").await?;
        assert_eq!(kept.as_deref(), Some("replicated"));
        Ok(())
    })
    .await
}
