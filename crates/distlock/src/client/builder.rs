//! The client's settings: [`ClientBuilder`], and the checks that turn it into a
//! [`Config`].

use std::time::Duration;

use crate::config::{release_window, Certificates, Config, FencingCounter};
use crate::duration::to_millis;
use crate::error::{Error, Result};
use crate::primitives::keys::validate_prefix;
use crate::transport::endpoint::mask_password;
use crate::transport::replica_sync::ReplicaSync;
use crate::transport::tls;

/// Settings of a [`Client`], validated when the client is built.
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    pub(super) watchdog_timeout: Duration,
    pub(super) connection_timeout: Duration,
    pub(super) response_timeout: Duration,
    /// `None`: the default, stretched to outlive the release's retries.
    pub(super) unlock_latch_ttl: Option<Duration>,
    pub(super) renew_batch_size: usize,
    pub(super) allow_eviction: bool,
    pub(super) fencing_counter: FencingCounter,
    pub(super) replica_sync: ReplicaSync,
    pub(super) tls_certificates: Option<Certificates>,
    pub(super) key_prefix: String,
}

/// The unlock latch's TTL unless set: comfortably past the default release window (3 s).
const DEFAULT_UNLOCK_LATCH_TTL: Duration = Duration::from_secs(10);

/// Most batches of the watchdog's renewal script stay far below this; the cap keeps one
/// script from blocking Redis for long when a process holds very many locks.
const MAX_RENEW_BATCH: usize = 1000;

impl Default for ClientBuilder {
    fn default() -> Self {
        Self {
            watchdog_timeout: Duration::from_secs(30),
            connection_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_millis(1000),
            unlock_latch_ttl: None,
            renew_batch_size: 200,
            allow_eviction: false,
            fencing_counter: FencingCounter::PerSlot,
            replica_sync: ReplicaSync::Auto,
            tls_certificates: None,
            key_prefix: String::new(),
        }
    }
}

impl ClientBuilder {
    /// The lease of locks taken in watchdog mode (the default), renewed every third of it
    /// while held. Default 30 s, as Redisson's `lockWatchdogTimeout`.
    ///
    /// A shorter timeout frees the lock of a crashed process sooner but needs Redis to
    /// answer renewals within a third of it.
    pub fn watchdog_timeout(mut self, timeout: Duration) -> Self {
        self.watchdog_timeout = timeout;
        self
    }

    /// How long connecting (and the first PING) may take. Default 2 s.
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// How long one command may wait for its reply before it fails. Default 1 s.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How long Redis keeps the answer of a release so that a retry after an ambiguous
    /// failure gets the same answer. It must exceed the release's retry window: three
    /// attempts, each waiting up to the response timeout. Default 10 s, or that window
    /// plus 10 s when a long response timeout makes it longer. The client deletes the
    /// answer as soon as it has read it, so this only bounds what a crash leaves.
    pub fn unlock_latch_ttl(mut self, ttl: Duration) -> Self {
        self.unlock_latch_ttl = Some(ttl);
        self
    }

    /// Connect even if the server may evict keys (a `maxmemory-policy` other than
    /// `noeviction`). Off by default, because eviction breaks the lock: a `volatile-*`
    /// policy evicts lock keys first (they are the keys with a TTL), handing the lock to
    /// another client while the holder still trusts it, and an `allkeys-*` policy can also
    /// evict the fencing counter, restarting tokens at 1. See docs/safety.md.
    pub fn allow_eviction(mut self, allow: bool) -> Self {
        self.allow_eviction = allow;
        self
    }

    /// Where fencing tokens come from; see [`FencingCounter`]. Default: one counter per
    /// hash slot, so the keys left behind stay bounded however many names are locked.
    pub fn fencing_counter(mut self, counter: FencingCounter) -> Self {
        self.fencing_counter = counter;
        self
    }

    /// Puts `prefix` before every key and channel the client writes: lock keys, release
    /// channels, fencing counters and unlock latches. One Redis can then serve several
    /// applications without their lock names meeting, and an ACL can grant one pattern
    /// (`~billing:* &billing:*`). Empty by default.
    ///
    /// The lock `orders` under the prefix `billing:` is the key `billing:orders`, so a
    /// Redisson client whose `NameMapper` adds the same prefix excludes it; but the helper
    /// keys and channel are prefixed too (`billing:redisson_lock__channel:{billing:orders}`),
    /// which Redisson's are not, so the two do not wake each other's waiters or share
    /// fencing tokens. Keep the default for a fleet shared with Redisson. For the same
    /// reason every distlock client of one application must use the same prefix: a
    /// prefixed client's `orders` and an unprefixed client's `billing:orders` are one key
    /// and exclude each other, but count tokens apart (both hand out token 1) and a
    /// waiter on one side sleeps until the other side's lease runs out. A prefix must
    /// not contain `{` or `}` ([`Error::InvalidConfig`]), which would change the Cluster
    /// slot of every key.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = distlock_testkit::RedisServer::start().await?;
    /// # let url = server.url();
    /// let billing = distlock::ClientBuilder::default().key_prefix("billing:").connect(&url).await?;
    /// let guard = billing.lock("orders")?.lock().await?;
    /// assert_eq!(guard.name(), "orders");
    /// guard.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// Whether each acquisition, renewal and release waits until replicas have it, so a
    /// failover to a replica cannot lose a held lock. Default [`ReplicaSync::Auto`]: on
    /// (one replica, within 1 s) once the master has a replica connected, at connect or
    /// at a check every 5 s after it. An acquisition no replica acknowledged is given
    /// back: `try_lock` fails with [`Error::NotReplicated`], a waiting call tries again.
    /// On a Redis Cluster it is decided per shard: `Auto` waits for a replica where the
    /// cluster lists one for the lock's shard, and an explicit setting waits for its count
    /// on every shard. See docs/deployment.md for what each choice costs.
    pub fn replica_sync(mut self, sync: ReplicaSync) -> Self {
        self.replica_sync = sync;
        self
    }

    /// Certificates for TLS deployments (`rediss://`, `rediss+cluster://`,
    /// `rediss+sentinel://`): a root certificate to trust instead of the built-in web roots
    /// (a private CA), and a client certificate for servers that ask for one
    /// (`tls-auth-clients yes`). They apply to every connection the client opens: each
    /// cluster node, the sentinels, and the master they name, through failovers.
    ///
    /// A URL without TLS is refused while they are set ([`Error::InvalidConfig`]) rather
    /// than connected to in clear, and so are certificates that do not parse as PEM.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let certificates = distlock::redis::TlsCertificates {
    ///     client_tls: None,
    ///     root_cert: Some(std::fs::read("/etc/redis/ca.crt")?),
    /// };
    /// let client = distlock::ClientBuilder::default()
    ///     .tls_certificates(certificates)
    ///     .connect("rediss+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster")
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "tls")]
    pub fn tls_certificates(mut self, certificates: redis::TlsCertificates) -> Self {
        self.tls_certificates = Some(certificates);
        self
    }

    /// `info` with the builder's TLS certificates, if any: they need a TLS address.
    pub(super) fn with_certificates(
        &self,
        info: redis::ConnectionInfo,
    ) -> Result<redis::ConnectionInfo> {
        let Some(certificates) = &self.tls_certificates else {
            return Ok(info);
        };
        let address = mask_password(&info.addr().to_string());
        tls::with_certificates(info, certificates).map_err(|err| Error::InvalidConfig {
            what: "TLS certificates",
            reason: format!("cannot be used for {address}: {err}"),
        })
    }

    /// How many locks one renewal script extends. Default 200; at most 1000.
    pub fn renew_batch_size(mut self, size: usize) -> Self {
        self.renew_batch_size = size;
        self
    }

    pub(super) fn validate(&self) -> Result<Config> {
        let watchdog_timeout_ms = to_millis("watchdog timeout", self.watchdog_timeout)?;
        if watchdog_timeout_ms < 30 {
            return Err(Error::InvalidDuration {
                what: "watchdog timeout",
                reason: "must be at least 30 ms, to renew every third of it".into(),
            });
        }
        if let Some(certificates) = &self.tls_certificates {
            tls::check(certificates)?;
        }
        validate_prefix(&self.key_prefix)?;
        to_millis("connection timeout", self.connection_timeout)?;
        to_millis("response timeout", self.response_timeout)?;
        let response_timeout = self.response_timeout;
        let unlock_latch_ttl = self.unlock_latch_ttl.unwrap_or_else(|| {
            let window = release_window(response_timeout);
            if window < DEFAULT_UNLOCK_LATCH_TTL {
                DEFAULT_UNLOCK_LATCH_TTL
            } else {
                window.saturating_add(DEFAULT_UNLOCK_LATCH_TTL)
            }
        });
        let unlock_latch_ttl_ms = to_millis("unlock latch ttl", unlock_latch_ttl)?;
        if !(1..=MAX_RENEW_BATCH).contains(&self.renew_batch_size) {
            return Err(Error::InvalidConfig {
                what: "renew batch size",
                reason: format!("{} is outside 1..={MAX_RENEW_BATCH}", self.renew_batch_size),
            });
        }
        let config = Config {
            watchdog_timeout: self.watchdog_timeout,
            watchdog_timeout_ms,
            connection_timeout: self.connection_timeout,
            response_timeout: self.response_timeout,
            unlock_latch_ttl_ms,
            renew_batch_size: self.renew_batch_size,
            fencing_counter: self.fencing_counter,
            tls_certificates: self.tls_certificates.clone(),
            key_prefix: self.key_prefix.as_str().into(),
        };
        let window = config.release_window();
        if unlock_latch_ttl <= window {
            return Err(Error::InvalidConfig {
                what: "unlock latch ttl",
                reason: format!(
                    "{:?} does not outlive a release's retries ({window:?} with a {:?} \
                     response timeout): a retried release could read no answer",
                    unlock_latch_ttl, self.response_timeout
                ),
            });
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_bad_settings() {
        let cases = [
            ClientBuilder::default().unlock_latch_ttl(Duration::from_secs(3)),
            ClientBuilder::default().watchdog_timeout(Duration::ZERO),
            ClientBuilder::default().watchdog_timeout(Duration::from_millis(10)),
            ClientBuilder::default().response_timeout(Duration::MAX),
            ClientBuilder::default().renew_batch_size(0),
            ClientBuilder::default().renew_batch_size(MAX_RENEW_BATCH + 1),
        ];
        for builder in cases {
            assert!(builder.validate().is_err(), "{builder:?} should be refused");
        }
        assert!(ClientBuilder::default().validate().is_ok());
    }
}
