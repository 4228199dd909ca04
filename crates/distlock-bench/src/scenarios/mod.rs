//! The benchmark scenarios. Each returns a [`Report`](crate::report::Report) whose figures
//! are medians over repeated runs, and whose ratio is taken against a baseline measured
//! in the same run.

pub mod contended;
pub mod parallel;
pub mod uncontended;
pub mod watchdog;

use std::time::Duration;

use distlock::Client;
use tokio::time::Instant;

use crate::stats::Latencies;

/// Settings shared by the throughput scenarios.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// How long each timed run lasts.
    pub length: Duration,
    /// How many times each run is repeated (the median is reported).
    pub runs: usize,
}

pub type BenchResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// `tasks` tasks, each on its own lock name (or all on one), acquire and release back to
/// back for `length`. Returns complete cycles per second and the cycle latencies.
pub async fn lock_cycles(
    client: &Client,
    names: &[String],
    length: Duration,
) -> BenchResult<(f64, Latencies)> {
    let started = Instant::now();
    let until = started + length;
    let tasks: Vec<_> = names
        .iter()
        .map(|name| {
            let lock = client.lock(name.clone());
            tokio::spawn(async move {
                let lock = lock?;
                let mut latencies = Latencies::new();
                while Instant::now() < until {
                    let cycle = Instant::now();
                    let guard = lock.lock().await?;
                    guard.release().await?;
                    latencies.record(cycle.elapsed());
                }
                Ok::<_, distlock::Error>(latencies)
            })
        })
        .collect();
    let mut all = Latencies::new();
    for task in tasks {
        all.merge(&task.await??);
    }
    Ok((all.len() as f64 / started.elapsed().as_secs_f64(), all))
}
