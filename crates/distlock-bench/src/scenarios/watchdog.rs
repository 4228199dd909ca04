//! Many locks held in watchdog mode: what keeping them costs Redis and the client.
//!
//! The client's one watchdog task renews every held lock each third of the watchdog
//! timeout, one script call per batch. A timer per lock would send one command per lock
//! per third of the timeout: with 10,000 locks and a 30 s timeout, 1,000 commands/s.

use std::time::Duration;

use distlock::{Client, LockGuard};
use distlock_testkit::RedisServer;
use indicatif::{ProgressBar, ProgressStyle};
use tokio::time::Instant;

use super::BenchResult;
use crate::report::{checked, figure, Report};

const TARGET_COMMANDS_PER_SEC: f64 = 10.0;
const TARGET_BYTES_PER_LOCK: f64 = 1024.0;
const ACQUIRING_TASKS: usize = 64;

pub async fn run(server: &RedisServer, locks: usize, hold: Duration) -> BenchResult<Report> {
    let client = Client::connect(&server.url()).await?;
    let watchdog_timeout = Duration::from_secs(30);

    let rss_before = resident_bytes()?;
    let guards = acquire_all(&client, locks).await?;
    let rss_after = resident_bytes()?;
    let bytes_per_lock = rss_after.saturating_sub(rss_before) as f64 / locks as f64;

    let before = server.info_commandstats().await?;
    let started = Instant::now();
    let progress = ProgressBar::new(hold.as_secs());
    progress.set_style(
        ProgressStyle::with_template("  watchdog: holding {msg} [{bar:30}] {pos}/{len} s")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    progress.set_message(format!("{locks} locks"));
    while started.elapsed() < hold {
        tokio::time::sleep(Duration::from_secs(1).min(hold.saturating_sub(started.elapsed())))
            .await;
        progress.set_position(started.elapsed().as_secs());
    }
    progress.finish_and_clear();
    let held_for = started.elapsed().as_secs_f64();
    let after = server.info_commandstats().await?;
    let delta = |name: &str| {
        after
            .get(name)
            .copied()
            .unwrap_or(0)
            .saturating_sub(before.get(name).copied().unwrap_or(0))
    };
    // Commands sent to Redis: the renewal scripts (and a reload after NOSCRIPT, if any).
    // commandstats also counts the calls a script makes inside Redis; those are reported
    // apart, since a timer per lock would run the same per-lock operations.
    let sent = delta("evalsha") + delta("eval") + delta("script|load");
    let inside_scripts: u64 = after
        .keys()
        .filter(|name| !matches!(name.as_str(), "evalsha" | "eval" | "script|load" | "info"))
        .map(|name| delta(name))
        .sum();
    let commands_per_sec = sent as f64 / held_for;

    let lost = guards.iter().filter(|guard| guard.is_lost()).count();
    let released = release_all(guards).await?;
    let per_lock_timer = locks as f64 / (watchdog_timeout.as_secs_f64() / 3.0);
    Ok(Report {
        scenario: "watchdog",
        result: figure("renewal commands sent/s", commands_per_sec, ""),
        baseline: figure("a timer per lock would send", per_lock_timer, "cmd/s"),
        ratio: commands_per_sec / per_lock_timer,
        target: format!("<= {TARGET_COMMANDS_PER_SEC} cmd/s"),
        met: commands_per_sec <= TARGET_COMMANDS_PER_SEC
            && bytes_per_lock <= TARGET_BYTES_PER_LOCK
            && lost == 0
            && released == locks,
        details: vec![
            figure("locks held", locks as f64, ""),
            figure(
                "operations inside the scripts (per lock: TYPE, HEXISTS, PEXPIRE)",
                inside_scripts as f64 / held_for,
                "ops/s",
            ),
            figure("held for", held_for, "s"),
            checked(
                "client memory per held lock",
                bytes_per_lock,
                "bytes",
                format!("<= {TARGET_BYTES_PER_LOCK} bytes"),
                bytes_per_lock <= TARGET_BYTES_PER_LOCK,
            ),
            checked(
                "locks lost while held",
                lost as f64,
                "",
                "= 0".into(),
                lost == 0,
            ),
            checked(
                "locks released afterwards",
                released as f64,
                "",
                format!("= {locks}"),
                released == locks,
            ),
        ],
    })
}

async fn acquire_all(client: &Client, locks: usize) -> BenchResult<Vec<LockGuard>> {
    let per_task = locks.div_ceil(ACQUIRING_TASKS);
    let tasks: Vec<_> = (0..ACQUIRING_TASKS)
        .map(|task| {
            let client = client.clone();
            tokio::spawn(async move {
                let mut guards = Vec::new();
                for n in (task * per_task)..((task + 1) * per_task).min(locks) {
                    guards.push(client.lock(format!("bench:watchdog:{n}"))?.lock().await?);
                }
                Ok::<_, distlock::Error>(guards)
            })
        })
        .collect();
    let mut guards = Vec::with_capacity(locks);
    for task in tasks {
        guards.extend(task.await??);
    }
    Ok(guards)
}

async fn release_all(guards: Vec<LockGuard>) -> BenchResult<usize> {
    let releases = futures_util::future::join_all(guards.into_iter().map(LockGuard::release));
    Ok(releases.await.into_iter().filter(Result::is_ok).count())
}

/// This process's resident memory, from /proc/self/statm.
fn resident_bytes() -> BenchResult<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .ok_or("unexpected /proc/self/statm")?
        .parse()?;
    Ok(pages * 4096)
}
