//! The machine is shared: before each round, the stores scenario waits (a while) for the
//! other processes' load to drop, and says how busy the machine was.

use std::time::Duration;

/// A round starts once the machine was less busy than this share of its CPU time over
/// the last second, or after [`PATIENCE`] at the latest.
pub const QUIET: f64 = 0.25;
const PATIENCE: Duration = Duration::from_secs(30);
const WINDOW: Duration = Duration::from_secs(1);

/// Busy and total jiffies of all CPUs so far (the first line of /proc/stat).
fn jiffies() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|field| field.parse().ok())
        .collect();
    let total: u64 = fields.iter().take(8).sum();
    // idle and iowait are not busy.
    let idle = fields.get(3)? + fields.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// The busy share of the machine's CPU time over [`WINDOW`]; 0 where /proc/stat is not.
async fn busy() -> f64 {
    let before = jiffies();
    tokio::time::sleep(WINDOW).await;
    match (before, jiffies()) {
        (Some((busy0, total0)), Some((busy1, total1))) if total1 > total0 => {
            (busy1 - busy0) as f64 / (total1 - total0) as f64
        }
        _ => 0.0,
    }
}

/// Waits until the machine was less than [`QUIET`] busy for a second, or [`PATIENCE`]
/// has passed; returns the last share seen and how long it waited.
pub async fn wait() -> (f64, Duration) {
    let started = tokio::time::Instant::now();
    loop {
        let share = busy().await;
        if share < QUIET || started.elapsed() >= PATIENCE {
            return (share, started.elapsed().saturating_sub(WINDOW));
        }
    }
}
