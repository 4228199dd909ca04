//! A connection to whichever server the sentinels currently name as master.
//!
//! redis-rs's `SentinelClient` finds the master once (asking each sentinel in turn, and
//! checking with ROLE that the server agrees) but does not follow a failover: a connection
//! it made keeps talking to the old master, which after a failover is gone, or back as a
//! replica that answers writes with READONLY. [`FailoverLink`] asks the sentinels again
//! whenever its connection breaks or a write is refused that way, so the next command goes
//! to the new master. It never retries a command itself: whether a lock command may be
//! sent again is the caller's decision (the engine retries acquisitions while waiting,
//! releases retry with their latch).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Cmd, IntoConnectionInfo, Pipeline, RedisError, RedisFuture, RedisResult,
    Value,
};

use crate::config::Certificates;
use crate::transport::endpoint::SentinelSpec;

impl SentinelSpec {
    /// A sentinel client that finds this master, trusting `certificates` over TLS.
    fn client(&self, certificates: Option<&Certificates>) -> RedisResult<SentinelClient> {
        let addresses = self
            .sentinels
            .iter()
            .map(|url| Ok(url.as_str().into_connection_info()?.addr().clone()))
            .collect::<RedisResult<Vec<_>>>()?;
        let mut builder =
            SentinelClientBuilder::new(addresses, &self.service, SentinelServerType::Master)?
                .set_client_to_redis_db(self.db);
        if let Some(username) = &self.username {
            builder = builder.set_client_to_redis_username(username);
        }
        if let Some(password) = &self.password {
            builder = builder.set_client_to_redis_password(password);
        }
        if let Some(first) = self.sentinels.first() {
            let info = first.as_str().into_connection_info()?;
            if let Some(username) = info.redis_settings().username() {
                builder = builder.set_client_to_sentinel_username(username);
            }
            if let Some(password) = info.redis_settings().password() {
                builder = builder.set_client_to_sentinel_password(password);
            }
        }
        if self.tls {
            builder = crate::transport::tls::for_sentinel(builder, certificates);
        }
        builder.build()
    }
}

/// The master the sentinels name, as this client last found it. One is shared by all of a
/// client's connections to the master (its command connections, the connections synced
/// writes use, dedicated ones), so that when one of them finds the master gone, the
/// sentinels are asked once and every other connection moves with it on its next
/// command, instead of each finding out by failing a command of its own.
#[derive(Clone)]
pub(crate) struct SentinelMaster {
    shared: Arc<MasterShared>,
}

struct MasterShared {
    spec: SentinelSpec,
    connection_timeout: Duration,
    tls_certificates: Option<Certificates>,
    /// The generation of the master as last found, or 0 while it must be asked for
    /// again. Read on every command, so it is an atomic rather than behind the lock.
    known: AtomicU64,
    /// Serializes discoveries: many commands failing at once ask the sentinels once.
    discovery: tokio::sync::Mutex<Discovery>,
}

/// The discoveries so far: the master last found, numbered by how often it changed, and
/// when the sentinels may be asked again after a discovery failed.
#[derive(Default)]
struct Discovery {
    generation: u64,
    master: Option<(String, redis::Client)>,
    retry: Option<Retry>,
}

struct Retry {
    not_before: tokio::time::Instant,
    backoff: Duration,
    reason: String,
}

/// Backoff between discoveries that fail (a failover in progress, sentinels down): fast
/// enough to find the new master soon after it is promoted, slow enough that a fleet of
/// failing commands does not flood the sentinels.
const MIN_DISCOVERY_BACKOFF: Duration = Duration::from_millis(50);
const MAX_DISCOVERY_BACKOFF: Duration = Duration::from_millis(250);

impl SentinelMaster {
    pub(crate) fn new(
        spec: SentinelSpec,
        connection_timeout: Duration,
        tls_certificates: Option<Certificates>,
    ) -> Self {
        Self {
            shared: Arc::new(MasterShared {
                spec,
                connection_timeout,
                tls_certificates,
                known: AtomicU64::new(0),
                discovery: tokio::sync::Mutex::new(Discovery::default()),
            }),
        }
    }

    pub(crate) fn spec(&self) -> &SentinelSpec {
        &self.shared.spec
    }

    /// A client for the server the sentinels name as master right now, asked afresh.
    pub(crate) async fn ask_sentinels(&self) -> RedisResult<redis::Client> {
        let certificates = self.shared.tls_certificates.as_ref();
        self.shared
            .spec
            .client(certificates)?
            .async_get_client()
            .await
    }

    /// The master, for a client that is connecting: the sentinels are asked until they
    /// name one, within the connection timeout. Right after a failover they may name none
    /// for a moment (the promoted server's entry is still flagged, or it does not answer
    /// as a master yet), and a new client must not fail for that.
    pub(crate) async fn find_at_connect(&self) -> RedisResult<(u64, redis::Client)> {
        let deadline = tokio::time::Instant::now() + self.shared.connection_timeout;
        loop {
            let err = match self.current().await {
                Ok(found) => return Ok(found),
                Err(err) => err,
            };
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(err);
            }
            tracing::debug!(error = %err, "the sentinels name no master yet; asking again");
            // `current` asks again once its backoff has passed.
            tokio::time::sleep(MIN_DISCOVERY_BACKOFF.min(deadline - now)).await;
        }
    }

    /// True while `generation` is the master as last found.
    fn is_current(&self, generation: u64) -> bool {
        self.shared.known.load(Ordering::Acquire) == generation
    }

    /// A command on a connection to master `generation` failed in a way that says the
    /// master may have moved: the next command of any connection asks the sentinels.
    fn suspect(&self, generation: u64) {
        let _ =
            self.shared
                .known
                .compare_exchange(generation, 0, Ordering::AcqRel, Ordering::Acquire);
    }

    /// The master as last found, with its generation; asks the sentinels first if it is
    /// in doubt. The generation changes only when the sentinels name another server, so
    /// connections to the same master survive a discovery that found it again.
    pub(crate) async fn current(&self) -> RedisResult<(u64, redis::Client)> {
        let mut discovery = self.shared.discovery.lock().await;
        if let Some((_, client)) = &discovery.master {
            if self.is_current(discovery.generation) {
                return Ok((discovery.generation, client.clone()));
            }
        }
        if let Some(retry) = &discovery.retry {
            if tokio::time::Instant::now() < retry.not_before {
                return Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::NotConnected,
                    format!(
                        "no master yet; the sentinels are asked again shortly: {}",
                        retry.reason
                    ),
                )));
            }
        }
        // During a failover the sentinels may name no reachable master for a while: that
        // is an outage of the connection, to be retried like a refused one.
        let outcome = tokio::time::timeout(self.shared.connection_timeout, self.ask_sentinels())
            .await
            .map_err(|_| {
                RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the sentinels did not name a master in time",
                ))
            })
            .and_then(|found| {
                found.map_err(|err| {
                    RedisError::from(std::io::Error::new(
                        std::io::ErrorKind::NotConnected,
                        format!("the sentinels name no reachable master: {err}"),
                    ))
                })
            });
        let master = match outcome {
            Ok(master) => master,
            Err(err) => {
                let backoff = discovery
                    .retry
                    .as_ref()
                    .map_or(MIN_DISCOVERY_BACKOFF, |retry| {
                        (retry.backoff * 2).min(MAX_DISCOVERY_BACKOFF)
                    });
                discovery.retry = Some(Retry {
                    not_before: tokio::time::Instant::now() + backoff,
                    backoff,
                    reason: err.to_string(),
                });
                return Err(err);
            }
        };
        discovery.retry = None;
        let address = master.get_connection_info().addr().to_string();
        let moved = discovery
            .master
            .as_ref()
            .is_none_or(|(known, _)| *known != address);
        if moved {
            discovery.generation += 1;
            tracing::info!(master = %address, generation = discovery.generation, "the sentinels name a new master");
        }
        discovery.master = Some((address, master.clone()));
        self.shared
            .known
            .store(discovery.generation, Ordering::Release);
        Ok((discovery.generation, master))
    }
}

/// A command connection to the current master. Cheap to clone; clones share the
/// connection. Links of one client share their [`SentinelMaster`].
#[derive(Clone)]
pub(crate) struct FailoverLink {
    shared: Arc<LinkShared>,
}

struct LinkShared {
    master: SentinelMaster,
    config: AsyncConnectionConfig,
    /// This link's connection, with the generation of the master it goes to; `None` once
    /// it failed, until the next command connects again.
    current: Mutex<Option<(u64, MultiplexedConnection)>>,
    /// Serializes reconnects of this link.
    connecting: tokio::sync::Mutex<()>,
}

impl FailoverLink {
    /// A link to `master`, connected now.
    pub(crate) async fn connect(
        master: SentinelMaster,
        response_timeout: Duration,
    ) -> RedisResult<Self> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(master.shared.connection_timeout))
            .set_response_timeout(Some(response_timeout));
        let link = Self {
            shared: Arc::new(LinkShared {
                master,
                config,
                current: Mutex::new(None),
                connecting: tokio::sync::Mutex::new(()),
            }),
        };
        link.connection().await?;
        Ok(link)
    }

    fn current(&self) -> MutexGuard<'_, Option<(u64, MultiplexedConnection)>> {
        // Only whole values are stored, so a poisoned lock still holds a consistent one.
        self.shared
            .current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// This link's connection if it still goes to the master as last found.
    fn fresh(&self) -> Option<(u64, MultiplexedConnection)> {
        self.current()
            .clone()
            .filter(|(generation, _)| self.shared.master.is_current(*generation))
    }

    /// The connection to the current master, connecting (and asking the sentinels) first
    /// if this link has none, or one to a master that is no longer current.
    async fn connection(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        if let Some(fresh) = self.fresh() {
            return Ok(fresh);
        }
        let _connecting = self.shared.connecting.lock().await;
        let (generation, master) = self.shared.master.current().await?;
        if let Some(current) = self.current().clone() {
            if current.0 == generation {
                return Ok(current);
            }
        }
        let connection = master
            .get_multiplexed_async_connection_with_config(&self.shared.config)
            .await
            .inspect_err(|_| self.shared.master.suspect(generation))?;
        let current = (generation, connection);
        *self.current() = Some(current.clone());
        Ok(current)
    }

    /// A command on this link's connection to master `generation` failed in a way that
    /// says the master may have moved: the link drops that connection (unless a newer one
    /// replaced it) and every link of the client asks again.
    fn forget(&self, generation: u64, err: &RedisError) {
        {
            let mut current = self.current();
            if current
                .as_ref()
                .is_some_and(|(made_for, _)| *made_for == generation)
            {
                tracing::warn!(error = %err, "the master's connection failed; asking the sentinels again");
                *current = None;
            }
        }
        self.shared.master.suspect(generation);
    }
}

/// A failure after which the master may have changed: the connection broke, or the
/// server is a replica now (READONLY) or cannot take writes (MASTERDOWN, LOADING).
fn master_may_have_moved(err: &RedisError) -> bool {
    use redis::ServerErrorKind as Kind;
    err.is_io_error()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_timeout()
        || matches!(
            err.kind(),
            redis::ErrorKind::Server(Kind::ReadOnly | Kind::MasterDown | Kind::BusyLoading)
        )
}

/// The failure in a reply that means the master may have moved, if there is one: a
/// failed call, or a server error reply such as READONLY (which redis-rs hands back as a
/// value, turned into an error only when the caller reads it).
fn moved_master_failure<'v>(reply: &RedisResult<impl AsRef<[Value]> + 'v>) -> Option<RedisError> {
    match reply {
        Err(err) => master_may_have_moved(err).then(|| err.clone()),
        Ok(values) => values.as_ref().iter().find_map(|value| match value {
            Value::ServerError(server_error) => {
                let err = RedisError::from(server_error.clone());
                master_may_have_moved(&err).then_some(err)
            }
            _ => None,
        }),
    }
}

impl ConnectionLike for FailoverLink {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut connection) = self.connection().await?;
            let reply = connection
                .req_packed_command(cmd)
                .await
                .map(|value| [value]);
            if let Some(err) = moved_master_failure(&reply) {
                self.forget(generation, &err);
            }
            reply.map(|[value]| value)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (generation, mut connection) = self.connection().await?;
            let reply = connection
                .req_packed_commands(pipeline, offset, count)
                .await;
            if let Some(err) = moved_master_failure(&reply) {
                self.forget(generation, &err);
            }
            reply
        })
    }

    fn get_db(&self) -> i64 {
        self.shared.master.spec().db
    }
}
