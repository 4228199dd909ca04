//! The `distlock` command's whole-process cost: the wall time of `distlock run NAME --
//! true` from spawn to exit, against `flock -n FILE true` (the local lock ops teams use)
//! and a bare `redis-cli SET NX` (one process, one round trip to the same server), all
//! spawned and waited for the same way, interleaved in the same rounds. `distlock status`
//! (connect, read, exit) shows what connecting costs.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::time::Instant;

use super::BenchResult;
use crate::report::{checked, figure, Report};
use crate::stats::median;

/// Spawns of each command per round.
const SPAWNS: usize = 30;

/// What `distlock run` may add over a bare `redis-cli SET NX`: "a few milliseconds".
pub const TARGET_EXTRA_MS: f64 = 5.0;

/// The `distlock` binary: built beside this one (`cargo build --release -p distlock-cli`,
/// which `./dev bench` does).
fn distlock_binary() -> BenchResult<PathBuf> {
    let here = std::env::current_exe()?;
    let binary = here.with_file_name("distlock");
    if !binary.exists() {
        return Err(format!(
            "{} is missing: build it with cargo build --release -p distlock-cli",
            binary.display()
        )
        .into());
    }
    Ok(binary)
}

/// The wall time of one run of `program args…`, from spawn to exit.
async fn timed(program: &PathBuf, args: &[String], url: &str) -> BenchResult<Duration> {
    let started = Instant::now();
    let status = tokio::process::Command::new(program)
        .args(args)
        .env("REDIS_URL", url)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await?;
    let took = started.elapsed();
    if !status.success() {
        return Err(format!("{} {args:?} exited with {status}", program.display()).into());
    }
    Ok(took)
}

pub async fn run(url: &str, port: u16, runs: usize) -> BenchResult<Report> {
    let distlock = distlock_binary()?;
    let dir = std::env::temp_dir().join(format!("distlock-bench-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let flock_file = dir.join("lock");
    let which = |name: &str| -> BenchResult<PathBuf> {
        std::env::var_os("PATH")
            .and_then(|path| {
                std::env::split_paths(&path)
                    .map(|dir| dir.join(name))
                    .find(|candidate| candidate.exists())
            })
            .ok_or_else(|| format!("{name} is not on PATH").into())
    };
    let commands: [(&str, PathBuf, Vec<String>); 4] = [
        (
            "distlock run -- true",
            distlock.clone(),
            ["run", "bench:cli", "--", "true"]
                .map(String::from)
                .to_vec(),
        ),
        (
            "flock -n FILE true",
            which("flock")?,
            vec!["-n".into(), flock_file.display().to_string(), "true".into()],
        ),
        (
            "redis-cli SET NX",
            which("redis-cli")?,
            [
                "-p",
                &port.to_string(),
                "SET",
                "bench:cli:nx",
                "1",
                "NX",
                "PX",
                "1",
            ]
            .map(String::from)
            .to_vec(),
        ),
        (
            "distlock status",
            distlock,
            ["status", "bench:cli"].map(String::from).to_vec(),
        ),
    ];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); commands.len()];
    for _ in 0..runs.max(1) {
        for _ in 0..SPAWNS {
            for (index, (_, program, args)) in commands.iter().enumerate() {
                let took = timed(program, args, url).await?;
                times[index].push(took.as_secs_f64() * 1e3);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let medians: Vec<f64> = times.iter().map(|samples| median(samples)).collect();
    let (run, flock, redis_cli, status) = (medians[0], medians[1], medians[2], medians[3]);
    let extra = run - redis_cli;
    Ok(Report {
        scenario: "cli",
        result: figure("distlock run -- true, wall p50", run, "ms"),
        baseline: figure("redis-cli SET NX, wall p50", redis_cli, "ms"),
        ratio: redis_cli / run,
        target: format!("≤ {TARGET_EXTRA_MS} ms over redis-cli"),
        met: extra <= TARGET_EXTRA_MS,
        details: vec![
            checked(
                "distlock run over redis-cli",
                extra,
                "ms",
                format!("<= {TARGET_EXTRA_MS}"),
                extra <= TARGET_EXTRA_MS,
            ),
            figure("flock -n FILE true, wall p50", flock, "ms"),
            figure("distlock run ÷ flock", run / flock, "x"),
            figure(
                "distlock status (connect, read, exit), wall p50",
                status,
                "ms",
            ),
            figure("spawns of each command", times[0].len() as f64, "runs"),
        ],
    })
}
