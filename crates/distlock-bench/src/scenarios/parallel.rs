//! 64 tasks, each on its own lock, all through one client. The best possible rate is half
//! the EVALSHA rate of 64 concurrent callers on the same connection.

use distlock::Client;

use super::{cycles_against_baselines, BenchResult, CycleLoads, Plan};
use crate::report::{figure, Report};

pub const TASKS: usize = 64;
pub const TARGET: f64 = 0.8;

pub async fn run(client: &Client, plan: Plan) -> BenchResult<Report> {
    let names: Vec<String> = (0..TASKS).map(|n| format!("bench:parallel:{n}")).collect();
    let CycleLoads {
        noop, raw, lock, ..
    } = cycles_against_baselines(client, plan, &names, None).await?;
    // A cycle is two script calls: the best possible cycle rate is half the no-op rate.
    let ratio = lock.ratio_to_first * 2.0;
    Ok(Report {
        scenario: "parallel",
        result: figure("cycles/s", lock.rate, ""),
        baseline: figure("EVALSHA/s ÷ 2 =", noop.rate / 2.0, "cycles/s"),
        ratio,
        target: format!("ratio >= {TARGET:.2}"),
        met: ratio >= TARGET,
        details: vec![
            figure("raw lock scripts, no library", raw.rate, "cycles/s"),
            figure(
                "library vs raw scripts",
                lock.ratio_to_first / raw.ratio_to_first,
                "×",
            ),
            figure(
                "raw scripts vs EVALSHA ÷ 2 (server-side script cost)",
                raw.ratio_to_first * 2.0,
                "×",
            ),
            figure("lock+release p99", lock.latency.micros(0.99), "µs"),
        ],
    })
}
