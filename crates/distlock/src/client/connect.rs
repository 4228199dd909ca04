//! Connecting: each kind of deployment (one server, a Cluster by its seeds, a Sentinel
//! master), the checks every one gets (eviction policy, replica sync), and the assembly
//! of the session from the transport and the engine.

use std::sync::Arc;

use futures_util::StreamExt;

use super::builder::ClientBuilder;
use super::Client;
use crate::config::Config;
use crate::engine::latches::Latches;
use crate::engine::renewal::scheduler::Watchdog;
use crate::engine::session::{Core, Parts, Session};
use crate::engine::subscriptions::Subscriptions;
use crate::error::{Error, Result};
use crate::primitives;
use crate::runtime::Background;
#[cfg(feature = "cluster")]
use crate::transport::cluster::topology::Topology;
#[cfg(feature = "sentinel")]
use crate::transport::connection::Link;
use crate::transport::connection::{Connection, RedisConnection};
use crate::transport::deployment::Deployment;
use crate::transport::endpoint::{
    mask_password, parse_endpoint, shorten_for_errors, Endpoint, SentinelSpec,
};
use crate::transport::eviction::EvictionWatch;
use crate::transport::probe::{describe_target, probe, ServerFacts};
use crate::transport::pubsub::FeedSource;
use crate::transport::replica_sync::{synced_writes, SyncSlot};
use crate::transport::script;
#[cfg(feature = "sentinel")]
use crate::transport::sentinel::{FailoverLink, SentinelMaster};
use crate::transport::servers::{background_connection, home_runtime, open_manager, Servers};
use crate::transport::tls;
use crate::transport::Store;

/// How many cluster seeds are asked at the same time while connecting: enough that a few
/// silent ones do not hold up a live one, few enough that a long seed list does not open
/// hundreds of sockets at once.
const SEEDS_PROBED_AT_ONCE: usize = 8;

impl ClientBuilder {
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
    /// Or another store, when distlock is built with its feature:
    ///
    /// - `postgres://[user:password@]host[:port]/database[?sslmode=…]` (feature
    ///   `postgres`): locks kept in a table of that database;
    /// - `etcd://[user:password@]host1:port1,host2:port2[/prefix]` (feature `etcd`): locks
    ///   kept as keys under the prefix (`distlock/` by default);
    /// - `zk://host1:port1,host2:port2[/prefix]` (feature `zk`): locks kept as ephemeral
    ///   nodes under the prefix node (`/distlock` by default), alive with the client's
    ///   ZooKeeper session.
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
            Endpoint::Postgres(url) => self.connect_postgres(url).await,
            Endpoint::Etcd(spec) => self.connect_etcd(spec).await,
            Endpoint::Zk(spec) => self.connect_zk(spec).await,
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
        script::preload(&connection, primitives::scripts())
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
        script::preload(&connection, primitives::scripts())
            .await
            .map_err(connect_error)?;
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
        script::preload(&connection, primitives::scripts())
            .await
            .map_err(connect_error)?;
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
        if let Err(err) = script::preload(&connection, primitives::scripts()).await {
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
        Ok(assemble(connected, synced, eviction))
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

/// The session of a connected client: its renewal scheduler, its subscriptions, its
/// latch deleter and its background checks, on the connections made.
fn assemble(connected: Connected, synced: SyncSlot, eviction: EvictionWatch) -> Client {
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
        Store::Redis,
    );
    let subscriptions = Subscriptions::new(
        FeedSource::Redis(Box::new(servers.clone())),
        config.connection_timeout,
        background.handle().clone(),
        background.stopping().clone(),
    );
    let latches = Latches::new(connection.clone(), deployment.is_cluster());
    let core = Core::new(Parts {
        connection,
        config,
        subscriptions,
        watchdog,
        latches,
        background,
        deployment,
        target,
        synced,
        servers: Some(servers),
        eviction,
        store: Store::Redis,
    });
    Client {
        session: Session::new(core),
    }
}
