//! The fair lock against the lease lock, in the same run and under the same load: eight
//! tasks in two processes (four each, one client per process) take turns on one lock,
//! holding it 1 ms and thinking 2 ms, as in the contended scenario.
//!
//! A fair release hands the lock to the next waiter in its own script, so a handoff costs
//! the release's way to the server and the grant's way back as a message: about one round
//! trip where the lease lock needs a release, a message and the waiter's own attempt.
//!
//! The worker processes are this binary again (`--worker-kind`), started together at a
//! time the parent gives; each prints one JSON line per hold, timed by the wall clock,
//! which both processes of one machine share. The parent checks:
//!
//! - the handoff gap: release called → next holder's `lock()` returned, for holders that
//!   were waiting when the lock was let go;
//! - the rate against the ideal 1 / (hold + one round trip);
//! - Jain's fairness over the eight tasks;
//! - FIFO: no holder got the lock before one that had started waiting well before it
//!   (more than a round trip and a margin earlier, so that two requests in flight at the
//!   same time are not counted).

use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::io::AsyncBufReadExt;

use super::{BenchResult, Plan};
use crate::baseline::{self, Raw};
use crate::report::{checked, figure, Report};
use crate::stats::{jain, median, Latencies};

const PROCESSES: usize = 2;
const TASKS_PER_PROCESS: usize = 4;
const HOLD: Duration = Duration::from_millis(1);
const THINK: Duration = Duration::from_millis(2);
const NAME: &str = "bench:fair";

const TARGET_GAP_P50_RTTS: f64 = 1.5;
const TARGET_RATIO: f64 = 0.95;
const TARGET_JAIN: f64 = 0.99;

/// Two waits that began closer than this are not ordered by the FIFO check: their
/// requests may reach the server in either order.
const FIFO_MARGIN: Duration = Duration::from_micros(500);

/// Which lock a worker takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
pub enum Kind {
    Fair,
    Lease,
}

/// One hold, as a worker reports it: wall-clock nanoseconds since the epoch.
#[derive(Debug, Serialize, Deserialize)]
struct Hold {
    task: usize,
    wait_started: u64,
    acquired: u64,
    release_started: u64,
    /// When the release call returned to the holder.
    release_done: u64,
    token: u64,
}

fn wall_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|since| u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Holds the worker, yielding to other tasks, until `length` has passed (see the
/// contended scenario).
async fn busy_hold(length: Duration) {
    let until = tokio::time::Instant::now() + length;
    while tokio::time::Instant::now() < until {
        tokio::task::yield_now().await;
    }
}

/// The worker: `tasks` tasks numbered from `first_task` take `kind` of lock on `url` from
/// `start` (wall-clock ms) for `length`, and print one JSON line per hold.
pub async fn worker(
    kind: Kind,
    url: &str,
    first_task: usize,
    tasks: usize,
    start_ms: u64,
    length: Duration,
) -> BenchResult<()> {
    let client = distlock::Client::connect(url).await?;
    let (fair, lease) = (client.fair_lock(NAME)?, client.lock(NAME)?);
    let now_ms = wall_nanos() / 1_000_000;
    tokio::time::sleep(Duration::from_millis(start_ms.saturating_sub(now_ms))).await;
    let until = tokio::time::Instant::now() + length;
    let workers: Vec<_> = (0..tasks)
        .map(|n| {
            let (fair, lease) = (fair.clone(), lease.clone());
            tokio::spawn(async move {
                let mut holds = Vec::new();
                while tokio::time::Instant::now() < until {
                    let wait_started = wall_nanos();
                    let guard = match kind {
                        Kind::Fair => fair.lock().await?,
                        Kind::Lease => lease.lock().await?,
                    };
                    let acquired = wall_nanos();
                    if std::env::var_os("FAIR_SLEEP_HOLD").is_some() {
                        tokio::task::spawn_blocking(|| std::thread::sleep(HOLD)).await?;
                    } else {
                        busy_hold(HOLD).await;
                    }
                    let release_started = wall_nanos();
                    let token = guard.fencing_token();
                    guard.release().await?;
                    let release_done = wall_nanos();
                    holds.push(Hold {
                        task: first_task + n,
                        wait_started,
                        acquired,
                        release_started,
                        release_done,
                        token,
                    });
                    tokio::time::sleep(THINK).await;
                }
                BenchResult::Ok(holds)
            })
        })
        .collect();
    let mut out = String::new();
    for worker in workers {
        for hold in worker.await?? {
            out.push_str(&serde_json::to_string(&hold)?);
            out.push('\n');
        }
    }
    print!("{out}");
    client.shutdown().await;
    Ok(())
}

/// Microseconds Redis spent in the commands sent to it since its statistics were reset
/// (`INFO commandstats`: top-level commands only, a script's inner calls included in it).
async fn server_micros(stats: &mut redis::aio::MultiplexedConnection) -> BenchResult<f64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(stats)
        .await?;
    Ok(info
        .lines()
        .filter_map(|line| {
            let (command, fields) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            if !["evalsha", "eval", "unlink", "publish", "ping"].contains(&command) {
                return None;
            }
            fields
                .split(',')
                .find_map(|field| field.strip_prefix("usec="))
                .and_then(|usec| usec.parse::<f64>().ok())
        })
        .sum())
}

/// One timed run: both processes, started together; their holds, in acquisition order,
/// and the server's time per hold.
async fn one_run(kind: Kind, url: &str, length: Duration) -> BenchResult<(Vec<Hold>, f64)> {
    let mut stats = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut stats)
        .await?;
    let exe = std::env::current_exe()?;
    let start_ms = wall_nanos() / 1_000_000 + 500;
    let mut children = Vec::new();
    for process in 0..PROCESSES {
        let child = tokio::process::Command::new(&exe)
            .arg("--worker-kind")
            .arg(match kind {
                Kind::Fair => "fair",
                Kind::Lease => "lease",
            })
            .arg("--url")
            .arg(url)
            .arg("--worker-first-task")
            .arg((process * TASKS_PER_PROCESS).to_string())
            .arg("--worker-tasks")
            .arg(TASKS_PER_PROCESS.to_string())
            .arg("--worker-start-ms")
            .arg(start_ms.to_string())
            .arg("--secs")
            .arg(length.as_secs_f64().to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
        children.push(child);
    }
    let mut holds = Vec::new();
    for mut child in children {
        let stdout = child.stdout.take().ok_or("a worker has no stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        while let Some(line) = lines.next_line().await? {
            holds.push(serde_json::from_str::<Hold>(&line)?);
        }
        let status = child.wait().await?;
        if !status.success() {
            return Err(format!("a worker failed: {status}").into());
        }
    }
    holds.sort_by_key(|hold| hold.acquired);
    let per_hold = server_micros(&mut stats).await? / holds.len().max(1) as f64;
    Ok((holds, per_hold))
}

/// A run with every command logged (crate::slowlog): the server's calls and time per
/// hold, by kind of call, as figures ("server µs per hold: evalsha 6k+7a", with the calls
/// per hold beside it).
async fn profiled_run(
    kind: Kind,
    url: &str,
    length: Duration,
) -> BenchResult<Vec<crate::report::Figure>> {
    let mut connection = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    crate::slowlog::start(&mut connection).await?;
    let run = one_run(kind, url, length).await;
    let calls = crate::slowlog::stop(&mut connection).await?;
    let holds = run?.0.len().max(1) as f64;
    let mut figures = Vec::new();
    let mut ranked: Vec<_> = calls.into_iter().collect();
    ranked.sort_by_key(|(_, calls)| std::cmp::Reverse(calls.micros));
    for (call, calls) in ranked {
        figures.push(figure(
            format!(
                "profiled: {} ({:.2} calls/hold), server µs per hold",
                call.label(),
                calls.count as f64 / holds
            ),
            calls.micros as f64 / holds,
            "µs",
        ));
    }
    Ok(figures)
}

struct Figures {
    server_per_hold: f64,
    rate: f64,
    hold: f64,
    gap_p50: f64,
    gap_p99: f64,
    /// The release call, from its start to its return to the holder, p50.
    release_call_p50: f64,
    /// Handoffs whose next holder had the lock before the release call returned, as a
    /// share of all handoffs to a waiting task.
    before_reply: f64,
    jain: f64,
    overtaken: usize,
    token_regressions: usize,
}

fn figures(holds: &[Hold], server_per_hold: f64, rtt_micros: f64, debug: bool) -> Figures {
    let first = holds
        .iter()
        .map(|hold| hold.wait_started)
        .min()
        .unwrap_or(0);
    let last = holds
        .iter()
        .map(|hold| hold.release_started)
        .max()
        .unwrap_or(first);
    let span = (last.saturating_sub(first)) as f64 / 1e9;
    let mut gaps = Latencies::new();
    let mut release_calls = Latencies::new();
    let (mut handoffs, mut before_reply) = (0u32, 0u32);
    let mut hold_times = Latencies::new();
    let mut per_task = [0u64; PROCESSES * TASKS_PER_PROCESS];
    let mut token_regressions = 0;
    for (index, hold) in holds.iter().enumerate() {
        hold_times.record(Duration::from_nanos(
            hold.release_started.saturating_sub(hold.acquired),
        ));
        release_calls.record(Duration::from_nanos(
            hold.release_done.saturating_sub(hold.release_started),
        ));
        if let Some(count) = per_task.get_mut(hold.task) {
            *count += 1;
        }
        if let Some(next) = holds.get(index + 1) {
            if next.token <= hold.token {
                token_regressions += 1;
            }
            if next.wait_started < hold.release_started {
                gaps.record(Duration::from_nanos(
                    next.acquired.saturating_sub(hold.release_started),
                ));
                handoffs += 1;
                if next.acquired < hold.release_done {
                    before_reply += 1;
                }
            }
        }
    }
    // A hold overtook another if it began waiting clearly later but got the lock first.
    let margin =
        u64::try_from(FIFO_MARGIN.as_nanos()).unwrap_or(u64::MAX) + (rtt_micros * 1e3) as u64;
    let mut overtaken = 0;
    for (index, earlier) in holds.iter().enumerate() {
        if let Some(before) = holds[..index]
            .iter()
            .filter(|before| before.wait_started > earlier.wait_started + margin)
            .max_by_key(|before| before.wait_started)
        {
            if debug {
                eprintln!(
                    "overtaken: task {} waited from {} (acq {}), task {} from +{} µs acquired {} µs earlier",
                    earlier.task,
                    earlier.wait_started,
                    earlier.acquired,
                    before.task,
                    (before.wait_started - earlier.wait_started) / 1000,
                    (earlier.acquired - before.acquired) / 1000
                );
            }
            overtaken += 1;
        }
    }
    Figures {
        server_per_hold,
        rate: holds.len() as f64 / span.max(f64::MIN_POSITIVE),
        hold: hold_times.micros(0.5),
        gap_p50: gaps.micros(0.5),
        gap_p99: gaps.micros(0.99),
        release_call_p50: release_calls.micros(0.5),
        before_reply: f64::from(before_reply) / f64::from(handoffs.max(1)),
        jain: jain(&per_task),
        overtaken,
        token_regressions,
    }
}

/// The floor under any handoff by pub/sub: from a PUBLISH being sent to its message
/// arriving at a subscriber on another connection of this process, at p50, in µs.
async fn pubsub_floor(url: &str) -> BenchResult<f64> {
    use futures_util::StreamExt;
    let client = redis::Client::open(url)?;
    let mut publisher = client.get_multiplexed_async_connection().await?;
    let mut subscriber = client.get_async_pubsub().await?;
    subscriber.subscribe("bench:fair:floor").await?;
    let mut messages = subscriber.on_message();
    let mut latencies = Latencies::new();
    for _ in 0..300 {
        let sent = tokio::time::Instant::now();
        let command = redis::cmd("PUBLISH")
            .arg("bench:fair:floor")
            .arg("0")
            .clone();
        let publish = command.query_async::<i64>(&mut publisher);
        let (published, received) = tokio::join!(publish, messages.next());
        published?;
        received.ok_or("the subscription ended")?;
        latencies.record(sent.elapsed());
    }
    Ok(latencies.micros(0.5))
}

/// Runs both locks `plan.runs` times, alternating, and reports each with medians.
pub async fn run(
    url: &str,
    rtt_connection: &distlock::Connection,
    plan: Plan,
) -> BenchResult<Vec<Report>> {
    let kinds = [(Kind::Fair, "fair"), (Kind::Lease, "fair-vs-lease")];
    let mut measured: Vec<Vec<Figures>> = vec![Vec::new(), Vec::new()];
    let mut rtts = Vec::new();
    let mut floors = Vec::new();
    for _ in 0..plan.runs {
        let (_, rtt) =
            baseline::run(Raw::Noop, rtt_connection, 1, Duration::from_millis(300)).await?;
        let rtt = rtt.micros(0.5);
        rtts.push(rtt);
        // In a task of the runtime, as the round trip above and the lock's waiters are
        // measured: polled from `main`'s own thread instead, every message would also
        // pay a wake-up of that thread by the worker that read it (about 100 µs here).
        let floor_url = url.to_owned();
        floors.push(tokio::spawn(async move { pubsub_floor(&floor_url).await }).await??);
        for (slot, (kind, _)) in kinds.iter().enumerate() {
            let (holds, server_per_hold) = one_run(*kind, url, plan.length).await?;
            let debug = *kind == Kind::Fair && std::env::var_os("FAIR_DEBUG").is_some();
            measured[slot].push(figures(&holds, server_per_hold, rtt, debug));
        }
    }
    let rtt = median(&rtts);
    let floor = median(&floors);
    // Where the server's time goes: one more run of each, every command logged.
    let mut profiles = Vec::new();
    for (kind, _) in &kinds {
        profiles.push(profiled_run(*kind, url, plan.length).await?);
    }
    let mut reports = Vec::new();
    for (((kind, scenario), runs), profile) in kinds.iter().zip(measured).zip(profiles) {
        let pick = |f: fn(&Figures) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
        let (rate, hold, gap_p50, gap_p99, jain) = (
            pick(|f| f.rate),
            pick(|f| f.hold),
            pick(|f| f.gap_p50),
            pick(|f| f.gap_p99),
            pick(|f| f.jain),
        );
        let overtaken: usize = runs.iter().map(|f| f.overtaken).sum();
        let regressions: usize = runs.iter().map(|f| f.token_regressions).sum();
        let ideal = 1e6 / (hold + rtt);
        let ratio = rate / ideal;
        let fair = *kind == Kind::Fair;
        let mut details = vec![
            figure("EVALSHA round trip p50", rtt, "µs"),
            figure("PUBLISH sent → message received p50", floor, "µs"),
            figure("hold p50 (nominal 1000)", hold, "µs"),
            figure(
                "server time per hold (commandstats, all commands)",
                pick(|f| f.server_per_hold),
                "µs",
            ),
            figure("release→next acquire p99", gap_p99, "µs"),
            // Where the handoff's time goes: the release call's own round trip, and how
            // often the next holder's code ran before that call returned (a fair grant is
            // published before the release's reply is sent).
            figure(
                "release call p50 (start → return)",
                pick(|f| f.release_call_p50),
                "µs",
            ),
            figure(
                "next holder ran before the release returned (share)",
                pick(|f| f.before_reply),
                "",
            ),
            checked(
                "fencing tokens out of order (all runs)",
                regressions as f64,
                "",
                "0".into(),
                regressions == 0,
            ),
        ];
        if fair {
            details.push(checked(
                "release→next acquire p50",
                gap_p50,
                "µs",
                format!(
                    "<= {TARGET_GAP_P50_RTTS} RTT = {:.0} µs",
                    TARGET_GAP_P50_RTTS * rtt
                ),
                gap_p50 <= TARGET_GAP_P50_RTTS * rtt,
            ));
            details.push(checked(
                "Jain fairness over 8 tasks",
                jain,
                "",
                format!(">= {TARGET_JAIN}"),
                jain >= TARGET_JAIN,
            ));
            details.push(checked(
                "holds that overtook an earlier waiter (all runs)",
                overtaken as f64,
                "",
                "0".into(),
                overtaken == 0,
            ));
        } else {
            details.push(figure("release→next acquire p50", gap_p50, "µs"));
            details.push(figure("Jain fairness over 8 tasks", jain, ""));
            details.push(figure(
                "holds that overtook an earlier waiter (all runs)",
                overtaken as f64,
                "",
            ));
        }
        details.extend(profile);
        let met = !fair || (ratio >= TARGET_RATIO && details.iter().all(|d| d.met != Some(false)));
        reports.push(Report {
            scenario,
            result: figure("acquisitions/s", rate, ""),
            baseline: figure("ideal 1/(hold+RTT) =", ideal, "acq/s"),
            ratio,
            target: if fair {
                format!("ratio >= {TARGET_RATIO:.2}")
            } else {
                "the lease lock, same load".into()
            },
            met,
            details,
        });
    }
    Ok(reports)
}
