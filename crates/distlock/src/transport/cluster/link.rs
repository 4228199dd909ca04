//! The command connection to a Redis Cluster: scripts (and the deletion of unlock
//! latches) go straight to the master that owns their slot; everything else, and anything
//! unusual, goes through redis-rs's cluster connection.
//!
//! redis-rs's `ClusterConnection` hands every command to a routing task, which passes it
//! to the node's connection task, and the reply comes back the same way: two more task
//! hops per command than a plain connection. Measured on the 2-core test VM, that made a
//! cluster lock cycle take 180 µs against 89 µs on one server. Almost every command is an
//! EVALSHA whose first key names its slot, so this link keeps a slot map and one
//! multiplexed connection per master, and sends such scripts there directly, as it does
//! the UNLINK of unlock latches whose keys share a slot. With 64 tasks over a single-shard
//! cluster that moved a cycle from 0.81 to 0.85 of a plain master (docs/benchmarks.md).
//!
//! redis-rs stays in charge of what is hard: a script the owner does not take (MOVED, ASK,
//! TRYAGAIN or CLUSTERDOWN: none of them ran it) is sent again through the cluster
//! connection, which follows the redirection; a MOVED also corrects the map. A node whose
//! connection fails loses its slots from the map, which is then read again (CLUSTER
//! SLOTS, through the cluster connection), so a failover moves the direct path to the new
//! master. A direct send whose connection broke is never repeated here: the script may
//! have run, and only the caller knows whether sending it again is safe.
//!
//! Pipelines whose first command is such a script (a synced write: the script, then WAIT)
//! take the direct path too, and follow redirections here: WAIT counts the writes of the
//! connection it is sent on, so the script and its WAIT must reach the slot's master
//! together, on one connection, and how many replicas the WAIT asks for depends on which
//! master that turns out to be. Each redirection composes the pipeline again for the
//! master it names. (redis-rs follows a redirection inside a pipeline by sending the same
//! pipeline on: right for the connection, wrong for the count. Where only redis-rs can
//! reach a master, a CLUSTER MYID behind the pipeline says which master ran it.)
//!
//! The map also says how many replicas the cluster lists for each master (CLUSTER NODES,
//! failing replicas included), which replica sync uses to decide per shard whether a
//! write has a replica to wait for. All of a client's links share one map ([`Topology`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, SingleNodeRoutingInfo, Slot, SlotAddr};
use redis::{
    AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, FromRedisValue, Pipeline,
    RedisFuture, RedisResult, Value,
};

use super::redirect::{direct_slot, misrouted, redirection, retry_pause, within, Misrouted};
use super::topology::{dialable, Node, Owner, Topology, REPLICAS_RECHECK};
use super::CLUSTER_RETRIES;

/// Gives the WAIT to send behind a synced write, and the count it asks for, from the
/// replica count listed for the master the write goes to (`None`: not known); `None` for
/// no WAIT.
pub(crate) type WaitFor = dyn Fn(Option<u32>) -> Option<(Cmd, u32)> + Send + Sync;

/// What to send to one master, as [`ClusterLink::pipeline_to_slot`]'s caller composes
/// it for that master.
struct Composed {
    pipeline: Pipeline,
    /// Holds the link's turn for the master while in flight (it carries a WAIT).
    exclusive: bool,
}

/// What [`ClusterLink::pipeline_to_slot`] sent: the replies, the replica count the
/// pipeline was composed for, and whether that count is the one of the master that ran
/// it (false when redis-rs followed a redirection to another master).
struct Sent {
    replies: Vec<Value>,
    listed: Option<u32>,
    for_that_master: bool,
}

/// A cluster connection with a direct path for slot-routed scripts. Cheap to clone.
#[derive(Clone)]
pub(crate) struct ClusterLink {
    fallback: ClusterConnection,
    shared: Arc<Shared>,
    topology: Arc<Topology>,
}

struct Shared {
    /// Direct connections, by master, with the topology's generation when each was
    /// opened; a master missing here is being connected to, or its connection failed.
    nodes: Mutex<HashMap<Node, (MultiplexedConnection, u64)>>,
    connecting: Mutex<Vec<Node>>,
    /// One write-and-WAIT at a time per master on this link: WAIT holds the connection
    /// on the server until the replicas answer, and a write queued behind it would spend
    /// its own response time waiting. Per master, so that one shard's slow replica does
    /// not hold up the writes of the others.
    turns: Mutex<HashMap<Node, Arc<tokio::sync::Mutex<()>>>>,
    /// Credentials, database and TLS of the seeds, for connections to any master.
    template: ConnectionInfo,
    config: AsyncConnectionConfig,
    /// Bounds a pipeline with every redirection it follows, as redis-rs's response
    /// timeout bounds a command.
    response_timeout: Duration,
    /// The runtime that drives this link, for background reads of the map (a lookup may
    /// come from a caller on another runtime, which may end).
    runtime: Option<tokio::runtime::Handle>,
}

impl ClusterLink {
    /// Wraps `fallback`, sharing `topology` with the client's other links, and reads the
    /// slot map through it.
    pub(crate) async fn new(
        fallback: ClusterConnection,
        template: ConnectionInfo,
        config: AsyncConnectionConfig,
        response_timeout: Duration,
        topology: Arc<Topology>,
    ) -> Self {
        let link = Self {
            fallback,
            topology,
            shared: Arc::new(Shared {
                nodes: Mutex::new(HashMap::new()),
                connecting: Mutex::new(Vec::new()),
                turns: Mutex::new(HashMap::new()),
                template,
                config,
                response_timeout,
                runtime: tokio::runtime::Handle::try_current().ok(),
            }),
        };
        // Without a map every command takes the cluster connection: slower, still right.
        // (A synced write then goes there too, waiting for the policy's full count.)
        if let Err(err) = link.refresh().await {
            tracing::debug!(error = %err, "could not read the cluster's slot map yet");
        }
        link
    }

    /// Reads the slot map again, through the cluster connection.
    async fn refresh(&self) -> RedisResult<()> {
        self.topology.reload(&self.fallback).await
    }

    fn nodes(&self) -> MutexGuard<'_, HashMap<Node, (MultiplexedConnection, u64)>> {
        // Whole values only: a poisoned lock still holds a consistent map.
        self.shared
            .nodes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// This link's connection to `node`, unless the node's connection failed (on any
    /// link of the client) since it was opened.
    fn open_connection(&self, node: &Node) -> Option<MultiplexedConnection> {
        let broken_at = self.topology.broken_at().get(node).copied().unwrap_or(0);
        let mut nodes = self.nodes();
        match nodes.get(node) {
            Some((connection, opened)) if *opened >= broken_at => Some(connection.clone()),
            Some(_) => {
                nodes.remove(node);
                None
            }
            None => None,
        }
    }

    /// Sends `write` (a script call) to the master of its slot and, on the same
    /// connection right behind it, the WAIT that `wait` gives for that master's replica
    /// count as the cluster lists it (`None`: not known); no WAIT when it gives none. The
    /// count is the one of the master the write is actually sent to: a redirection (MOVED,
    /// ASK) builds the WAIT again for the master it names. A map older than
    /// [`REPLICAS_RECHECK`] is read again first, so a replica that joined a shard is
    /// waited for from then on. Returns the write's reply and, if a WAIT was sent, its
    /// reply and the count it asked for.
    pub(crate) async fn write_then_wait(
        &self,
        write: &Cmd,
        wait: &WaitFor,
    ) -> RedisResult<(Value, Option<(Value, u32)>)> {
        let slot = direct_slot(write).ok_or_else(|| {
            redis::RedisError::from((
                redis::ErrorKind::Client,
                "a synced write must be a script call with a key",
            ))
        })?;
        // Tried, not read: a map that cannot be read (CLUSTER SLOTS refused) is asked for
        // once per period, not before every write.
        if self.topology.tried_at().elapsed() > REPLICAS_RECHECK {
            if let Err(err) = self.refresh().await {
                tracing::debug!(error = %err, "could not read the cluster's slot map");
            }
        }
        let compose = |listed: Option<u32>| {
            let mut pipeline = redis::pipe();
            pipeline.add_command(write.clone());
            let waits = wait(listed);
            if let Some((command, _)) = &waits {
                pipeline.add_command(command.clone());
            }
            Composed {
                pipeline,
                exclusive: waits.is_some(),
            }
        };
        // Not cut off as a whole: the wait for a turn at the master, each send, and the
        // retries after redirections are bounded each (by the response timeout, and the
        // redirections also by their count).
        let Sent {
            mut replies,
            listed,
            for_that_master,
        } = self.pipeline_to_slot(slot, &compose).await?;
        let unexpected = || {
            redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "a synced write did not get its replies",
            ))
        };
        let waited = match wait(listed) {
            Some((_, required)) => {
                let waited = replies.pop().ok_or_else(unexpected)?;
                Some((waited, required))
            }
            None => None,
        };
        let written = replies.pop().ok_or_else(unexpected)?;
        if !for_that_master {
            // Composed for another master than the one that ran it: not acknowledged as
            // that master's replicas require, whatever the WAIT said.
            let required = wait(None).map_or(1, |(_, required)| required);
            return Ok((written, Some((Value::Int(0), required))));
        }
        Ok((written, waited))
    }

    /// True unless this link's turn for the master of `write`'s slot is taken: a hint for
    /// spreading synced writes over links, not a reservation.
    pub(crate) fn turn_looks_free(&self, write: &Cmd) -> bool {
        let Some(owner) = direct_slot(write).and_then(|slot| self.owner(slot)) else {
            return true;
        };
        self.shared
            .turns
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(&owner.node)
            .is_none_or(|turn| turn.try_lock().is_ok())
    }

    /// Waits for this link's turn at `node`, at most the response timeout: behind a queue
    /// of writes each waiting for a replica that does not answer, a write fails (having
    /// sent nothing) rather than outwait its caller's patience.
    async fn wait_for_turn(&self, node: &Node) -> RedisResult<tokio::sync::OwnedMutexGuard<()>> {
        tokio::time::timeout(self.shared.response_timeout, self.turn(node).lock_owned())
            .await
            .map_err(|_| {
                redis::RedisError::from(std::io::Error::new(std::io::ErrorKind::TimedOut, NO_TURN))
            })
    }

    /// This link's turn for synced writes to `node`.
    fn turn(&self, node: &Node) -> Arc<tokio::sync::Mutex<()>> {
        let mut turns = self
            .shared
            .turns
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        Arc::clone(turns.entry(Arc::clone(node)).or_default())
    }

    /// The replica count listed for the master at `node` (one a MOVED or ASK names; a
    /// slot's own owner carries its count).
    fn replicas_of(&self, node: &Node) -> Option<u32> {
        self.topology
            .replicas_by_node
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(node)
            .copied()
    }

    fn owner(&self, slot: Slot) -> Option<Owner> {
        self.topology
            .slots
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(&slot)
            .cloned()
    }

    /// Reads the map again in the background, once at a time.
    fn refresh_soon(&self) {
        /// Lowers the flag however the read ends, even if its task is dropped unrun.
        struct Refreshing(Arc<Topology>);
        impl Drop for Refreshing {
            fn drop(&mut self) {
                self.0.refreshing.store(false, Ordering::Release);
            }
        }
        if self.topology.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let flag = Refreshing(Arc::clone(&self.topology));
        let runtime = self
            .shared
            .runtime
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok());
        if let Some(runtime) = runtime {
            let link = self.clone();
            runtime.spawn(async move {
                let _flag = flag;
                if let Err(err) = link.refresh().await {
                    tracing::debug!(error = %err, "could not read the cluster's slot map");
                }
            });
        }
    }

    /// The direct connection for `cmd`, if it is one [`direct_slot`] routes, its slot's
    /// master is known, and a connection to it is open (one is opened for next time if not).
    fn direct(&self, cmd: &Cmd) -> Option<(Node, MultiplexedConnection)> {
        let node = self.owner(direct_slot(cmd)?)?.node;
        if !dialable(&node) {
            return None;
        }
        if let Some(connection) = self.open_connection(&node) {
            return Some((node, connection));
        }
        self.connect_soon(node);
        None
    }

    /// Opens a direct connection to `node` in the background, on the runtime polling this
    /// link (the one that drives it), once at a time per node.
    fn connect_soon(&self, node: Node) {
        {
            let mut connecting = self
                .shared
                .connecting
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if connecting.contains(&node) {
                return;
            }
            connecting.push(Arc::clone(&node));
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Nothing here could drive the connection: let a later call open it.
            self.shared
                .connecting
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .retain(|other| *other != node);
            return;
        };
        let link = self.clone();
        runtime.spawn(async move {
            let generation = link.topology.generation.load(Ordering::Acquire);
            match link.open_node(&node).await {
                Ok(connection) => {
                    link.nodes()
                        .insert(Arc::clone(&node), (connection, generation));
                }
                Err(err) => {
                    tracing::debug!(error = %err, node = %node.0, "no direct connection to a cluster master");
                }
            }
            link.shared
                .connecting
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .retain(|other| *other != node);
        });
    }

    /// Opens a direct connection to `node`, with the seeds' credentials and TLS, on the
    /// runtime that drives this link (a connection is driven where it was opened, and a
    /// caller's runtime may end).
    async fn open_node(&self, node: &Node) -> RedisResult<MultiplexedConnection> {
        let addr = match self.shared.template.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host: node.0.clone(),
                port: node.1,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(node.0.clone(), node.1),
        };
        let info = self.shared.template.clone().set_addr(addr);
        let config = self.shared.config.clone();
        let open = async move {
            redis::Client::open(info)?
                .get_multiplexed_async_connection_with_config(&config)
                .await
        };
        let here = tokio::runtime::Handle::try_current().map(|current| current.id());
        match &self.shared.runtime {
            Some(runtime) if here.ok() != Some(runtime.id()) => {
                runtime.spawn(open).await.map_err(|err| {
                    redis::RedisError::from(std::io::Error::other(format!(
                        "the client's runtime did not open the connection: {err}"
                    )))
                })?
            }
            _ => open.await,
        }
    }

    /// The direct connection to `node`, opened now if there is none.
    async fn connection_to(&self, node: &Node) -> RedisResult<MultiplexedConnection> {
        if let Some(connection) = self.open_connection(node) {
            return Ok(connection);
        }
        let generation = self.topology.generation.load(Ordering::Acquire);
        let connection = self.open_node(node).await?;
        self.nodes()
            .insert(Arc::clone(node), (connection.clone(), generation));
        Ok(connection)
    }

    /// The direct connection to `node` failed: forget it and its slots, and read the map
    /// again, so that the next scripts go through the cluster connection meanwhile.
    fn forget(&self, node: &Node) {
        self.forget_now(node);
        self.refresh_soon();
    }

    /// Drops `node`'s connections (this link's and the other links') and its slots from
    /// the map, without reading it again.
    fn forget_now(&self, node: &Node) {
        self.nodes().remove(node);
        self.topology.mark_broken(node);
    }

    /// A MOVED reply names the slot's new master; how many replicas it has is read with
    /// the whole map, in the background.
    fn moved(&self, detail: &str) {
        let Some((slot, node)) = redirection(detail) else {
            return;
        };
        self.topology
            .slots
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(
                slot,
                Owner {
                    replicas: self.replicas_of(&node),
                    id: "".into(),
                    node,
                },
            );
        self.refresh_soon();
    }

    /// Sends what `compose` builds to `slot`'s master on a direct connection, and sends
    /// it again wherever a reply to its first command says it should have gone (MOVED:
    /// the new master; ASK: the importing master, after ASKING) or after a pause
    /// (TRYAGAIN, CLUSTERDOWN). Each of those replies means the first command did not
    /// run. `compose` is given the replica count listed for the master it is sent to, and
    /// is asked again for every master. At most [`CLUSTER_RETRIES`] times; the last reply
    /// is returned as it is, with the count it was composed for. A broken connection is
    /// not retried, as for a single command. With no usable map, redis-rs's cluster
    /// connection takes it to the slot's master, on one connection.
    async fn pipeline_to_slot(
        &self,
        slot: Slot,
        compose: &(dyn Fn(Option<u32>) -> Composed + Send + Sync),
    ) -> RedisResult<Sent> {
        let mut asked: Option<Node> = None;
        let mut attempt = 0;
        // Retries after unreachable masters and slots in transition end here; waiting for
        // a turn at a master does not count against it.
        let mut deadline = Instant::now() + self.shared.response_timeout;
        loop {
            let asking = asked.take();
            let target = match &asking {
                Some(node) => Some((Arc::clone(node), self.replicas_of(node), "".into())),
                None => {
                    if self.owner(slot).is_none() {
                        // No map yet, or the owner's connection failed: read it now.
                        if let Err(err) = self.refresh().await {
                            tracing::debug!(error = %err, "could not read the cluster's slot map");
                        }
                    }
                    self.owner(slot)
                        .map(|owner| (owner.node, owner.replicas, owner.id))
                }
            };
            let (node, listed) = match target {
                Some((node, listed, _)) if dialable(&node) => (node, listed),
                // No map, or a master it names by an endpoint that cannot be dialled.
                target => return self.through_cluster_connection(slot, target, compose).await,
            };
            let composed = compose(listed);
            let count = composed.pipeline.cmd_iter().count();
            let Some(mut connection) = self.reach(&node, attempt, deadline).await? else {
                attempt += 1;
                continue;
            };
            let turn = match composed.exclusive {
                true => {
                    let waiting = Instant::now();
                    let turn = self.wait_for_turn(&node).await?;
                    deadline += waiting.elapsed();
                    Some(turn)
                }
                false => None,
            };
            let replies = match &asking {
                Some(_) => {
                    let mut with_asking = redis::pipe();
                    with_asking.cmd("ASKING");
                    for cmd in composed.pipeline.cmd_iter() {
                        with_asking.add_command(cmd.clone());
                    }
                    connection.req_packed_commands(&with_asking, 1, count).await
                }
                None => {
                    connection
                        .req_packed_commands(&composed.pipeline, 0, count)
                        .await
                }
            };
            drop(turn);
            let replies = match replies {
                Ok(replies) => replies,
                Err(err) => {
                    // A timeout says the master is slow, not gone: keep its connections.
                    if !err.is_timeout() {
                        self.forget(&node);
                    }
                    return Err(err);
                }
            };
            attempt += 1;
            let redirected = replies.first().and_then(misrouted);
            let sent = |replies| Sent {
                replies,
                listed,
                for_that_master: true,
            };
            if attempt > CLUSTER_RETRIES || Instant::now() > deadline {
                return Ok(sent(replies));
            }
            match redirected {
                None => return Ok(sent(replies)),
                Some(Misrouted::Moved(detail)) => self.moved(&detail),
                Some(Misrouted::Ask(detail)) => asked = redirection(&detail).map(|(_, node)| node),
                Some(Misrouted::InTransition) => retry_pause(attempt).await,
            }
        }
    }

    /// Sends what `compose` builds through redis-rs's cluster connection, which fills in
    /// endpoints CLUSTER SLOTS cannot give and takes it to the slot's master, on one
    /// connection. redis-rs follows a MOVED or ASK inside a pipeline itself, to whichever
    /// master it names, so the count `compose` was given may be another master's: a
    /// CLUSTER MYID behind it says which master ran it, and if that is not the one the
    /// count was for, [`Sent::for_that_master`] is false. `target`: the slot's master as
    /// the map has it (address, replica count, id), if known.
    async fn through_cluster_connection(
        &self,
        slot: Slot,
        target: Option<(Node, Option<u32>, Arc<str>)>,
        compose: &(dyn Fn(Option<u32>) -> Composed + Send + Sync),
    ) -> RedisResult<Sent> {
        // A count is only trusted for a master known by id; otherwise the caller's own
        // (the policy's) count is composed, which is right for any master.
        let (node, listed, expected) = match target {
            Some((node, listed @ Some(_), id)) if !id.is_empty() => (Some(node), listed, Some(id)),
            target => (target.map(|(node, ..)| node), None, None),
        };
        let composed = compose(listed);
        let count = composed.pipeline.cmd_iter().count();
        let mut pipeline = composed.pipeline;
        if expected.is_some() {
            pipeline.cmd("CLUSTER").arg("MYID");
        }
        let turn = match (&node, composed.exclusive) {
            (Some(node), true) => Some(self.wait_for_turn(node).await?),
            _ => None,
        };
        let route = SingleNodeRoutingInfo::SpecificNode(Route::with_slot(slot, SlotAddr::Master));
        let sent_count = count + usize::from(expected.is_some());
        let mut replies = self
            .fallback
            .clone()
            .route_pipeline(pipeline, 0, sent_count, route)
            .await?;
        drop(turn);
        let for_that_master = match expected {
            None => true,
            Some(expected) => {
                let ran_on = replies
                    .pop()
                    .and_then(|id| String::from_redis_value(id).ok());
                ran_on.as_deref() == Some(&*expected)
            }
        };
        Ok(Sent {
            replies,
            listed,
            for_that_master,
        })
    }

    /// A connection to `node`, for attempt `attempt` of a pipeline. A master that cannot
    /// be connected to was sent nothing, so the pipeline may go elsewhere: its slots are
    /// forgotten, the map is read again after a pause, and `None` says to try again, until
    /// the attempts run out and the failure is returned.
    async fn reach(
        &self,
        node: &Node,
        attempt: u32,
        deadline: Instant,
    ) -> RedisResult<Option<MultiplexedConnection>> {
        match self.connection_to(node).await {
            Ok(connection) => Ok(Some(connection)),
            Err(err) if attempt >= CLUSTER_RETRIES || Instant::now() > deadline => Err(err),
            Err(err) => {
                tracing::debug!(error = %err, node = %node.0, "cannot reach a cluster master; reading the slot map again");
                self.forget_now(node);
                retry_pause(attempt).await;
                if let Err(err) = self.refresh().await {
                    tracing::debug!(error = %err, "could not read the cluster's slot map");
                }
                Ok(None)
            }
        }
    }
}
/// The message of the error a synced write fails with when it never had its turn.
const NO_TURN: &str =
    "synced lock writes to this master are queued behind replicas that do not answer";

/// True if `err` says a synced write was never sent: it waited for its turn at a master
/// whose replicas do not answer, as long as it may. For an acquisition that is a refusal
/// for want of replicas, with nothing to give back.
pub(crate) fn never_sent(err: &redis::RedisError) -> bool {
    err.is_timeout() && err.to_string().contains(NO_TURN)
}

impl ConnectionLike for ClusterLink {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            if let Some((node, mut direct)) = self.direct(cmd) {
                match direct.req_packed_command(cmd).await {
                    Ok(reply) => match misrouted(&reply) {
                        None => return Ok(reply),
                        // Not run: the cluster connection follows the redirection.
                        Some(Misrouted::Moved(detail)) => self.moved(&detail),
                        Some(Misrouted::Ask(_) | Misrouted::InTransition) => {}
                    },
                    Err(err) => {
                        self.forget(&node);
                        return Err(err);
                    }
                }
            }
            self.fallback.req_packed_command(cmd).await
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            match pipeline.cmd_iter().next().and_then(direct_slot) {
                // Only a pipeline whose first reply is kept can be checked for a
                // redirection.
                Some(slot) if offset == 0 => {
                    let compose = |_: Option<u32>| Composed {
                        pipeline: pipeline.clone(),
                        exclusive: false,
                    };
                    within(
                        self.shared.response_timeout,
                        self.pipeline_to_slot(slot, &compose),
                    )
                    .await
                    .map(|sent| sent.replies)
                }
                _ => {
                    self.fallback
                        .req_packed_commands(pipeline, offset, count)
                        .await
                }
            }
        })
    }

    fn get_db(&self) -> i64 {
        self.fallback.get_db()
    }
}
