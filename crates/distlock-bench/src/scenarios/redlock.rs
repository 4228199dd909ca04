//! RedLock over 5 private masters, uncontended: one task acquires and releases back to
//! back. The baseline is the same cycle of the single-node lock on one of those masters,
//! measured in the same rounds. rslock, itself a RedLock client, runs the same cycle over
//! the same 5 masters.
//!
//! It is measured twice. Over loopback, a RedLock cycle is bound by CPU: this machine has
//! 2 cores for 5 servers and the client, and every master must be scheduled for every
//! script, so the ratio mostly shows that contention. Then each master is put behind a
//! fault proxy that delays every chunk by [`LINK_DELAY`] each way, as a network between
//! hosts would: the cycle is then bound by round trips, and a ratio near 1 shows that the
//! masters are asked at once, not one by one (one by one would give 1/5).

use std::sync::Arc;
use std::time::Duration;

use distlock::{Client, RedLock};
use distlock_testkit::{FaultProxy, RedisServer};
use rslock::LockManager;

use super::{interleaved, lock_cycles, timed_cycles, BenchResult, Measured, Plan};
use crate::baseline::{self, Fan, Raw};
use crate::report::{checked, figure, Report};

pub const MASTERS: usize = 5;
pub const TARGET: f64 = 0.6;
const NAME: &str = "bench:redlock";
/// One-way delay of the simulated network: a round trip gains twice this.
const LINK_DELAY: Duration = Duration::from_millis(1);

/// The single-node cycle, the RedLock cycle and rslock's, measured in the same rounds
/// against the servers at `urls`; with `layouts`, also the raw scripts sent to every
/// master at once from one task: Redisson's layout and the leaner one in a RedLock's two
/// rounds (every acquire, then every release: what a RedLock of either layout could reach
/// before any library runs), and Redisson's chained per master (each master's release
/// straight after its own acquire, which no RedLock can do).
async fn measure(plan: Plan, urls: &[String], layouts: bool) -> BenchResult<Vec<Measured>> {
    let mut clients = Vec::new();
    for url in urls {
        clients.push(Client::connect(url).await?);
    }
    let single = clients[0].clone();
    let redlock = RedLock::new(NAME, &clients)?.with_lease(Duration::from_secs(30));
    let peer = Arc::new(LockManager::new(urls.to_vec()));
    let names = vec![NAME.to_owned()];
    let connections: Vec<_> = clients.iter().map(Client::connection).collect();
    let loads = if layouts { 6 } else { 3 };
    let measured = interleaved(plan, loads, async |load, length| match load {
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
        3 => Ok(baseline::run_across(Raw::LockScripts, Fan::Phased, &connections, length).await?),
        4 => Ok(baseline::run_across(Raw::LeanScripts, Fan::Phased, &connections, length).await?),
        5 => Ok(baseline::run_across(Raw::LockScripts, Fan::Chained, &connections, length).await?),
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
    for client in clients {
        client.shutdown().await;
    }
    Ok(measured)
}

pub async fn run(plan: Plan) -> BenchResult<Report> {
    let mut servers = Vec::new();
    for _ in 0..MASTERS {
        servers.push(RedisServer::start().await?);
    }
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let [single_load, redlock_load, peer_load, raw_load, lean_load, chained_load] =
        <[_; 6]>::try_from(measure(plan, &urls, true).await?)
            .map_err(|_| "interleaved returned the wrong number of loads")?;

    let mut proxies = Vec::new();
    for server in &servers {
        let proxy = FaultProxy::in_front_of(server).await?;
        proxy.set_delay(LINK_DELAY);
        proxies.push(proxy);
    }
    let far: Vec<String> = proxies.iter().map(FaultProxy::url).collect();
    let [far_single, far_redlock, far_peer] = <[_; 3]>::try_from(measure(plan, &far, false).await?)
        .map_err(|_| "interleaved returned the wrong number of loads")?;

    let ratio = redlock_load.ratio_to_first;
    let versus_peer = redlock_load.ratio_to_first / peer_load.ratio_to_first;
    let far_ratio = far_redlock.ratio_to_first;
    let link = format!("{} ms links", LINK_DELAY.as_millis());
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
            figure(
                "raw lock scripts in a RedLock's two rounds vs rslock 0.10 (Redisson's layout, no library)",
                raw_load.ratio_to_first / peer_load.ratio_to_first,
                "×",
            ),
            figure(
                "leaner layout's raw scripts in a RedLock's two rounds vs rslock 0.10",
                lean_load.ratio_to_first / peer_load.ratio_to_first,
                "×",
            ),
            figure(
                "distlock RedLock vs its raw scripts in two rounds (the library's own cost)",
                redlock_load.ratio_to_first / raw_load.ratio_to_first,
                "×",
            ),
            figure(
                "raw lock scripts chained per master vs rslock 0.10 (no barrier between the rounds, which no RedLock can skip)",
                chained_load.ratio_to_first / peer_load.ratio_to_first,
                "×",
            ),
            figure(
                format!("{link}: single-node lock+release p50"),
                far_single.latency.micros(0.5),
                "µs",
            ),
            figure(
                format!("{link}: RedLock lock+release p50"),
                far_redlock.latency.micros(0.5),
                "µs",
            ),
            checked(
                format!("{link}: RedLock vs single-node (cycles/s)"),
                far_ratio,
                "×",
                format!(">= {TARGET:.2}"),
                far_ratio >= TARGET,
            ),
            figure(
                format!("{link}: rslock 0.10 vs single-node (cycles/s)"),
                far_peer.ratio_to_first,
                "×",
            ),
        ],
    })
}
