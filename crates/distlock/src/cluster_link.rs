//! The command connection to a Redis Cluster: scripts (and the deletion of unlock
//! latches) go straight to the master that owns their slot; everything else, and anything
//! unusual, goes through redis-rs's cluster connection.
//!
//! redis-rs's `ClusterConnection` hands every command to a routing task, which passes it
//! to the node's connection task, and the reply comes back the same way: two more task
//! hops per command than a plain connection. Measured on the 2-core test VM, that made a
//! cluster lock cycle take 180 µs against 89 µs on one server. Almost every command
//! distlock sends is an EVALSHA whose first key names its slot, so this link keeps a slot
//! map and one multiplexed connection per master, and sends such scripts there directly.
//! The other command of a lock cycle, the UNLINK of a release's unlock latch, goes there
//! too when its keys share a slot (latches are deleted by slot). With 64 tasks over a
//! single-shard cluster that moved a cycle from 0.81 to 0.85 of a plain master (medians
//! of alternating runs; docs/benchmarks.md).
//!
//! redis-rs stays in charge of what is hard: a script the owner does not take (MOVED, ASK,
//! TRYAGAIN or CLUSTERDOWN: none of them ran it) is sent again through the cluster
//! connection, which follows the redirection; a MOVED also corrects the map. A node whose
//! connection fails loses its slots from the map, which is then read again (CLUSTER
//! SLOTS, through the cluster connection), so a failover moves the direct path to the new
//! master. A direct send whose connection broke is never repeated here: the script may
//! have run, and only the caller knows whether sending it again is safe.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo, Slot};
use redis::{
    Arg, AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, Pipeline, RedisFuture,
    RedisResult, Value,
};

const SLOTS: u16 = 16_384;

/// A master's address, as CLUSTER SLOTS and MOVED give it.
type Node = Arc<(String, u16)>;

/// A cluster connection with a direct path for slot-routed scripts. Cheap to clone.
#[derive(Clone)]
pub(crate) struct ClusterLink {
    fallback: ClusterConnection,
    shared: Arc<Shared>,
}

struct Shared {
    /// The master of each slot, when known.
    slots: RwLock<HashMap<Slot, Node>>,
    /// Direct connections, by master; a master missing here is being connected to, or
    /// its connection failed.
    nodes: Mutex<HashMap<Node, MultiplexedConnection>>,
    connecting: Mutex<Vec<Node>>,
    refreshing: AtomicBool,
    /// Credentials, database and TLS of the seeds, for connections to any master.
    template: ConnectionInfo,
    config: AsyncConnectionConfig,
}

impl ClusterLink {
    /// Wraps `fallback`, and reads the slot map through it.
    pub(crate) async fn new(
        fallback: ClusterConnection,
        template: ConnectionInfo,
        config: AsyncConnectionConfig,
    ) -> Self {
        let link = Self {
            fallback,
            shared: Arc::new(Shared {
                slots: RwLock::new(HashMap::new()),
                nodes: Mutex::new(HashMap::new()),
                connecting: Mutex::new(Vec::new()),
                refreshing: AtomicBool::new(false),
                template,
                config,
            }),
        };
        // Without a map every command takes the cluster connection: slower, still right.
        if let Err(err) = link.refresh().await {
            tracing::debug!(error = %err, "could not read the cluster's slot map yet");
        }
        link
    }

    fn nodes(&self) -> MutexGuard<'_, HashMap<Node, MultiplexedConnection>> {
        // Whole values only: a poisoned lock still holds a consistent map.
        self.shared
            .nodes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Reads CLUSTER SLOTS through the cluster connection and replaces the map.
    async fn refresh(&self) -> RedisResult<()> {
        let mut fallback = self.fallback.clone();
        let reply = fallback
            .route_command(
                redis::cmd("CLUSTER").arg("SLOTS").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
            )
            .await?;
        let mut map = HashMap::with_capacity(usize::from(SLOTS));
        if let Value::Array(ranges) = reply {
            for range in ranges {
                let Value::Array(fields) = range else {
                    continue;
                };
                let (Some(Value::Int(first)), Some(Value::Int(last)), Some(Value::Array(master))) =
                    (fields.first(), fields.get(1), fields.get(2))
                else {
                    continue;
                };
                let (Some(host), Some(Value::Int(port))) = (master.first(), master.get(1)) else {
                    continue;
                };
                let host = match host {
                    Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                    Value::SimpleString(text) => text.clone(),
                    _ => continue,
                };
                let (Ok(port), Ok(first), Ok(last)) = (
                    u16::try_from(*port),
                    u16::try_from(*first),
                    u16::try_from(*last),
                ) else {
                    continue;
                };
                let node: Node = Arc::new((host, port));
                for slot in (first..=last.min(SLOTS - 1)).filter_map(Slot::new) {
                    map.insert(slot, Arc::clone(&node));
                }
            }
        }
        *self
            .shared
            .slots
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = map;
        Ok(())
    }

    /// Reads the map again in the background, once at a time.
    fn refresh_soon(&self) {
        if self.shared.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let link = self.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(err) = link.refresh().await {
                    tracing::debug!(error = %err, "could not read the cluster's slot map");
                }
                link.shared.refreshing.store(false, Ordering::Release);
            });
        } else {
            self.shared.refreshing.store(false, Ordering::Release);
        }
    }

    /// The direct connection for `cmd`, if it is one [`direct_slot`] routes, its slot's
    /// master is known, and a connection to it is open (one is opened for next time if not).
    fn direct(&self, cmd: &Cmd) -> Option<(Node, MultiplexedConnection)> {
        let slot = direct_slot(cmd)?;
        let node = self
            .shared
            .slots
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(&slot)?
            .clone();
        if let Some(connection) = self.nodes().get(&node) {
            return Some((node, connection.clone()));
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
            let addr = match link.shared.template.addr() {
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
            let info = link.shared.template.clone().set_addr(addr);
            let opened = match redis::Client::open(info) {
                Ok(client) => {
                    client
                        .get_multiplexed_async_connection_with_config(&link.shared.config)
                        .await
                }
                Err(err) => Err(err),
            };
            match opened {
                Ok(connection) => {
                    link.nodes().insert(Arc::clone(&node), connection);
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

    /// The direct connection to `node` failed: forget it and its slots, and read the map
    /// again, so that the next scripts go through the cluster connection meanwhile.
    fn forget(&self, node: &Node) {
        self.nodes().remove(node);
        self.shared
            .slots
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .retain(|_, owner| owner != node);
        self.refresh_soon();
    }

    /// A MOVED reply names the slot's new master.
    fn moved(&self, detail: &str) {
        let mut parts = detail.split_whitespace();
        let (Some(slot), Some(address)) = (parts.next(), parts.next()) else {
            return;
        };
        let (Some(slot), Some((host, port))) = (
            slot.parse::<u16>().ok().and_then(Slot::new),
            address.rsplit_once(':'),
        ) else {
            return;
        };
        let Ok(port) = port.parse::<u16>() else {
            return;
        };
        self.shared
            .slots
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(slot, Arc::new((host.to_owned(), port)));
    }
}

/// The slot a command can go straight to, if it is one the direct path takes: a script
/// call (`EVALSHA sha numkeys key …` or `EVAL`), routed by its first key, or an `UNLINK`
/// whose keys all share one slot (the deletion of unlock latches, grouped by slot).
fn direct_slot(cmd: &Cmd) -> Option<Slot> {
    let mut args = cmd.args_iter();
    let name = match args.next()? {
        Arg::Simple(name) => name,
        _ => return None,
    };
    if name.eq_ignore_ascii_case(b"UNLINK") {
        let mut slot = None;
        for key in args {
            let Arg::Simple(key) = key else {
                return None;
            };
            let this = Slot::for_key(key);
            if *slot.get_or_insert(this) != this {
                // Keys of several slots: redis-rs's cluster connection splits them.
                return None;
            }
        }
        return slot;
    }
    if !name.eq_ignore_ascii_case(b"EVALSHA") && !name.eq_ignore_ascii_case(b"EVAL") {
        return None;
    }
    args.next()?;
    let keys = match args.next()? {
        Arg::Simple(count) => std::str::from_utf8(count).ok()?.parse::<usize>().ok()?,
        _ => return None,
    };
    if keys == 0 {
        return None;
    }
    match args.next()? {
        Arg::Simple(key) => Some(Slot::for_key(key)),
        _ => None,
    }
}

/// What a direct reply says about where the script should have gone, if anything.
enum Misrouted {
    /// MOVED: the slot has a new master, given in the detail.
    Moved(String),
    /// ASK, TRYAGAIN, CLUSTERDOWN: the slot is in transition.
    InTransition,
}

fn misrouted(reply: &Value) -> Option<Misrouted> {
    let Value::ServerError(err) = reply else {
        return None;
    };
    use redis::ServerErrorKind as Kind;
    match err.kind()? {
        Kind::Moved => Some(Misrouted::Moved(
            err.details().unwrap_or_default().to_owned(),
        )),
        Kind::Ask | Kind::TryAgain | Kind::ClusterDown => Some(Misrouted::InTransition),
        _ => None,
    }
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
                        Some(Misrouted::InTransition) => {}
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
        self.fallback.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.fallback.get_db()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_scripts_by_first_key_and_unlinks_of_one_slot() {
        let script = redis::cmd("EVALSHA")
            .arg("sha")
            .arg(2)
            .arg("{a}:lock")
            .arg("other")
            .clone();
        assert_eq!(direct_slot(&script), Some(Slot::for_key("a")));
        let keyless = redis::cmd("EVALSHA").arg("sha").arg(0).clone();
        assert_eq!(direct_slot(&keyless), None);
        let one_slot = redis::cmd("UNLINK").arg("{a}:x").arg("{a}:y").clone();
        assert_eq!(direct_slot(&one_slot), Some(Slot::for_key("a")));
        // Keys of two slots are split by the cluster connection, never sent to one node.
        let two_slots = redis::cmd("UNLINK").arg("{a}:x").arg("{b}:y").clone();
        assert_eq!(direct_slot(&two_slots), None);
        assert_eq!(direct_slot(&redis::cmd("UNLINK")), None);
        assert_eq!(direct_slot(redis::cmd("GET").arg("{a}:x")), None);
    }
}
