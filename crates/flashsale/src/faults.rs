//! Hidden test hooks, never set in production: each is read once from the environment.
//!
//! - `FLASHSALE_FAULT_STOP_AT=POINT[,POINT…]`: the process stops itself (SIGSTOP) the first
//!   time it reaches each named point, as a pause at the worst moment would, and waits for
//!   a SIGCONT (or a SIGKILL) from outside. The points are [`WORKER_COMMIT`],
//!   [`STOPPING`], [`RELEASE`] and [`TAKEN_OVER`].
//! - `FLASHSALE_TEST_CLOCK_SKEW_MS=N`: this process's wall clock ([`crate::model::now_millis`])
//!   reads N ms ahead (or behind, for a negative N), as a host whose clock is off would.

use std::collections::HashSet;
use std::sync::{LazyLock, Mutex, PoisonError};

/// The order worker holds a batch it read and is about to store it.
pub const WORKER_COMMIT: &str = "worker-commit";
/// A take-over has committed in SQL and not yet touched its Redis.
pub const TAKEN_OVER: &str = "taken-over";
/// A stopping instance has drained its orders and is about to leave the store's beats.
pub const STOPPING: &str = "stopping";
/// A stopping instance has checked that it may release the store and is about to.
pub const RELEASE: &str = "release";

/// The points still armed: each fires once.
static ARMED: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(|| {
    let points = std::env::var("FLASHSALE_FAULT_STOP_AT").unwrap_or_default();
    Mutex::new(
        points
            .split(',')
            .map(|point| point.trim().to_owned())
            .filter(|point| !point.is_empty())
            .collect(),
    )
});

static CLOCK_SKEW_MS: LazyLock<i64> = LazyLock::new(|| {
    std::env::var("FLASHSALE_TEST_CLOCK_SKEW_MS")
        .ok()
        .and_then(|skew| skew.trim().parse().ok())
        .unwrap_or(0)
});

/// Stops this process here if `point` is armed, the first time only.
pub(crate) fn stop_at(point: &str) {
    let fire = ARMED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(point);
    if !fire {
        return;
    }
    tracing::warn!(point, "fault hook: stopping this process");
    if let Err(err) = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP) {
        tracing::error!(error = %err, "fault hook: could not stop this process");
    }
}

/// How far this process's wall clock is skewed, in ms (0 unless the hook is set).
pub(crate) fn clock_skew_ms() -> i64 {
    *CLOCK_SKEW_MS
}
