//! One task acquires and releases one lock back to back. A cycle is two script calls, so
//! the best possible rate is half the raw EVALSHA rate on the same connection.

use distlock::Client;

use rslock::LockManager;

use super::{cycles_against_baselines, BenchResult, CycleLoads, Plan};
use crate::report::{figure, Report};

pub const TARGET: f64 = 0.9;

pub async fn run(client: &Client, peer: &LockManager, plan: Plan) -> BenchResult<Report> {
    let names: Vec<String> = vec!["bench:uncontended".to_owned()];
    let loads = cycles_against_baselines(client, plan, &names, Some(peer)).await?;
    let CycleLoads {
        noop,
        raw,
        lock,
        peer,
    } = loads;
    let peer = peer.ok_or("no rslock measurement")?;
    // A cycle is two script calls: the best possible cycle rate is half the no-op rate.
    let ratio = lock.ratio_to_first * 2.0;
    Ok(Report {
        scenario: "uncontended",
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
            figure("lock+release p50", lock.latency.micros(0.5), "µs"),
            figure(
                "rslock 0.10 lock+unlock p50",
                peer.latency.micros(0.5),
                "µs",
            ),
            figure(
                "distlock vs rslock 0.10 (cycles/s)",
                lock.ratio_to_first / peer.ratio_to_first,
                "×",
            ),
            figure("raw scripts p50", raw.latency.micros(0.5), "µs"),
            figure("EVALSHA round trip p50", noop.latency.micros(0.5), "µs"),
        ],
    })
}
