//! The client: one connection, one watchdog and one subscriber per process, shared by every
//! lock.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::AsyncConnectionConfig;
use tokio_util::sync::CancellationToken;

#[cfg(feature = "cluster")]
use crate::cluster_link::{ClusterLink, Topology};
use crate::connection::{Connection, Link, RedisConnection};
#[cfg(feature = "cluster")]
use crate::deployment::cluster_client;
use crate::deployment::{
    mask_password, parse_endpoint, shorten_for_errors, Deployment, Endpoint, SentinelSpec, Servers,
};
use crate::duration::to_millis;
use crate::engine::latches::Latches;
use crate::engine::subscriptions::Subscriptions;
use crate::engine::watchdog::Watchdog;
use crate::error::{Error, Result};
use crate::eviction::EvictionWatch;
use crate::keys::{validate_name, validate_prefix, FencingCounter};
use crate::lock::{Lock, RELEASE_ATTEMPTS, RELEASE_RETRY_PAUSE};
use crate::replica_sync::{
    self, ReplicaSync, Resolved, SyncPolicy, SyncSlot, SyncedWrites, AUTO_RECHECK,
};
use crate::runtime::Background;
use crate::scripts;
#[cfg(feature = "sentinel")]
use crate::sentinel::{FailoverLink, SentinelMaster};
use crate::tls;

/// Settings of a [`Client`], validated when the client is built.
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    watchdog_timeout: Duration,
    connection_timeout: Duration,
    response_timeout: Duration,
    /// `None`: the default, stretched to outlive the release's retries.
    unlock_latch_ttl: Option<Duration>,
    renew_batch_size: usize,
    allow_eviction: bool,
    fencing_counter: FencingCounter,
    replica_sync: ReplicaSync,
    tls_certificates: Option<tls::Certificates>,
    key_prefix: String,
}

/// The unlock latch's TTL unless set: comfortably past the default release window (3 s).
const DEFAULT_UNLOCK_LATCH_TTL: Duration = Duration::from_secs(10);

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
    pub(crate) tls_certificates: Option<tls::Certificates>,
}

impl Config {
    /// How long one release may keep retrying after lost replies: each attempt waits up to
    /// the response timeout, with a growing pause between attempts. The unlock latch must
    /// outlive it, and the last handle on a client waits this long for pending releases.
    pub(crate) fn release_window(&self) -> Duration {
        release_window(self.response_timeout)
    }
}

fn release_window(response_timeout: Duration) -> Duration {
    let pauses: Duration = (1..RELEASE_ATTEMPTS).map(|n| RELEASE_RETRY_PAUSE * n).sum();
    response_timeout
        .saturating_mul(RELEASE_ATTEMPTS)
        .saturating_add(pauses)
}

/// Most batches of the watchdog's renewal script stay far below this; the cap keeps one
/// script from blocking Redis for long when a process holds very many locks.
const MAX_RENEW_BATCH: usize = 1000;

/// How many cluster seeds are asked at the same time while connecting: enough that a few
/// silent ones do not hold up a live one, few enough that a long seed list does not open
/// hundreds of sockets at once.
const SEEDS_PROBED_AT_ONCE: usize = 8;

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
    /// let billing = distlock::Client::builder().key_prefix("billing:").connect(&url).await?;
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
    /// let client = distlock::Client::builder()
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
    fn with_certificates(&self, info: redis::ConnectionInfo) -> Result<redis::ConnectionInfo> {
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

    fn validate(&self) -> Result<Config> {
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

    /// Connects to the deployment at `url` and checks that it answers like Redis:
    ///
    /// - `redis://[user:password@]host[:port][/db]`, or `rediss://` for TLS: one server.
    ///   If it is a Redis Cluster node, the client connects to the whole cluster with it
    ///   as the seed.
    /// - `redis+cluster://[user:password@]host1:port1,host2:port2[/db]` (or
    ///   `rediss+cluster://`): a Redis Cluster, by its seed nodes.
    /// - `redis+sentinel://[user:password@]host1:port1,host2:port2/service[/db]` (or
    ///   `rediss+sentinel://`): the master that the sentinels name for `service`,
    ///   followed through failovers.
    ///
    /// The connections reconnect by themselves after a failure. The lock API is the same
    /// whatever the deployment.
    pub async fn connect(self, url: &str) -> Result<Client> {
        match parse_endpoint(url)? {
            Endpoint::Single(single) => {
                if single.starts_with("rediss:") {
                    // Said here: without TLS, redis-rs refuses the URL without naming
                    // the feature that would take it.
                    tls::prepare(&mask_password(url), true)?;
                }
                let info = redis::IntoConnectionInfo::into_connection_info(single.as_str())
                    .map_err(|err| Error::InvalidUrl {
                        url: mask_password(url),
                        reason: err.to_string(),
                    })?;
                let redis_client =
                    redis::Client::open(self.with_certificates(info)?).map_err(|err| {
                        Error::InvalidUrl {
                            url: mask_password(url),
                            reason: err.to_string(),
                        }
                    })?;
                self.connect_with(redis_client).await
            }
            Endpoint::Cluster(seeds) => self.connect_cluster(seeds).await,
            Endpoint::Sentinel(spec) => self.connect_sentinel(spec).await,
        }
    }

    /// Connects through a `redis::Client` the caller configured, for settings a URL
    /// cannot carry, such as a custom DNS resolver. A cluster node is joined as the seed
    /// of its cluster, as by [`ClientBuilder::connect`].
    ///
    /// For TLS with your own root certificate or a client certificate, prefer
    /// [`ClientBuilder::tls_certificates`]: certificates given to the builder reach every
    /// node of a cluster, while those built into `redis_client`
    /// (`redis::Client::build_with_tls`) reach only that server. When both are given, the
    /// builder's are used.
    pub async fn connect_with(self, redis_client: redis::Client) -> Result<Client> {
        let config = self.validate()?;
        let redis_client = match self.tls_certificates {
            None => redis_client,
            Some(_) => redis::Client::open(
                self.with_certificates(redis_client.get_connection_info().clone())?,
            )
            .map_err(|err| Error::InvalidConfig {
                what: "TLS certificates",
                reason: err.to_string(),
            })?,
        };
        let target = describe_target(&redis_client);
        tls::prepare(&target, tls::is_tls(redis_client.get_connection_info()))?;
        let facts = probe(&redis_client, &config, &target).await?;
        if facts.cluster {
            tracing::info!(%target, "the server is a cluster node; connecting to its cluster");
            let seeds = vec![redis_client.get_connection_info().clone()];
            return self.start_cluster(config, seeds, target, facts).await;
        }
        let background = Background::start()?;
        let home = match home_runtime() {
            Some(_) => Some(
                open_manager(&redis_client, &config)
                    .await
                    .map_err(|source| Error::Connect {
                        target: target.clone(),
                        source,
                    })?,
            ),
            None => None,
        };
        let connection = background_connection(&background, &redis_client, &config, home)
            .await
            .map_err(|source| Error::Connect {
                target: target.clone(),
                source,
            })?;
        scripts::preload(&connection)
            .await
            .map_err(|source| Error::Connect {
                target: target.clone(),
                source,
            })?;
        self.finish(Connected {
            config,
            servers: Servers::Standalone(redis_client),
            connection,
            background,
            deployment: Deployment::Standalone,
            checked_at: target.clone(),
            target,
        })
        .await
    }

    /// Connects to a Redis Cluster through any of `seeds` (`redis://host:port` URLs, all
    /// with the same credentials and TLS mode): the first that answers gives the topology.
    ///
    /// On the cluster, each script goes to the node that owns its lock's slot (every key
    /// of one lock shares a slot), redirections during resharding (MOVED, ASK, TRYAGAIN)
    /// are followed within the response timeout, and waiters listen with sharded pub/sub
    /// (SSUBSCRIBE) on Redis 7, classic pub/sub before it.
    pub async fn connect_cluster<S: AsRef<str>>(
        self,
        seeds: impl IntoIterator<Item = S>,
    ) -> Result<Client> {
        let config = self.validate()?;
        if !cfg!(feature = "cluster") {
            return Err(without_cluster("redis+cluster://…".to_owned()));
        }
        let mut infos = Vec::new();
        for seed in seeds {
            let seed = seed.as_ref();
            let info = redis::IntoConnectionInfo::into_connection_info(seed).map_err(|err| {
                Error::InvalidUrl {
                    url: mask_password(seed),
                    reason: err.to_string(),
                }
            })?;
            infos.push(self.with_certificates(info)?);
        }
        if infos.is_empty() {
            return Err(Error::InvalidUrl {
                url: String::new(),
                reason: "a cluster needs at least one seed node".into(),
            });
        }
        if let Some(seed) = infos.iter().find(|info| tls::is_tls(info)) {
            tls::prepare(&mask_password(&seed.addr().to_string()), true)?;
        }
        // The first seed that answers is enough: the cluster client learns the rest.
        // Seeds are asked a few at a time, and the whole search is bounded by the
        // connection timeout: asked one by one, N silent seeds took N timeouts.
        let probes: Vec<_> = infos
            .iter()
            .cloned()
            .map(|seed| probe_seed(seed, &config))
            .collect();
        let mut probes = futures_util::stream::iter(probes).buffer_unordered(SEEDS_PROBED_AT_ONCE);
        let search = async {
            let mut failure = None;
            while let Some(outcome) = probes.next().await {
                match outcome {
                    Ok(found) => return Ok(found),
                    Err(err) => {
                        tracing::warn!(error = %err, "cluster seed did not answer");
                        failure = Some(err);
                    }
                }
            }
            Err(failure)
        };
        let seeds_named = infos
            .iter()
            .map(|info| info.addr().to_string())
            .collect::<Vec<_>>()
            .join(",");
        match tokio::time::timeout(config.connection_timeout, search).await {
            Ok(Ok((target, facts))) => {
                drop(probes);
                if !facts.cluster {
                    tracing::warn!(%target, "a seed does not report cluster mode; connecting as a cluster anyway");
                }
                self.start_cluster(config, infos, target, facts).await
            }
            Ok(Err(Some(failure))) => Err(failure),
            Ok(Err(None)) => Err(Error::InvalidUrl {
                url: String::new(),
                reason: "a cluster needs at least one seed node".into(),
            }),
            Err(_) => Err(Error::ConnectTimeout {
                target: shorten_for_errors(format!("cluster seeds {seeds_named}")),
                after: config.connection_timeout,
            }),
        }
    }

    /// Connects to the master a set of sentinels names, and follows it through failovers:
    /// after a broken connection or a READONLY reply, the next command asks the sentinels
    /// again. Waiters' pub/sub follows too.
    #[cfg(feature = "sentinel")]
    async fn connect_sentinel(self, spec: SentinelSpec) -> Result<Client> {
        let config = self.validate()?;
        let sentinels = spec
            .sentinels
            .iter()
            .map(|url| mask_password(url))
            .collect::<Vec<_>>()
            .join(",");
        let target = shorten_for_errors(format!(
            "master {:?} of sentinels {sentinels}",
            spec.service
        ));
        tls::prepare(&target, spec.tls)?;
        if config.tls_certificates.is_some() && !spec.tls {
            return Err(Error::InvalidConfig {
                what: "TLS certificates",
                reason: format!(
                    "{target} is not a TLS deployment: use rediss+sentinel:// to connect \
                     with them"
                ),
            });
        }
        let sentinel_master = SentinelMaster::new(
            spec,
            config.connection_timeout,
            config.tls_certificates.clone(),
        );
        let (_, master) = sentinel_master
            .find_at_connect()
            .await
            .map_err(|source| match source.kind() {
                redis::ErrorKind::Io if source.is_timeout() => Error::ConnectTimeout {
                    target: target.clone(),
                    after: config.connection_timeout,
                },
                _ => Error::Connect {
                    target: target.clone(),
                    source,
                },
            })?;
        let master_target = describe_target(&master);
        probe(&master, &config, &master_target).await?;
        let connect_error = |source| Error::Connect {
            target: target.clone(),
            source,
        };
        let background = Background::start()?;
        let home = match home_runtime() {
            Some(_) => Some(Link::Sentinel(
                FailoverLink::connect(sentinel_master.clone(), config.response_timeout)
                    .await
                    .map_err(connect_error)?,
            )),
            None => None,
        };
        let opening = {
            let (sentinel_master, response_timeout) =
                (sentinel_master.clone(), config.response_timeout);
            background.handle().spawn(async move {
                FailoverLink::connect(sentinel_master, response_timeout).await
            })
        };
        let own = opening
            .await
            .map_err(|err| {
                connect_error(redis::RedisError::from(std::io::Error::other(format!(
                    "the client's runtime stopped while connecting: {err}"
                ))))
            })?
            .map_err(connect_error)?;
        let connection = Connection::new(
            home_runtime().zip(home),
            Link::Sentinel(own),
            background.handle().clone(),
        );
        scripts::preload(&connection).await.map_err(connect_error)?;
        self.finish(Connected {
            config,
            servers: Servers::Sentinel(sentinel_master),
            connection,
            background,
            deployment: Deployment::Standalone,
            checked_at: master_target.clone(),
            target,
        })
        .await
    }

    /// Built without the `sentinel` feature: a Sentinel URL is refused.
    #[cfg(not(feature = "sentinel"))]
    async fn connect_sentinel(self, spec: SentinelSpec) -> Result<Client> {
        Err(Error::InvalidUrl {
            url: format!("redis+sentinel://…/{}", spec.service),
            reason: "a Sentinel deployment, but distlock was built without its `sentinel` \
                     feature"
                .into(),
        })
    }

    #[cfg(feature = "cluster")]
    async fn start_cluster(
        self,
        config: Config,
        seeds: Vec<redis::ConnectionInfo>,
        target: String,
        facts: ServerFacts,
    ) -> Result<Client> {
        let connect_error = |source| Error::Connect {
            target: target.clone(),
            source,
        };
        let sharded_pubsub = facts.major_version >= 7;
        let servers = Servers::Cluster {
            seeds,
            topology: Topology::new(),
            sharded: sharded_pubsub,
            config: config.clone(),
        };
        let background = Background::start()?;
        let home = match home_runtime() {
            Some(_) => Some(
                servers
                    .open(&config, config.response_timeout)
                    .await
                    .map_err(connect_error)?,
            ),
            None => None,
        };
        let own = servers
            .open_on(background.handle(), &config, config.response_timeout)
            .await?;
        let connection = own.with_home(home_runtime().zip(home));
        scripts::preload(&connection).await.map_err(connect_error)?;
        self.finish(Connected {
            config,
            servers,
            connection,
            background,
            deployment: Deployment::Cluster { sharded_pubsub },
            checked_at: target.clone(),
            target,
        })
        .await
    }

    /// Built without the `cluster` feature: a Redis Cluster is refused.
    #[cfg(not(feature = "cluster"))]
    async fn start_cluster(
        self,
        _config: Config,
        _seeds: Vec<redis::ConnectionInfo>,
        target: String,
        _facts: ServerFacts,
    ) -> Result<Client> {
        Err(without_cluster(target))
    }

    /// Builds a client on a connection the caller already has. Calls made on the runtime
    /// that calls this go through it, if that is a multi-thread runtime; on a
    /// current-thread runtime the connection is not used, and every call goes through the
    /// client's own runtime (a connection driven by a current-thread runtime stalls
    /// whenever that runtime's thread blocks).
    ///
    /// `redis_client` must point at the same server: the client's own runtime opens two
    /// connections from it, one for its background work (renewals, the releases of dropped
    /// guards, calls from other runtimes) and one for pub/sub, opened on first wait.
    pub async fn with_connection(
        self,
        redis_client: redis::Client,
        connection: impl Into<RedisConnection>,
    ) -> Result<Client> {
        let config = self.validate()?;
        let target = describe_target(&redis_client);
        tls::prepare(&target, tls::is_tls(redis_client.get_connection_info()))?;
        let background = Background::start()?;
        let connection =
            background_connection(&background, &redis_client, &config, Some(connection.into()))
                .await
                .map_err(|source| Error::Connect {
                    target: target.clone(),
                    source,
                })?;
        if let Err(err) = scripts::preload(&connection).await {
            // Not fatal: each script is loaded again on first use.
            tracing::warn!(error = %err, "could not preload distlock's scripts");
        }
        self.finish(Connected {
            config,
            servers: Servers::Standalone(redis_client),
            connection,
            background,
            deployment: Deployment::Standalone,
            checked_at: target.clone(),
            target,
        })
        .await
    }
}

/// A client's connections, before the last checks.
struct Connected {
    config: Config,
    servers: Servers,
    connection: Connection,
    background: Background,
    deployment: Deployment,
    /// Where the connection goes (the master, for Sentinel), for the eviction check.
    checked_at: String,
    /// How the client names its deployment in errors.
    target: String,
}

impl ClientBuilder {
    /// The checks every deployment gets (eviction policy, replica sync), then the client.
    async fn finish(self, connected: Connected) -> Result<Client> {
        let eviction = EvictionWatch::check_at_connect(
            &connected.connection,
            &connected.checked_at,
            self.allow_eviction,
        )
        .await?;
        let synced = synced_writes(
            self.replica_sync,
            &connected.connection,
            &connected.servers,
            &connected.config,
            &connected.background,
            connected.deployment.is_cluster(),
        )
        .await?;
        Ok(Client::start(connected, synced, eviction))
    }
}

/// The refusal of a Redis Cluster by a build without the `cluster` feature.
fn without_cluster(url: String) -> Error {
    Error::InvalidUrl {
        url,
        reason: "a Redis Cluster, but distlock was built without its `cluster` feature".into(),
    }
}

/// Asks one cluster seed what it is: the seed as a target for messages, and its facts.
async fn probe_seed(seed: redis::ConnectionInfo, config: &Config) -> Result<(String, ServerFacts)> {
    let url = seed.addr().to_string();
    let probe_client = redis::Client::open(seed).map_err(|err| Error::InvalidUrl {
        url,
        reason: err.to_string(),
    })?;
    let target = describe_target(&probe_client);
    let facts = probe(&probe_client, config, &target).await?;
    Ok((target, facts))
}

fn manager_config(config: &Config) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(config.connection_timeout))
        .set_response_timeout(Some(config.response_timeout))
}

impl Servers {
    /// A new connection to the client's servers whose replies may take
    /// `response_timeout`, driven on the runtime this is called on.
    async fn open(&self, config: &Config, response_timeout: Duration) -> redis::RedisResult<Link> {
        match self {
            Servers::Standalone(redis_client) => {
                let manager = ConnectionManager::new_with_config(
                    redis_client.clone(),
                    manager_config(config).set_response_timeout(Some(response_timeout)),
                )
                .await?;
                Ok(RedisConnection::Manager(manager).into())
            }
            #[cfg(feature = "sentinel")]
            Servers::Sentinel(master) => Ok(Link::Sentinel(
                FailoverLink::connect(master.clone(), response_timeout).await?,
            )),
            #[cfg(feature = "cluster")]
            Servers::Cluster {
                seeds, topology, ..
            } => {
                let config = Config {
                    response_timeout,
                    ..config.clone()
                };
                let cluster = cluster_client(seeds, &config, None)?;
                let fallback = cluster.get_async_connection().await?;
                // Every seed carries the same credentials, database and TLS mode.
                let template = seeds.first().cloned().ok_or_else(|| {
                    redis::RedisError::from((
                        redis::ErrorKind::InvalidClientConfig,
                        "a cluster needs at least one seed",
                    ))
                })?;
                let direct = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(config.connection_timeout))
                    .set_response_timeout(Some(response_timeout));
                Ok(Link::Cluster(
                    ClusterLink::new(
                        fallback,
                        template,
                        direct,
                        response_timeout,
                        Arc::clone(topology),
                    )
                    .await,
                ))
            }
        }
    }

    /// [`Servers::open`] on the client's own runtime, so that the connection (and its
    /// reconnects) never depends on the caller's.
    async fn open_on(
        &self,
        runtime: &tokio::runtime::Handle,
        config: &Config,
        response_timeout: Duration,
    ) -> Result<Connection> {
        let opening = {
            let (servers, config) = (self.clone(), config.clone());
            runtime.spawn(async move { servers.open(&config, response_timeout).await })
        };
        let link = opening
            .await
            .map_err(|err| Error::Runtime(std::io::Error::other(err.to_string())))??;
        Ok(Connection::new(None, link, runtime.clone()))
    }
}

/// Settles replica sync and, when it is on, opens the connections synced writes use.
/// Under [`ReplicaSync::Auto`], a master with no replica yet is asked again every
/// [`AUTO_RECHECK`] by a service on the client's runtime, which turns sync on once one
/// has attached.
async fn synced_writes(
    setting: ReplicaSync,
    connection: &Connection,
    servers: &Servers,
    config: &Config,
    background: &Background,
    cluster: bool,
) -> Result<SyncSlot> {
    let slot = SyncSlot::default();
    match replica_sync::resolve(setting, connection, cluster).await? {
        Resolved::Off => {}
        Resolved::On(policy) => {
            let writes = open_synced_writes(policy, servers, config, background.handle()).await?;
            let _ = slot.set(writes);
        }
        Resolved::NoReplicaYet => {
            let (slot, connection, servers, config) = (
                slot.clone(),
                connection.clone(),
                servers.clone(),
                config.clone(),
            );
            let runtime = background.handle().clone();
            background.spawn_service(async move {
                watch_for_a_replica(slot, connection, servers, config, runtime).await;
            });
        }
    }
    Ok(slot)
}

/// Asks the master every [`AUTO_RECHECK`] whether a replica has attached, and turns
/// replica sync on when one has. Runs until then, or until the client shuts down.
async fn watch_for_a_replica(
    slot: SyncSlot,
    connection: Connection,
    servers: Servers,
    config: Config,
    runtime: tokio::runtime::Handle,
) {
    loop {
        tokio::time::sleep(AUTO_RECHECK).await;
        let policy = match replica_sync::resolve(ReplicaSync::Auto, &connection, false).await {
            Ok(Resolved::On(policy)) => policy,
            Ok(Resolved::NoReplicaYet) => continue,
            Ok(Resolved::Off) => return,
            Err(err) => {
                tracing::debug!(error = %err, "could not ask the master about replicas");
                continue;
            }
        };
        match open_synced_writes(policy, &servers, &config, &runtime).await {
            Ok(writes) => {
                let _ = slot.set(writes);
                return;
            }
            Err(err) => {
                tracing::warn!(error = %err, "a replica attached, but the connections for synced writes did not open; trying again");
            }
        }
    }
}

/// The connections synced writes use: on the client's own runtime, each allowed the WAIT
/// on top of a normal reply.
async fn open_synced_writes(
    policy: SyncPolicy,
    servers: &Servers,
    config: &Config,
    runtime: &tokio::runtime::Handle,
) -> Result<SyncedWrites> {
    let response_timeout = config.response_timeout.saturating_add(policy.timeout);
    let mut connections = Vec::new();
    for _ in 0..SyncedWrites::pool_size() {
        connections.push(servers.open_on(runtime, config, response_timeout).await?);
    }
    tracing::info!(
        replicas = policy.replicas,
        timeout = ?policy.timeout,
        "replica sync is on: lock writes wait for replicas"
    );
    SyncedWrites::new(policy, connections).ok_or(Error::InvalidConfig {
        what: "replica sync",
        reason: "no connection for synced writes".into(),
    })
}

async fn open_manager(
    redis_client: &redis::Client,
    config: &Config,
) -> redis::RedisResult<RedisConnection> {
    ConnectionManager::new_with_config(redis_client.clone(), manager_config(config))
        .await
        .map(RedisConnection::Manager)
}

/// Opens the background connection on the client's own runtime (so that its driver, and
/// every reconnect, runs there) and pairs it with `home`, the connection of the runtime
/// that is connecting.
async fn background_connection(
    background: &Background,
    redis_client: &redis::Client,
    config: &Config,
    home: Option<RedisConnection>,
) -> redis::RedisResult<Connection> {
    let opening = {
        let redis_client = redis_client.clone();
        let config = config.clone();
        background
            .handle()
            .spawn(async move { open_manager(&redis_client, &config).await })
    };
    let own = opening.await.map_err(|err| {
        redis::RedisError::from(std::io::Error::other(format!(
            "the client's runtime stopped while connecting: {err}"
        )))
    })??;
    let home = home_runtime().zip(home);
    Ok(Connection::new(
        home.map(|(id, link)| (id, link.into())),
        own.into(),
        background.handle().clone(),
    ))
}

/// The runtime a client may keep a fast connection on: the caller's, if it is a
/// multi-thread runtime. Such a runtime drives its connections on any free worker, so a
/// call cancelled there and finished on the client's runtime still gets its reply, and it
/// either runs or is shut down (which fails its calls at once).
///
/// A current-thread runtime is driven only while its one thread sits in `block_on`. A
/// connection driven there stalls whenever that thread blocks (synchronous work after a
/// cancelled release, `Handle::block_on` from another thread), and with it every call in
/// flight on it, even calls the client has taken over. Calls from such a runtime are
/// therefore all handed to the client's own runtime, at the cost of a thread hop (about
/// 18 µs a call on the test VM).
fn home_runtime() -> Option<tokio::runtime::Id> {
    let runtime = tokio::runtime::Handle::try_current().ok()?;
    (runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread).then(|| runtime.id())
}

/// Opens one short-lived connection and PINGs, so that a bad address, a refused
/// handshake or a server that is not Redis is reported at `connect` with its real cause
/// rather than as a later command failure.
///
/// The same connection asks INFO what kind of server it is (a cluster node, which
/// version); a server that will not say (INFO refused by an ACL, a proxy) is taken for a
/// standalone server of unknown version.
async fn probe(client: &redis::Client, config: &Config, target: &str) -> Result<ServerFacts> {
    let probe_config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(config.connection_timeout))
        .set_response_timeout(Some(config.connection_timeout));
    let mut facts = ServerFacts::default();
    let attempt = async {
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&probe_config)
            .await?;
        let pong = redis::cmd("PING").query_async::<String>(&mut conn).await?;
        if let Ok(info) = redis::cmd("INFO").query_async::<String>(&mut conn).await {
            facts = ServerFacts::from_info(&info);
        }
        Ok::<_, redis::RedisError>(pong)
    };
    let outcome = tokio::time::timeout(config.connection_timeout, attempt)
        .await
        .map_err(|_| Error::ConnectTimeout {
            target: target.to_owned(),
            after: config.connection_timeout,
        })?;
    match outcome {
        Ok(reply) if reply == "PONG" => Ok(facts),
        Ok(reply) => Err(Error::NotRedis {
            target: target.to_owned(),
            detail: format!("PING answered {reply:?}"),
        }),
        Err(err) if err.is_timeout() => Err(Error::ConnectTimeout {
            target: target.to_owned(),
            after: config.connection_timeout,
        }),
        Err(err)
            if err.is_io_error()
                || matches!(
                    err.kind(),
                    redis::ErrorKind::AuthenticationFailed | redis::ErrorKind::Server(_)
                ) =>
        {
            Err(Error::Connect {
                target: target.to_owned(),
                source: err,
            })
        }
        Err(err) => Err(Error::NotRedis {
            target: target.to_owned(),
            detail: err.to_string(),
        }),
    }
}

/// What the probe learned about the server.
#[derive(Debug, Default, Clone, Copy)]
struct ServerFacts {
    /// `cluster_enabled:1`: a Redis Cluster node.
    cluster: bool,
    /// The major version, 0 when unknown (it decides sharded pub/sub on a cluster).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    major_version: u32,
}

impl ServerFacts {
    fn from_info(info: &str) -> Self {
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.trim_end().strip_prefix(name)?.strip_prefix(':'))
        };
        let major_version = field("redis_version")
            .and_then(|version| version.split('.').next()?.parse().ok())
            .unwrap_or(0);
        Self {
            cluster: field("cluster_enabled") == Some("1"),
            major_version,
        }
    }
}

fn describe_target(client: &redis::Client) -> String {
    client.get_connection_info().addr().to_string()
}

/// A handle on one Redis deployment, shared by every lock of a process.
///
/// Cloning is cheap: clones share one command connection, one pub/sub connection (opened on
/// the first wait), and one watchdog task that renews every held lock in batches.
///
/// Each client has a random id (a UUID from the OS's CSPRNG); lock owners are
/// `"<client id>:<n>"`, n counting its acquisitions, as Redisson's are
/// `"<uuid>:<thread id>"`.
///
/// Each client runs a thread of its own with a small tokio runtime, where its background
/// work happens (renewals, pub/sub, the releases of dropped guards), so it works from any
/// runtime and never depends on the caller's. Call [`Client::shutdown`] on a graceful exit;
/// dropping the last handle does the same.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = distlock_testkit::RedisServer::start().await?;
/// # let url = server.url();
/// use std::time::Duration;
///
/// // `url` is e.g. "redis://user:password@127.0.0.1:6379/0", or "rediss://…" for TLS.
/// let client = distlock::Client::builder()
///     .watchdog_timeout(Duration::from_secs(10))
///     .connect(&url)
///     .await?;
/// let guard = client.lock("invoices")?.lock().await?;
/// println!("token {}", guard.fencing_token());
/// guard.release().await?;
///
/// // Bad input is a typed error, not a panic.
/// assert!(matches!(client.lock(""), Err(distlock::Error::InvalidName { .. })));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
}

/// The handles' shared part: when the last handle (client, lock or guard) is gone, it
/// stops the client's runtime, after the releases already started have been sent.
struct ClientInner {
    core: Arc<Core>,
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        self.core.close();
        self.core
            .background
            .shutdown_blocking(self.core.config.release_window());
    }
}

/// What the engine and the background work need. Background tasks hold this, never a
/// [`Client`], so that they do not keep the client's runtime from stopping.
pub(crate) struct Core {
    id: String,
    /// Numbers owners: each acquisition is `"<client id>:<n>"`, n never reused.
    owners: AtomicU64,
    /// Numbers release requests; with the client id it names their unlock latches.
    requests: AtomicU64,
    connection: Connection,
    config: Config,
    subscriptions: Subscriptions,
    watchdog: Watchdog,
    latches: Latches,
    background: Background,
    deployment: Deployment,
    /// Where the client connected (`host:port` of the server or first cluster seed): names
    /// the node in errors, and orders locks of one name on different deployments.
    target: String,
    /// Where lock writes go when they wait for replicas (empty while replica sync is off).
    synced: SyncSlot,
    /// How to reach the servers again, for connections of their own.
    servers: Servers,
    /// Whether the server may evict keys, as last checked.
    eviction: Arc<EvictionWatch>,
    /// Cancelled when the client starts shutting down: new calls fail, waiters stop.
    closing: CancellationToken,
}

/// `"<client id>:r<n>"`, written wherever it is displayed.
struct RequestId<'a> {
    client: &'a str,
    n: u64,
}

impl fmt::Display for RequestId<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:r{}", self.client, self.n)
    }
}

/// Room for an owner id on the stack: a 36-character UUID, a colon and a `u64`.
struct OwnerBuf {
    bytes: [u8; 64],
    len: usize,
}

impl Default for OwnerBuf {
    fn default() -> Self {
        Self {
            bytes: [0; 64],
            len: 0,
        }
    }
}

impl OwnerBuf {
    fn filled(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl fmt::Write for OwnerBuf {
    fn write_str(&mut self, text: &str) -> fmt::Result {
        let end = self.len + text.len();
        let room = self.bytes.get_mut(self.len..end).ok_or(fmt::Error)?;
        room.copy_from_slice(text.as_bytes());
        self.len = end;
        Ok(())
    }
}

impl Core {
    /// A new owner, never used before by any client: this client's id and a number.
    pub(crate) fn next_owner(&self) -> Arc<str> {
        // Starts at 1 and stays far below i64::MAX, which Redisson parses thread ids as.
        let n = self.owners.fetch_add(1, Ordering::Relaxed) + 1;
        // Formatted on the stack and copied once into the Arc: one allocation per
        // acquisition attempt instead of two.
        let mut owner = OwnerBuf::default();
        let formatted = fmt::write(&mut owner, format_args!("{}:{n}", self.id));
        match (formatted, std::str::from_utf8(owner.filled())) {
            (Ok(()), Ok(owner)) => Arc::from(owner),
            _ => format!("{}:{n}", self.id).into(),
        }
    }

    /// A request id unique across all clients: this client's id and a sequence number.
    /// Displayed, not allocated: it is written straight into the key that carries it.
    pub(crate) fn next_request_id(&self) -> impl fmt::Display + '_ {
        let n = self.requests.fetch_add(1, Ordering::Relaxed);
        RequestId {
            client: &self.id,
            n,
        }
    }

    /// Fails once the client is shut down: its background work no longer runs, so a new
    /// holding would never be renewed.
    pub(crate) fn ensure_open(&self) -> Result<()> {
        if self.closing.is_cancelled() {
            return Err(Error::Shutdown);
        }
        Ok(())
    }

    /// Fails while the server is known to evict keys (see [`EvictionWatch`]): nothing new
    /// is acquired where its key could be evicted.
    pub(crate) fn ensure_keys_stay(&self) -> Result<()> {
        self.eviction.ensure_safe()
    }

    /// Cancelled once the client starts shutting down.
    pub(crate) fn closing(&self) -> &CancellationToken {
        &self.closing
    }

    /// Starts shutting down: every new call fails with [`Error::Shutdown`], waiters stop
    /// waiting, and every live holding is marked lost, because nothing will renew it.
    fn close(&self) {
        self.closing.cancel();
        self.watchdog.close();
    }

    pub(crate) fn connection(&self) -> Connection {
        self.connection.clone()
    }

    /// [`Core::request`] for a single command.
    pub(crate) async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T> {
        self.request(|mut connection| async move { cmd.query_async(&mut connection).await })
            .await
    }

    /// Sends one request for a caller, through `send`, once more if the connection was
    /// found dropped: a server restarted since the connection's last use fails the first
    /// request on it, and that failure is what reopens it. Only for requests that are
    /// harmless to repeat.
    pub(crate) async fn request<T, F, Fut>(&self, send: F) -> Result<T>
    where
        F: Fn(Connection) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        self.ensure_open()?;
        match send(self.connection()).await {
            Err(err) if err.is_connection_dropped() => {
                tracing::debug!(error = %err, "connection was dropped; sending once more");
                Ok(send(self.connection()).await?)
            }
            other => Ok(other?),
        }
    }

    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    pub(crate) fn subscriptions(&self) -> &Subscriptions {
        &self.subscriptions
    }

    pub(crate) fn watchdog(&self) -> &Watchdog {
        &self.watchdog
    }

    pub(crate) fn latches(&self) -> &Latches {
        &self.latches
    }

    pub(crate) fn background(&self) -> &Background {
        &self.background
    }

    pub(crate) fn deployment(&self) -> Deployment {
        self.deployment
    }

    pub(crate) fn target(&self) -> &str {
        &self.target
    }

    /// The synced-write connections and policy, when replica sync is on.
    pub(crate) fn synced(&self) -> Option<&SyncedWrites> {
        self.synced.get()
    }
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("id", &self.inner.core.id)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Connects with the default settings; see [`ClientBuilder::connect`].
    pub async fn connect(url: &str) -> Result<Client> {
        Self::builder().connect(url).await
    }

    /// Starts configuring a client.
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    fn start(connected: Connected, synced: SyncSlot, eviction: EvictionWatch) -> Client {
        let Connected {
            config,
            servers,
            connection,
            background,
            deployment,
            target,
            ..
        } = connected;
        let eviction = Arc::new(eviction);
        eviction.keep_checking(connection.clone(), &background);
        let watchdog = Watchdog::start(
            connection.clone(),
            &config,
            &background,
            deployment,
            synced.clone(),
        );
        let subscriptions = Subscriptions::new(
            servers.clone(),
            config.connection_timeout,
            background.handle().clone(),
            background.stopping().clone(),
        );
        let latches = Latches::new(connection.clone(), deployment.is_cluster());
        Client {
            inner: Arc::new(ClientInner {
                core: Arc::new(Core {
                    id: uuid::Uuid::new_v4().to_string(),
                    owners: AtomicU64::new(0),
                    requests: AtomicU64::new(0),
                    connection,
                    config,
                    subscriptions,
                    watchdog,
                    latches,
                    background,
                    deployment,
                    target,
                    synced,
                    servers,
                    eviction,
                    closing: CancellationToken::new(),
                }),
            }),
        }
    }

    /// This client's random id, the first half of every owner it writes.
    pub fn id(&self) -> &str {
        &self.inner.core.id
    }

    /// A handle on the lock called `name`. Nothing is sent to Redis until it is used.
    ///
    /// The name is the Redis key of the lock, exactly as given (after the client's
    /// [key prefix](ClientBuilder::key_prefix), if it has one), so a Redisson `RLock` of
    /// the same name excludes this one.
    pub fn lock(&self, name: impl Into<String>) -> Result<Lock> {
        let name = name.into();
        validate_name(&name)?;
        let prefix = &self.inner.core.config.key_prefix;
        if prefix.is_empty() {
            return Ok(Lock::new(self.clone(), name));
        }
        let key = format!("{prefix}{name}");
        validate_name(&key)?;
        Ok(Lock::new(self.clone(), key))
    }

    /// A clone of the command connection, for callers that want to run their own commands
    /// on the same server (a fenced write, say). It works from any runtime, like the
    /// client, and fails once the client has shut down. Like any redis-rs connection
    /// manager, it reconnects after a failure, but the first command after the server
    /// restarted may fail with a broken pipe: send it again.
    pub fn connection(&self) -> Connection {
        let core = &self.inner.core;
        core.connection.refusing_after(&core.closing)
    }

    /// Opens a connection of its own to this client's deployment (the same server, the
    /// master the sentinels name, or the cluster), for commands that block their
    /// connection on the server, such as `XREADGROUP … BLOCK` or `BLPOP`: on the shared
    /// [`Client::connection`] they would hold up every lock operation behind them.
    /// Replies may take `response_timeout`. The connection lives on the client's own
    /// runtime, works from any runtime, and fails once the client has shut down.
    pub async fn dedicated_connection(&self, response_timeout: Duration) -> Result<Connection> {
        let core = &self.inner.core;
        core.ensure_open()?;
        to_millis("response timeout", response_timeout)?;
        let connection = core
            .servers
            .open_on(core.background.handle(), &core.config, response_timeout)
            .await?;
        Ok(connection.refusing_after(&core.closing))
    }

    /// True if this client talks to a Redis Cluster: one command may then only carry
    /// keys of one hash slot.
    pub fn is_cluster(&self) -> bool {
        self.inner.core.deployment.is_cluster()
    }

    /// How many leases this client's watchdog tracks right now: one per holding that is
    /// still renewed or trusted (re-entries of a holding count once).
    pub fn tracked_leases(&self) -> usize {
        self.inner.core.watchdog.tracked()
    }

    /// For tests only: blocks the client's own runtime thread for `duration`, as a
    /// machine too busy to schedule it would. Not part of the API.
    #[doc(hidden)]
    pub fn stall_background_for_tests(&self, duration: Duration) {
        self.inner
            .core
            .background()
            .spawn(async move { std::thread::sleep(duration) });
    }

    /// Stops the client: waits for the releases of dropped guards and the lock operations
    /// in flight, then stops its background work (the watchdog, the pub/sub hub). Call it
    /// on a graceful exit.
    ///
    /// From the moment it is called:
    /// - acquisitions, re-entries and queries fail with [`Error::Shutdown`], and calls
    ///   waiting for a lock return that error at once;
    /// - nothing renews a live guard any more, so each one's lost signal fires at once
    ///   ([`LockGuard::lost`](crate::LockGuard::lost), `lost_token`, `is_lost`);
    /// - giving back still works: releasing or dropping a guard frees its lock, during
    ///   and after the shutdown, and an acquisition that completes after it gives its lock
    ///   back. A guard kept alive keeps its lock until its lease runs out.
    ///
    /// It waits at most a release's retry window (about 3 s by default), by the client's
    /// own clock, so it returns even if the runtime that connected is stalled. Dropping
    /// the last handle on a client (every clone, lock and guard) does the same. A client
    /// kept in a `static` is never dropped: call this before the program exits. The
    /// client's thread ends once nothing of the client is left.
    pub async fn shutdown(&self) {
        let core = &self.inner.core;
        core.close();
        core.background.shutdown(core.config.release_window()).await;
    }

    pub(crate) fn core(&self) -> &Arc<Core> {
        &self.inner.core
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(not(feature = "tls"))]
    #[tokio::test]
    async fn without_the_tls_feature_a_rediss_url_names_the_feature() {
        let err = Client::connect("rediss://127.0.0.1:1/").await.unwrap_err();
        assert!(matches!(err, Error::InvalidUrl { .. }), "{err}");
        assert!(err.to_string().contains("`tls` feature"), "{err}");
    }

    #[cfg(not(feature = "cluster"))]
    #[tokio::test]
    async fn without_the_cluster_feature_a_cluster_url_is_refused() {
        let err = Client::connect("redis+cluster://127.0.0.1:1,127.0.0.1:2")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidUrl { .. }), "{err}");
        assert!(err.to_string().contains("`cluster` feature"), "{err}");
    }

    #[cfg(not(feature = "sentinel"))]
    #[tokio::test]
    async fn without_the_sentinel_feature_a_sentinel_url_is_refused() {
        let err = Client::connect("redis+sentinel://127.0.0.1:1/mymaster")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidUrl { .. }), "{err}");
        assert!(err.to_string().contains("`sentinel` feature"), "{err}");
    }

    #[test]
    fn refuses_bad_settings() {
        let cases = [
            Client::builder().unlock_latch_ttl(Duration::from_secs(3)),
            Client::builder().watchdog_timeout(Duration::ZERO),
            Client::builder().watchdog_timeout(Duration::from_millis(10)),
            Client::builder().response_timeout(Duration::MAX),
            Client::builder().renew_batch_size(0),
            Client::builder().renew_batch_size(MAX_RENEW_BATCH + 1),
        ];
        for builder in cases {
            assert!(builder.validate().is_err(), "{builder:?} should be refused");
        }
        assert!(Client::builder().validate().is_ok());
    }
}
