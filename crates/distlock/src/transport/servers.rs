//! How to reach a connected client's servers, and the connections opened on them: the
//! command connection (one driven on the client's own runtime, one on the caller's), the
//! connections synced writes use, dedicated connections handed to callers.

#[cfg(feature = "cluster")]
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
#[cfg(feature = "cluster")]
use redis::ConnectionInfo;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::runtime::Background;
#[cfg(feature = "cluster")]
use crate::transport::cluster::{cluster_client, link::ClusterLink, topology::Topology};
use crate::transport::connection::{Connection, Link, RedisConnection};
#[cfg(feature = "sentinel")]
use crate::transport::sentinel::{FailoverLink, SentinelMaster};

/// How to reach a connected client's servers again: for its pub/sub hub, for the
/// connections synced writes use, and for dedicated connections handed to callers.
#[derive(Clone)]
pub(crate) enum Servers {
    /// One server.
    Standalone(redis::Client),
    /// The master a set of sentinels names, as the client's connections last found it.
    #[cfg(feature = "sentinel")]
    Sentinel(SentinelMaster),
    /// A cluster, by its seeds; pub/sub subscribes with SSUBSCRIBE when `sharded`. Every
    /// command link opened on it shares `topology`.
    #[cfg(feature = "cluster")]
    Cluster {
        seeds: Vec<ConnectionInfo>,
        topology: Arc<Topology>,
        sharded: bool,
        config: Config,
    },
}

pub(crate) fn manager_config(config: &Config) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(config.connection_timeout))
        .set_response_timeout(Some(config.response_timeout))
}

impl Servers {
    /// A new connection to the client's servers whose replies may take
    /// `response_timeout`, driven on the runtime this is called on.
    pub(crate) async fn open(
        &self,
        config: &Config,
        response_timeout: Duration,
    ) -> redis::RedisResult<Link> {
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
    pub(crate) async fn open_on(
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

pub(crate) async fn open_manager(
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
pub(crate) async fn background_connection(
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
pub(crate) fn home_runtime() -> Option<tokio::runtime::Id> {
    let runtime = tokio::runtime::Handle::try_current().ok()?;
    (runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread).then(|| runtime.id())
}
