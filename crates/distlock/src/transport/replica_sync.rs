//! Replica sync: lock writes that wait until replicas have them.
//!
//! With master-replica replication, a failover can promote a replica that never received
//! the newest lock write, and the lock is then free on the new master while its holder
//! still trusts it. Following every lock write with `WAIT <replicas> <timeout>` closes that
//! window for the writes that replicas acknowledged: an acquisition no replica acknowledged
//! is given back and fails, so a holder's lock is always on a replica too.
//!
//! WAIT counts acknowledgements of the writes made *by the connection it is sent on*, so it
//! is pipelined right behind the script on the same connection. A WAIT on any other
//! connection would wait for that connection's (older, or no) writes and could report
//! success for a write no replica has. And because WAIT blocks its connection on the
//! server until the replicas answer, synced writes go over connections of their own
//! ([`SyncedWrites`]): a replica that is slow or gone then delays lock writes, never the
//! client's other commands (reads, `is_locked`, the user's own commands on
//! [`Client::connection`](crate::Client::connection)).
//!
//! When the server has WAITAOF (Redis 7.2) and its AOF is on, the write also waits until
//! the master's own AOF has it (`WAITAOF 1 <replicas> <timeout>`), so a master restarted
//! from its AOF remembers the lock too.
//!
//! On a Redis Cluster, each shard has its own master and replicas, and WAIT counts the
//! replicas of the master that took the write. Under [`ReplicaSync::Auto`] a write waits
//! for one replica when the cluster lists one for its shard's master, and for none when it
//! lists none: a master without a replica (one whose replica was promoted in a failover
//! and has not been replaced yet) has nobody to fail over to, so there is no failover that
//! could lose its locks, and refusing them would only take the shard's locks away. The
//! cluster lists a replica whose replication link is cut, so a write it cannot
//! acknowledge is still refused.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{Cmd, FromRedisValue, Value};

use crate::config::Config;
use crate::duration::to_millis;
use crate::error::{Error, Result};
use crate::runtime::Background;
use crate::transport::connection::Connection;
use crate::transport::servers::Servers;

/// Whether lock writes wait for replicas; see [`ClientBuilder::replica_sync`].
///
/// [`ClientBuilder::replica_sync`]: crate::ClientBuilder::replica_sync
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ReplicaSync {
    /// On (1 replica, within 1 s) whenever the master has a replica connected, as
    /// Redisson's `checkLockSyncedSlaves`. The default.
    ///
    /// On a cluster, decided per shard: a write waits for one replica when the cluster
    /// lists one for its shard's master (read again every 5 seconds), and for none when
    /// it lists none.
    ///
    /// A master with no replica at connect is asked again every 5 seconds, so a replica
    /// that attaches after the client started (a deployment whose services start before
    /// their replicas) turns sync on within that time. Once on, it stays on: while no
    /// replica answers, acquisitions are refused ([`Error::NotReplicated`] from
    /// `try_lock`; waiting calls wait) rather than granted unprotected.
    #[default]
    Auto,
    /// Never wait: a failover can lose a lock that a replica had not received yet.
    Off,
    /// Wait after each acquisition, renewal and release until `count` replicas have the
    /// write, at most `timeout`. On a cluster, `count` replicas of the master of the
    /// lock's shard, whatever the cluster lists. An acquisition with fewer acknowledgements is given back;
    /// `try_lock` then fails with [`Error::NotReplicated`], and a call willing to wait
    /// tries again with backoff until replicas acknowledge or its patience ends.
    Replicas {
        /// How many replicas must acknowledge.
        count: u32,
        /// How long to wait for them.
        timeout: Duration,
    },
}

/// The default of [`ReplicaSync::Auto`]: one replica, within a second.
const AUTO_TIMEOUT: Duration = Duration::from_secs(1);

/// How often [`ReplicaSync::Auto`] asks a master that had no replica whether one has
/// attached: one `INFO replication` per client each time, which costs the server
/// microseconds.
pub(crate) const AUTO_RECHECK: Duration = Duration::from_secs(5);

/// Where a client's synced writes live once replica sync is on: set at connect, or later
/// when [`ReplicaSync::Auto`] first sees a replica, and never unset. The lock calls and
/// the watchdog read it on each write.
pub(crate) type SyncSlot = Arc<std::sync::OnceLock<SyncedWrites>>;

/// What [`resolve`] settled on.
#[derive(Debug)]
pub(crate) enum Resolved {
    /// Sync is on, with this policy.
    On(SyncPolicy),
    /// Sync is off for good (asked for, or the server does not take WAIT).
    Off,
    /// [`ReplicaSync::Auto`] found no replica connected yet: ask again later.
    NoReplicaYet,
}

/// Synced writes are spread over this many connections, so that a few slow WAITs do not
/// queue every other lock write behind them.
const SYNCED_CONNECTIONS: usize = 4;

/// The sync a client settled on at connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SyncPolicy {
    pub(crate) replicas: u32,
    pub(crate) timeout: Duration,
    timeout_ms: u64,
    /// Wait for the master's AOF too (WAITAOF): the server has it and AOF is on.
    aof: bool,
    /// On a cluster under [`ReplicaSync::Auto`]: wait for no more replicas than the
    /// cluster lists for the write's shard.
    per_shard: bool,
}

/// What the WAIT behind a synced write reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Acks {
    /// How many replicas acknowledged.
    pub(crate) acknowledged: u32,
    /// How many had to: the policy's count, or fewer on a cluster shard that lists fewer
    /// replicas under [`ReplicaSync::Auto`].
    pub(crate) required: u32,
}

impl Acks {
    /// True if enough replicas have the write.
    pub(crate) fn enough(self) -> bool {
        self.acknowledged >= self.required
    }
}

impl SyncPolicy {
    /// The command that follows a lock write, waiting for `replicas`.
    fn wait_command(&self, replicas: u32) -> Cmd {
        let mut cmd = if self.aof {
            let mut cmd = redis::cmd("WAITAOF");
            cmd.arg(1);
            cmd
        } else {
            redis::cmd("WAIT")
        };
        cmd.arg(replicas).arg(self.timeout_ms);
        cmd
    }

    /// How many replicas acknowledged, from the reply of [`SyncPolicy::wait_command`].
    /// WAITAOF answers `[local AOF, replicas]`; a master whose own AOF did not get the
    /// write counts as no acknowledgement at all.
    fn acknowledged(&self, reply: &Value) -> Option<u32> {
        let number = |value: &Value| match value {
            Value::Int(n) => u32::try_from(*n).ok(),
            _ => None,
        };
        match reply {
            Value::Array(values) if self.aof => match values.as_slice() {
                [local, replicas] => (number(local)? >= 1)
                    .then(|| number(replicas))
                    .flatten()
                    .or(Some(0)),
                _ => None,
            },
            other => number(other),
        }
    }
}

/// Resolves the setting against what the server says, on `connection` (the client's
/// ordinary command connection: to its master, or to every master of a `cluster`).
pub(crate) async fn resolve(
    setting: ReplicaSync,
    connection: &Connection,
    cluster: bool,
) -> Result<Resolved> {
    let (replicas, timeout) = match setting {
        ReplicaSync::Off => return Ok(Resolved::Off),
        ReplicaSync::Replicas { count, timeout } => {
            if count == 0 {
                return Err(Error::InvalidConfig {
                    what: "replica sync",
                    reason: "needs at least 1 replica; use ReplicaSync::Off for none".into(),
                });
            }
            (count, timeout)
        }
        // Per shard, as each write goes: see `SyncPolicy::per_shard`.
        ReplicaSync::Auto if cluster => (1, AUTO_TIMEOUT),
        ReplicaSync::Auto => {
            let replication = info(connection, "replication").await;
            match replication
                .first()
                .map(|replication| online_replicas(replication))
            {
                Some(online) if online >= 1 => (1, AUTO_TIMEOUT),
                _ => return Ok(Resolved::NoReplicaYet),
            }
        }
    };
    let timeout_ms = to_millis("replica sync timeout", timeout)?;
    let mut probe = connection.clone();
    if let Err(err) = redis::cmd("WAIT")
        .arg(0)
        .arg(0)
        .query_async::<i64>(&mut probe)
        .await
    {
        tracing::warn!(
            error = %err,
            "the server does not take WAIT (a proxy or a managed Redis?): replica sync is off, \
             and a failover can lose a lock a replica had not received"
        );
        return Ok(Resolved::Off);
    }
    // A cluster connection asks every master and hands back each one's answer, refusals
    // included, as a map: every master must take WAITAOF and have its AOF on.
    let has_waitaof = redis::cmd("WAITAOF")
        .arg(0)
        .arg(0)
        .arg(0)
        .query_async::<Value>(&mut probe)
        .await
        .is_ok_and(|reply| !holds_an_error(&reply));
    let persistence = info(connection, "persistence").await;
    let aof_on = !persistence.is_empty()
        && persistence
            .iter()
            .all(|section| field(section, "aof_enabled").as_deref() == Some("1"));
    Ok(Resolved::On(SyncPolicy {
        replicas,
        timeout,
        timeout_ms,
        aof: has_waitaof && aof_on,
        per_shard: cluster && setting == ReplicaSync::Auto,
    }))
}

/// One INFO section from each server that answered: the one server, or every master of
/// a cluster (whose connection answers with a map of node to reply).
async fn info(connection: &Connection, section: &str) -> Vec<String> {
    let mut connection = connection.clone();
    let reply = redis::cmd("INFO")
        .arg(section)
        .query_async::<Value>(&mut connection)
        .await;
    let text = |value: &Value| String::from_redis_value(value.clone()).ok();
    match reply {
        Ok(Value::Map(replies)) => replies
            .iter()
            .filter_map(|(_, reply)| text(reply))
            .collect(),
        Ok(reply) => text(&reply).into_iter().collect(),
        Err(_) => Vec::new(),
    }
}

/// True if `reply`, or any reply a cluster gathered into it, is an error.
fn holds_an_error(reply: &Value) -> bool {
    match reply {
        Value::ServerError(_) => true,
        Value::Map(replies) => replies.iter().any(|(_, reply)| holds_an_error(reply)),
        _ => false,
    }
}

/// The replicas `INFO replication` lists as `state=online`: in sync and streaming.
/// `connected_slaves` also counts a backup taken with `redis-cli --rdb` (or any client
/// that asks for one copy of the data and leaves), listed as `wait_bgsave` or
/// `send_bulk` and never online: counting it turned `Auto` on for good, and every lock
/// write then failed with `NotReplicated` once the backup had gone.
fn online_replicas(replication: &str) -> u32 {
    let online = replication
        .lines()
        .filter(|line| line.starts_with("slave") && line.contains(':'))
        .filter(|line| {
            line.split(',')
                .any(|field| field.trim_end() == "state=online")
        })
        .count();
    u32::try_from(online).unwrap_or(u32::MAX)
}

fn field(info: &str, name: &str) -> Option<String> {
    info.lines().find_map(|line| {
        line.trim_end()
            .strip_prefix(name)?
            .strip_prefix(':')
            .map(str::to_owned)
    })
}

/// The connections synced writes go over, and the policy they follow.
///
/// Each connection carries one synced write at a time. WAIT holds its connection on the
/// server until the replicas answer (up to the sync timeout), so a write queued behind it
/// on the same connection would spend its own response time waiting for another write's
/// WAIT, and time out while the replicas are away instead of failing with
/// [`Error::NotReplicated`]. Writes wait for a free connection here, on the client, where
/// no timeout runs.
#[derive(Clone)]
pub(crate) struct SyncedWrites {
    policy: SyncPolicy,
    connections: Arc<[SyncedLink]>,
    next: Arc<AtomicUsize>,
}

struct SyncedLink {
    connection: Connection,
    /// Held while a write and its WAIT are in flight on `connection`.
    busy: tokio::sync::Mutex<()>,
}

impl SyncedWrites {
    pub(crate) fn new(policy: SyncPolicy, connections: Vec<Connection>) -> Option<Self> {
        let connections: Vec<SyncedLink> = connections
            .into_iter()
            .map(|connection| SyncedLink {
                connection,
                busy: tokio::sync::Mutex::new(()),
            })
            .collect();
        (!connections.is_empty()).then(|| Self {
            policy,
            connections: connections.into(),
            next: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// How many connections to open for them.
    pub(crate) fn pool_size() -> usize {
        SYNCED_CONNECTIONS
    }

    pub(crate) fn policy(&self) -> &SyncPolicy {
        &self.policy
    }

    /// Sends `write` and the WAIT behind it, in one pipeline on one of the synced
    /// connections. Returns the write's reply and what the WAIT reported. On a cluster
    /// the WAIT is composed for the master the write reaches (per shard under
    /// [`ReplicaSync::Auto`]: none for a master with no replica listed), and the link
    /// takes turns per master; elsewhere writes take turns per connection here.
    pub(crate) async fn send<T: redis::FromRedisValue>(
        &self,
        write: &Cmd,
    ) -> redis::RedisResult<(T, Acks)> {
        let count = self.connections.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % count;
        let policy = self.policy;
        let wait = Arc::new(move |listed: Option<u32>| {
            let replicas = match (policy.per_shard, listed) {
                (true, Some(listed)) => listed.min(policy.replicas),
                _ => policy.replicas,
            };
            (replicas > 0).then(|| (policy.wait_command(replicas), replicas))
        });
        // On a cluster, the first connection not busy with this write's master.
        let pick = (0..count)
            .map(|offset| (start + offset) % count)
            .find(|&at| self.connections[at].connection.turn_looks_free(write))
            .unwrap_or(start);
        if let Some(sent) = self.connections[pick]
            .connection
            .write_then_wait(write, wait)
            .await
        {
            let (written, waited) = sent?;
            return self.read_replies(written, waited);
        }
        // The first free connection from a rotating start; if all are busy, queue on one.
        let free = (0..count).find_map(|offset| {
            let link = &self.connections[(start + offset) % count];
            link.busy.try_lock().ok().map(|turn| (link, turn))
        });
        let (link, _turn) = match free {
            Some(free) => free,
            None => {
                let link = &self.connections[start];
                (link, link.busy.lock().await)
            }
        };
        let mut connection = link.connection.clone();
        let mut pipeline = redis::pipe();
        pipeline.add_command(write.clone());
        pipeline.add_command(self.policy.wait_command(self.policy.replicas));
        let mut replies = connection.req_packed_commands(&pipeline, 0, 2).await?;
        let waited = replies.pop();
        let written = replies.pop();
        let (Some(written), Some(waited)) = (written, waited) else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "a synced write did not get two replies",
            )));
        };
        self.read_replies(written, Some((waited, self.policy.replicas)))
    }

    /// The write's reply, and the acknowledgements of the WAIT sent for `required`
    /// replicas behind it (none sent: none required). A WAIT the server refused (a
    /// WAITAOF on a master promoted without AOF, say) counts as no acknowledgement, so an
    /// acquisition is given back rather than left granted and unreported.
    fn read_replies<T: redis::FromRedisValue>(
        &self,
        written: Value,
        waited: Option<(Value, u32)>,
    ) -> redis::RedisResult<(T, Acks)> {
        let value = match written {
            Value::ServerError(err) => return Err(err.into()),
            written => T::from_redis_value(written)?,
        };
        let acks = match waited {
            None => Acks {
                acknowledged: 0,
                required: 0,
            },
            Some((waited, required)) => {
                let acknowledged = match waited {
                    Value::ServerError(err) => {
                        tracing::warn!(error = ?err, "the server refused the WAIT behind a lock write; counted as no acknowledgement");
                        0
                    }
                    waited => self.policy.acknowledged(&waited).unwrap_or(0),
                };
                Acks {
                    acknowledged,
                    required,
                }
            }
        };
        Ok((value, acks))
    }
}

/// Settles replica sync and, when it is on, opens the connections synced writes use.
/// Under [`ReplicaSync::Auto`], a master with no replica yet is asked again every
/// [`AUTO_RECHECK`] by a service on the client's runtime, which turns sync on once one
/// has attached.
pub(crate) async fn synced_writes(
    setting: ReplicaSync,
    connection: &Connection,
    servers: &Servers,
    config: &Config,
    background: &Background,
    cluster: bool,
) -> Result<SyncSlot> {
    let slot = SyncSlot::default();
    match resolve(setting, connection, cluster).await? {
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
        let policy = match resolve(ReplicaSync::Auto, &connection, false).await {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(aof: bool) -> SyncPolicy {
        SyncPolicy {
            replicas: 1,
            timeout: Duration::from_secs(1),
            timeout_ms: 1000,
            aof,
            per_shard: false,
        }
    }

    #[test]
    fn counts_only_online_replicas() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:3\r\n\
                    slave0:ip=127.0.0.1,port=0,state=wait_bgsave,offset=0,lag=0\r\n\
                    slave1:ip=10.0.0.2,port=6380,state=online,offset=42,lag=0\r\n\
                    slave2:ip=10.0.0.3,port=6380,state=send_bulk,offset=0,lag=0\r\n\
                    master_repl_offset:42\r\n";
        assert_eq!(online_replicas(info), 1);
        assert_eq!(online_replicas("role:master\r\nconnected_slaves:0\r\n"), 0);
    }

    #[test]
    fn reads_wait_and_waitaof_replies() {
        assert_eq!(policy(false).acknowledged(&Value::Int(2)), Some(2));
        let both = Value::Array(vec![Value::Int(1), Value::Int(1)]);
        assert_eq!(policy(true).acknowledged(&both), Some(1));
        let no_local = Value::Array(vec![Value::Int(0), Value::Int(2)]);
        assert_eq!(policy(true).acknowledged(&no_local), Some(0));
        assert_eq!(policy(false).acknowledged(&Value::Nil), None);
    }
}
