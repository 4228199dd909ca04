//! Lock cycles across a network. On loopback a cycle is mostly Redis's own script time
//! (Redisson's layout costs the server more per cycle than rslock's `SET NX PX`), but
//! users run Redis across a network, where the round trips dominate. The uncontended
//! load (one task) and the parallel one (64 tasks, one lock each) run behind the
//! testkit's delay proxy, which adds a delay each way, with rslock behind the same proxy
//! in the same rounds. The ratio is distlock's cycles/s over rslock's, per round, median.

use std::sync::Arc;
use std::time::Duration;

use distlock::Client;
use distlock_testkit::{FaultProxy, RedisServer};
use rslock::LockManager;
use tokio::time::Instant;

use super::{interleaved, lock_cycles, peer_cycles, BenchResult, Plan};
use crate::report::{figure, Figure, Report};
use crate::stats::median;

/// distlock against rslock behind the same delay.
pub const TARGET: f64 = 0.97;

/// The delays added each way, with the scenario names they report under.
const SETTINGS: [(Duration, &str, &str); 2] = [
    (
        Duration::from_micros(100),
        "net-100µs-uncontended",
        "net-100µs-parallel",
    ),
    (
        Duration::from_millis(1),
        "net-1ms-uncontended",
        "net-1ms-parallel",
    ),
];

/// Tasks of the parallel load, as on loopback.
const PARALLEL_TASKS: usize = 64;

/// `server_time`: distlock's and rslock's server time per cycle as measured on loopback
/// (it does not depend on the network), reported beside each row.
pub async fn run(
    server: &RedisServer,
    plan: Plan,
    server_time: Option<(f64, f64)>,
) -> BenchResult<Vec<Report>> {
    let mut reports = Vec::new();
    for (delay, uncontended, parallel) in SETTINGS {
        let proxy = FaultProxy::in_front_of(server).await?;
        proxy.set_delay(delay);
        let client = Client::connect(&proxy.url()).await?;
        let peer = Arc::new(LockManager::new(vec![proxy.url()]));
        let round_trip = ping_round_trip(&client).await?;
        for (scenario, tasks) in [(uncontended, 1), (parallel, PARALLEL_TASKS)] {
            let names: Vec<String> = (0..tasks)
                .map(|n| format!("bench:{scenario}:{n}"))
                .collect();
            let measured = interleaved(plan, 2, async |load, length| match load {
                0 => peer_cycles(&peer, &names, length).await,
                _ => lock_cycles(&client, &names, length).await,
            })
            .await?;
            let [peer_load, lock_load] = measured.as_slice() else {
                return Err("interleaved returned too few loads".into());
            };
            let ratio = lock_load.ratio_to_first;
            let mut details: Vec<Figure> = vec![
                figure("delay added each way", delay.as_secs_f64() * 1e6, "µs"),
                figure("PING round trip p50 through the proxy", round_trip, "µs"),
                figure("lock+release p50", lock_load.latency.micros(0.5), "µs"),
                figure(
                    "rslock 0.10 lock+unlock p50",
                    peer_load.latency.micros(0.5),
                    "µs",
                ),
            ];
            if let Some((distlock_server, rslock_server)) = server_time {
                details.push(figure(
                    "server time per cycle (loopback commandstats)",
                    distlock_server,
                    "µs",
                ));
                details.push(figure(
                    "rslock server time per cycle (loopback commandstats)",
                    rslock_server,
                    "µs",
                ));
            }
            reports.push(Report {
                scenario,
                result: figure("cycles/s", lock_load.rate, ""),
                baseline: figure("rslock 0.10 =", peer_load.rate, "cycles/s"),
                ratio,
                target: format!("ratio >= {TARGET:.2}"),
                met: ratio >= TARGET,
                details,
            });
        }
        client.shutdown().await;
        proxy.shutdown().await;
    }
    Ok(reports)
}

/// The median PING round trip through the proxy, µs: what the delay really adds (the
/// proxy's sleeps are timed to tens of microseconds, not exactly).
async fn ping_round_trip(client: &Client) -> BenchResult<f64> {
    let mut connection = client.connection();
    let mut samples = Vec::new();
    for _ in 0..200 {
        let sent = Instant::now();
        redis::cmd("PING")
            .query_async::<String>(&mut connection)
            .await?;
        samples.push(sent.elapsed().as_secs_f64() * 1e6);
    }
    Ok(median(&samples))
}
