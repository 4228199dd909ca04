//! RedLock over 5 private masters, uncontended: one task acquires and releases back to
//! back. The baseline is the same cycle of the single-node lock on one of those masters,
//! measured in the same rounds. rslock, itself a RedLock client, runs the same cycle over
//! the same 5 masters.
//!
//! A RedLock cycle sends each script to all masters at once, so on a machine with cores to
//! spare it costs about one single-node cycle plus the slowest master's delay. This
//! machine has 2 cores for 5 servers, the client and its 5 connection drivers, so the
//! ratio also shows that contention for the CPU.

use std::sync::Arc;
use std::time::Duration;

use distlock::{Client, RedLock};
use distlock_testkit::RedisServer;
use rslock::LockManager;

use super::{interleaved, lock_cycles, timed_cycles, BenchResult, Plan};
use crate::report::{checked, figure, Report};

pub const MASTERS: usize = 5;
pub const TARGET: f64 = 0.6;
const NAME: &str = "bench:redlock";

pub async fn run(plan: Plan) -> BenchResult<Report> {
    let mut servers = Vec::new();
    for _ in 0..MASTERS {
        servers.push(RedisServer::start().await?);
    }
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let mut clients = Vec::new();
    for url in &urls {
        clients.push(Client::connect(url).await?);
    }
    let single = clients[0].clone();
    let redlock = RedLock::new(NAME, &clients)?.with_lease(Duration::from_secs(30));
    let peer = Arc::new(LockManager::new(urls.clone()));
    let names = vec![NAME.to_owned()];
    let measured = interleaved(plan, 3, async |load, length| match load {
        0 => lock_cycles(&single, &names, length).await,
        1 => {
            timed_cycles(vec![redlock.clone()], length, |lock| {
                Box::pin(async move {
                    lock.lock().await?.release().await?;
                    Ok(())
                })
            })
            .await
        }
        _ => {
            timed_cycles(vec![Arc::clone(&peer)], length, |manager| {
                Box::pin(async move {
                    let lock = manager.lock(NAME, Duration::from_secs(30)).await?;
                    manager.unlock(&lock).await;
                    Ok(())
                })
            })
            .await
        }
    })
    .await?;
    let [single_load, redlock_load, peer_load] = <[_; 3]>::try_from(measured)
        .map_err(|_| "interleaved returned the wrong number of loads")?;
    let ratio = redlock_load.ratio_to_first;
    let versus_peer = redlock_load.ratio_to_first / peer_load.ratio_to_first;
    Ok(Report {
        scenario: "redlock",
        result: figure("RedLock cycles/s (5 masters)", redlock_load.rate, ""),
        baseline: figure("single-node cycles/s =", single_load.rate, "cycles/s"),
        ratio,
        target: format!("ratio >= {TARGET:.2}"),
        met: ratio >= TARGET,
        details: vec![
            figure(
                "RedLock lock+release p50",
                redlock_load.latency.micros(0.5),
                "µs",
            ),
            figure(
                "single-node lock+release p50",
                single_load.latency.micros(0.5),
                "µs",
            ),
            figure(
                "rslock 0.10 (5 masters) cycles/s",
                peer_load.rate,
                "cycles/s",
            ),
            figure(
                "rslock 0.10 lock+unlock p50",
                peer_load.latency.micros(0.5),
                "µs",
            ),
            checked(
                "distlock RedLock vs rslock 0.10 (cycles/s)",
                versus_peer,
                "×",
                ">= 1.0".to_owned(),
                versus_peer >= 1.0,
            ),
        ],
    })
}
