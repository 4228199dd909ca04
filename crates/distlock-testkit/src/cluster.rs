//! A real Redis Cluster for tests: three masters and three replicas on loopback.
//!
//! Every node is a [`PrivateRedis`] with cluster mode on, so it gets a free port, a
//! private directory (holding its `nodes.conf`, which keeps its node id across a
//! [`restart`](RedisCluster::restart)) and is killed when the [`RedisCluster`] is dropped.
//! The cluster is created with `redis-cli --cluster create`, as an operator would.
//!
//! Besides accessors for the topology, the harness injects the faults a lock running on
//! a cluster must survive: frozen or crashed nodes, failovers (by crash or by operator),
//! and slot migrations, including a split form that leaves a slot half-migrated (so
//! clients see `ASK` redirects) for as long as the test wants.
//!
//! Node *indices* (0..6, in start order) identify processes and never change; roles do.
//! Queries about roles ask the nodes, so they see failovers.

use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use private_redis::{pick_free_port, PrivateRedis};

use crate::error::TestkitError;
use crate::probe::{self, info_field, poll, query};

/// Number of hash slots of a Redis Cluster.
pub const CLUSTER_SLOTS: u16 = 16384;

/// Environment variable naming the `redis-cli` binary to use instead of the one on `PATH`.
pub const REDIS_CLI_ENV: &str = "DISTLOCK_REDIS_CLI";

const MASTERS: usize = 3;
const NODES: usize = 6;
/// Short, so failure detection (and with it a failover) takes seconds, not the default
/// 15 s; not shorter, because on a loaded two-core machine a node can miss a ping
/// deadline of a few hundred milliseconds and be failed over spuriously.
const NODE_TIMEOUT_MS: u64 = 1500;
/// Bound on `redis-cli --cluster create`, which itself waits for the nodes to agree.
const CREATE_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound on the cluster settling after start, a failover, a restart or a migration:
/// failure detection takes about two node timeouts, the election up to a second more.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);
/// A new cluster-bus port is picked when redis-server could not bind the last one.
const BUS_PORT_ATTEMPTS: u32 = 5;
/// Keys moved per `MIGRATE`, as `redis-cli --cluster reshard` does by default.
const MIGRATE_BATCH: usize = 100;
/// `MIGRATE`'s own timeout for talking to the target, in milliseconds.
const MIGRATE_TIMEOUT_MS: u64 = 5000;

/// A node's role in the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterRole {
    /// Serves slots.
    Master,
    /// Replicates a master and takes over when it fails.
    Replica,
}

/// One node as the cluster sees it (see [`RedisCluster::nodes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterNodeInfo {
    /// Index of the node's process in the [`RedisCluster`] (start order, stable).
    pub index: usize,
    /// Its client port on 127.0.0.1.
    pub port: u16,
    /// Its cluster node id.
    pub id: String,
    /// Its current role.
    pub role: ClusterRole,
    /// For a replica, the node id of its master.
    pub master_id: Option<String>,
    /// The slots it serves, as inclusive ranges (empty for a replica).
    pub slots: Vec<RangeInclusive<u16>>,
    /// Whether the observing node flags it as failing (`fail` or `fail?`).
    pub failing: bool,
}

impl ClusterNodeInfo {
    /// Whether it serves `slot`.
    pub fn serves(&self, slot: u16) -> bool {
        self.slots.iter().any(|range| range.contains(&slot))
    }
}

/// One process of the cluster.
#[derive(Debug)]
struct Node {
    process: PrivateRedis,
    bus_port: u16,
    /// Kept in the node's `nodes.conf`, so it survives restarts.
    id: String,
    /// Mirrors SIGSTOP/SIGCONT so waits skip a node that cannot answer.
    paused: AtomicBool,
}

/// Three masters and three replicas forming a Redis Cluster on loopback.
///
/// ```no_run
/// use distlock_testkit::{RedisCluster, TestkitError};
///
/// # async fn demo() -> Result<(), TestkitError> {
/// let mut cluster = RedisCluster::start().await?;
/// let client = redis::cluster::ClusterClient::new(cluster.seed_urls())?;
/// let mut conn = client.get_async_connection().await?;
/// let () = redis::cmd("SET").arg("k").arg("v").query_async(&mut conn).await?;
///
/// let slot = cluster.key_slot("k").await?;
/// let owner = cluster.master_for_slot(slot).await?;
/// let promoted = cluster.failover_by_kill(owner).await?;
/// assert_eq!(cluster.master_for_slot(slot).await?, promoted);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<Node>,
}

impl RedisCluster {
    /// Starts six cluster-mode servers, creates the cluster with `redis-cli --cluster
    /// create ... --cluster-replicas 1`, and waits until every node reports
    /// `cluster_state:ok` with all 16384 slots covered, all nodes agree on who serves which
    /// slot, and every replica's link to its master is up.
    ///
    /// `redis-cli` is taken from `DISTLOCK_REDIS_CLI` if set, otherwise from `PATH`.
    pub async fn start() -> Result<RedisCluster, TestkitError> {
        let cluster = RedisCluster {
            nodes: start_nodes(NODES).await?,
        };
        cluster.create().await?;
        cluster.wait_for_topology(NODES, MASTERS).await?;
        Ok(cluster)
    }

    /// One master serving all 16384 slots, with one replica: a cluster with the same
    /// processes as a standalone master and its replica, so that comparing the two shows
    /// what cluster mode and routing by slot cost, apart from the cost of more processes.
    /// Failover helpers work on it as on [`start`](Self::start)'s cluster.
    pub async fn start_single_shard() -> Result<RedisCluster, TestkitError> {
        let cluster = RedisCluster {
            nodes: start_nodes(2).await?,
        };
        let (master, replica) = (cluster.port(0)?, cluster.port(1)?);
        let () = query(
            master,
            redis::cmd("CLUSTER")
                .arg("ADDSLOTSRANGE")
                .arg(0)
                .arg(CLUSTER_SLOTS - 1),
        )
        .await?;
        let () = query(
            replica,
            redis::cmd("CLUSTER")
                .arg("MEET")
                .arg("127.0.0.1")
                .arg(master)
                .arg(cluster.bus_port(0)?),
        )
        .await?;
        // A node can follow only a master it has met.
        let master_id = cluster.node_id(0)?.to_owned();
        poll("the replica to learn the master", SETTLE_TIMEOUT, || {
            let master_id = &master_id;
            async move {
                let nodes: String = query(replica, redis::cmd("CLUSTER").arg("NODES"))
                    .await
                    .map_err(|err| err.to_string())?;
                if nodes.contains(master_id.as_str()) {
                    Ok(())
                } else {
                    Err("master not known yet".to_owned())
                }
            }
        })
        .await?;
        let () = query(
            replica,
            redis::cmd("CLUSTER").arg("REPLICATE").arg(&master_id),
        )
        .await?;
        cluster.wait_for_topology(2, 1).await?;
        Ok(cluster)
    }

    /// Waits until every node reports a healthy cluster of `nodes` nodes, `masters` of
    /// them masters.
    async fn wait_for_topology(&self, nodes: usize, masters: usize) -> Result<(), TestkitError> {
        self.wait_until(
            "a new cluster: all nodes joined, all slots covered",
            SETTLE_TIMEOUT,
            |views| {
                let (_, view) = views.first().ok_or("no node answered")?;
                if view.len() != nodes {
                    return Err(format!("{} of {nodes} nodes known", view.len()));
                }
                let found = view
                    .iter()
                    .filter(|node| node.role == ClusterRole::Master)
                    .count();
                if found != masters {
                    return Err(format!("{found} masters, want {masters}"));
                }
                Ok(())
            },
        )
        .await
    }

    /// `redis-cli --cluster create`: assigns slots to the first three nodes and makes the
    /// others their replicas.
    async fn create(&self) -> Result<(), TestkitError> {
        let binary = std::env::var_os(REDIS_CLI_ENV)
            .filter(|path| !path.is_empty())
            .unwrap_or_else(|| "redis-cli".into());
        let mut command = tokio::process::Command::new(binary);
        command.args(["--cluster", "create"]);
        command.args(self.nodes.iter().map(|node| address(node.process.port())));
        command
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let what = "--cluster create".to_owned();
        let output = tokio::time::timeout(CREATE_TIMEOUT, command.output())
            .await
            .map_err(|_| TestkitError::RedisCli {
                what: what.clone(),
                status: format!("did not finish within {CREATE_TIMEOUT:?}"),
                output: String::new(),
            })?
            .map_err(TestkitError::io("running redis-cli --cluster create"))?;
        if !output.status.success() {
            return Err(TestkitError::RedisCli {
                what,
                status: output.status.to_string(),
                output: format!(
                    "{}{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                ),
            });
        }
        Ok(())
    }

    /// `redis://127.0.0.1:{port}` of every node, in index order: seeds for a cluster
    /// client.
    pub fn seed_urls(&self) -> Vec<String> {
        self.ports()
            .into_iter()
            .map(|port| format!("redis://127.0.0.1:{port}"))
            .collect()
    }

    /// `redis+cluster://127.0.0.1:{port},…` naming every node: the URL distlock (and a
    /// service's `REDIS_URL`) takes for a cluster.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .ports()
            .into_iter()
            .map(|port| format!("127.0.0.1:{port}"))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// A cluster client seeded with every node. Creating it does not connect.
    pub fn client(&self) -> Result<redis::cluster::ClusterClient, TestkitError> {
        Ok(redis::cluster::ClusterClient::new(self.seed_urls())?)
    }

    /// The client ports of all nodes, in index order.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|node| node.process.port()).collect()
    }

    /// The client port of node `index`.
    pub fn port(&self, index: usize) -> Result<u16, TestkitError> {
        Ok(self.node(index)?.process.port())
    }

    /// The cluster-bus port of node `index` (chosen freely, not port + 10000, which may be
    /// taken or beyond 65535).
    pub fn bus_port(&self, index: usize) -> Result<u16, TestkitError> {
        Ok(self.node(index)?.bus_port)
    }

    /// The cluster node id of node `index`.
    pub fn node_id(&self, index: usize) -> Result<&str, TestkitError> {
        Ok(&self.node(index)?.id)
    }

    /// Whether node `index` is running and not paused.
    pub fn is_up(&self, index: usize) -> bool {
        self.nodes.get(index).is_some_and(Node::is_up)
    }

    /// A plain (non-cluster) connection to node `index`, e.g. to see the `MOVED`/`ASK`
    /// redirects a cluster client follows silently.
    pub async fn node_connection(
        &self,
        index: usize,
    ) -> Result<redis::aio::MultiplexedConnection, TestkitError> {
        let client = redis::Client::open(probe::url(self.port(index)?))?;
        Ok(client.get_multiplexed_async_connection().await?)
    }

    /// Every node with its current role and slots, as the first node that is up sees
    /// them. After any of this type's operations the nodes agree, so whose view it is
    /// only matters while a test changes the topology behind the harness's back.
    pub async fn nodes(&self) -> Result<Vec<ClusterNodeInfo>, TestkitError> {
        let mut last_error = None;
        for node in self.nodes.iter().filter(|node| node.is_up()) {
            match self.view_of(node.process.port()).await {
                Ok(view) => return Ok(view),
                Err(err) => last_error = Some(err),
            }
        }
        Err(last_error
            .unwrap_or_else(|| TestkitError::Topology("no node of the cluster is up".to_owned())))
    }

    /// The slot of `key` (`CLUSTER KEYSLOT`, asked of a node that is up).
    pub async fn key_slot(&self, key: &str) -> Result<u16, TestkitError> {
        let port = self.any_up_port()?;
        query(port, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key)).await
    }

    /// Index of the master serving `slot`.
    pub async fn master_for_slot(&self, slot: u16) -> Result<usize, TestkitError> {
        self.nodes()
            .await?
            .into_iter()
            .find(|node| node.role == ClusterRole::Master && node.serves(slot))
            .map(|node| node.index)
            .ok_or_else(|| TestkitError::Topology(format!("no master serves slot {slot}")))
    }

    /// Index of a replica of master `master` that is up.
    pub async fn replica_of(&self, master: usize) -> Result<usize, TestkitError> {
        let master_id = self.node(master)?.id.clone();
        let view = self.nodes().await?;
        let info = view.iter().find(|node| node.index == master);
        if info.map(|node| node.role) != Some(ClusterRole::Master) {
            return Err(TestkitError::Topology(format!(
                "node {master} is not a master"
            )));
        }
        view.iter()
            .find(|node| {
                node.master_id.as_deref() == Some(master_id.as_str()) && self.is_up(node.index)
            })
            .map(|node| node.index)
            .ok_or_else(|| {
                TestkitError::Topology(format!("master {master} has no replica that is up"))
            })
    }

    /// Freezes node `index` with SIGSTOP: it keeps its connections but answers nothing,
    /// neither clients nor the cluster bus, so after the node timeout the others flag it
    /// as failing and, if it is a master, fail it over.
    pub fn pause(&self, index: usize) -> Result<(), TestkitError> {
        let node = self.node(index)?;
        node.process.pause()?;
        node.paused.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Continues node `index` after [`pause`](Self::pause) (SIGCONT).
    pub fn resume(&self, index: usize) -> Result<(), TestkitError> {
        let node = self.node(index)?;
        node.process.resume()?;
        node.paused.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Kills node `index` with SIGKILL and waits until the process has exited. The
    /// others are not waited for; see [`failover_by_kill`](Self::failover_by_kill).
    pub async fn kill(&mut self, index: usize) -> Result<(), TestkitError> {
        let node = self.node_mut(index)?;
        node.process.kill().await?;
        node.paused.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Restarts node `index` (killing it first if it runs) on the same ports with the same
    /// node id, then waits until the cluster is healthy again with all six nodes up.
    ///
    /// Persistence is off, so it comes back **empty**: a failed-over master rejoins as a
    /// replica of its successor and resyncs; a master that was not failed over rejoins
    /// still owning its slots but without their keys.
    pub async fn restart(&mut self, index: usize) -> Result<(), TestkitError> {
        let node = self.node_mut(index)?;
        node.process.restart().await?;
        node.paused.store(false, Ordering::SeqCst);
        let port = node.process.port();
        self.wait_until(
            &format!("node {index} (port {port}) to rejoin the cluster"),
            SETTLE_TIMEOUT,
            |views| {
                if views.iter().any(|(observer, _)| *observer == index) {
                    Ok(())
                } else {
                    Err(format!("node {index} not answering yet"))
                }
            },
        )
        .await
    }

    /// Waits, for at most `limit`, until the nodes that are up all report
    /// `cluster_state:ok` with every slot served, agree on who serves which slot, and
    /// every replica among them has its master link up.
    pub async fn wait_until_healthy(&self, limit: Duration) -> Result<(), TestkitError> {
        self.wait_until("a healthy cluster", limit, |_| Ok(()))
            .await
    }

    /// Kills master `master` (SIGKILL) and waits until one of its replicas has been
    /// promoted and serves its slots, with `cluster_state:ok` back on every surviving node.
    /// Returns the index of the new master.
    pub async fn failover_by_kill(&mut self, master: usize) -> Result<usize, TestkitError> {
        let replica = self.replica_of(master).await?;
        let slots = self.slots_of(master).await?;
        self.kill(master).await?;
        self.wait_for_promotion(master, replica, &slots, "failover after a kill")
            .await?;
        Ok(replica)
    }

    /// Stops replication from master `master` without making its replica unpromotable:
    /// freezes the replica (SIGSTOP), then has the master drop its replica connections and
    /// checks that it has none left. From then on a write the master acknowledges exists
    /// on the master only. Returns the replica's index; finish with
    /// [`failover_by_kill_after_cut`](Self::failover_by_kill_after_cut).
    pub async fn cut_replica_link(&self, master: usize) -> Result<usize, TestkitError> {
        let replica = self.replica_of(master).await?;
        self.pause(replica)?;
        probe::drop_replica_links(self.port(master)?).await?;
        Ok(replica)
    }

    /// The lossy failover: kills master `master`, then thaws `replica` (frozen by
    /// [`cut_replica_link`](Self::cut_replica_link)), in that order so that the replica
    /// cannot catch up first, and waits until the replica serves the master's slots. What
    /// the master took after the cut is gone.
    pub async fn failover_by_kill_after_cut(
        &mut self,
        master: usize,
        replica: usize,
    ) -> Result<(), TestkitError> {
        let slots = self.slots_of(master).await?;
        self.kill(master).await?;
        self.resume(replica)?;
        self.wait_for_promotion(master, replica, &slots, "failover after a cut link")
            .await
    }

    /// Sends `CLUSTER FAILOVER` to a replica of master `master` (an orderly switch: the
    /// replica catches up first, so no write is lost) and waits until it serves the
    /// slots, the old master has become its replica with its link up, and the cluster is
    /// healthy. Returns the index of the new master.
    pub async fn manual_failover(&self, master: usize) -> Result<usize, TestkitError> {
        let replica = self.replica_of(master).await?;
        let slots = self.slots_of(master).await?;
        let () = query(self.port(replica)?, redis::cmd("CLUSTER").arg("FAILOVER")).await?;
        self.wait_for_promotion(master, replica, &slots, "manual failover")
            .await?;
        let new_master_id = self.node(replica)?.id.clone();
        self.wait_until(
            &format!("node {master} to follow the new master {replica}"),
            SETTLE_TIMEOUT,
            |views| {
                let old = views
                    .iter()
                    .flat_map(|(_, view)| view.iter())
                    .filter(|node| node.index == master);
                for node in old {
                    if node.master_id.as_deref() != Some(new_master_id.as_str()) {
                        return Err(format!("old master seen as {node:?}"));
                    }
                }
                Ok(())
            },
        )
        .await?;
        Ok(replica)
    }

    /// Moves `slot` (with its keys) to master `to` by the resharding protocol: importing
    /// on the target, migrating on the source, `MIGRATE` of the keys in batches, then
    /// `CLUSTER SETSLOT ... NODE` on every master. Waits until every node that is up
    /// agrees on the new owner. Moving a slot to its current owner does nothing.
    pub async fn migrate_slot(&self, slot: u16, to: usize) -> Result<(), TestkitError> {
        match self.begin_slot_migration(slot, to).await? {
            Some(migration) => migration.finish().await,
            None => Ok(()),
        }
    }

    /// Starts moving `slot` to master `to` and returns a handle to finish it, so a test
    /// can act while the slot is half-migrated. From now on the source answers `ASK` for
    /// keys of the slot it no longer has, and the target serves those keys to clients
    /// that send `ASKING`. Returns `None` when `to` already serves the slot.
    ///
    /// Dropping the handle without [`finish`](SlotMigration::finish) leaves the slot in
    /// the migrating state.
    pub async fn begin_slot_migration(
        &self,
        slot: u16,
        to: usize,
    ) -> Result<Option<SlotMigration>, TestkitError> {
        if slot >= CLUSTER_SLOTS {
            return Err(TestkitError::Topology(format!("slot {slot} out of range")));
        }
        let view = self.nodes().await?;
        let source = view
            .iter()
            .find(|node| node.role == ClusterRole::Master && node.serves(slot))
            .ok_or_else(|| TestkitError::Topology(format!("no master serves slot {slot}")))?;
        let target = view
            .iter()
            .find(|node| node.index == to)
            .ok_or_else(|| TestkitError::Topology(format!("no node {to}")))?;
        if target.role != ClusterRole::Master {
            return Err(TestkitError::Topology(format!(
                "node {to} is not a master; slots can only move to masters"
            )));
        }
        if source.index == to {
            return Ok(None);
        }
        let masters = view
            .iter()
            .filter(|node| node.role == ClusterRole::Master && self.is_up(node.index))
            .map(|node| node.port)
            .collect();
        let migration = SlotMigration {
            slot,
            source_port: source.port,
            source_id: source.id.clone(),
            target_port: target.port,
            target_id: target.id.clone(),
            masters,
            observers: self.up_ports(),
        };
        // Importing first: once the source says ASK, the target must accept ASKING.
        migration
            .setslot(migration.target_port, "IMPORTING", &migration.source_id)
            .await?;
        migration
            .setslot(migration.source_port, "MIGRATING", &migration.target_id)
            .await?;
        Ok(Some(migration))
    }

    fn node(&self, index: usize) -> Result<&Node, TestkitError> {
        self.nodes
            .get(index)
            .ok_or_else(|| TestkitError::Topology(format!("no node {index}")))
    }

    fn node_mut(&mut self, index: usize) -> Result<&mut Node, TestkitError> {
        self.nodes
            .get_mut(index)
            .ok_or_else(|| TestkitError::Topology(format!("no node {index}")))
    }

    fn any_up_port(&self) -> Result<u16, TestkitError> {
        self.up_ports()
            .first()
            .map(|(_, port)| *port)
            .ok_or_else(|| TestkitError::Topology("no node of the cluster is up".to_owned()))
    }

    /// `(index, port)` of the nodes that are running and not paused.
    fn up_ports(&self) -> Vec<(usize, u16)> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, node)| node.is_up())
            .map(|(index, node)| (index, node.process.port()))
            .collect()
    }

    async fn slots_of(&self, master: usize) -> Result<Vec<RangeInclusive<u16>>, TestkitError> {
        let view = self.nodes().await?;
        match view.into_iter().find(|node| node.index == master) {
            Some(node) if node.role == ClusterRole::Master && !node.slots.is_empty() => {
                Ok(node.slots)
            }
            _ => Err(TestkitError::Topology(format!(
                "node {master} is not a master serving slots"
            ))),
        }
    }

    async fn view_of(&self, port: u16) -> Result<Vec<ClusterNodeInfo>, TestkitError> {
        let text: String = query(port, redis::cmd("CLUSTER").arg("NODES")).await?;
        parse_nodes(&text, &self.ports())
    }

    /// Waits until `replica` serves `slots` in the view of every node that is up and the
    /// cluster is healthy.
    async fn wait_for_promotion(
        &self,
        old_master: usize,
        replica: usize,
        slots: &[RangeInclusive<u16>],
        what: &str,
    ) -> Result<(), TestkitError> {
        self.wait_until(
            &format!("{what}: node {replica} to replace master {old_master}"),
            SETTLE_TIMEOUT,
            |views| {
                for (observer, view) in views {
                    let promoted = view
                        .iter()
                        .find(|node| node.index == replica)
                        .ok_or_else(|| format!("node {observer} does not know {replica}"))?;
                    if promoted.role != ClusterRole::Master || promoted.slots != slots {
                        return Err(format!("node {observer} sees {promoted:?}"));
                    }
                }
                Ok(())
            },
        )
        .await
    }

    /// Polls the nodes that are up until they are healthy (see
    /// [`wait_until_healthy`](Self::wait_until_healthy)) and `extra` accepts their views.
    async fn wait_until<F>(&self, what: &str, limit: Duration, extra: F) -> Result<(), TestkitError>
    where
        F: Fn(&[(usize, Vec<ClusterNodeInfo>)]) -> Result<(), String>,
    {
        let ports = self.ports();
        poll(what, limit, || {
            let observers = self.up_ports();
            let ports = &ports;
            let extra = &extra;
            async move {
                let views = healthy_views(&observers, ports).await?;
                extra(&views)
            }
        })
        .await
    }
}

impl Node {
    fn is_up(&self) -> bool {
        self.process.pid().is_some() && !self.paused.load(Ordering::SeqCst)
    }
}

/// A slot migration in progress, from [`RedisCluster::begin_slot_migration`].
///
/// It holds only ports and ids, not a borrow of the cluster, so a test can keep using the
/// cluster (and its clients) while the slot is half-migrated.
#[derive(Debug)]
#[must_use = "the slot stays half-migrated until `finish` is called"]
pub struct SlotMigration {
    slot: u16,
    source_port: u16,
    source_id: String,
    target_port: u16,
    target_id: String,
    /// Client ports of the masters that were up at the start; each is told the new owner.
    masters: Vec<u16>,
    /// `(index, port)` of the nodes that were up at the start; they must agree at the end.
    observers: Vec<(usize, u16)>,
}

impl SlotMigration {
    /// The slot being moved.
    pub fn slot(&self) -> u16 {
        self.slot
    }

    /// Client port of the master giving the slot away.
    pub fn source_port(&self) -> u16 {
        self.source_port
    }

    /// Client port of the master receiving the slot.
    pub fn target_port(&self) -> u16 {
        self.target_port
    }

    /// Moves every key currently in the slot from the source to the target (`CLUSTER
    /// GETKEYSINSLOT` + `MIGRATE ... KEYS`, in batches) and returns how many moved. The
    /// slot stays migrating: afterwards the source answers `ASK` for all its keys.
    pub async fn move_keys(&self) -> Result<usize, TestkitError> {
        let mut moved = 0;
        loop {
            let keys: Vec<Vec<u8>> = query(
                self.source_port,
                redis::cmd("CLUSTER")
                    .arg("GETKEYSINSLOT")
                    .arg(self.slot)
                    .arg(MIGRATE_BATCH),
            )
            .await?;
            if keys.is_empty() {
                return Ok(moved);
            }
            let mut migrate = redis::cmd("MIGRATE");
            migrate
                .arg("127.0.0.1")
                .arg(self.target_port)
                .arg("")
                .arg(0)
                .arg(MIGRATE_TIMEOUT_MS)
                .arg("KEYS")
                .arg(&keys);
            let reply: String = query(self.source_port, &migrate).await?;
            // NOKEY: every key expired or was deleted since GETKEYSINSLOT; nothing moved.
            if reply != "OK" && reply != "NOKEY" {
                return Err(TestkitError::UnexpectedReply(format!("MIGRATE: {reply}")));
            }
            moved += keys.len();
        }
    }

    /// Moves the keys still in the source, assigns the slot to the target on every
    /// master (target first, so it owns the slot before the source starts answering
    /// `MOVED`), and waits until every node that was up agrees on the new owner.
    pub async fn finish(self) -> Result<(), TestkitError> {
        self.move_keys().await?;
        self.setslot(self.target_port, "NODE", &self.target_id)
            .await?;
        self.setslot(self.source_port, "NODE", &self.target_id)
            .await?;
        for &port in &self.masters {
            if port != self.target_port && port != self.source_port {
                self.setslot(port, "NODE", &self.target_id).await?;
            }
        }
        let all_ports: Vec<u16> = self.observers.iter().map(|(_, port)| *port).collect();
        let target_port = self.target_port;
        let slot = self.slot;
        poll(
            &format!("slot {slot} to be served by port {target_port} everywhere"),
            SETTLE_TIMEOUT,
            || {
                let observers = &self.observers;
                let all_ports = &all_ports;
                async move {
                    let views = healthy_views(observers, all_ports).await?;
                    for (observer, view) in &views {
                        let owner = view
                            .iter()
                            .find(|node| node.role == ClusterRole::Master && node.serves(slot));
                        if owner.map(|node| node.port) != Some(target_port) {
                            return Err(format!("node {observer} sees slot {slot} at {owner:?}"));
                        }
                    }
                    Ok(())
                }
            },
        )
        .await
    }

    async fn setslot(&self, port: u16, state: &str, node_id: &str) -> Result<(), TestkitError> {
        let () = query(
            port,
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(self.slot)
                .arg(state)
                .arg(node_id),
        )
        .await?;
        Ok(())
    }
}

/// Starts one cluster-mode server, retrying with a new bus port if its bus port was taken
/// between probing and binding.
/// Starts `count` cluster-mode servers, not yet joined into a cluster.
async fn start_nodes(count: usize) -> Result<Vec<Node>, TestkitError> {
    let mut nodes = Vec::with_capacity(count);
    for _ in 0..count {
        let (process, bus_port) = start_node().await?;
        let id: String = query(process.port(), redis::cmd("CLUSTER").arg("MYID")).await?;
        nodes.push(Node {
            process,
            bus_port,
            id,
            paused: AtomicBool::new(false),
        });
    }
    Ok(nodes)
}

async fn start_node() -> Result<(PrivateRedis, u16), TestkitError> {
    let mut last_error = None;
    for _ in 0..BUS_PORT_ATTEMPTS {
        let bus_port = pick_free_port()?;
        let bus = bus_port.to_string();
        let timeout = NODE_TIMEOUT_MS.to_string();
        let started = PrivateRedis::ephemeral()
            .args(&[
                "--cluster-enabled",
                "yes",
                // Relative to the node's private directory, so each node has its own.
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                &timeout,
                "--cluster-port",
                &bus,
                // A replica may take over however long it was cut off: tests pause
                // replicas for seconds, and a refused failover would hang the test.
                "--cluster-replica-validity-factor",
                "0",
                // Roles change only when a test asks, not by replicas wandering to
                // orphaned masters.
                "--cluster-allow-replica-migration",
                "no",
                // Redis 7 delays a full sync by 5 s to batch replicas; a test has no
                // other replica to wait for.
                "--repl-diskless-sync-delay",
                "0",
            ])
            .start()
            .await;
        match started {
            Ok(process) => return Ok((process, bus_port)),
            // Raised when every attempt of PrivateRedis hit "Address already in use";
            // with its own port fresh each time, the fixed bus port is the likely culprit.
            Err(err @ private_redis::Error::PortUnavailable { .. }) => last_error = Some(err),
            Err(err) => return Err(err.into()),
        }
    }
    Err(last_error.map_or_else(
        || TestkitError::Topology("no cluster node started".to_owned()),
        TestkitError::from,
    ))
}

fn address(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

/// Each observer's view, provided every observer is healthy and all views agree on who
/// serves which slot; otherwise a description of what is not right yet.
async fn healthy_views(
    observers: &[(usize, u16)],
    ports: &[u16],
) -> Result<Vec<(usize, Vec<ClusterNodeInfo>)>, String> {
    if observers.is_empty() {
        return Err("no node is up".to_owned());
    }
    let mut views = Vec::with_capacity(observers.len());
    let mut reference: Option<(usize, SlotOwners)> = None;
    for &(index, port) in observers {
        let failed = |err: TestkitError| format!("node {index} (port {port}): {err}");
        let info: String = query(port, redis::cmd("CLUSTER").arg("INFO"))
            .await
            .map_err(failed)?;
        let state = info_field(&info, "cluster_state");
        let slots_ok = info_field(&info, "cluster_slots_ok");
        if state != Some("ok") || slots_ok != Some("16384") {
            return Err(format!(
                "node {index}: cluster_state {state:?}, cluster_slots_ok {slots_ok:?}"
            ));
        }
        let text: String = query(port, redis::cmd("CLUSTER").arg("NODES"))
            .await
            .map_err(failed)?;
        let view = parse_nodes(&text, ports).map_err(failed)?;
        let me = view
            .iter()
            .find(|node| node.index == index)
            .ok_or_else(|| format!("node {index} does not list itself"))?;
        if me.role == ClusterRole::Replica {
            let replication = probe::info(port, "replication").await.map_err(failed)?;
            let link = info_field(&replication, "master_link_status");
            if link != Some("up") {
                return Err(format!("replica {index}: master_link_status {link:?}"));
            }
        }
        let owners = slot_owners(&view);
        match &reference {
            None => reference = Some((index, owners)),
            Some((first, expected)) if *expected != owners => {
                return Err(format!(
                    "nodes {first} and {index} disagree on slot owners: {expected:?} vs {owners:?}"
                ));
            }
            Some(_) => {}
        }
        views.push((index, view));
    }
    // Also agree on the nodes that are up: a node that just came back is flagged failing
    // for a while, and a failed-over master that restarts believes it is still a master
    // until the others tell it otherwise.
    for &(index, _) in observers {
        let mut seen = views.iter().map(|(observer, view)| {
            let node = view.iter().find(|node| node.index == index);
            (
                observer,
                node.map(|node| (node.role, &node.master_id, node.failing)),
            )
        });
        let Some((_, first)) = seen.next() else {
            continue;
        };
        if let Some((_, _, true)) = first {
            return Err(format!("node {index} is flagged failing"));
        }
        if let Some((observer, other)) = seen.find(|(_, other)| *other != first) {
            return Err(format!(
                "node {index} is {other:?} to node {observer} but {first:?} to another"
            ));
        }
    }
    Ok(views)
}

/// Slot ranges by first slot: `(last slot, owner id)`. Equal maps mean the same owners.
type SlotOwners = BTreeMap<u16, (u16, String)>;

/// Who serves which slots in `view`.
fn slot_owners(view: &[ClusterNodeInfo]) -> SlotOwners {
    view.iter()
        .filter(|node| node.role == ClusterRole::Master)
        .flat_map(|node| {
            node.slots
                .iter()
                .map(|range| (*range.start(), (*range.end(), node.id.clone())))
        })
        .collect()
}

/// Parses `CLUSTER NODES`; `ports` maps a node's port to its index. Lines of nodes not
/// in `ports` (there are none in a cluster of this harness) are skipped.
///
/// Line format: `<id> <ip:port@cport[,hostname]> <flags> <master> <ping-sent>
/// <pong-recv> <config-epoch> <link-state> <slot> <slot> ...`, where a slot is `n`,
/// `a-b`, or a bracketed migration marker, which is not ownership and is skipped.
fn parse_nodes(text: &str, ports: &[u16]) -> Result<Vec<ClusterNodeInfo>, TestkitError> {
    let mut nodes = Vec::new();
    for line in text.lines().filter(|line| !line.trim().is_empty()) {
        let malformed = || TestkitError::UnexpectedReply(format!("CLUSTER NODES line `{line}`"));
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [id, address, flags, master, _ping, _pong, _epoch, _link, slots @ ..] =
            fields.as_slice()
        else {
            return Err(malformed());
        };
        let port: u16 = address
            .split(['@', ','])
            .next()
            .and_then(|host_port| host_port.rsplit_once(':'))
            .and_then(|(_, port)| port.parse().ok())
            .ok_or_else(malformed)?;
        let Some(index) = ports.iter().position(|known| *known == port) else {
            continue;
        };
        let flags: Vec<&str> = flags.split(',').collect();
        let role = if flags.contains(&"master") {
            ClusterRole::Master
        } else if flags.contains(&"slave") {
            ClusterRole::Replica
        } else {
            // A node known only by a handshake has no role yet; treat it as not
            // part of the topology.
            continue;
        };
        let mut ranges = Vec::new();
        for slot in slots.iter().filter(|slot| !slot.starts_with('[')) {
            let (first, last) = slot.split_once('-').unwrap_or((slot, slot));
            let first: u16 = first.parse().map_err(|_| malformed())?;
            let last: u16 = last.parse().map_err(|_| malformed())?;
            ranges.push(first..=last);
        }
        ranges.sort_by_key(|range| *range.start());
        nodes.push(ClusterNodeInfo {
            index,
            port,
            id: (*id).to_owned(),
            role,
            master_id: (*master != "-").then(|| (*master).to_owned()),
            slots: ranges,
            failing: flags.iter().any(|flag| *flag == "fail" || *flag == "fail?"),
        });
    }
    nodes.sort_by_key(|node| node.index);
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cluster_nodes() -> Result<(), TestkitError> {
        let text = "\
aaa 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460 [5461->-bbb]\n\
bbb 127.0.0.1:7001@17001,host master - 0 0 2 connected 5461-10922 16000\n\
ccc 127.0.0.1:7002@17002 slave,fail aaa 0 0 1 disconnected\n\
ddd 127.0.0.1:9999@19999 master - 0 0 3 connected 10923-15999 16001-16383\n";
        let nodes = parse_nodes(text, &[7000, 7001, 7002])?;
        assert_eq!(nodes.len(), 3);
        assert_eq!(nodes[0].slots, vec![0..=5460]);
        assert_eq!(nodes[0].role, ClusterRole::Master);
        assert_eq!(nodes[1].slots, vec![5461..=10922, 16000..=16000]);
        assert!(nodes[1].serves(16000));
        assert!(!nodes[1].serves(16001));
        assert_eq!(nodes[2].role, ClusterRole::Replica);
        assert_eq!(nodes[2].master_id.as_deref(), Some("aaa"));
        assert!(nodes[2].failing);
        assert!(!nodes[0].failing);
        Ok(())
    }

    #[test]
    fn rejects_malformed_cluster_nodes() {
        let result = parse_nodes("aaa 127.0.0.1:7000@17000 master\n", &[7000]);
        assert!(matches!(result, Err(TestkitError::UnexpectedReply(_))));
    }
}
