//! One task acquires and releases one lock back to back. A cycle is two script calls, so
//! the best possible rate is half the raw EVALSHA rate on the same connection.

use distlock::Client;

use std::sync::Arc;

use rslock::LockManager;

use super::{cycle_report, cycles_against_baselines, BenchResult, Plan};
use crate::report::{figure, Report};

pub const TARGET: f64 = 0.9;

pub async fn run(client: &Client, peer: &Arc<LockManager>, plan: Plan) -> BenchResult<Report> {
    let names = vec!["bench:uncontended".to_owned()];
    let loads = cycles_against_baselines(client, plan, &names, Some(peer)).await?;
    let peer = loads.peer.as_ref().ok_or("no rslock measurement")?;
    let details = vec![
        figure("lock+release p50", loads.lock.latency.micros(0.5), "µs"),
        figure("raw scripts p50", loads.raw.latency.micros(0.5), "µs"),
        figure(
            "EVALSHA round trip p50",
            loads.noop.latency.micros(0.5),
            "µs",
        ),
        figure(
            "rslock 0.10 lock+unlock p50",
            peer.latency.micros(0.5),
            "µs",
        ),
        figure(
            "distlock vs rslock 0.10 (cycles/s)",
            loads.lock.ratio_to_first / peer.ratio_to_first,
            "×",
        ),
    ];
    Ok(cycle_report("uncontended", TARGET, &loads, details))
}
