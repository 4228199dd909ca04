//! The transport layer: how a client reaches its Redis deployment. Connections, the
//! standalone / Sentinel / Cluster links, pub/sub connections, replica sync, the checks a
//! server gets at connect (is it Redis, which version, may it evict keys), and running Lua
//! scripts. It knows nothing about locks: it moves commands, replies and messages.
//!
//! - [`endpoint`]: the URLs that name a deployment;
//! - [`probe`]: the first PING and INFO, and what they say about the server;
//! - [`servers`]: how to reach the servers again, and the connections opened on them;
//! - [`connection`]: the command connection every caller shares, from any runtime;
//! - [`sentinel`], [`cluster`]: the links that follow a Sentinel master or a Cluster;
//! - [`pubsub`]: pub/sub connections, for the engine's subscription hub;
//! - [`replica_sync`]: writes that wait for replicas (WAIT);
//! - [`script`]: EVALSHA, with EVAL when the server lost the script;
//! - [`eviction`]: the eviction-policy check;
//! - [`deployment`]: what differs between deployments for the protocol above;
//! - [`tls`]: TLS set-up;
//! - `postgres` (feature `postgres`): the PostgreSQL pool, its statements' failures, and
//!   the connection that LISTENs;
//! - `etcd` (feature `etcd`): the etcd client, the session lease, and the watches;
//! - `zk` (feature `zk`): the ZooKeeper session, its replacement after an expiry, and the
//!   watches.
//!
//! [`Store`] says which of them a client's primitives talk to.

#[cfg(feature = "cluster")]
pub(crate) mod cluster;
pub(crate) mod connection;
pub(crate) mod deployment;
pub(crate) mod endpoint;
#[cfg(feature = "etcd")]
pub(crate) mod etcd;
pub(crate) mod eviction;
#[cfg(any(feature = "postgres", feature = "etcd", feature = "zk"))]
pub(crate) mod on_runtime;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
pub(crate) mod probe;
pub(crate) mod pubsub;
pub(crate) mod replica_sync;
pub(crate) mod script;
#[cfg(feature = "sentinel")]
pub(crate) mod sentinel;
pub(crate) mod servers;
pub(crate) mod tls;
#[cfg(feature = "zk")]
pub(crate) mod zk;

/// The store a client's primitives talk to: Redis (any deployment, through the client's
/// command connection), or another store through its link.
#[derive(Clone)]
pub(crate) enum Store {
    Redis,
    #[cfg(feature = "postgres")]
    Postgres(postgres::PgLink),
    #[cfg(feature = "etcd")]
    Etcd(etcd::EtcdLink),
    #[cfg(feature = "zk")]
    Zk(zk::ZkLink),
}

impl Store {
    /// The store's name, for errors.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Store::Redis => "Redis",
            #[cfg(feature = "postgres")]
            Store::Postgres(_) => postgres::STORE,
            #[cfg(feature = "etcd")]
            Store::Etcd(_) => etcd::STORE,
            #[cfg(feature = "zk")]
            Store::Zk(_) => zk::STORE,
        }
    }

    /// Fails with [`Error::Unsupported`](crate::Error::Unsupported) unless this is Redis:
    /// for what only Redis offers.
    pub(crate) fn ensure_redis(&self, what: &'static str) -> crate::error::Result<()> {
        match self {
            Store::Redis => Ok(()),
            #[allow(unreachable_patterns)]
            other => Err(crate::error::Error::Unsupported {
                store: other.name(),
                what,
            }),
        }
    }
}
