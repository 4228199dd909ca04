//! The client's validated settings, and the setting types every layer reads: a leaf that
//! imports nothing of the crate but its errors' neighbours, so the transport, the engine
//! and the primitives can all take what they need from it.

use std::sync::Arc;
use std::time::Duration;

/// How many times a release or a re-entry is sent when the reply is lost to a broken
/// connection or a timeout. The unlock latch and absolute hold counts make repeats safe.
pub(crate) const RELEASE_ATTEMPTS: u32 = 3;

/// Pause before repeating a release, times the attempt number.
pub(crate) const RELEASE_RETRY_PAUSE: Duration = Duration::from_millis(25);

/// Certificates for TLS connections: a private CA, a client certificate.
#[cfg(feature = "tls")]
pub(crate) type Certificates = redis::TlsCertificates;

/// Without TLS there are no certificates to hold.
#[cfg(not(feature = "tls"))]
#[derive(Clone, Debug)]
pub(crate) enum Certificates {}

/// Where a lock's fencing tokens come from.
///
/// Tokens must strictly increase per lock name. A counter per name does that, but leaves
/// one key behind for every name ever locked: per-request lock names then grow Redis
/// forever. A counter per Redis Cluster hash slot does it too (a name's tokens come from
/// one counter that only goes up), with at most 16,384 keys whatever the number of names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FencingCounter {
    /// One counter per hash slot, `distlock_fence:{<tag>}`, where `<tag>` is a short string
    /// in the same slot as the lock name (so scripts stay single-slot on a cluster).
    /// Tokens of names that share a slot interleave, with gaps per name. The default.
    #[default]
    PerSlot,
    /// One counter per lock name, `redisson_lock_token:{<name>}`, as Redisson's
    /// `RFencedLock`. Choose it to share tokens with Redisson; every name locked leaves
    /// its counter behind.
    PerName,
}

/// Validated settings, shared by the client's background tasks.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) watchdog_timeout: Duration,
    pub(crate) watchdog_timeout_ms: u64,
    pub(crate) connection_timeout: Duration,
    pub(crate) response_timeout: Duration,
    pub(crate) unlock_latch_ttl_ms: u64,
    pub(crate) renew_batch_size: usize,
    pub(crate) fencing_counter: FencingCounter,
    /// Put before every key and channel the client writes (see `keys`); empty by default.
    pub(crate) key_prefix: Arc<str>,
    /// For every TLS connection: cluster nodes and sentinels are connected to long after
    /// the builder is gone.
    #[cfg_attr(not(any(feature = "cluster", feature = "sentinel")), allow(dead_code))]
    pub(crate) tls_certificates: Option<Certificates>,
}

impl Config {
    /// How long one release may keep retrying after lost replies: each attempt waits up to
    /// the response timeout, with a growing pause between attempts. The unlock latch must
    /// outlive it, and the last handle on a client waits this long for pending releases.
    pub(crate) fn release_window(&self) -> Duration {
        release_window(self.response_timeout)
    }
}

pub(crate) fn release_window(response_timeout: Duration) -> Duration {
    let pauses: Duration = (1..RELEASE_ATTEMPTS).map(|n| RELEASE_RETRY_PAUSE * n).sum();
    response_timeout
        .saturating_mul(RELEASE_ATTEMPTS)
        .saturating_add(pauses)
}
