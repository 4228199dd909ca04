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
        use std::sync::Arc;

        use crate::engine::latches::Latches;
        use crate::engine::renewal::scheduler::Watchdog;
        use crate::engine::session::{Core, Parts, Session};
        use crate::engine::subscriptions::Subscriptions;
        use crate::primitives;
        use crate::runtime::Background;
        use crate::transport::connection::{Connection, Link, NoRedis};
        use crate::transport::deployment::Deployment;
        use crate::transport::eviction::EvictionWatch;
        use crate::transport::postgres::{PgLink, STORE};
        use crate::transport::pubsub::FeedSource;
        use crate::transport::replica_sync::SyncSlot;
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
        // Never used for a command: every primitive on this store goes through `link`.
        let connection = Connection::new(
            None,
            Link::Absent(NoRedis { store: STORE }),
            background.handle().clone(),
        );
        let store = Store::Postgres(link.clone());
        let watchdog = Watchdog::start(
            connection.clone(),
            &config,
            &background,
            Deployment::Standalone,
            SyncSlot::default(),
            store.clone(),
        );
        let subscriptions = Subscriptions::new(
            FeedSource::Postgres(link),
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
        Ok(Client {
            session: Session::new(core),
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
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    fn refuse_redis_settings(&self, store: &'static str) -> Result<()> {
        let redis_only = |what: &'static str| Error::InvalidConfig {
            what,
            reason: format!(
                "is a Redis setting, and this URL is {store}'s: {}",
                if what == "TLS certificates" {
                    "give sslmode, sslrootcert, sslcert and sslkey in the URL instead"
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
