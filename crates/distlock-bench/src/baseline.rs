//! Baselines measured in the same run as the scenarios: raw EVALSHA round trips.

use std::sync::LazyLock;
use std::time::Duration;

use distlock::Connection;
use redis::Script;
use tokio::time::Instant;

use crate::stats::Latencies;

static NOOP: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/noop.lua")));

/// `callers` tasks call a no-op script back to back on `connection` for `length`.
/// Returns calls per second and the latency of each call.
pub async fn evalsha(
    connection: &Connection,
    callers: usize,
    length: Duration,
) -> Result<(f64, Latencies), redis::RedisError> {
    // Load it once so the timed loop is pure EVALSHA.
    NOOP.prepare_invoke()
        .invoke_async::<i64>(&mut connection.clone())
        .await?;
    let started = Instant::now();
    let until = started + length;
    let tasks: Vec<_> = (0..callers)
        .map(|_| {
            let mut connection = connection.clone();
            tokio::spawn(async move {
                let mut latencies = Latencies::new();
                while Instant::now() < until {
                    let sent = Instant::now();
                    NOOP.prepare_invoke()
                        .invoke_async::<i64>(&mut connection)
                        .await?;
                    latencies.record(sent.elapsed());
                }
                Ok::<_, redis::RedisError>(latencies)
            })
        })
        .collect();
    let mut all = Latencies::new();
    for task in tasks {
        let latencies = task
            .await
            .map_err(|err| redis::RedisError::from(std::io::Error::other(err.to_string())))??;
        all.merge(&latencies);
    }
    let rate = all.len() as f64 / started.elapsed().as_secs_f64();
    Ok((rate, all))
}
