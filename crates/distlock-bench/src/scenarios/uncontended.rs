//! One task acquires and releases one lock back to back. A cycle is two script calls, so
//! the best possible rate is half the raw EVALSHA rate on the same connection.

use distlock::Client;

use super::{lock_cycles, BenchResult, Plan};
use crate::baseline;
use crate::report::{figure, Report};
use crate::stats::median;

pub const TARGET: f64 = 0.9;

pub async fn run(client: &Client, plan: Plan) -> BenchResult<Report> {
    let names = vec!["bench:uncontended".to_owned()];
    let (mut cycles, mut baselines, mut cycle_p50, mut rtt_p50) = (vec![], vec![], vec![], vec![]);
    for _ in 0..plan.runs {
        let (base, base_latency) = baseline::evalsha(&client.connection(), 1, plan.length).await?;
        let (rate, latency) = lock_cycles(client, &names, plan.length).await?;
        baselines.push(base);
        cycles.push(rate);
        rtt_p50.push(base_latency.micros(0.5));
        cycle_p50.push(latency.micros(0.5));
    }
    let (rate, base) = (median(&cycles), median(&baselines));
    let ratio = rate / (base / 2.0);
    Ok(Report {
        scenario: "uncontended",
        result: figure("cycles/s", rate, ""),
        baseline: figure("EVALSHA/s ÷ 2 =", base / 2.0, "cycles/s"),
        ratio,
        target: format!("ratio >= {TARGET:.2}"),
        met: ratio >= TARGET,
        details: vec![
            figure("lock+release p50", median(&cycle_p50), "µs"),
            figure("EVALSHA round trip p50", median(&rtt_p50), "µs"),
        ],
    })
}
