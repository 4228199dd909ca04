//! Redis Cluster: the client redis-rs gives (with distlock's timeouts and retries), the
//! slot map every link of a client shares, and the link that sends slot-routed scripts
//! straight to their master.

pub(crate) mod link;
pub(crate) mod redirect;
pub(crate) mod topology;

use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::{ConnectionInfo, PushInfo, RedisResult};

use crate::config::Config;

/// How often one cluster command is sent again after a redirection it cannot follow at
/// once (TRYAGAIN while a slot migrates, CLUSTERDOWN during a failover) or a lost node.
/// Every retry still ends within the response timeout, which bounds the whole command.
pub(crate) const CLUSTER_RETRIES: u32 = 12;
/// Pauses between those retries, in milliseconds: short, because a migration moves a
/// slot's few lock keys in a few milliseconds, and growing up to a quarter second.
pub(crate) const CLUSTER_MIN_RETRY_WAIT_MS: u64 = 5;
pub(crate) const CLUSTER_MAX_RETRY_WAIT_MS: u64 = 250;

/// A cluster client on `seeds` with the client's timeouts. With `pushes`, it speaks RESP3
/// and sends every push (pub/sub messages, subscription confirmations, disconnections)
/// there: that is how redis-rs carries pub/sub on a cluster.
pub(crate) fn cluster_client(
    seeds: &[ConnectionInfo],
    config: &Config,
    pushes: Option<tokio::sync::mpsc::UnboundedSender<PushInfo>>,
) -> RedisResult<ClusterClient> {
    let mut builder = ClusterClientBuilder::new(seeds.to_vec())
        .connection_timeout(config.connection_timeout)
        .response_timeout(config.response_timeout)
        .retries(CLUSTER_RETRIES)
        .min_retry_wait(CLUSTER_MIN_RETRY_WAIT_MS)
        .max_retry_wait(CLUSTER_MAX_RETRY_WAIT_MS);
    if let Some(certificates) = &config.tls_certificates {
        // The seeds carry them too, but the cluster client connects to the nodes it
        // discovers with these alone.
        builder = crate::transport::tls::for_cluster(builder, certificates);
    }
    if let Some(pushes) = pushes {
        builder = builder
            .use_protocol(redis::ProtocolVersion::RESP3)
            .push_sender(pushes);
    }
    builder.build()
}
