//! Eight tasks of one client take turns on one lock: hold 1 ms, think 2 ms. The lock is
//! always wanted, so the rate is bounded by 1 / (hold + one round trip), and what the
//! scenario shows is how fast and how fairly it changes hands.
//!
//! tokio's timer rounds a sleep up to the next millisecond tick, which would turn "hold
//! 1 ms" into about 2 ms and hide the handoff cost, and sleeping on a blocking thread costs
//! its own wake-ups. So a holder holds like a CPU-bound critical section: it yields until
//! its hold time is up. Thinking (not holding) uses tokio's timer; its actual length is
//! reported. The ideal rate uses the hold actually achieved: the lock cannot change hands
//! faster than its holder lets go.

use std::time::Duration;

use std::sync::Arc;

use rslock::LockManager;
use tokio::time::Instant;

use super::{BenchResult, Plan};
use crate::baseline::{self, Raw};
use crate::report::{checked, figure, Report};
use crate::stats::{jain, median, Latencies};

// `THINK` is slept with tokio's timer, `HOLD` held busily (see the module docs).

pub const TASKS: usize = 8;
pub const HOLD: Duration = Duration::from_millis(1);
pub const THINK: Duration = Duration::from_millis(2);

const TARGET_RATIO: f64 = 0.85;
const TARGET_GAP_P50_RTTS: f64 = 3.0;
const TARGET_GAP_P99_MICROS: f64 = 1000.0;
const TARGET_WAIT_P99_MICROS: f64 = 10_000.0;
const TARGET_JAIN: f64 = 0.95;

struct Hold {
    task: usize,
    wait_started: Instant,
    acquired: Instant,
    release_started: Instant,
    thought: Duration,
}

/// Holds the worker, yielding to other tasks, until `length` has passed.
async fn busy_hold(length: Duration) {
    let until = Instant::now() + length;
    while Instant::now() < until {
        tokio::task::yield_now().await;
    }
}

/// The lock implementation a run measures: distlock, or a peer under the same load.
#[derive(Clone)]
pub enum Implementation {
    Distlock(distlock::Lock),
    /// rslock with its defaults: a failed attempt is retried after a random delay of up
    /// to 200 ms.
    Rslock(Arc<LockManager>),
}

/// The lock every task contends for.
pub const NAME: &str = "bench:contended";
/// rslock has no watchdog; its lease only has to outlast one hold.
const PEER_LEASE: Duration = Duration::from_secs(30);

/// One hold, with what it takes to release it.
enum Held {
    Distlock(distlock::LockGuard),
    Rslock(Arc<LockManager>, rslock::Lock),
}

impl Implementation {
    async fn acquire(&self) -> BenchResult<Held> {
        Ok(match self {
            Implementation::Distlock(lock) => Held::Distlock(lock.lock().await?),
            Implementation::Rslock(manager) => Held::Rslock(
                Arc::clone(manager),
                manager.acquire_no_guard(NAME, PEER_LEASE).await?,
            ),
        })
    }
}

impl Held {
    async fn release(self) -> BenchResult<()> {
        match self {
            Held::Distlock(guard) => {
                guard.release().await?;
            }
            Held::Rslock(manager, lock) => manager.unlock(&lock).await,
        }
        Ok(())
    }
}

async fn one_run(
    implementation: &Implementation,
    length: Duration,
) -> BenchResult<(Vec<Hold>, f64)> {
    let started = Instant::now();
    let until = started + length;
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let implementation = implementation.clone();
            tokio::spawn(async move {
                let mut holds = Vec::new();
                while Instant::now() < until {
                    let wait_started = Instant::now();
                    let held = implementation.acquire().await?;
                    let acquired = Instant::now();
                    busy_hold(HOLD).await;
                    let release_started = Instant::now();
                    held.release().await?;
                    let released = Instant::now();
                    tokio::time::sleep(THINK).await;
                    holds.push(Hold {
                        task,
                        wait_started,
                        acquired,
                        release_started,
                        thought: released.elapsed(),
                    });
                }
                BenchResult::Ok(holds)
            })
        })
        .collect();
    let mut holds = Vec::new();
    for task in tasks {
        holds.extend(task.await??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok((holds, elapsed))
}

pub async fn run(
    scenario: &'static str,
    implementation: Implementation,
    rtt_connection: &distlock::Connection,
    plan: Plan,
) -> BenchResult<Report> {
    let mut rates = Vec::new();
    let mut rtts = Vec::new();
    let mut held = Vec::new();
    let mut thought = Vec::new();
    let (mut gap_p50, mut gap_p99, mut wait_p99, mut wait_max, mut fairness) =
        (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..plan.runs {
        let (_, rtt) =
            baseline::run(Raw::Noop, rtt_connection, 1, Duration::from_millis(300)).await?;
        rtts.push(rtt.micros(0.5));
        let (mut holds, elapsed) = one_run(&implementation, plan.length).await?;
        rates.push(holds.len() as f64 / elapsed);
        holds.sort_by_key(|hold| hold.acquired);

        let mut gaps = Latencies::new();
        let mut waits = Latencies::new();
        let mut hold_times = Latencies::new();
        let mut think_times = Latencies::new();
        let mut per_task = [0u64; TASKS];
        for (index, hold) in holds.iter().enumerate() {
            waits.record(hold.acquired - hold.wait_started);
            hold_times.record(hold.release_started - hold.acquired);
            think_times.record(hold.thought);
            per_task[hold.task] += 1;
            // A handoff: the next holder was already waiting when this one let go.
            if let Some(next) = holds.get(index + 1) {
                if next.wait_started < hold.release_started {
                    gaps.record(
                        next.acquired
                            .saturating_duration_since(hold.release_started),
                    );
                }
            }
        }
        held.push(hold_times.micros(0.5));
        thought.push(think_times.micros(0.5));
        gap_p50.push(gaps.micros(0.5));
        gap_p99.push(gaps.micros(0.99));
        wait_p99.push(waits.micros(0.99));
        wait_max.push(waits.max_micros());
        fairness.push(jain(&per_task));
    }
    let rtt = median(&rtts);
    let hold = median(&held);
    let ideal = 1e6 / (hold + rtt);
    let rate = median(&rates);
    let ratio = rate / ideal;
    let (gap_p50, gap_p99, wait_p99, jain) = (
        median(&gap_p50),
        median(&gap_p99),
        median(&wait_p99),
        median(&fairness),
    );
    let details = vec![
        figure("EVALSHA round trip p50", rtt, "µs"),
        figure("hold p50 (nominal 1000)", hold, "µs"),
        figure(
            "think p50 (nominal 2000, tokio timer)",
            median(&thought),
            "µs",
        ),
        checked(
            "release→next acquire p50",
            gap_p50,
            "µs",
            format!(
                "<= {TARGET_GAP_P50_RTTS} RTT = {:.0} µs",
                TARGET_GAP_P50_RTTS * rtt
            ),
            gap_p50 <= TARGET_GAP_P50_RTTS * rtt,
        ),
        checked(
            "release→next acquire p99",
            gap_p99,
            "µs",
            format!("<= {TARGET_GAP_P99_MICROS} µs"),
            gap_p99 <= TARGET_GAP_P99_MICROS,
        ),
        checked(
            "acquisition wait p99",
            wait_p99,
            "µs",
            format!("<= {TARGET_WAIT_P99_MICROS} µs"),
            wait_p99 <= TARGET_WAIT_P99_MICROS,
        ),
        figure("acquisition wait max", median(&wait_max), "µs"),
        checked(
            "Jain fairness over tasks",
            jain,
            "",
            format!(">= {TARGET_JAIN}"),
            jain >= TARGET_JAIN,
        ),
    ];
    let met = ratio >= TARGET_RATIO && details.iter().all(|d| d.met != Some(false));
    Ok(Report {
        scenario,
        result: figure("acquisitions/s", rate, ""),
        baseline: figure("ideal 1/(hold+RTT) =", ideal, "acq/s"),
        ratio,
        target: format!("ratio >= {TARGET_RATIO:.2}"),
        met,
        details,
    })
}
