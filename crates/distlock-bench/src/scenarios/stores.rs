//! Stores side by side (issue 31): distlock on each store it runs on, and the peers on the
//! same servers, measured in one run by the same harness. Asked for by name
//! (`--scenario stores`, `--store redis|postgres|etcd|zk|all`): it starts a private
//! PostgreSQL, a private 3-member etcd cluster and a private 3-server ZooKeeper ensemble
//! beside the private Redis, and spawns processes.
//!
//! Some subjects are behind distlock-bench features, off by default so that a plain
//! workspace build needs neither OpenSSL nor protoc: `peer-postgres` (the PostgreSQL peer,
//! which forces native-tls), `etcd` (the etcd store and its peer) and `zk` (the ZooKeeper
//! store and its peer; running it needs a JVM and ZooKeeper's jar). Without them, their
//! rows and columns say "not built (feature …)"; `--store etcd` or `--store zk` alone is
//! refused.
//!
//! Three rows, each taken once per round for every subject, rounds alternating the
//! subjects (their order rotates each round) so that the machine's drift falls on all of
//! them alike; medians over the rounds, with the smallest and largest:
//!
//! 1. **Uncontended cycle**: one task, lock then release, back to back. Its baseline is
//!    the store's own round trip measured in a slice just before, in the same round: a
//!    no-op EVALSHA on Redis, a raw `SELECT 1` on one connection of a sqlx pool on
//!    PostgreSQL, a raw linearizable `get` on etcd, a raw `set_data` (a write, through
//!    the leader and a quorum) on ZooKeeper; one request per round trip, one caller.
//!    The ratio is round trips per
//!    second ÷ cycles per second in that round (also each p50 ÷ the floor's p50): how many
//!    round trips a cycle costs. Beside it, per store: distlock's own scripts or
//!    statements sent raw, (PostgreSQL) `SELECT 1` through a pool, with and without
//!    sqlx's ping before each use, (etcd) distlock's placement transaction alone, and
//!    (ZooKeeper) a raw read and a raw create + delete of an ephemeral sequential node.
//! 2. **Contended**: eight tasks in two processes (four each, one client per process, as
//!    the fair scenario runs them) take turns on one lock, hold 1 ms, think 2 ms. The
//!    handoff (release called → the next holder's acquisition returned, for a holder
//!    that was already waiting), Jain's index over the eight tasks' acquisitions, and the
//!    rate against the ideal 1 / (hold + that round's round trip).
//! 3. **kill -9**: a holder process is killed with SIGKILL while another client waits;
//!    the time until that client holds the lock. distlock's watchdog lease is 2 s on
//!    every store, renewed every third of it, so a lease design frees the lock when the
//!    lease left at the kill runs out: that lease left is read just before the kill and
//!    reported, and the kill falls at a different point of the renewal period each round.
//!    A session lock (the PostgreSQL peer's advisory lock) is freed when the server
//!    notices the holder's connection closed; etcd's lock RPC holds on a lease of the
//!    same 2 s, which etcd expires itself. On ZooKeeper both distlock and the peer hold
//!    through their session, whose timeout is the same 2 s: the ensemble deletes the
//!    killed holder's node when it expires the session, 2 s after it last heard from
//!    the holder (rounded up to the ensemble's tick), so that time is set by the
//!    session timeout; no client can read how much of it is left.
//!
//! The machine is shared: each round waits (up to 30 s) for the other processes' load to
//! drop first, and says how busy the machine was.
//!
//! A store slots in through [`subject::Store`]: its server and baselines (`deploy.rs`),
//! and its subjects (`subject.rs`: distlock, then any peer).

mod deploy;
#[cfg(feature = "etcd")]
mod etcd_floor;
#[cfg(feature = "etcd")]
mod peer_etcd;
#[cfg(feature = "zk")]
mod peer_zk;
mod quiet;
mod report;
pub mod subject;
pub mod worker;
#[cfg(feature = "zk")]
mod zk_floor;

use std::time::Duration;

use tokio::time::Instant;

use super::{timed_cycles, BenchResult, Plan};
use crate::report::Report;
use crate::stats::{jain, Latencies};
use deploy::{deploy, Deployed};
use subject::{Locker, OneLock, Store, Subject, WATCHDOG_LEASE};
use worker::Hold;

/// Which stores `--store` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreChoice {
    Redis,
    Postgres,
    /// Needs the `etcd` feature.
    Etcd,
    /// Needs the `zk` feature.
    Zk,
    /// Every store; those this build lacks are listed as not built.
    All,
}

impl StoreChoice {
    fn stores(self) -> Vec<Store> {
        match self {
            StoreChoice::Redis => vec![Store::Redis],
            StoreChoice::Postgres => vec![Store::Postgres],
            StoreChoice::Etcd => vec![Store::Etcd],
            StoreChoice::Zk => vec![Store::Zk],
            StoreChoice::All => vec![Store::Redis, Store::Postgres, Store::Etcd, Store::Zk],
        }
    }
}

const PROCESSES: usize = 2;
const TASKS_PER_PROCESS: usize = 4;
const TASKS: usize = PROCESSES * TASKS_PER_PROCESS;
/// Workers start together this long after they are spawned: time to connect and warm up.
const START_AFTER: Duration = Duration::from_millis(700);
/// How long the kill -9 row waits for the next holder before it gives up.
const KILL_LIMIT: Duration = Duration::from_secs(30);
const UNCONTENDED: &str = "bench:stores:uncontended";

/// One round of the contended row, for one subject.
struct Contention {
    rate: f64,
    ratio: f64,
    hold: f64,
    rtt: f64,
    gap_p50: f64,
    gap_p99: f64,
    jain: f64,
    overlaps: usize,
    token_regressions: usize,
}

/// What the rounds measured for one subject.
struct SubjectRounds {
    subject: Subject,
    cycle_rate: Vec<f64>,
    /// Per round: the floor's rate over the cycle rate.
    round_trips: Vec<f64>,
    /// Per round: the cycle's latency p50 over the floor's.
    p50_round_trips: Vec<f64>,
    cycle_latency: Latencies,
    /// The peer only: its `try_acquire` + release, in round trips.
    try_round_trips: Vec<f64>,
    contention: Vec<Contention>,
    kill_ms: Vec<f64>,
    lease_left_ms: Vec<f64>,
    lock: OneLock,
    killed: OneLock,
    locker: Locker,
}

/// Runs the scenario on `choice`'s stores, the Redis one at `redis_url`.
pub async fn run(choice: StoreChoice, redis_url: &str, plan: Plan) -> BenchResult<Vec<Report>> {
    let mut deployed: Vec<Deployed> = Vec::new();
    // Subjects this build lacks, with the feature that would build them.
    let mut not_built: Vec<(Subject, &'static str)> = Vec::new();
    for store in choice.stores() {
        if let Some(feature) = store.missing() {
            if choice != StoreChoice::All {
                return Err(format!(
                    "the {} store is not built: rebuild distlock-bench with --features {feature}",
                    store.key()
                )
                .into());
            }
            not_built.extend(store.subjects().iter().map(|&subject| (subject, feature)));
            continue;
        }
        deployed.push(deploy(store, redis_url).await?);
    }
    let mut subjects = Vec::new();
    for (index, deployment) in deployed.iter().enumerate() {
        for &subject in deployment.store.subjects() {
            if let Some(feature) = subject.missing() {
                not_built.push((subject, feature));
                continue;
            }
            let locker = Locker::connect(subject, &deployment.url).await?;
            subjects.push((
                index,
                SubjectRounds {
                    subject,
                    cycle_rate: Vec::new(),
                    round_trips: Vec::new(),
                    p50_round_trips: Vec::new(),
                    cycle_latency: Latencies::new(),
                    try_round_trips: Vec::new(),
                    contention: Vec::new(),
                    kill_ms: Vec::new(),
                    lease_left_ms: Vec::new(),
                    lock: locker.lock(UNCONTENDED)?,
                    killed: locker.lock(worker::KILLED)?,
                    locker,
                },
            ));
        }
    }
    let started = Instant::now();
    let mut busy = Vec::new();
    for round in 0..plan.runs {
        // Between rounds nothing of ours runs: what keeps the CPUs busy is someone else's.
        let (share, waited) = quiet::wait().await;
        busy.push(share);
        eprintln!(
            "round {}/{}: machine {:.0}% busy before it{}",
            round + 1,
            plan.runs,
            share * 100.0,
            if waited.is_zero() {
                String::new()
            } else {
                format!(
                    " (after waiting {:.0} s for it to calm)",
                    waited.as_secs_f64()
                )
            }
        );
        // Row 1: per store, its floor, then each of its subjects right after.
        let mut round_rtt = vec![f64::NAN; deployed.len()];
        for index in rotated(deployed.len(), round) {
            let (mut floor_rate, mut floor_p50) = (f64::NAN, f64::NAN);
            for (slot, probe) in deployed[index].probes.iter_mut().enumerate() {
                let (rate, p50) = probe.measure(plan.length).await?;
                if slot == 0 {
                    (floor_rate, floor_p50) = (rate, p50);
                }
                probe.p50_ratio.push(p50 / floor_p50);
            }
            round_rtt[index] = floor_p50;
            // The store's subjects, in an order that also moves every round.
            let mine: Vec<usize> = (0..subjects.len())
                .filter(|&slot| subjects[slot].0 == index)
                .collect();
            for turn in rotated(mine.len(), round) {
                let rounds = &mut subjects[mine[turn]].1;
                let (rate, latency) = cycles(&rounds.lock, plan.length, false).await?;
                rounds.cycle_rate.push(rate);
                rounds.round_trips.push(floor_rate / rate);
                rounds.p50_round_trips.push(latency.micros(0.5) / floor_p50);
                rounds.cycle_latency.merge(&latency);
                if rounds.subject.reports_try() {
                    let (rate, _) = cycles(&rounds.lock, plan.length, true).await?;
                    rounds.try_round_trips.push(floor_rate / rate);
                }
            }
        }
        // Row 2: eight tasks in two processes, per subject.
        for slot in rotated(subjects.len(), round) {
            let (index, rounds) = &mut subjects[slot];
            let holds = worker::contention(
                rounds.subject,
                &deployed[*index].url,
                PROCESSES,
                TASKS_PER_PROCESS,
                plan.length,
                START_AFTER,
            )
            .await?;
            rounds
                .contention
                .push(contention(&holds, round_rtt[*index]));
        }
        // Row 3: kill -9 of a holder, at a point of the renewal period that moves each
        // round (a golden-ratio sequence over a third of the lease).
        let phase = WATCHDOG_LEASE.mul_f64((round as f64 * 0.618_034).fract() / 3.0);
        for slot in rotated(subjects.len(), round) {
            let (index, rounds) = &mut subjects[slot];
            let (killed_ms, lease_left) =
                kill_nine(rounds.subject, &deployed[*index].url, &rounds.killed, phase).await?;
            rounds.kill_ms.push(killed_ms);
            if let Some(left) = lease_left {
                rounds.lease_left_ms.push(left);
            }
        }
        for (index, rounds) in &subjects {
            let last = |values: &[f64]| values.last().copied().unwrap_or(f64::NAN);
            let handoff = rounds.contention.last().map_or(f64::NAN, |c| c.gap_p50);
            eprintln!(
                "  {:<30} floor p50 {:>5.1} µs; cycle {:>5.1} round trips by rate, {:>5.1} by p50; handoff p50 {:>5.0} µs; kill -9 {:>7.1} ms",
                rounds.subject.label(),
                round_rtt[*index],
                last(&rounds.round_trips),
                last(&rounds.p50_round_trips),
                handoff,
                last(&rounds.kill_ms),
            );
        }
    }
    let (least, most) = crate::stats::min_max(&busy);
    let noisy = busy.iter().filter(|&&share| share >= quiet::QUIET).count();
    eprintln!(
        "stores: {} rounds in {:.0} s; the machine was {:.0}% busy before a round at the median ({:.0}–{:.0}%), {noisy} rounds started above {:.0}%",
        plan.runs,
        started.elapsed().as_secs_f64(),
        crate::stats::median(&busy) * 100.0,
        least * 100.0,
        most * 100.0,
        quiet::QUIET * 100.0
    );
    // Each subject's rows, a subject not built in its place beside its store's.
    let mut reports: Vec<(Subject, Report)> = Vec::new();
    for (index, rounds) in &subjects {
        reports.push((rounds.subject, report::cycle(&deployed[*index], rounds)));
        reports.push((rounds.subject, report::contended(rounds)));
        reports.push((rounds.subject, report::kill(rounds)));
    }
    for &(subject, feature) in &not_built {
        eprintln!(
            "stores: {} not built (feature {feature}); its rows are empty",
            subject.label()
        );
        reports.push((subject, report::not_built(subject, feature)));
    }
    reports.sort_by_key(|(subject, _)| *subject);
    let reports: Vec<Report> = reports.into_iter().map(|(_, report)| report).collect();
    eprintln!("{}", report::summary(&subjects, &deployed, &not_built));
    for (_, rounds) in &subjects {
        rounds.locker.shutdown().await;
    }
    Ok(reports)
}

/// `0..n`, started at `round % n`: the order of the subjects moves every round.
fn rotated(n: usize, round: usize) -> Vec<usize> {
    (0..n).map(|i| (i + round) % n.max(1)).collect()
}

/// One task: acquire and release back to back for `length` (`try_acquire` if `tried`).
async fn cycles(lock: &OneLock, length: Duration, tried: bool) -> BenchResult<(f64, Latencies)> {
    let lock = lock.clone();
    // One cycle before the clock starts: what the first one opens (the etcd peer's lease,
    // since a clone is a new holder) is not a cycle's cost.
    lock.acquire().await?.release().await?;
    let worker = (lock, tried);
    timed_cycles(vec![worker], length, |(lock, tried)| {
        Box::pin(async move {
            let held = if *tried {
                lock.try_acquire()
                    .await?
                    .ok_or("an uncontended lock was busy")?
            } else {
                lock.acquire().await?
            };
            held.release().await
        })
    })
    .await
}

/// The figures of one contended run; `rtt` is the store's round trip at p50 this round.
fn contention(holds: &[Hold], rtt: f64) -> Contention {
    let first = holds.iter().map(|h| h.wait_started).min().unwrap_or(0);
    let last = holds
        .iter()
        .map(|h| h.release_started)
        .max()
        .unwrap_or(first);
    let span = last.saturating_sub(first) as f64 / 1e9;
    let mut gaps = Latencies::new();
    let mut hold_times = Latencies::new();
    let mut per_task = [0u64; TASKS];
    let (mut overlaps, mut token_regressions) = (0, 0);
    for (index, hold) in holds.iter().enumerate() {
        hold_times.record(Duration::from_nanos(
            hold.release_started.saturating_sub(hold.acquired),
        ));
        if let Some(count) = per_task.get_mut(hold.task) {
            *count += 1;
        }
        if let Some(next) = holds.get(index + 1) {
            // The next holder got the lock before this one let go of it.
            if next.acquired < hold.release_started {
                overlaps += 1;
            }
            if hold.token != 0 && next.token <= hold.token {
                token_regressions += 1;
            }
            // A handoff: the next holder was already waiting when this one let go.
            if next.wait_started < hold.release_started {
                gaps.record(Duration::from_nanos(
                    next.acquired.saturating_sub(hold.release_started),
                ));
            }
        }
    }
    let rate = holds.len() as f64 / span.max(f64::MIN_POSITIVE);
    let hold = hold_times.micros(0.5);
    Contention {
        rate,
        ratio: rate / (1e6 / (hold + rtt)),
        hold,
        rtt,
        gap_p50: gaps.micros(0.5),
        gap_p99: gaps.micros(0.99),
        jain: jain(&per_task),
        overlaps,
        token_regressions,
    }
}

/// Kills a holder process of `subject` with SIGKILL after `phase`, while `waiter` waits
/// for the same lock. Returns the milliseconds from the kill to the waiter holding it,
/// and the lease the server had left just before the kill (lease locks only).
async fn kill_nine(
    subject: Subject,
    url: &str,
    waiter: &OneLock,
    phase: Duration,
) -> BenchResult<(f64, Option<f64>)> {
    let mut child = worker::holder(subject, url).await?;
    tokio::time::sleep(phase).await;
    let lock = waiter.clone();
    let next = tokio::spawn(async move {
        let held = lock.acquire().await?;
        let acquired = Instant::now();
        held.release().await?;
        BenchResult::Ok(acquired)
    });
    // Let the waiter make its first attempt and start waiting, as a next holder would be.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let lease_left = if subject.reads_lease_left() {
        waiter.lease_left().await?
    } else {
        None
    };
    child.start_kill()?;
    let killed = Instant::now();
    child.wait().await?;
    let acquired = match tokio::time::timeout(KILL_LIMIT, next).await {
        Ok(joined) => joined??,
        Err(_) => return Err(format!("{}: no next holder within 30 s", subject.key()).into()),
    };
    Ok((
        acquired.duration_since(killed).as_secs_f64() * 1e3,
        lease_left.map(|left| left.as_secs_f64() * 1e3),
    ))
}
