//! A real Redis Sentinel deployment for tests: one master, two replicas, three sentinels.
//!
//! Every process is a [`PrivateRedis`] (the sentinels through
//! [`private_redis::Builder::sentinel`]), so each has a free loopback port and a private
//! directory, and all are killed when the [`SentinelGroup`] is dropped.
//!
//! Processes are addressed by **port**, because that is what Sentinel reports: the
//! master's port changes with each failover, and a test asks
//! [`master_port`](SentinelGroup::master_port) which one it is now.
//!
//! # Losing an acknowledged write in a failover
//!
//! Redis replication is asynchronous, so a lock written to the master and acknowledged
//! can vanish when the master dies before its replicas received it and Sentinel promotes
//! one of them. To make that happen on demand, not by luck of timing:
//!
//! ```no_run
//! use std::time::Duration;
//! use distlock_testkit::{SentinelGroup, TestkitError};
//!
//! # async fn demo() -> Result<(), TestkitError> {
//! let mut group = SentinelGroup::start().await?;
//! group.cut_replica_links().await?;   // replicas frozen, their links dropped
//! // ... client A takes its lock: the write lands on the master only ...
//! let old = group.kill_master().await?; // the only copy of the write is gone
//! group.heal_replica_links()?;          // replicas thaw and find the master dead
//! let new = group.wait_for_new_master(old, Duration::from_secs(30)).await?;
//! // ... client B finds the lock free on the new master ...
//! # let _ = new;
//! # Ok(())
//! # }
//! ```
//!
//! Why this shape: freezing the replicas alone is not enough, because the master keeps
//! sending to their sockets and the kernel buffers the bytes, which a thawed replica
//! would then apply. [`cut_replica_links`](SentinelGroup::cut_replica_links) therefore
//! also makes the master drop its replica connections (`CLIENT KILL TYPE replica`); the
//! frozen replicas cannot reconnect, so later writes stay on the master alone. The
//! replicas are thawed right after the kill, well before Sentinel's down-after period,
//! so Sentinel still considers them fit for promotion.

use std::collections::HashMap;
use std::time::Duration;

use private_redis::PrivateRedis;

use crate::error::TestkitError;
use crate::probe::{drop_replica_links, info, info_field, poll, query, role};

/// The name under which the sentinels monitor the master.
pub const MASTER_NAME: &str = "mymaster";

const REPLICAS: usize = 2;
const SENTINELS: usize = 3;
/// Sentinels that must agree the master is down before a failover.
const QUORUM: usize = 2;
/// Short, so a failover starts a second after the master stops answering.
const DOWN_AFTER_MS: u64 = 1000;
/// Also the time before a failover that found no leader or no good replica is retried
/// (twice this), so short; but long enough for the promotion itself on a loaded machine.
const FAILOVER_TIMEOUT_MS: u64 = 3000;
/// Bound on the group settling after start: Sentinels find replicas through the master's
/// INFO and each other through hello messages every 2 s.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);

/// A master, two replicas and three Sentinels monitoring them as [`MASTER_NAME`].
#[derive(Debug)]
pub struct SentinelGroup {
    /// Data servers; the first started as the master, but any may be master now.
    servers: Vec<PrivateRedis>,
    sentinels: Vec<PrivateRedis>,
    /// Ports of the replicas frozen by [`cut_replica_links`](Self::cut_replica_links).
    cut: Vec<u16>,
}

impl SentinelGroup {
    /// Starts the master, its two replicas (`--replicaof`) and three Sentinels
    /// (`sentinel monitor mymaster 127.0.0.1 <port> 2`, down after 1 s), then waits until
    /// both replicas' links are up and every Sentinel knows both replicas and the two
    /// other Sentinels.
    pub async fn start() -> Result<SentinelGroup, TestkitError> {
        let master = PrivateRedis::ephemeral()
            .args(&data_server_args())
            .start()
            .await?;
        let master_port = master.port().to_string();
        let mut servers = vec![master];
        for _ in 0..REPLICAS {
            let mut args = data_server_args();
            args.extend(["--replicaof", "127.0.0.1", &master_port]);
            servers.push(PrivateRedis::ephemeral().args(&args).start().await?);
        }
        let mut group = SentinelGroup {
            servers,
            sentinels: Vec::new(),
            cut: Vec::new(),
        };
        // Replicas linked before the Sentinels start, so each Sentinel's first INFO of the
        // master already lists them instead of only its next one, 10 s later.
        group.wait_for_replica_links(SETTLE_TIMEOUT).await?;

        let config = format!(
            "sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} {QUORUM}\n\
             sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n\
             sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n\
             sentinel parallel-syncs {MASTER_NAME} {REPLICAS}\n"
        );
        for _ in 0..SENTINELS {
            let sentinel = PrivateRedis::ephemeral()
                .sentinel(config.clone())
                .start()
                .await?;
            group.sentinels.push(sentinel);
        }
        group.wait_until_sentinels_agree().await?;
        Ok(group)
    }

    /// `redis://127.0.0.1:{port}` of every Sentinel.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinel_ports()
            .into_iter()
            .map(|port| format!("redis://127.0.0.1:{port}"))
            .collect()
    }

    /// The client ports of the Sentinels.
    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(PrivateRedis::port).collect()
    }

    /// `redis+sentinel://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3/mymaster`: the whole
    /// deployment in one URL, for clients configured by URL.
    pub fn sentinel_url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinel_ports()
            .into_iter()
            .map(|port| format!("127.0.0.1:{port}"))
            .collect();
        format!("redis+sentinel://{}/{MASTER_NAME}", hosts.join(","))
    }

    /// The monitored master's name, [`MASTER_NAME`].
    pub fn master_name(&self) -> &'static str {
        MASTER_NAME
    }

    /// The client ports of the data servers (master and replicas) in start order; the
    /// first was the master at start.
    pub fn server_ports(&self) -> Vec<u16> {
        self.servers.iter().map(PrivateRedis::port).collect()
    }

    /// The master's port as the first answering Sentinel reports it
    /// (`SENTINEL GET-MASTER-ADDR-BY-NAME`).
    pub async fn master_port(&self) -> Result<u16, TestkitError> {
        let mut last_error = None;
        for port in self.live_sentinel_ports() {
            match sentinel_master_port(port).await {
                Ok(master) => return Ok(master),
                Err(err) => last_error = Some(err),
            }
        }
        Err(last_error
            .unwrap_or_else(|| TestkitError::Topology("no Sentinel is running".to_owned())))
    }

    /// The ports of the data servers other than the current master, alive or not.
    pub async fn replica_ports(&self) -> Result<Vec<u16>, TestkitError> {
        let master = self.master_port().await?;
        Ok(self
            .server_ports()
            .into_iter()
            .filter(|port| *port != master)
            .collect())
    }

    /// Freezes the process on `port` (data server or Sentinel) with SIGSTOP.
    pub fn pause(&self, port: u16) -> Result<(), TestkitError> {
        Ok(self.process(port)?.pause()?)
    }

    /// Continues the process on `port` after [`pause`](Self::pause) (SIGCONT).
    pub fn resume(&self, port: u16) -> Result<(), TestkitError> {
        Ok(self.process(port)?.resume()?)
    }

    /// Kills the process on `port` with SIGKILL and waits until it has exited.
    pub async fn kill(&mut self, port: u16) -> Result<(), TestkitError> {
        self.cut.retain(|cut| *cut != port);
        Ok(self.process_mut(port)?.kill().await?)
    }

    /// Restarts the process on `port` (killing it first if it runs) with the same
    /// arguments. A data server comes back empty, as the replica of whatever its command
    /// line says until Sentinel reconfigures it; a Sentinel keeps the state it wrote to
    /// its config file.
    pub async fn restart(&mut self, port: u16) -> Result<(), TestkitError> {
        self.cut.retain(|cut| *cut != port);
        Ok(self.process_mut(port)?.restart().await?)
    }

    /// Kills the current master (SIGKILL) and returns its port. Sentinel notices after
    /// its down-after period (1 s) and promotes a replica; see
    /// [`wait_for_new_master`](Self::wait_for_new_master).
    pub async fn kill_master(&mut self) -> Result<u16, TestkitError> {
        let master = self.master_port().await?;
        self.kill(master).await?;
        Ok(master)
    }

    /// Stops replication from the current master without making the replicas
    /// unpromotable: freezes every replica (SIGSTOP), then has the master drop its
    /// replica connections (`CLIENT KILL TYPE replica`) and checks that it has none left.
    /// From then on a write acknowledged by the master exists on the master only.
    ///
    /// Undo with [`heal_replica_links`](Self::heal_replica_links) soon (within Sentinel's
    /// 1 s down-after period is best): frozen replicas are marked down by Sentinel, and a
    /// failover finds no replica to promote while they are. See the module docs for the
    /// whole scenario.
    pub async fn cut_replica_links(&mut self) -> Result<(), TestkitError> {
        let master = self.master_port().await?;
        let replicas: Vec<u16> = self
            .servers
            .iter()
            .filter(|server| server.port() != master && server.pid().is_some())
            .map(PrivateRedis::port)
            .collect();
        for &port in &replicas {
            self.pause(port)?;
            self.cut.push(port);
        }
        drop_replica_links(master).await
    }

    /// Thaws the replicas frozen by [`cut_replica_links`](Self::cut_replica_links)
    /// (SIGCONT). They reconnect to the master (and catch up) if it is still alive.
    pub fn heal_replica_links(&mut self) -> Result<(), TestkitError> {
        for port in std::mem::take(&mut self.cut) {
            self.resume(port)?;
        }
        Ok(())
    }

    /// A graceful failover, as an operator starts one: `SENTINEL FAILOVER` (sent again
    /// while a Sentinel answers that no replica is fit yet), then waits, for at most
    /// `limit`, until the Sentinels name a new master and the old one has become its
    /// replica with its link up. Returns `(old, new)` master ports.
    pub async fn manual_failover(&self, limit: Duration) -> Result<(u16, u16), TestkitError> {
        let old = self.master_port().await?;
        let sentinel = self
            .live_sentinel_ports()
            .first()
            .copied()
            .ok_or_else(|| TestkitError::Topology("no Sentinel is running".to_owned()))?;
        poll(
            "a Sentinel to accept SENTINEL FAILOVER",
            limit,
            || async move {
                query::<String>(
                    sentinel,
                    redis::cmd("SENTINEL").arg("FAILOVER").arg(MASTER_NAME),
                )
                .await
                .map(drop)
                .map_err(|err| err.to_string())
            },
        )
        .await?;
        let new = self.wait_for_new_master(old, limit).await?;
        poll(
            &format!("old master {old} to replicate from {new}"),
            limit,
            || async move {
                let replication = info(old, "replication")
                    .await
                    .map_err(|err| err.to_string())?;
                match info_field(&replication, "master_link_status") {
                    Some("up") => Ok(()),
                    other => Err(format!("master_link_status {other:?}")),
                }
            },
        )
        .await?;
        Ok((old, new))
    }

    /// Waits, for at most `limit`, until every running Sentinel reports a master other
    /// than `old_port` and that server answers `INFO replication` with `role:master`.
    /// Returns its port. A Sentinel frozen with [`pause`](Self::pause) counts as running
    /// and cannot answer, so resume it before waiting.
    pub async fn wait_for_new_master(
        &self,
        old_port: u16,
        limit: Duration,
    ) -> Result<u16, TestkitError> {
        let sentinels = self.live_sentinel_ports();
        poll(
            &format!("Sentinel to replace master {old_port}"),
            limit,
            || {
                let sentinels = &sentinels;
                async move {
                    let mut reported = Vec::with_capacity(sentinels.len());
                    for &sentinel in sentinels {
                        let master = sentinel_master_port(sentinel)
                            .await
                            .map_err(|err| format!("sentinel {sentinel}: {err}"))?;
                        reported.push(master);
                    }
                    let new = match reported.as_slice() {
                        [first, rest @ ..]
                            if *first != old_port && rest.iter().all(|port| port == first) =>
                        {
                            *first
                        }
                        _ => return Err(format!("sentinels report masters {reported:?}")),
                    };
                    match role(new).await {
                        Ok(role) if role == "master" => Ok(new),
                        Ok(role) => Err(format!("{new} is reported but has role {role}")),
                        Err(err) => Err(format!("{new} is reported but: {err}")),
                    }
                }
            },
        )
        .await
    }

    fn process(&self, port: u16) -> Result<&PrivateRedis, TestkitError> {
        self.servers
            .iter()
            .chain(&self.sentinels)
            .find(|process| process.port() == port)
            .ok_or_else(|| TestkitError::Topology(format!("no process of the group on {port}")))
    }

    fn process_mut(&mut self, port: u16) -> Result<&mut PrivateRedis, TestkitError> {
        self.servers
            .iter_mut()
            .chain(&mut self.sentinels)
            .find(|process| process.port() == port)
            .ok_or_else(|| TestkitError::Topology(format!("no process of the group on {port}")))
    }

    fn live_sentinel_ports(&self) -> Vec<u16> {
        self.sentinels
            .iter()
            .filter(|sentinel| sentinel.pid().is_some())
            .map(PrivateRedis::port)
            .collect()
    }

    async fn wait_for_replica_links(&self, limit: Duration) -> Result<(), TestkitError> {
        let replicas: Vec<u16> = self
            .servers
            .iter()
            .skip(1)
            .map(PrivateRedis::port)
            .collect();
        poll("replica links to come up", limit, || {
            let replicas = &replicas;
            async move {
                for &port in replicas {
                    let replication = info(port, "replication")
                        .await
                        .map_err(|err| format!("replica {port}: {err}"))?;
                    let link = info_field(&replication, "master_link_status");
                    if link != Some("up") {
                        return Err(format!("replica {port}: master_link_status {link:?}"));
                    }
                }
                Ok(())
            }
        })
        .await
    }

    async fn wait_until_sentinels_agree(&self) -> Result<(), TestkitError> {
        let sentinels = self.sentinel_ports();
        let mut replicas: Vec<u16> = self
            .servers
            .iter()
            .skip(1)
            .map(PrivateRedis::port)
            .collect();
        replicas.sort_unstable();
        poll(
            "every Sentinel to know both replicas and the other Sentinels",
            SETTLE_TIMEOUT,
            || {
                let sentinels = &sentinels;
                let replicas = &replicas;
                async move {
                    for &sentinel in sentinels {
                        let failed = |err: TestkitError| format!("sentinel {sentinel}: {err}");
                        let known = sentinel_list(sentinel, "REPLICAS").await.map_err(failed)?;
                        let mut known = ports_of(&known);
                        known.sort_unstable();
                        if known != *replicas {
                            return Err(format!("sentinel {sentinel} knows replicas {known:?}"));
                        }
                        let peers = sentinel_list(sentinel, "SENTINELS").await.map_err(failed)?;
                        if peers.len() != SENTINELS - 1 {
                            return Err(format!(
                                "sentinel {sentinel} knows {} other sentinels",
                                peers.len()
                            ));
                        }
                    }
                    Ok(())
                }
            },
        )
        .await
    }
}

/// Arguments of every data server.
fn data_server_args() -> Vec<&'static str> {
    vec![
        // Redis 7 delays a full sync by 5 s to batch replicas; start and failover would
        // wait for it.
        "--repl-diskless-sync-delay",
        "0",
    ]
}

/// `SENTINEL GET-MASTER-ADDR-BY-NAME` on the Sentinel at `port`.
async fn sentinel_master_port(port: u16) -> Result<u16, TestkitError> {
    let addr: Option<(String, String)> = query(
        port,
        redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(MASTER_NAME),
    )
    .await?;
    let (_, master) =
        addr.ok_or_else(|| TestkitError::Topology(format!("Sentinel {port} knows no master")))?;
    master
        .parse()
        .map_err(|_| TestkitError::UnexpectedReply(format!("master port `{master}`")))
}

/// `SENTINEL <what> mymaster` (`REPLICAS` or `SENTINELS`): one field map per instance.
async fn sentinel_list(
    port: u16,
    what: &str,
) -> Result<Vec<HashMap<String, String>>, TestkitError> {
    let entries: Vec<Vec<String>> =
        query(port, redis::cmd("SENTINEL").arg(what).arg(MASTER_NAME)).await?;
    Ok(entries
        .into_iter()
        .map(|flat| {
            flat.chunks_exact(2)
                .map(|pair| (pair[0].clone(), pair[1].clone()))
                .collect()
        })
        .collect())
}

fn ports_of(entries: &[HashMap<String, String>]) -> Vec<u16> {
    entries
        .iter()
        .filter_map(|entry| entry.get("port")?.parse().ok())
        .collect()
}
