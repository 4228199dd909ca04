//! The semaphores against the lease lock, in the same run:
//!
//! - **a cycle without contention**: one task takes one permit and gives it back, back to
//!   back, for a `Semaphore` and for a `PermitSemaphore` (fixed lease, and watchdog),
//!   against the lease lock's `try_lock` + `release` and against half the no-op EVALSHA
//!   rate (a cycle is two script calls), all interleaved in slices as the uncontended
//!   scenario does;
//! - **throughput with 4 permits**: 16, then 64 tasks, half on each of two clients, loop
//!   on acquire, hold 1 ms, release. Holds per second against the ideal 4 / (hold + one
//!   round trip), and against the lease lock (one permit) under the same load.
//!
//! Every holder counts itself in an `AtomicUsize` between `acquire` returning and
//! `release` being called: a window inside the one the server grants, so the highest
//! count seen can only exceed the permits if the server let more in. It is checked.
//!
//! A hold sleeps 1 ms on a blocking thread: tokio's timer rounds a sleep up to the next
//! millisecond tick (about 2 ms), and four holders held busily, as the contended scenario
//! holds its one, would take both cores of the machine from redis-server. The ideal rate
//! uses the hold actually measured.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use distlock::{Client, ReleaseOutcome};
use redis::aio::MultiplexedConnection;
use tokio::time::Instant;

use super::{interleaved, timed_cycles, BenchResult, Plan};
use crate::baseline::{self, Raw};
use crate::cost;
use crate::report::{checked, figure, Report};
use crate::stats::{jain, median, Latencies};

/// Permits of the semaphores under load.
const PERMITS: usize = 4;
/// Each load's tasks are split evenly over this many clients.
const CLIENTS: usize = 2;
const HOLD: Duration = Duration::from_millis(1);
/// The fixed lease of the `with_lease` handles: far longer than any hold.
const FIXED_LEASE: Duration = Duration::from_secs(30);

/// A name no earlier run left state under (with `--url`, a server may keep old keys).
fn fresh(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos());
    format!("bench:sem:{name}:{}:{nanos}", std::process::id())
}

/// What a task takes and gives back.
#[derive(Clone)]
enum Subject {
    Lock(distlock::Lock),
    Semaphore(distlock::Semaphore),
    Permits(distlock::PermitSemaphore),
}

enum Held {
    Lock(distlock::LockGuard),
    Semaphore(distlock::SemaphorePermits),
    Permits(distlock::LeasedPermits),
}

impl Subject {
    /// Waits for one permit (the lock).
    async fn acquire(&self) -> BenchResult<Held> {
        Ok(match self {
            Subject::Lock(lock) => Held::Lock(lock.lock().await?),
            Subject::Semaphore(semaphore) => Held::Semaphore(semaphore.acquire(1).await?),
            Subject::Permits(permits) => Held::Permits(permits.acquire(1).await?),
        })
    }

    /// Takes one permit (the lock) without waiting: uncontended, it must be free.
    async fn take(&self) -> BenchResult<Held> {
        let held = match self {
            Subject::Lock(lock) => lock.try_lock().await?.map(Held::Lock),
            Subject::Semaphore(semaphore) => semaphore.try_acquire(1).await?.map(Held::Semaphore),
            Subject::Permits(permits) => permits.try_acquire(1).await?.map(Held::Permits),
        };
        held.ok_or_else(|| "uncontended, yet not free".into())
    }
}

impl Held {
    /// Gives it back; false if the hold had been lost before.
    async fn release(self) -> BenchResult<bool> {
        Ok(match self {
            Held::Lock(guard) => guard.release().await? == ReleaseOutcome::Released,
            Held::Semaphore(permits) => {
                permits.release().await?;
                true
            }
            Held::Permits(permits) => permits.release().await? == ReleaseOutcome::Released,
        })
    }
}

/// The subjects of the uncontended cycles, as [`handles`] makes them: the lease lock
/// (their baseline) first.
const CYCLE_SUBJECTS: [(&str, &str); 4] = [
    ("lock-cycle", "lease lock try_lock+release"),
    ("sem-cycle", "Semaphore try_acquire(1)+release"),
    ("permit-lease", "PermitSemaphore, fixed lease"),
    ("permit-wd", "PermitSemaphore, watchdog"),
];

/// The names one set of subjects uses: a lock, and a semaphore and a permit semaphore
/// with `permits` set, each fresh.
async fn names(client: &Client, tag: &str, permits: usize) -> BenchResult<[String; 3]> {
    let names = [
        fresh(&format!("{tag}:lock")),
        fresh(&format!("{tag}:semaphore")),
        fresh(&format!("{tag}:permits")),
    ];
    if !client
        .semaphore(&*names[1])?
        .try_set_permits(permits as i64)
        .await?
        .is_set()
        || !client
            .permit_semaphore(&*names[2])?
            .try_set_permits(permits as i64)
            .await?
            .is_set()
    {
        return Err("a fresh semaphore had its permits set already".into());
    }
    Ok(names)
}

/// One handle per entry of [`CYCLE_SUBJECTS`], on `client`.
fn handles(client: &Client, [lock, semaphore, permits]: &[String; 3]) -> BenchResult<[Subject; 4]> {
    let permits = client.permit_semaphore(&**permits)?;
    Ok([
        Subject::Lock(client.lock(&**lock)?),
        Subject::Semaphore(client.semaphore(&**semaphore)?),
        Subject::Permits(permits.with_lease(FIXED_LEASE)),
        Subject::Permits(permits.with_watchdog()),
    ])
}

/// What one cycle costs besides time, per subject: allocations, and the server's time in
/// the commands the library sends itself.
async fn cycle_costs(
    subjects: [Subject; 4],
    connection: distlock::Connection,
    mut stats: MultiplexedConnection,
) -> BenchResult<(Vec<cost::Cost>, cost::Cost)> {
    let mut costs = Vec::new();
    for subject in &subjects {
        costs.push(
            cost::per_cycle(&mut stats, &["evalsha", "eval", "unlink"], || async {
                subject.take().await?.release().await?;
                Ok(())
            })
            .await?,
        );
    }
    let pings = cost::per_cycle(&mut stats, &["ping"], || {
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
    Ok((costs, pings))
}

/// The uncontended cycles, one report per subject.
async fn cycles(
    client: &Client,
    stats: Option<MultiplexedConnection>,
    plan: Plan,
) -> BenchResult<Vec<Report>> {
    let connection = client.connection();
    let subjects = handles(client, &names(client, "cycle", PERMITS).await?)?;
    // The lease lock first: each round's ratios are taken against it (the table's
    // baseline); the no-op after it, for the floor.
    let order = [Some(0), None, Some(1), Some(2), Some(3)];
    let measured = interleaved(plan, order.len(), async |load, length| {
        let Some(subject) = order[load] else {
            return Ok(baseline::run(Raw::Noop, &connection, 1, length).await?);
        };
        let subject = subjects[subject].clone();
        timed_cycles(vec![subject], length, |subject| {
            Box::pin(async move {
                subject.take().await?.release().await?;
                Ok(())
            })
        })
        .await
    })
    .await?;
    // Measured in a task, as every cycle above (the client's fast link; see the
    // uncontended scenario).
    let costs = match stats {
        Some(stats) => {
            let measuring = cycle_costs(subjects.clone(), connection.clone(), stats);
            Some(tokio::spawn(measuring).await??)
        }
        None => None,
    };
    let noop = &measured[1];
    let floor = noop.rate / 2.0;
    let loaded = [&measured[0], &measured[2], &measured[3], &measured[4]];
    let mut reports = Vec::new();
    for (index, ((scenario, what), loaded)) in CYCLE_SUBJECTS.iter().zip(loaded).enumerate() {
        // Two script calls per cycle: half the no-op rate is the floor. For the lease
        // lock this is the median of its own per-round ratios; for the others, a ratio of
        // two such medians.
        let to_floor = 2.0 * loaded.ratio_to_first / noop.ratio_to_first;
        let mut details = vec![
            figure(format!("{what} p50"), loaded.latency.micros(0.5), "µs"),
            figure(format!("{what} p99"), loaded.latency.micros(0.99), "µs"),
        ];
        if let Some((costs, pings)) = &costs {
            let cost = &costs[index];
            details.push(figure(
                "server time per cycle (commandstats)",
                cost.server_micros,
                "µs",
            ));
            details.push(figure("allocations per cycle", cost.allocations, ""));
            if index == 0 {
                details.push(figure("two PINGs: allocations", pings.allocations, ""));
            }
        }
        let report = if index == 0 {
            details.push(figure(
                "EVALSHA round trip p50",
                noop.latency.micros(0.5),
                "µs",
            ));
            Report {
                scenario,
                result: figure("cycles/s", loaded.rate, ""),
                baseline: figure("EVALSHA/s ÷ 2 =", floor, "cycles/s"),
                ratio: to_floor,
                target: "reported (the baseline)".into(),
                met: true,
                details,
            }
        } else {
            details.insert(0, figure("vs EVALSHA/s ÷ 2 (the floor)", to_floor, "×"));
            Report {
                scenario,
                result: figure("cycles/s", loaded.rate, ""),
                baseline: figure("lease lock, same run", measured[0].rate, "cycles/s"),
                ratio: loaded.ratio_to_first,
                target: "reported".into(),
                met: true,
                details,
            }
        };
        reports.push(report);
    }
    Ok(reports)
}

/// One hold of a task under load.
struct Hold {
    task: usize,
    wait_started: Instant,
    acquired: Instant,
    release_started: Instant,
}

/// What one timed slice of a load gave.
struct Slice {
    rate: f64,
    hold_p50: f64,
    wait_p50: f64,
    wait_p99: f64,
    gap_p50: f64,
    gap_p99: f64,
    jain: f64,
    max_holders: usize,
    lost: usize,
}

/// `tasks` tasks (task `n` on `handles[n % handles.len()]`, one handle per client) loop on
/// acquire, hold, release for `length`. `permits` is what the subject lets in at once.
async fn slice(
    handles: &[Subject],
    tasks: usize,
    permits: usize,
    length: Duration,
) -> BenchResult<Slice> {
    let holders = Arc::new(AtomicUsize::new(0));
    let max_holders = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let until = started + length;
    let running: Vec<_> = (0..tasks)
        .map(|task| {
            let subject = handles[task % handles.len()].clone();
            let (holders, max_holders) = (Arc::clone(&holders), Arc::clone(&max_holders));
            tokio::spawn(async move {
                let (mut holds, mut lost) = (Vec::new(), 0);
                while Instant::now() < until {
                    let wait_started = Instant::now();
                    let held = subject.acquire().await?;
                    let acquired = Instant::now();
                    let now = holders.fetch_add(1, Ordering::SeqCst) + 1;
                    max_holders.fetch_max(now, Ordering::SeqCst);
                    tokio::task::spawn_blocking(|| std::thread::sleep(HOLD)).await?;
                    holders.fetch_sub(1, Ordering::SeqCst);
                    let release_started = Instant::now();
                    if !held.release().await? {
                        lost += 1;
                    }
                    holds.push(Hold {
                        task,
                        wait_started,
                        acquired,
                        release_started,
                    });
                }
                BenchResult::Ok((holds, lost))
            })
        })
        .collect();
    let (mut holds, mut lost) = (Vec::new(), 0);
    for task in running {
        let (some, lost_here) = task.await??;
        holds.extend(some);
        lost += lost_here;
    }
    // The rate over the slice: holds begun in it (the tasks still waiting at its end
    // finish their turn after it).
    let in_slice = holds.iter().filter(|hold| hold.acquired < until).count();
    let (mut waits, mut hold_times) = (Latencies::new(), Latencies::new());
    let mut per_task = vec![0u64; tasks];
    for hold in &holds {
        waits.record(hold.acquired - hold.wait_started);
        hold_times.record(hold.release_started - hold.acquired);
        per_task[hold.task] += 1;
    }
    // The j-th release lets the (permits + j)-th acquisition in: no more than `permits`
    // are held at once, so that acquisition cannot come before it. With waiters always
    // queued (16 or 64 tasks for 4 permits) the gap is the handoff.
    let mut acquisitions: Vec<Instant> = holds.iter().map(|hold| hold.acquired).collect();
    let mut releases: Vec<Instant> = holds.iter().map(|hold| hold.release_started).collect();
    acquisitions.sort();
    releases.sort();
    let mut gaps = Latencies::new();
    for (release, acquired) in releases.iter().zip(acquisitions.iter().skip(permits)) {
        gaps.record(acquired.saturating_duration_since(*release));
    }
    Ok(Slice {
        rate: in_slice as f64 / length.as_secs_f64(),
        hold_p50: hold_times.micros(0.5),
        wait_p50: waits.micros(0.5),
        wait_p99: waits.micros(0.99),
        gap_p50: gaps.micros(0.5),
        gap_p99: gaps.micros(0.99),
        jain: jain(&per_task),
        max_holders: max_holders.load(Ordering::SeqCst),
        lost,
    })
}

/// One kind of load: which of [`handles`] it takes, and how many holders it lets in.
struct Kind {
    report: &'static str,
    subject: usize,
    permits: usize,
}

const fn kind(report: &'static str, subject: usize, permits: usize) -> Kind {
    Kind {
        report,
        subject,
        permits,
    }
}

/// The loads measured each round: for each task count, the lease lock first (the
/// baseline), then the semaphore, then the permit semaphore (watchdog).
const LOADS: [(usize, [Kind; 3]); 2] = [
    (
        16,
        [
            kind("lock-1/16", 0, 1),
            kind("sem-4/16", 1, PERMITS),
            kind("permit-4/16", 3, PERMITS),
        ],
    ),
    (
        64,
        [
            kind("lock-1/64", 0, 1),
            kind("sem-4/64", 1, PERMITS),
            kind("permit-4/64", 3, PERMITS),
        ],
    ),
];

/// The throughput loads, one report per kind and task count.
async fn throughput(client: &Client, url: &str, plan: Plan) -> BenchResult<Vec<Report>> {
    // The first client is the caller's; the others connect here.
    let mut clients = vec![client.clone()];
    for _ in 1..CLIENTS {
        clients.push(Client::connect(url).await?);
    }
    let names = names(client, "load", PERMITS).await?;
    let per_client = clients
        .iter()
        .map(|client| handles(client, &names))
        .collect::<BenchResult<Vec<_>>>()?;
    // For each subject, its handle on every client.
    let on_each = |subject: usize| -> Vec<Subject> {
        per_client
            .iter()
            .map(|handles| handles[subject].clone())
            .collect()
    };
    let connection = client.connection();
    let mut rtts = Vec::new();
    // [load][kind] → one Slice per round.
    let mut slices: Vec<Vec<Vec<Slice>>> = LOADS
        .iter()
        .map(|(_, kinds)| kinds.iter().map(|_| Vec::new()).collect())
        .collect();
    for _ in 0..plan.runs {
        let (_, rtt) = baseline::run(Raw::Noop, &connection, 1, Duration::from_millis(200)).await?;
        rtts.push(rtt.micros(0.5));
        for (load, (tasks, kinds)) in LOADS.iter().enumerate() {
            for (kind, load_kind) in kinds.iter().enumerate() {
                let handles = on_each(load_kind.subject);
                let measured = slice(&handles, *tasks, load_kind.permits, plan.length).await?;
                slices[load][kind].push(measured);
            }
        }
    }
    for extra in clients.into_iter().skip(1) {
        extra.shutdown().await;
    }
    let rtt = median(&rtts);
    let mut reports = Vec::new();
    for (load, (tasks, kinds)) in LOADS.iter().enumerate() {
        let tasks = *tasks;
        let lock_rates: Vec<f64> = slices[load][0].iter().map(|s| s.rate).collect();
        for (kind, load_kind) in kinds.iter().enumerate() {
            let permits = load_kind.permits;
            let runs = &slices[load][kind];
            let pick = |f: fn(&Slice) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
            let rate = pick(|s| s.rate);
            let hold = pick(|s| s.hold_p50);
            let ideal = permits as f64 * 1e6 / (hold + rtt);
            // Not a median: one slice over the permits is a failure.
            let max_holders = runs.iter().map(|s| s.max_holders).max().unwrap_or(0);
            let lost: usize = runs.iter().map(|s| s.lost).sum();
            let mut details = Vec::new();
            if kind > 0 {
                // Per round, against the lease lock measured just before it.
                let to_lock: Vec<f64> = runs
                    .iter()
                    .zip(&lock_rates)
                    .map(|(s, lock)| s.rate / lock)
                    .collect();
                details.push(figure(
                    format!("vs lease lock, same {tasks} tasks (holds/s)"),
                    median(&to_lock),
                    "×",
                ));
            }
            details.extend([
                checked(
                    "max holders",
                    max_holders as f64,
                    "",
                    format!("<= {permits}"),
                    max_holders <= permits,
                ),
                figure("acquire wait p50", pick(|s| s.wait_p50), "µs"),
                figure("acquire wait p99", pick(|s| s.wait_p99), "µs"),
                figure(
                    "release → acquire of the freed permit p50",
                    pick(|s| s.gap_p50),
                    "µs",
                ),
                figure(
                    "release → acquire of the freed permit p99",
                    pick(|s| s.gap_p99),
                    "µs",
                ),
                figure("hold p50 (nominal 1000)", hold, "µs"),
                figure("EVALSHA round trip p50", rtt, "µs"),
                figure(
                    format!("Jain fairness over {tasks} tasks"),
                    pick(|s| s.jain),
                    "",
                ),
                checked(
                    "holds lost before release (all runs)",
                    lost as f64,
                    "",
                    "0".into(),
                    lost == 0,
                ),
            ]);
            let met = details.iter().all(|d| d.met != Some(false));
            reports.push(Report {
                scenario: load_kind.report,
                result: figure("holds/s", rate, ""),
                baseline: figure(format!("ideal {permits}/(hold+RTT) ="), ideal, "holds/s"),
                ratio: rate / ideal,
                target: format!("max holders <= {permits}"),
                met,
                details,
            });
        }
    }
    Ok(reports)
}

pub async fn run(
    client: &Client,
    url: &str,
    stats: Option<MultiplexedConnection>,
    plan: Plan,
) -> BenchResult<Vec<Report>> {
    let mut reports = cycles(client, stats, plan).await?;
    reports.extend(throughput(client, url, plan).await?);
    Ok(reports)
}
