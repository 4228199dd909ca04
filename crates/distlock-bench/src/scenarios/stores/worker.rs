//! The stores scenario's worker processes: this binary again, started with
//! `--stores-worker`. Two kinds:
//!
//! - `contend`: a few tasks take turns on one lock (hold 1 ms, think 2 ms, as in the
//!   contended and fair scenarios) from a wall-clock start time the parent gives, and
//!   print one JSON line per hold, timed by the wall clock that every process of the
//!   machine shares;
//! - `hold`: takes one lock, prints `HELD <token>`, and waits to be killed.

use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::subject::{Locker, Subject};
use crate::scenarios::BenchResult;

/// What a worker process does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    Contend,
    Hold,
}

pub const HOLD: Duration = Duration::from_millis(1);
pub const THINK: Duration = Duration::from_millis(2);

/// The lock the contending tasks share.
pub const CONTENDED: &str = "bench:stores:contended";
/// The lock the killed holder holds.
pub const KILLED: &str = "bench:stores:killed";

/// One hold, as a worker reports it: wall-clock nanoseconds since the epoch.
#[derive(Debug, Serialize, Deserialize)]
pub struct Hold {
    pub task: usize,
    pub wait_started: u64,
    pub acquired: u64,
    pub release_started: u64,
    pub token: u64,
}

pub fn wall_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|since| u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Holds the worker, yielding to other tasks, until `length` has passed: tokio's timer
/// would round a 1 ms sleep up to about 2 ms (see the contended scenario).
async fn busy_hold(length: Duration) {
    let until = tokio::time::Instant::now() + length;
    while tokio::time::Instant::now() < until {
        tokio::task::yield_now().await;
    }
}

/// What the parent tells a worker.
pub struct Orders<'a> {
    pub role: Role,
    pub subject: Subject,
    pub url: &'a str,
    pub first_task: usize,
    pub tasks: usize,
    pub start_ms: u64,
    pub length: Duration,
}

/// The worker's body.
pub async fn run(orders: Orders<'_>) -> BenchResult<()> {
    let locker = Locker::connect(orders.subject, orders.url).await?;
    match orders.role {
        Role::Hold => {
            let held = locker.lock(KILLED)?.acquire().await?;
            println!("HELD {}", held.token());
            std::future::pending::<()>().await;
            Ok(())
        }
        Role::Contend => {
            contend(&locker, &orders).await?;
            locker.shutdown().await;
            Ok(())
        }
    }
}

async fn contend(locker: &Locker, orders: &Orders<'_>) -> BenchResult<()> {
    let lock = locker.lock(CONTENDED)?;
    // Warm up: every task's first acquisition opens what it needs (pool connections, the
    // notification listener, the etcd peer's lease), before the timed start rather than
    // inside it. Each task keeps the lock it warmed up: a clone of the etcd peer's lock is
    // a new holder, with a lease of its own.
    let warm: Vec<_> = (0..orders.tasks)
        .map(|_| {
            let lock = lock.clone();
            tokio::spawn(async move {
                lock.acquire().await?.release().await?;
                BenchResult::Ok(lock)
            })
        })
        .collect();
    let mut locks = Vec::new();
    for task in warm {
        locks.push(task.await??);
    }
    let now_ms = wall_nanos() / 1_000_000;
    if now_ms > orders.start_ms {
        eprintln!(
            "stores worker ({}): ready {} ms after the start time",
            orders.subject.key(),
            now_ms - orders.start_ms
        );
    }
    tokio::time::sleep(Duration::from_millis(
        orders.start_ms.saturating_sub(now_ms),
    ))
    .await;
    let until = tokio::time::Instant::now() + orders.length;
    let workers: Vec<_> = locks
        .into_iter()
        .enumerate()
        .map(|(n, lock)| {
            let task = orders.first_task + n;
            tokio::spawn(async move {
                let mut holds = Vec::new();
                while tokio::time::Instant::now() < until {
                    let wait_started = wall_nanos();
                    let held = lock.acquire().await?;
                    let acquired = wall_nanos();
                    busy_hold(HOLD).await;
                    let release_started = wall_nanos();
                    let token = held.token();
                    held.release().await?;
                    holds.push(Hold {
                        task,
                        wait_started,
                        acquired,
                        release_started,
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
    Ok(())
}

/// Starts a worker process of this binary; its stdout is piped, stderr inherited, and it
/// is killed if dropped.
pub fn spawn(
    role: Role,
    subject: Subject,
    url: &str,
    first_task: usize,
    tasks: usize,
    start_ms: u64,
    length: Duration,
) -> BenchResult<Child> {
    let role = match role {
        Role::Contend => "contend",
        Role::Hold => "hold",
    };
    Ok(Command::new(std::env::current_exe()?)
        .args(["--stores-worker", role, "--worker-subject", subject.key()])
        .args(["--url", url])
        .args(["--worker-first-task", &first_task.to_string()])
        .args(["--worker-tasks", &tasks.to_string()])
        .args(["--worker-start-ms", &start_ms.to_string()])
        .args(["--secs", &length.as_secs_f64().to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()?)
}

/// Runs `processes` contending workers of `tasks_each` tasks, started together, and
/// returns their holds in acquisition order.
pub async fn contention(
    subject: Subject,
    url: &str,
    processes: usize,
    tasks_each: usize,
    length: Duration,
    start_after: Duration,
) -> BenchResult<Vec<Hold>> {
    let start_ms = (wall_nanos() / 1_000_000) + u64::try_from(start_after.as_millis())?;
    let mut children = Vec::new();
    for process in 0..processes {
        children.push(spawn(
            Role::Contend,
            subject,
            url,
            process * tasks_each,
            tasks_each,
            start_ms,
            length,
        )?);
    }
    let mut holds = Vec::new();
    for mut child in children {
        let stdout = child.stdout.take().ok_or("a worker has no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        while let Some(line) = lines.next_line().await? {
            holds.push(serde_json::from_str::<Hold>(&line)?);
        }
        let status = child.wait().await?;
        if !status.success() {
            return Err(format!("a {} worker failed: {status}", subject.key()).into());
        }
    }
    holds.sort_by_key(|hold| hold.acquired);
    Ok(holds)
}

/// Starts a holder process and waits until it holds [`KILLED`]; returns it, to be killed.
pub async fn holder(subject: Subject, url: &str) -> BenchResult<Child> {
    let mut child = spawn(Role::Hold, subject, url, 0, 1, 0, Duration::from_secs(1))?;
    let stdout = child.stdout.take().ok_or("the holder has no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let announced = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await? {
            if line.starts_with("HELD ") {
                return BenchResult::Ok(());
            }
        }
        Err("the holder exited before it held the lock".into())
    })
    .await;
    match announced {
        Ok(result) => result?,
        Err(_) => return Err("the holder did not take the lock within 30 s".into()),
    }
    Ok(child)
}
