//! Baselines measured in the same run as the scenarios, on the same connection:
//!
//! - a no-op script: one EVALSHA round trip and nothing else (the baseline);
//! - distlock's own acquire and release scripts called raw, with none of the library
//!   around them: the difference to the library is what the library itself costs;
//! - a leaner layout's scripts, raw (a string lock with a fencing INCR, released by a
//!   compare-and-delete): what Redisson's layout costs the server, against the least a
//!   lock with fencing tokens and release messages could cost.

use std::sync::LazyLock;
use std::time::Duration;

use distlock::Connection;
use redis::{RedisError, Script};
use tokio::time::Instant;

use crate::stats::Latencies;

static NOOP: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/noop.lua")));
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("../../distlock/src/primitives/shared/fence.lua"),
        include_str!("../../distlock/src/primitives/lock/scripts/lock_acquire.lua")
    ))
});
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("../../distlock/src/primitives/shared/latch.lua"),
        include_str!("../../distlock/src/primitives/lock/scripts/lock_release.lua")
    ))
});

static LEAN_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/lean_acquire.lua")));
static LEAN_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/lean_release.lua")));

/// Which raw load a baseline task runs.
#[derive(Debug, Clone, Copy)]
pub enum Raw {
    /// One no-op EVALSHA per iteration.
    Noop,
    /// distlock's acquire then release script per iteration (a lock cycle, raw).
    LockScripts,
    /// The leaner layout's acquire then release per iteration (`scripts/lean_*.lua`).
    LeanScripts,
}

/// `callers` tasks run `raw` back to back on `connection` for `length`. Returns iterations
/// per second and the latency of each iteration.
pub async fn run(
    raw: Raw,
    connection: &Connection,
    callers: usize,
    length: Duration,
) -> Result<(f64, Latencies), RedisError> {
    let started = Instant::now();
    let until = started + length;
    let tasks: Vec<_> = (0..callers)
        .map(|caller| {
            let mut connection = connection.clone();
            tokio::spawn(async move {
                let keys = RawKeys::of(caller);
                let mut latencies = Latencies::new();
                let mut request = 0u64;
                while Instant::now() < until {
                    let sent = Instant::now();
                    request += 1;
                    one(raw, &mut connection, &keys, request).await?;
                    latencies.record(sent.elapsed());
                }
                Ok::<_, RedisError>(latencies)
            })
        })
        .collect();
    let mut all = Latencies::new();
    for task in tasks {
        let latencies = task
            .await
            .map_err(|err| RedisError::from(std::io::Error::other(err.to_string())))??;
        all.merge(&latencies);
    }
    Ok((all.len() as f64 / started.elapsed().as_secs_f64(), all))
}

/// How a raw cycle is spread over several masters.
#[derive(Debug, Clone, Copy)]
pub enum Fan {
    /// Each master runs its own acquire then release, all masters at once: a master's
    /// release may go while another's acquire is still out. No RedLock can do this (it
    /// must hear a majority before it holds anything), so it flatters the raw scripts.
    Chained,
    /// Every master's acquire at once, then, once all have answered, every master's
    /// release at once: the two rounds a RedLock makes, with no library around them.
    Phased,
}

/// One task runs `raw` back to back for `length`, each iteration on every connection at
/// once (as a RedLock asks its masters), spread as `fan` says. Returns iterations per
/// second and the latency of each iteration.
pub async fn run_across(
    raw: Raw,
    fan: Fan,
    connections: &[Connection],
    length: Duration,
) -> Result<(f64, Latencies), RedisError> {
    let mut connections = connections.to_vec();
    // In a task, as the lock's own cycles run: a future polled by `block_on` would have
    // each call handed to the client's thread.
    let task = tokio::spawn(async move {
        let started = Instant::now();
        let until = started + length;
        let keys = RawKeys::of(0);
        let mut latencies = Latencies::new();
        let mut request = 0u64;
        while Instant::now() < until {
            let sent = Instant::now();
            request += 1;
            let keys = &keys;
            match fan {
                Fan::Chained => {
                    futures_util::future::try_join_all(
                        connections
                            .iter_mut()
                            .map(|connection| one(raw, connection, keys, request)),
                    )
                    .await?;
                }
                Fan::Phased => {
                    futures_util::future::try_join_all(
                        connections
                            .iter_mut()
                            .map(|connection| acquire(raw, connection, keys)),
                    )
                    .await?;
                    futures_util::future::try_join_all(
                        connections
                            .iter_mut()
                            .map(|connection| release(raw, connection, keys, request)),
                    )
                    .await?;
                }
            }
            latencies.record(sent.elapsed());
        }
        let rate = latencies.len() as f64 / started.elapsed().as_secs_f64();
        Ok::<_, RedisError>((rate, latencies))
    });
    task.await
        .map_err(|err| RedisError::from(std::io::Error::other(err.to_string())))?
}

/// The keys one caller's raw cycles use, its own.
struct RawKeys {
    lock: String,
    token: String,
    /// The other fencing-counter setting's key, which every acquisition reads.
    other_token: String,
}

impl RawKeys {
    fn of(caller: usize) -> Self {
        Self {
            lock: format!("bench:raw:{caller}"),
            token: format!("bench:raw:{caller}:token"),
            other_token: format!("bench:raw:{caller}:other-token"),
        }
    }
}

/// One iteration of `raw`; `request` numbers the release's latch.
async fn one(
    raw: Raw,
    connection: &mut Connection,
    keys: &RawKeys,
    request: u64,
) -> Result<(), RedisError> {
    acquire(raw, connection, keys).await?;
    release(raw, connection, keys, request).await
}

/// The first call of an iteration of `raw`: the acquisition (the no-op's only call).
async fn acquire(raw: Raw, connection: &mut Connection, keys: &RawKeys) -> Result<(), RedisError> {
    match raw {
        Raw::Noop => {
            NOOP.prepare_invoke()
                .invoke_async::<i64>(connection)
                .await?;
        }
        Raw::LockScripts => {
            let token = ACQUIRE
                .key(&keys.lock)
                .key(&keys.token)
                .arg(30_000)
                .arg("bench:1")
                .arg(&keys.other_token)
                .invoke_async::<i64>(connection)
                .await?;
            answered("acquire", token >= 1)?;
        }
        Raw::LeanScripts => {
            let token = LEAN_ACQUIRE
                .key(&keys.lock)
                .key(&keys.token)
                .arg("bench:1")
                .arg(30_000)
                .invoke_async::<i64>(connection)
                .await?;
            answered("leaner acquire", token >= 1)?;
        }
    }
    Ok(())
}

/// The second call of an iteration of `raw`: the release (none for the no-op);
/// `request` numbers the release's latch.
async fn release(
    raw: Raw,
    connection: &mut Connection,
    keys: &RawKeys,
    request: u64,
) -> Result<(), RedisError> {
    match raw {
        Raw::Noop => {}
        Raw::LockScripts => {
            // A final release, as the lock sends it: channel and latch as keys; hold count
            // 0, lease, message, latch PX, first attempt.
            let left = RELEASE
                .key(&keys.lock)
                .key("bench:channel")
                .key(format!("{}:latch:{request}", keys.lock))
                .arg("bench:1")
                .arg(0)
                .arg(30_000)
                .arg("0")
                .arg(10_000)
                .arg("0")
                .invoke_async::<i64>(connection)
                .await?;
            answered("release", left == 0)?;
        }
        Raw::LeanScripts => {
            let freed = LEAN_RELEASE
                .key(&keys.lock)
                .key("bench:channel")
                .arg("bench:1")
                .arg("0")
                .invoke_async::<i64>(connection)
                .await?;
            answered("leaner release", freed == 1)?;
        }
    }
    Ok(())
}

/// A raw cycle must take and free its lock every time: a busy or "not held" answer would
/// count as a cycle done and flatter the baseline.
fn answered(call: &str, as_expected: bool) -> Result<(), RedisError> {
    if as_expected {
        return Ok(());
    }
    Err(RedisError::from(std::io::Error::other(format!(
        "a raw {call} did not answer as a free lock's would (a lock left held?)"
    ))))
}
