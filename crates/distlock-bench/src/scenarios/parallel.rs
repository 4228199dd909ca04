//! 64 tasks, each on its own lock, all through one client. The best possible rate is half
//! the EVALSHA rate of 64 concurrent callers on the same connection.

use distlock::Client;

use super::{cycle_report, cycles_against_baselines, BenchResult, Plan};
use crate::report::{figure, Report};

pub const TASKS: usize = 64;
pub const TARGET: f64 = 0.8;

pub async fn run(client: &Client, plan: Plan) -> BenchResult<Report> {
    let names: Vec<String> = (0..TASKS).map(|n| format!("bench:parallel:{n}")).collect();
    let loads = cycles_against_baselines(client, plan, &names, None).await?;
    let details = vec![figure(
        "lock+release p99",
        loads.lock.latency.micros(0.99),
        "µs",
    )];
    Ok(cycle_report("parallel", TARGET, &loads, details))
}
