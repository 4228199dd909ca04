//! The read-write lock under the loads the issue names, against the lease lock in the
//! same run:
//!
//! - **reads**: 64 tasks of one client take a read hold and give it back, as fast as they
//!   can; the lease lock under the same 64 tasks is the baseline (it lets one in at a
//!   time, where reads share);
//! - **a writer under a steady read load**: 16 tasks keep reading (hold 1 ms, back at
//!   once) while one writer asks for the write hold every 20 ms; how long it waits, with
//!   and without writer preference.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{BenchResult, Plan};
use crate::report::{figure, Report};
use crate::stats::{median, Latencies};

const READERS: usize = 64;
const STEADY_READERS: usize = 16;
const READ_HOLD: Duration = Duration::from_millis(1);
const WRITER_EVERY: Duration = Duration::from_millis(20);

/// Holds per second of 64 tasks looping on `take`.
async fn loop_rate<F, Fut>(length: Duration, take: F) -> BenchResult<f64>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = BenchResult<()>> + Send,
{
    let take = Arc::new(take);
    let until = Instant::now() + length;
    let started = Instant::now();
    let tasks: Vec<_> = (0..READERS)
        .map(|_| {
            let take = Arc::clone(&take);
            tokio::spawn(async move {
                let mut count = 0u64;
                while Instant::now() < until {
                    take().await?;
                    count += 1;
                }
                BenchResult::Ok(count)
            })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await??;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

/// How long one writer waits, each time it asks, while 16 tasks keep reading.
async fn writer_waits(rw: distlock::RwLock, length: Duration) -> BenchResult<Latencies> {
    let until = Instant::now() + length;
    let readers: Vec<_> = (0..STEADY_READERS)
        .map(|_| {
            let rw = rw.clone();
            tokio::spawn(async move {
                while Instant::now() < until {
                    let guard = rw.read().await?;
                    tokio::time::sleep(READ_HOLD).await;
                    guard.release().await?;
                }
                BenchResult::Ok(())
            })
        })
        .collect();
    let mut waits = Latencies::new();
    while Instant::now() < until {
        tokio::time::sleep(WRITER_EVERY).await;
        let asked = Instant::now();
        let guard = rw.write().await?;
        waits.record(asked.elapsed());
        guard.release().await?;
    }
    for reader in readers {
        reader.await??;
    }
    Ok(waits)
}

pub async fn run(client: &distlock::Client, plan: Plan) -> BenchResult<Vec<Report>> {
    let (mut reads, mut locks) = (Vec::new(), Vec::new());
    let (mut plain_p50, mut plain_max, mut preferred_p50, mut preferred_max) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..plan.runs {
        let rw = client.rw_lock("bench:rw")?;
        reads.push(
            loop_rate(plan.length, move || {
                let rw = rw.clone();
                async move { Ok(rw.read().await?.release().await.map(|_| ())?) }
            })
            .await?,
        );
        let lock = client.lock("bench:rw-baseline")?;
        locks.push(
            loop_rate(plan.length, move || {
                let lock = lock.clone();
                async move { Ok(lock.lock().await?.release().await.map(|_| ())?) }
            })
            .await?,
        );
        let plain = writer_waits(client.rw_lock("bench:rw-writer")?, plan.length).await?;
        plain_p50.push(plain.micros(0.5));
        plain_max.push(plain.max_micros());
        let preferred = writer_waits(
            client.rw_lock("bench:rw-writer-pref")?.prefer_writers(true),
            plan.length,
        )
        .await?;
        preferred_p50.push(preferred.micros(0.5));
        preferred_max.push(preferred.max_micros());
    }
    let (read_rate, lock_rate) = (median(&reads), median(&locks));
    Ok(vec![
        Report {
            scenario: "rw-reads",
            result: figure("read holds/s (64 tasks)", read_rate, ""),
            baseline: figure("lease lock, same 64 tasks", lock_rate, "acq/s"),
            ratio: read_rate / lock_rate,
            target: "readers share: above 1".into(),
            met: read_rate > lock_rate,
            details: vec![],
        },
        Report {
            scenario: "rw-writer",
            result: figure(
                "writer wait p50 under 16 readers, writer preference",
                median(&preferred_p50),
                "µs",
            ),
            baseline: figure("without writer preference", median(&plain_p50), "µs"),
            ratio: median(&preferred_p50) / median(&plain_p50),
            target: "reported".into(),
            met: true,
            details: vec![
                figure(
                    "writer wait max, writer preference",
                    median(&preferred_max),
                    "µs",
                ),
                figure("writer wait max, without", median(&plain_max), "µs"),
            ],
        },
    ])
}
