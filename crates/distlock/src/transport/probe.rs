//! The first conversation with a server: one short-lived connection that PINGs, so a bad
//! address, a refused handshake or a server that is not Redis is reported at connect with
//! its real cause, and asks INFO what kind of server it is.

use redis::AsyncConnectionConfig;

use crate::config::Config;
use crate::error::{Error, Result};

/// Opens one short-lived connection and PINGs, so that a bad address, a refused
/// handshake or a server that is not Redis is reported at `connect` with its real cause
/// rather than as a later command failure.
///
/// The same connection asks INFO what kind of server it is (a cluster node, which
/// version); a server that will not say (INFO refused by an ACL, a proxy) is taken for a
/// standalone server of unknown version.
pub(crate) async fn probe(
    client: &redis::Client,
    config: &Config,
    target: &str,
) -> Result<ServerFacts> {
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
pub(crate) struct ServerFacts {
    /// `cluster_enabled:1`: a Redis Cluster node.
    pub(crate) cluster: bool,
    /// The major version, 0 when unknown (it decides sharded pub/sub on a cluster).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) major_version: u32,
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

pub(crate) fn describe_target(client: &redis::Client) -> String {
    client.get_connection_info().addr().to_string()
}
