//! 64 tasks, each on its own lock, all through one client. The best possible rate is half
//! the EVALSHA rate of 64 concurrent callers on the same connection.

use distlock::Client;

use super::{lock_cycles, BenchResult, Plan};
use crate::baseline;
use crate::report::{figure, Report};
use crate::stats::median;

pub const TASKS: usize = 64;
pub const TARGET: f64 = 0.8;

pub async fn run(client: &Client, plan: Plan) -> BenchResult<Report> {
    let names: Vec<String> = (0..TASKS).map(|n| format!("bench:parallel:{n}")).collect();
    let (mut cycles, mut baselines, mut cycle_p99) = (vec![], vec![], vec![]);
    for _ in 0..plan.runs {
        let (base, _) = baseline::evalsha(&client.connection(), TASKS, plan.length).await?;
        let (rate, latency) = lock_cycles(client, &names, plan.length).await?;
        baselines.push(base);
        cycles.push(rate);
        cycle_p99.push(latency.micros(0.99));
    }
    let (rate, base) = (median(&cycles), median(&baselines));
    let ratio = rate / (base / 2.0);
    Ok(Report {
        scenario: "parallel",
        result: figure("cycles/s", rate, ""),
        baseline: figure("EVALSHA/s ÷ 2 =", base / 2.0, "cycles/s"),
        ratio,
        target: format!("ratio >= {TARGET:.2}"),
        met: ratio >= TARGET,
        details: vec![figure("lock+release p99", median(&cycle_p99), "µs")],
    })
}
