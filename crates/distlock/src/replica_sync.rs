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

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{Cmd, Value};

use crate::connection::Connection;
use crate::duration::to_millis;
use crate::error::{Error, Result};

/// Whether lock writes wait for replicas; see [`ClientBuilder::replica_sync`].
///
/// [`ClientBuilder::replica_sync`]: crate::ClientBuilder::replica_sync
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ReplicaSync {
    /// On (1 replica, within 1 s) whenever the master has a replica connected, as
    /// Redisson's `checkLockSyncedSlaves`. The default.
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
    /// write, at most `timeout`. An acquisition with fewer acknowledgements is given back;
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
}

impl SyncPolicy {
    /// The command that follows a lock write.
    fn wait_command(&self) -> Cmd {
        let mut cmd = if self.aof {
            let mut cmd = redis::cmd("WAITAOF");
            cmd.arg(1);
            cmd
        } else {
            redis::cmd("WAIT")
        };
        cmd.arg(self.replicas).arg(self.timeout_ms);
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
/// ordinary command connection, to its master). `cluster`: replica sync is not offered on
/// a cluster yet, and asking for it there is an error rather than a silent no.
pub(crate) async fn resolve(
    setting: ReplicaSync,
    connection: &Connection,
    cluster: bool,
) -> Result<Resolved> {
    let (replicas, timeout) = match setting {
        ReplicaSync::Off => return Ok(Resolved::Off),
        ReplicaSync::Replicas { count, timeout } => {
            if cluster {
                return Err(Error::InvalidConfig {
                    what: "replica sync",
                    reason: "not supported on a Redis Cluster yet; see docs/deployment.md".into(),
                });
            }
            if count == 0 {
                return Err(Error::InvalidConfig {
                    what: "replica sync",
                    reason: "needs at least 1 replica; use ReplicaSync::Off for none".into(),
                });
            }
            (count, timeout)
        }
        ReplicaSync::Auto => {
            if cluster {
                return Ok(Resolved::Off);
            }
            let replication = info(connection, "replication").await;
            match field(&replication, "connected_slaves").and_then(|n| n.parse::<u32>().ok()) {
                Some(connected) if connected >= 1 => (1, AUTO_TIMEOUT),
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
    let has_waitaof = redis::cmd("WAITAOF")
        .arg(0)
        .arg(0)
        .arg(0)
        .query_async::<Value>(&mut probe)
        .await
        .is_ok();
    let aof_on = field(&info(connection, "persistence").await, "aof_enabled") == Some("1".into());
    Ok(Resolved::On(SyncPolicy {
        replicas,
        timeout,
        timeout_ms,
        aof: has_waitaof && aof_on,
    }))
}

async fn info(connection: &Connection, section: &str) -> String {
    let mut connection = connection.clone();
    redis::cmd("INFO")
        .arg(section)
        .query_async::<String>(&mut connection)
        .await
        .unwrap_or_default()
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

    /// One of the synced connections, for a command that needs no WAIT (loading a script).
    pub(crate) fn connection(&self) -> Connection {
        let at = self.next.load(Ordering::Relaxed) % self.connections.len();
        self.connections[at].connection.clone()
    }

    /// Sends `write` and the WAIT behind it, in one pipeline on one of the synced
    /// connections. Returns the write's reply and how many replicas acknowledged.
    pub(crate) async fn send<T: redis::FromRedisValue>(
        &self,
        write: &Cmd,
    ) -> redis::RedisResult<(T, u32)> {
        let count = self.connections.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % count;
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
        pipeline.add_command(self.policy.wait_command());
        let mut replies = connection.req_packed_commands(&pipeline, 0, 2).await?;
        let waited = replies.pop();
        let written = replies.pop();
        let (Some(written), Some(waited)) = (written, waited) else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "a synced write did not get two replies",
            )));
        };
        let value = match written {
            Value::ServerError(err) => return Err(err.into()),
            written => T::from_redis_value(written)?,
        };
        let acknowledged = match waited {
            Value::ServerError(err) => return Err(err.into()),
            waited => self.policy.acknowledged(&waited).unwrap_or(0),
        };
        Ok((value, acknowledged))
    }
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
        }
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
