//! What the engine tells the outside about acquisitions and leases: a tracing span per
//! acquisition (the primitive, its key, how long it waited, how it ended), an event when a
//! lease is lost, and, with the `metrics` feature, the same as metrics through the
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
    Acquired,
    Busy,
    Error,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Acquired => "acquired",
            Outcome::Busy => "busy",
            Outcome::Error => "error",
        }
    }
}

/// An acquisition of `primitive` on `key` ended as `outcome` after `waited`.
pub(crate) fn acquisition(primitive: &'static str, key: &str, waited: Duration, outcome: Outcome) {
    tracing::debug!(
        primitive,
        key,
        waited_ms = waited.as_secs_f64() * 1e3,
        outcome = outcome.as_str(),
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
