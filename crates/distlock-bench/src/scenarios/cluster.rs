//! Redis Cluster against one server, in the same rounds: the uncontended cycle (one task)
//! and 64 parallel tasks on 64 names spread over every master's slots. The cluster is 3
//! masters and 3 replicas on this machine; the single server is one more private process.
//!
//! The ratio is what routing by slot costs the client. It is not a scaling figure: the
//! six cluster processes share the same 2 cores as the one server and the client, so the
//! cluster cannot be faster here. Scaling out needs cores of its own per master.

use distlock::Client;
use distlock_testkit::RedisCluster;

use super::{interleaved, lock_cycles, BenchResult, Plan};
use crate::report::{checked, figure, Report};

pub const TASKS: usize = 64;
pub const TARGET: f64 = 0.8;

pub async fn run(single: &Client, plan: Plan) -> BenchResult<Report> {
    let cluster = RedisCluster::start().await?;
    let seeds: Vec<String> = cluster
        .seed_urls()
        .iter()
        .map(|url| {
            url.trim_start_matches("redis://")
                .trim_end_matches('/')
                .to_owned()
        })
        .collect();
    let clustered = Client::connect(&format!("redis+cluster://{}", seeds.join(","))).await?;
    let one = vec!["bench:cluster:one".to_owned()];
    let many: Vec<String> = (0..TASKS).map(|n| format!("bench:cluster:{n}")).collect();
    let measured = interleaved(plan, 4, async |load, length| match load {
        0 => lock_cycles(single, &one, length).await,
        1 => lock_cycles(&clustered, &one, length).await,
        2 => lock_cycles(single, &many, length).await,
        _ => lock_cycles(&clustered, &many, length).await,
    })
    .await?;
    let [single_one, cluster_one, single_many, cluster_many] = <[_; 4]>::try_from(measured)
        .map_err(|_| "interleaved returned the wrong number of loads")?;
    // Each load's median ratio to the first; the parallel pair is compared by their ratios.
    let uncontended = cluster_one.ratio_to_first;
    let parallel = cluster_many.ratio_to_first / single_many.ratio_to_first;
    Ok(Report {
        scenario: "cluster",
        result: figure("cluster cycles/s (1 task)", cluster_one.rate, ""),
        baseline: figure("single-server cycles/s =", single_one.rate, "cycles/s"),
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
                "single lock+release p50 (1 task)",
                single_one.latency.micros(0.5),
                "µs",
            ),
            figure("cluster cycles/s (64 tasks)", cluster_many.rate, "cycles/s"),
            figure("single cycles/s (64 tasks)", single_many.rate, "cycles/s"),
            checked(
                "cluster vs single, 64 tasks over every master",
                parallel,
                "×",
                format!(">= {TARGET:.2}"),
                parallel >= TARGET,
            ),
            figure(
                "cluster lock+release p99 (64 tasks)",
                cluster_many.latency.micros(0.99),
                "µs",
            ),
        ],
    })
}
