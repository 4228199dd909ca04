//! Redis Cluster against one server, in the same rounds: the uncontended cycle (one task)
//! and 64 parallel tasks on 64 names spread over every master's slots. The cluster is 3
//! masters, each with a replica, on this machine. The baseline is one master with one
//! replica, so both sides pay for replication (every lock write is also sent to, and
//! applied by, a replica process on the same 2 cores); the same cycle on a server without
//! a replica is reported beside it.
//!
//! The ratio is what routing by slot costs the client. It is not a scaling figure: the
//! six cluster processes share the same 2 cores as the one server and the client, so the
//! cluster cannot be faster here. Scaling out needs cores of its own per master.
//!
//! With 64 tasks the 3-master cluster also pays for its extra processes: three masters
//! and three replicas take turns on 2 cores, each woken for a third of the commands, where
//! the baseline's one master takes them in larger batches. To separate that from routing,
//! a single-shard cluster (one master with every slot, one replica: the same processes as
//! the baseline) runs the same loads; its ratio is the cost of cluster mode and routing
//! alone.
//!
//! Both sides run without replica sync, so that the ratio is routing alone; the cost of
//! replica sync on the cluster (`Auto`: one WAIT per lock write) is reported beside it,
//! as a ratio to the same cluster without it.

use std::time::Duration;

use distlock::{Client, ReplicaSync};
use distlock_testkit::{RedisCluster, RedisServer};

use super::{interleaved, lock_cycles, BenchResult, Plan};
use crate::report::{checked, figure, Report};

pub const TASKS: usize = 64;
pub const TARGET: f64 = 0.8;

pub async fn run(unreplicated: &Client, plan: Plan) -> BenchResult<Report> {
    let master = RedisServer::start().await?;
    let replica_of = master.port().to_string();
    let _replica = RedisServer::start_with_args(&["--replicaof", "127.0.0.1", &replica_of]).await?;
    wait_for_replica(&master).await?;
    // Without sync on both sides: the same commands.
    let unsynced = || Client::builder().replica_sync(ReplicaSync::Off);
    let single = &unsynced().connect(&master.url()).await?;
    let cluster = RedisCluster::start().await?;
    let clustered = unsynced().connect(&cluster.url()).await?;
    let synced = Client::connect(&cluster.url()).await?;
    let shard = RedisCluster::start_single_shard().await?;
    let one_shard = unsynced().connect(&shard.url()).await?;
    let one = vec!["bench:cluster:one".to_owned()];
    let many: Vec<String> = (0..TASKS).map(|n| format!("bench:cluster:{n}")).collect();
    let measured = interleaved(plan, 8, async |load, length| match load {
        0 => lock_cycles(single, &one, length).await,
        1 => lock_cycles(&clustered, &one, length).await,
        2 => lock_cycles(single, &many, length).await,
        3 => lock_cycles(&clustered, &many, length).await,
        4 => lock_cycles(&one_shard, &one, length).await,
        5 => lock_cycles(&one_shard, &many, length).await,
        6 => lock_cycles(&synced, &one, length).await,
        _ => lock_cycles(unreplicated, &one, length).await,
    })
    .await?;
    let [single_one, cluster_one, single_many, cluster_many, shard_one, shard_many, synced_one, bare_one] =
        <[_; 8]>::try_from(measured)
            .map_err(|_| "interleaved returned the wrong number of loads")?;
    // Each load's median ratio to the first; the parallel pairs are compared by their ratios.
    let uncontended = cluster_one.ratio_to_first;
    let parallel = cluster_many.ratio_to_first / single_many.ratio_to_first;
    let shard_parallel = shard_many.ratio_to_first / single_many.ratio_to_first;
    let shard_uncontended = shard_one.ratio_to_first;
    Ok(Report {
        scenario: "cluster",
        result: figure("cluster cycles/s (1 task)", cluster_one.rate, ""),
        baseline: figure("master+replica cycles/s =", single_one.rate, "cycles/s"),
        ratio: uncontended,
        target: format!("ratio >= {TARGET:.2}"),
        met: uncontended >= TARGET,
        details: vec![
            figure(
                "cluster lock+release p50 (1 task)",
                cluster_one.latency.micros(0.5),
                "µs",
            ),
            figure(
                "master+replica lock+release p50 (1 task)",
                single_one.latency.micros(0.5),
                "µs",
            ),
            figure("cluster cycles/s (64 tasks)", cluster_many.rate, "cycles/s"),
            figure(
                "master+replica cycles/s (64 tasks)",
                single_many.rate,
                "cycles/s",
            ),
            checked(
                "cluster vs master+replica, 64 tasks over every master",
                parallel,
                "×",
                format!(">= {TARGET:.2}"),
                parallel >= TARGET,
            ),
            checked(
                "single-shard cluster vs master+replica, 64 tasks (routing alone)",
                shard_parallel,
                "×",
                format!(">= {TARGET:.2}"),
                shard_parallel >= TARGET,
            ),
            checked(
                "single-shard cluster vs master+replica, 1 task (routing alone)",
                shard_uncontended,
                "×",
                format!(">= {TARGET:.2}"),
                shard_uncontended >= TARGET,
            ),
            figure(
                "cluster lock+release p99 (64 tasks)",
                cluster_many.latency.micros(0.99),
                "µs",
            ),
            figure(
                "cluster with replica sync (Auto) cycles/s (1 task)",
                synced_one.rate,
                "cycles/s",
            ),
            figure(
                "cluster with replica sync vs without (1 task)",
                synced_one.ratio_to_first / cluster_one.ratio_to_first,
                "×",
            ),
            figure(
                "server without a replica cycles/s (1 task)",
                bare_one.rate,
                "cycles/s",
            ),
            figure(
                "cluster vs a server without a replica (1 task)",
                cluster_one.ratio_to_first / bare_one.ratio_to_first,
                "×",
            ),
        ],
    })
}

/// Waits (bounded) until the master reports its replica online.
pub async fn wait_for_replica(master: &RedisServer) -> BenchResult<()> {
    let mut conn = master.connection().await?;
    for _ in 0..200 {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut conn)
            .await?;
        if info.contains("state=online") {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    Err("the replica did not come online within 5 s".into())
}
