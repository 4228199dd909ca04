//! The benchmark scenarios. Each returns a [`Report`](crate::report::Report) whose figures
//! are medians over repeated runs, and whose ratio is taken against a baseline measured
//! in the same run.

pub mod cli;
pub mod cluster;
pub mod contended;
pub mod failover;
pub mod fair;
pub mod network;
pub mod parallel;
pub mod redlock;
pub mod replica_sync;
pub mod rw;
pub mod semaphore;
pub mod stores;
pub mod uncontended;
pub mod watchdog;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use distlock::Client;
use rslock::LockManager;
use tokio::time::Instant;

use crate::baseline::{self, Raw};
use crate::report::{figure, Figure, Report};
use crate::stats::{median, Latencies};

/// Settings shared by the throughput scenarios.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// How long each timed slice lasts.
    pub length: Duration,
    /// How many baseline/subject pairs are measured (medians are reported).
    pub runs: usize,
}

pub type BenchResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// What [`interleaved`] measured for one load: medians over the rounds.
pub struct Measured {
    pub rate: f64,
    /// Median over the rounds of this load's rate divided by the first load's rate in
    /// the same round.
    pub ratio_to_first: f64,
    pub latency: Latencies,
}

/// Measures each load in turn, in slices of `plan.length`, for `plan.runs` rounds. The
/// machine is shared and its speed drifts within seconds; a ratio taken within each
/// round cancels the drift that separate long runs would compare.
pub async fn interleaved<F>(plan: Plan, loads: usize, mut measure: F) -> BenchResult<Vec<Measured>>
where
    F: AsyncFnMut(usize, Duration) -> BenchResult<(f64, Latencies)>,
{
    let mut rates = vec![Vec::new(); loads];
    let mut ratios = vec![Vec::new(); loads];
    let mut latencies: Vec<Latencies> = (0..loads).map(|_| Latencies::new()).collect();
    for _ in 0..plan.runs {
        let mut first = f64::NAN;
        for load in 0..loads {
            let (rate, latency) = measure(load, plan.length).await?;
            if load == 0 {
                first = rate;
            }
            rates[load].push(rate);
            ratios[load].push(rate / first);
            latencies[load].merge(&latency);
        }
    }
    Ok(latencies
        .into_iter()
        .enumerate()
        .map(|(load, latency)| Measured {
            rate: median(&rates[load]),
            ratio_to_first: median(&ratios[load]),
            latency,
        })
        .collect())
}

/// What [`cycles_against_baselines`] measured.
pub struct CycleLoads {
    pub noop: Measured,
    pub raw: Measured,
    pub lock: Measured,
    pub peer: Option<Measured>,
    /// The leaner layout's raw scripts (measured when there is a peer).
    pub lean: Option<Measured>,
}

/// The uncontended and parallel scenarios: one lock name per task, compared with a no-op
/// script and with the raw lock scripts at the same concurrency, and with a peer library
/// when one is given.
pub async fn cycles_against_baselines(
    client: &Client,
    plan: Plan,
    names: &[String],
    peer: Option<&Arc<LockManager>>,
) -> BenchResult<CycleLoads> {
    let connection = client.connection();
    let callers = names.len();
    // With a peer, the leaner layout's raw scripts too: what a layout other than
    // Redisson's would give against the same peer.
    let loads = if peer.is_some() { 5 } else { 3 };
    let mut measured = interleaved(plan, loads, async |load, length| match (load, peer) {
        (0, _) => Ok(baseline::run(Raw::Noop, &connection, callers, length).await?),
        (1, _) => Ok(baseline::run(Raw::LockScripts, &connection, callers, length).await?),
        (3, Some(peer)) => peer_cycles(peer, names, length).await,
        (4, _) => Ok(baseline::run(Raw::LeanScripts, &connection, callers, length).await?),
        _ => lock_cycles(client, names, length).await,
    })
    .await?
    .into_iter();
    let mut next = || measured.next().ok_or("interleaved returned too few loads");
    Ok(CycleLoads {
        noop: next()?,
        raw: next()?,
        lock: next()?,
        peer: if peer.is_some() { Some(next()?) } else { None },
        lean: if peer.is_some() { Some(next()?) } else { None },
    })
}

/// The report of a cycle scenario: lock cycles against half the no-op rate (a cycle is
/// two script calls), with the raw-script baseline splitting the gap into what the
/// library costs and what Redis spends running the scripts.
pub fn cycle_report(
    scenario: &'static str,
    target: f64,
    loads: &CycleLoads,
    mut details: Vec<Figure>,
) -> Report {
    let CycleLoads {
        noop, raw, lock, ..
    } = loads;
    let ratio = lock.ratio_to_first * 2.0;
    let mut all = vec![
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
    ];
    if let (Some(peer), Some(lean)) = (&loads.peer, &loads.lean) {
        all.push(figure(
            "raw lock scripts vs rslock 0.10 (Redisson's layout, no library)",
            raw.ratio_to_first / peer.ratio_to_first,
            "×",
        ));
        all.push(figure(
            "leaner layout's raw scripts vs rslock 0.10 (scripts/lean_*.lua)",
            lean.ratio_to_first / peer.ratio_to_first,
            "×",
        ));
        // The two layouts side by side, both raw on the same connection: what Redisson's
        // layout costs, with no library on either side.
        all.push(figure(
            "Redisson's layout vs the leaner one (raw scripts, cycles/s)",
            raw.ratio_to_first / lean.ratio_to_first,
            "×",
        ));
    }
    all.append(&mut details);
    Report {
        scenario,
        result: figure("cycles/s", lock.rate, ""),
        baseline: figure("EVALSHA/s ÷ 2 =", noop.rate / 2.0, "cycles/s"),
        ratio,
        target: format!("ratio >= {target:.2}"),
        met: ratio >= target,
        details: all,
    }
}

/// A boxed lock cycle of one worker.
pub type Cycle<'a> = Pin<Box<dyn Future<Output = BenchResult<()>> + Send + 'a>>;

/// One task per worker runs `cycle` back to back for `length`, the same way for distlock
/// and for a peer. Returns complete cycles per second and the cycle latencies.
pub async fn timed_cycles<W, F>(
    workers: Vec<W>,
    length: Duration,
    cycle: F,
) -> BenchResult<(f64, Latencies)>
where
    W: Send + 'static,
    F: for<'a> Fn(&'a W) -> Cycle<'a> + Copy + Send + 'static,
{
    let started = Instant::now();
    let until = started + length;
    let tasks: Vec<_> = workers
        .into_iter()
        .map(|worker| {
            tokio::spawn(async move {
                let mut latencies = Latencies::new();
                while Instant::now() < until {
                    let sent = Instant::now();
                    cycle(&worker).await?;
                    latencies.record(sent.elapsed());
                }
                BenchResult::Ok(latencies)
            })
        })
        .collect();
    let mut all = Latencies::new();
    for task in tasks {
        all.merge(&task.await??);
    }
    Ok((all.len() as f64 / started.elapsed().as_secs_f64(), all))
}

/// distlock: one task per lock name, acquire and release back to back.
pub async fn lock_cycles(
    client: &Client,
    names: &[String],
    length: Duration,
) -> BenchResult<(f64, Latencies)> {
    let locks = names
        .iter()
        .map(|name| client.lock(name.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    timed_cycles(locks, length, |lock| {
        Box::pin(async move {
            lock.lock().await?.release().await?;
            Ok(())
        })
    })
    .await
}

/// rslock: lock (SET NX PX) and unlock (a script) back to back, one task per name.
pub async fn peer_cycles(
    manager: &Arc<LockManager>,
    names: &[String],
    length: Duration,
) -> BenchResult<(f64, Latencies)> {
    let workers = names
        .iter()
        .map(|name| (Arc::clone(manager), name.clone()))
        .collect();
    timed_cycles(workers, length, |(manager, name)| {
        Box::pin(async move {
            let lock = manager.lock(name.as_str(), Duration::from_secs(30)).await?;
            manager.unlock(&lock).await;
            Ok(())
        })
    })
    .await
}
