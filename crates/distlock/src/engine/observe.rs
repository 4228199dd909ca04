//! What the engine tells the outside about acquisitions and leases: a tracing span per
//! acquisition (`distlock.acquire`, debug level: the primitive and its key, then how long
//! it waited, how it ended and the fencing token it got, recorded when it ends, with an
//! event then too), and, with the `metrics` feature, the same as metrics through the
//! `metrics` facade, so a service can chart contention without wrapping every call:
//!
//! - `distlock_wait_seconds` (histogram; labels `primitive`, `outcome`): how long each
//!   acquisition waited, from the call to its end;
//! - `distlock_acquisitions_total` (counter; labels `primitive`, `outcome`): `acquired`,
//!   `busy` (nothing to be had in time) or `error`;
//! - `distlock_lost_total` (counter; label `lease`): leases found lost while held (a lock
//!   hold, a read hold, a permit).
//!
//! Labels carry the kind of primitive, never a key: a label per lock name would grow a
//! metric series per name.

use std::time::Duration;

/// How an acquisition ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Got it, with this fencing token when the primitive hands out tokens.
    Acquired {
        token: Option<u64>,
    },
    Busy,
    Error,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Acquired { .. } => "acquired",
            Outcome::Busy => "busy",
            Outcome::Error => "error",
        }
    }
}

/// The span an acquisition of `primitive` on `key` runs in: everything it logs (the
/// holding it starts, a reply it lost, a give-back) is inside it. `waited_ms`, `outcome`
/// and `token` are recorded when it ends.
pub(crate) fn acquisition_span(primitive: &'static str, key: &str) -> tracing::Span {
    tracing::debug_span!(
        "distlock.acquire",
        primitive,
        key,
        waited_ms = tracing::field::Empty,
        outcome = tracing::field::Empty,
        token = tracing::field::Empty,
    )
}

/// An acquisition of `primitive` on `key` ended as `outcome` after `waited`: recorded on
/// the current span (the acquisition's), and logged.
pub(crate) fn acquisition(primitive: &'static str, key: &str, waited: Duration, outcome: Outcome) {
    let waited_ms = waited.as_secs_f64() * 1e3;
    let span = tracing::Span::current();
    span.record("waited_ms", waited_ms);
    span.record("outcome", outcome.as_str());
    let token = match outcome {
        Outcome::Acquired { token } => token,
        _ => None,
    };
    if let Some(token) = token {
        span.record("token", token);
    }
    tracing::debug!(
        primitive,
        key,
        waited_ms,
        outcome = outcome.as_str(),
        token,
        "acquisition ended"
    );
    #[cfg(feature = "metrics")]
    {
        let labels = [("primitive", primitive), ("outcome", outcome.as_str())];
        metrics::histogram!("distlock_wait_seconds", &labels).record(waited.as_secs_f64());
        metrics::counter!("distlock_acquisitions_total", &labels).increment(1);
    }
}

/// A lease of `kind` was found lost while held.
pub(crate) fn lost(kind: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("distlock_lost_total", "lease" => kind).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = kind;
}
