//! One task acquires and releases one lock back to back. A cycle is two script calls, so
//! the best possible rate is half the raw EVALSHA rate on the same connection.

use std::sync::Arc;
use std::time::Duration;

use distlock::Client;
use redis::aio::MultiplexedConnection;
use rslock::LockManager;

use super::{cycle_report, cycles_against_baselines, BenchResult, Plan};
use crate::cost;
use crate::report::{checked, figure, Figure, Report};

pub const TARGET: f64 = 0.9;

/// The ceiling on allocations per lock cycle.
pub const MAX_ALLOCATIONS: f64 = 18.0;

pub async fn run(
    client: &Client,
    peer: &Arc<LockManager>,
    stats: Option<MultiplexedConnection>,
    plan: Plan,
) -> BenchResult<Report> {
    let names = vec!["bench:uncontended".to_owned()];
    let loads = cycles_against_baselines(client, plan, &names, Some(peer)).await?;
    let peer_loads = loads.peer.as_ref().ok_or("no rslock measurement")?;
    let mut details = vec![
        figure("lock+release p50", loads.lock.latency.micros(0.5), "µs"),
        figure("raw scripts p50", loads.raw.latency.micros(0.5), "µs"),
        figure(
            "EVALSHA round trip p50",
            loads.noop.latency.micros(0.5),
            "µs",
        ),
        figure(
            "rslock 0.10 lock+unlock p50",
            peer_loads.latency.micros(0.5),
            "µs",
        ),
        checked(
            "distlock vs rslock 0.10 (cycles/s)",
            loads.lock.ratio_to_first / peer_loads.ratio_to_first,
            "×",
            ">= 1.0".to_owned(),
            loads.lock.ratio_to_first / peer_loads.ratio_to_first >= 1.0,
        ),
    ];
    if let Some(mut stats) = stats {
        // Measured in a task, like the cycles above and like a server's request handlers:
        // a task of the runtime that connected uses the client's fast link, where a future
        // polled by `block_on` (this function's caller) is handed to the client's thread.
        let (client_in_task, peer) = (client.clone(), Arc::clone(peer));
        let mut stats_in_task = stats.clone();
        let measured =
            tokio::spawn(async move { costs(&client_in_task, &peer, &mut stats_in_task).await });
        details.append(&mut measured.await??);
        // The same cycle from here, outside any task: what a `#[tokio::main]` body pays.
        let lock = client.lock("bench:cost:block_on")?;
        let outside = cost::per_cycle(&mut stats, &["evalsha", "eval", "unlink"], || async {
            lock.lock().await?.release().await?;
            Ok(())
        })
        .await?;
        details.push(figure(
            "allocations per cycle from a block_on future (no fast link)",
            outside.allocations,
            "",
        ));
    }
    Ok(cycle_report("uncontended", TARGET, &loads, details))
}

/// Allocations and server time per cycle, distlock next to rslock, with two PINGs (two
/// round trips and nothing else) as the floor for allocations.
async fn costs(
    client: &Client,
    peer: &Arc<LockManager>,
    stats: &mut MultiplexedConnection,
) -> BenchResult<Vec<Figure>> {
    let connection = client.connection();
    let distlock = distlock_cost(client, stats).await?;
    let rslock = rslock_cost(peer, stats).await?;
    let pings = cost::per_cycle(stats, &["ping"], || {
        let mut connection = connection.clone();
        async move {
            for _ in 0..2 {
                redis::cmd("PING")
                    .query_async::<String>(&mut connection)
                    .await?;
            }
            Ok(())
        }
    })
    .await?;
    Ok(vec![
        checked(
            "allocations per cycle",
            distlock.allocations,
            "",
            format!("<= {MAX_ALLOCATIONS}"),
            distlock.allocations <= MAX_ALLOCATIONS,
        ),
        figure("rslock allocations per cycle", rslock.allocations, ""),
        figure("two PINGs: allocations", pings.allocations, ""),
        figure(
            "server time per cycle (commandstats)",
            distlock.server_micros,
            "µs",
        ),
        figure(
            "rslock server time per cycle (commandstats)",
            rslock.server_micros,
            "µs",
        ),
    ])
}

/// What one distlock lock cycle costs (the commands it sends itself: two scripts and the
/// latch's UNLINK).
pub async fn distlock_cost(
    client: &Client,
    stats: &mut MultiplexedConnection,
) -> BenchResult<cost::Cost> {
    let lock = client.lock("bench:cost")?;
    cost::per_cycle(stats, &["evalsha", "eval", "unlink"], || async {
        lock.lock().await?.release().await?;
        Ok(())
    })
    .await
}

/// What one rslock lock cycle costs (SET NX PX, then its unlock script).
pub async fn rslock_cost(
    peer: &Arc<LockManager>,
    stats: &mut MultiplexedConnection,
) -> BenchResult<cost::Cost> {
    cost::per_cycle(stats, &["set", "evalsha", "eval"], || async {
        let held = peer
            .lock("bench:cost:rslock", Duration::from_secs(30))
            .await?;
        peer.unlock(&held).await;
        Ok(())
    })
    .await
}
