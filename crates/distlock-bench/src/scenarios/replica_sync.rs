//! The cost of replica sync: a private master with one replica, and the uncontended lock
//! cycle with [`ReplicaSync::Off`] against the same cycle waiting for one replica after the
//! acquisition and after the release (WAIT pipelined behind each script), in the same
//! rounds.
//!
//! There is no target: the figure is what safety against a failover costs here, where the
//! replica is on the same machine. Across a network, add one replica round trip per write.

use std::time::Duration;

use distlock::{Client, ReplicaSync};
use distlock_testkit::RedisServer;

use super::cluster::wait_for_replica;
use super::{interleaved, lock_cycles, BenchResult, Plan};
use crate::report::{figure, Report};

pub async fn run(plan: Plan) -> BenchResult<Report> {
    let master = RedisServer::start().await?;
    let replica_of = master.port().to_string();
    let replica = RedisServer::start_with_args(&["--replicaof", "127.0.0.1", &replica_of]).await?;
    wait_for_replica(&master).await?;
    let unsynced = Client::builder()
        .replica_sync(ReplicaSync::Off)
        .connect(&master.url())
        .await?;
    let synced = Client::builder()
        .replica_sync(ReplicaSync::Replicas {
            count: 1,
            timeout: Duration::from_secs(1),
        })
        .connect(&master.url())
        .await?;
    let names = vec!["bench:replica-sync".to_owned()];
    let measured = interleaved(plan, 2, async |load, length| match load {
        0 => lock_cycles(&unsynced, &names, length).await,
        _ => lock_cycles(&synced, &names, length).await,
    })
    .await?;
    let [off, on] = <[_; 2]>::try_from(measured)
        .map_err(|_| "interleaved returned the wrong number of loads")?;
    drop(replica);
    Ok(Report {
        scenario: "replica-sync",
        result: figure("synced cycles/s (WAIT 1)", on.rate, ""),
        baseline: figure("unsynced cycles/s =", off.rate, "cycles/s"),
        ratio: on.ratio_to_first,
        target: "none (the cost of sync)".to_owned(),
        met: true,
        details: vec![
            figure("synced lock+release p50", on.latency.micros(0.5), "µs"),
            figure("unsynced lock+release p50", off.latency.micros(0.5), "µs"),
        ],
    })
}
