//! 64 tasks, each on its own lock, all through one client. The best possible rate is half
//! the EVALSHA rate of 64 concurrent callers on the same connection. rslock runs the same
//! 64 tasks on its own (one) connection.

use std::sync::Arc;

use distlock::Client;
use rslock::LockManager;

use super::{cycle_report, cycles_against_baselines, BenchResult, Plan};
use crate::report::{checked, figure, Report};

pub const TASKS: usize = 64;
pub const TARGET: f64 = 0.8;

pub async fn run(client: &Client, peer: &Arc<LockManager>, plan: Plan) -> BenchResult<Report> {
    let names: Vec<String> = (0..TASKS).map(|n| format!("bench:parallel:{n}")).collect();
    let loads = cycles_against_baselines(client, plan, &names, Some(peer)).await?;
    let peer_loads = loads.peer.as_ref().ok_or("no rslock measurement")?;
    let versus_peer = loads.lock.ratio_to_first / peer_loads.ratio_to_first;
    let details = vec![
        figure("lock+release p99", loads.lock.latency.micros(0.99), "µs"),
        figure("rslock 0.10 cycles/s", peer_loads.rate, "cycles/s"),
        figure(
            "rslock 0.10 lock+unlock p99",
            peer_loads.latency.micros(0.99),
            "µs",
        ),
        checked(
            "distlock vs rslock 0.10 (cycles/s)",
            versus_peer,
            "×",
            ">= 1.0".to_owned(),
            versus_peer >= 1.0,
        ),
    ];
    Ok(cycle_report("parallel", TARGET, &loads, details))
}
