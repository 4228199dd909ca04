//! Connecting to a store other than Redis, picked by the URL's scheme. Each is a Cargo
//! feature; a build without it refuses the URL with a typed error naming the feature.
//!
//! A client on another store is assembled from the same engine as a Redis client (the
//! acquisition loop, the renewal scheduler, the subscription hub, the client's runtime),
//! with that store's link where Redis has its connections.

use super::builder::ClientBuilder;
use super::Client;
use crate::error::{Error, Result};

impl ClientBuilder {
    /// `postgres://user:password@host:port/database[?sslmode=…]`: the lock table and the
    /// token sequence are created in the database if missing.
    #[cfg(feature = "postgres")]
    pub(super) async fn connect_postgres(self, url: String) -> Result<Client> {
        use crate::primitives;
        use crate::runtime::Background;
        use crate::transport::postgres::{PgLink, STORE};
        use crate::transport::pubsub::FeedSource;
        use crate::transport::Store;

        let config = self.validate()?;
        self.refuse_redis_settings(STORE)?;
        let background = Background::start()?;
        let link = PgLink::connect(
            &url,
            &config,
            background.handle(),
            primitives::postgres_setup(),
        )
        .await?;
        let target = link.target().to_owned();
        Ok(assemble_other(
            config,
            background,
            target,
            Store::Postgres(link.clone()),
            FeedSource::Postgres(link),
            STORE,
        ))
    }

    /// `etcd://[user:password@]host1:port1,host2:port2[/prefix]`: the client's session
    /// lease is granted at connect.
    #[cfg(feature = "etcd")]
    pub(super) async fn connect_etcd(
        self,
        spec: crate::transport::endpoint::EtcdSpec,
    ) -> Result<Client> {
        use crate::transport::etcd::{EtcdLink, STORE};
        use crate::transport::pubsub::FeedSource;
        use crate::transport::Store;

        let config = self.validate()?;
        self.refuse_redis_settings(STORE)?;
        let background = crate::runtime::Background::start()?;
        let link = EtcdLink::connect(spec, &config, background.handle()).await?;
        let target = link.target().to_owned();
        Ok(assemble_other(
            config,
            background,
            target,
            Store::Etcd(link.clone()),
            FeedSource::Etcd(link),
            STORE,
        ))
    }

    /// Built without the `etcd` feature: an etcd URL is refused.
    #[cfg(not(feature = "etcd"))]
    pub(super) async fn connect_etcd(
        self,
        spec: crate::transport::endpoint::EtcdSpec,
    ) -> Result<Client> {
        Err(Error::InvalidUrl {
            url: format!("etcd://{}", spec.endpoints.join(",").replace("http://", "")),
            reason: "an etcd URL, but distlock was built without its `etcd` feature".into(),
        })
    }

    /// `zk://host1:port1,host2:port2[/prefix]`: the client's session is opened at
    /// connect, asking for the watchdog timeout as its timeout.
    #[cfg(feature = "zk")]
    pub(super) async fn connect_zk(
        self,
        spec: crate::transport::endpoint::ZkSpec,
    ) -> Result<Client> {
        use crate::transport::pubsub::FeedSource;
        use crate::transport::zk::{ZkLink, STORE};
        use crate::transport::Store;

        let config = self.validate()?;
        self.refuse_redis_settings(STORE)?;
        let background = crate::runtime::Background::start()?;
        let link = ZkLink::connect(spec, &config, background.handle()).await?;
        let target = link.target().to_owned();
        Ok(assemble_other(
            config,
            background,
            target,
            Store::Zk(link.clone()),
            FeedSource::Zk(link),
            STORE,
        ))
    }

    /// Built without the `zk` feature: a ZooKeeper URL is refused.
    #[cfg(not(feature = "zk"))]
    pub(super) async fn connect_zk(
        self,
        spec: crate::transport::endpoint::ZkSpec,
    ) -> Result<Client> {
        Err(Error::InvalidUrl {
            url: format!("zk://{}{}", spec.hosts.join(","), spec.prefix),
            reason: "a ZooKeeper URL, but distlock was built without its `zk` feature".into(),
        })
    }

    /// Built without the `postgres` feature: a PostgreSQL URL is refused.
    #[cfg(not(feature = "postgres"))]
    pub(super) async fn connect_postgres(self, url: String) -> Result<Client> {
        Err(Error::InvalidUrl {
            url: crate::transport::endpoint::mask_password(&url),
            reason: "a PostgreSQL URL, but distlock was built without its `postgres` feature"
                .into(),
        })
    }

    /// Settings that only mean something on Redis, refused rather than ignored on
    /// `store`: certificates the connection would not use, or replica counts it would not
    /// wait for, must not pass for protection.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "etcd", feature = "zk")),
        allow(dead_code)
    )]
    fn refuse_redis_settings(&self, store: &'static str) -> Result<()> {
        let redis_only = |what: &'static str| Error::InvalidConfig {
            what,
            reason: format!(
                "is a Redis setting, and this URL is {store}'s: {}",
                if what == "TLS certificates" {
                    "give the store's own TLS settings in its URL instead"
                } else {
                    "leave it out"
                }
            ),
        };
        if self.tls_certificates.is_some() {
            return Err(redis_only("TLS certificates"));
        }
        if matches!(
            self.replica_sync,
            crate::transport::replica_sync::ReplicaSync::Replicas { .. }
        ) {
            return Err(redis_only("replica_sync"));
        }
        Ok(())
    }
}

/// The session of a client on a store other than Redis: the same engine (the renewal
/// scheduler, the subscription hub, the client's runtime), with `store`'s link where
/// Redis has its connections.
#[cfg(any(feature = "postgres", feature = "etcd", feature = "zk"))]
fn assemble_other(
    config: crate::config::Config,
    background: crate::runtime::Background,
    target: String,
    store: crate::transport::Store,
    feed: crate::transport::pubsub::FeedSource,
    name: &'static str,
) -> Client {
    use std::sync::Arc;

    use crate::engine::latches::Latches;
    use crate::engine::renewal::scheduler::Watchdog;
    use crate::engine::session::{Core, Parts, Session};
    use crate::engine::subscriptions::Subscriptions;
    use crate::transport::connection::{Connection, Link, NoRedis};
    use crate::transport::deployment::Deployment;
    use crate::transport::eviction::EvictionWatch;
    use crate::transport::replica_sync::SyncSlot;

    // Never used for a command: every primitive on this store goes through its link.
    let connection = Connection::new(
        None,
        Link::Absent(NoRedis { store: name }),
        background.handle().clone(),
    );
    let watchdog = Watchdog::start(
        connection.clone(),
        &config,
        &background,
        Deployment::Standalone,
        SyncSlot::default(),
        store.clone(),
    );
    let subscriptions = Subscriptions::new(
        feed,
        config.connection_timeout,
        background.handle().clone(),
        background.stopping().clone(),
    );
    let latches = Latches::new(connection.clone(), false);
    let eviction = Arc::new(EvictionWatch::not_applicable(&target));
    let core = Core::new(Parts {
        connection,
        config,
        subscriptions,
        watchdog,
        latches,
        background,
        deployment: Deployment::Standalone,
        target,
        synced: SyncSlot::default(),
        servers: None,
        eviction,
        store,
    });
    Client {
        session: Session::new(core),
    }
}
