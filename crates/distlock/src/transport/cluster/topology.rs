//! What a client's cluster links know of the cluster, shared by all of them: the master
//! of each slot (CLUSTER SLOTS), how many replicas each master has (CLUSTER NODES), and
//! which masters' connections have failed since they were opened.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{SingleNodeRoutingInfo, Slot};
use redis::{FromRedisValue, RedisResult, Value};

const SLOTS: u16 = 16_384;

/// How old the slot map may be before a lookup of a slot's replicas reads it again (in
/// the background): a replica that joins a shard is waited for from then on.
pub(crate) const REPLICAS_RECHECK: Duration = Duration::from_secs(5);

/// A master's address, as CLUSTER SLOTS and MOVED give it.
pub(crate) type Node = Arc<(String, u16)>;

/// A slot's master: its address, its node id (empty when not known: learnt from a
/// MOVED), and how many replicas the cluster lists for it (`None` when not known).
#[derive(Clone)]
pub(crate) struct Owner {
    pub(super) node: Node,
    pub(super) id: Arc<str>,
    pub(super) replicas: Option<u32>,
}

/// What a client's cluster links know of the cluster, shared by all of them (the command
/// links, the synced-write links, dedicated ones): what one learns, that a master is gone
/// or a slot has moved, the others use on their next command, instead of each failing
/// once on its own connection to a dead master first.
pub(crate) struct Topology {
    /// The master of each slot, when known.
    pub(super) slots: RwLock<HashMap<Slot, Owner>>,
    /// How many replicas each master has, by address, whether or not it serves slots
    /// yet (a master a MOVED or ASK names may be new).
    pub(super) replicas_by_node: RwLock<HashMap<Node, u32>>,
    /// When a read of the map was last tried.
    pub(super) tried_at: Mutex<Instant>,
    /// One read of the map at a time; callers that queued behind a read use its map.
    pub(super) reading: tokio::sync::Mutex<()>,
    pub(super) refreshing: AtomicBool,
    /// Counts failures of masters' connections; a link's connection opened before its
    /// master's latest failure is not used again.
    pub(super) generation: AtomicU64,
    pub(super) broken_at: Mutex<HashMap<Node, u64>>,
}

impl Topology {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            slots: RwLock::new(HashMap::new()),
            replicas_by_node: RwLock::new(HashMap::new()),
            tried_at: Mutex::new(Instant::now()),
            reading: tokio::sync::Mutex::new(()),
            refreshing: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            broken_at: Mutex::new(HashMap::new()),
        })
    }

    pub(super) fn tried_at(&self) -> Instant {
        *self
            .tried_at
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(super) fn broken_at(&self) -> MutexGuard<'_, HashMap<Node, u64>> {
        self.broken_at
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `node`'s connection failed: every link's connection to it opened so far is
    /// dropped, and its slots are forgotten until the map is read again.
    pub(super) fn mark_broken(&self, node: &Node) {
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        self.broken_at().insert(Arc::clone(node), generation);
        self.slots
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .retain(|_, owner| owner.node != *node);
    }
}

impl Topology {
    /// Reads CLUSTER SLOTS (who serves each slot) and CLUSTER NODES (each master's
    /// replicas) from one node, through the cluster connection, and replaces the map.
    pub(crate) async fn reload(&self, fallback: &ClusterConnection) -> RedisResult<()> {
        let asked_at = Instant::now();
        let _reading = self.reading.lock().await;
        let tried_at = *self
            .tried_at
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if tried_at > asked_at {
            // A read began and ended while this one waited for its turn.
            return Ok(());
        }
        *self
            .tried_at
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Instant::now();
        let mut fallback = fallback.clone();
        let mut both = redis::pipe();
        both.cmd("CLUSTER").arg("SLOTS").cmd("CLUSTER").arg("NODES");
        let mut replies = fallback
            .route_pipeline(both, 0, 2, SingleNodeRoutingInfo::Random)
            .await?
            .into_iter();
        let (Some(reply), nodes) = (replies.next(), replies.next()) else {
            return Ok(());
        };
        if let Value::ServerError(err) = reply {
            return Err(err.into());
        }
        // Without CLUSTER NODES (an ACL may forbid it), replica counts are unknown, and
        // replica sync waits for a replica everywhere.
        let members = nodes
            .and_then(|nodes| String::from_redis_value(nodes).ok())
            .map(|nodes| Members::read(&nodes));
        let mut replicas_by_node = members
            .as_ref()
            .map(|members| members.replicas_by_address.clone())
            .unwrap_or_default();
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
                let master_id = match master.get(2) {
                    Some(Value::BulkString(id)) => String::from_utf8_lossy(id).into_owned(),
                    Some(Value::SimpleString(id)) => id.clone(),
                    _ => String::new(),
                };
                let replicas = members
                    .as_ref()
                    .and_then(|members| members.replicas_of(&master_id));
                // NULL, "" or "?": an endpoint the node cannot give. The slots stay on the
                // map with their replica count, and go through the cluster connection.
                let host = match host {
                    Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                    Value::SimpleString(text) => text.clone(),
                    _ => String::new(),
                };
                let (Ok(port), Ok(first), Ok(last)) = (
                    u16::try_from(*port),
                    u16::try_from(*first),
                    u16::try_from(*last),
                ) else {
                    continue;
                };
                let owner = Owner {
                    node: Arc::new((host, port)),
                    id: master_id.into(),
                    replicas,
                };
                if let Some(replicas) = replicas {
                    replicas_by_node.insert(Arc::clone(&owner.node), replicas);
                }
                for slot in (first..=last.min(SLOTS - 1)).filter_map(Slot::new) {
                    map.insert(slot, owner.clone());
                }
            }
        }
        *self
            .slots
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = map;
        *self
            .replicas_by_node
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = replicas_by_node;
        Ok(())
    }
}

/// What CLUSTER NODES says of the cluster's members: each node id, and how many replicas
/// follow each master, by id and by address.
///
/// A replica flagged as failing counts: it may come back and be promoted with whatever it
/// had when it was cut off, so the writes made meanwhile must still be waited for (and
/// are refused while it cannot acknowledge them). A node that is not a member yet
/// (handshake) does not. A master killed and replaced in a failover is listed as a failed
/// master until it returns, as a replica of its successor, so the successor counts no
/// replica until then.
#[derive(Default)]
struct Members {
    ids: std::collections::HashSet<String>,
    replicas_by_id: HashMap<String, u32>,
    replicas_by_address: HashMap<Node, u32>,
}

impl Members {
    fn read(nodes: &str) -> Self {
        let mut members = Members::default();
        let mut masters: Vec<(String, Node)> = Vec::new();
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(id), Some(address), Some(flags), Some(master)) =
                (fields.first(), fields.get(1), fields.get(2), fields.get(3))
            else {
                continue;
            };
            if flags.contains("handshake") {
                continue;
            }
            members.ids.insert((*id).to_owned());
            let is = |role: &str| flags.split(',').any(|flag| flag == role);
            if (is("slave") || is("replica")) && *master != "-" {
                *members
                    .replicas_by_id
                    .entry((*master).to_owned())
                    .or_insert(0) += 1;
            } else if is("master") {
                // `ip:port@cport[,hostname]`
                let endpoint = address.split('@').next().unwrap_or_default();
                if let Some((host, port)) = endpoint.rsplit_once(':') {
                    if let Ok(port) = port.parse::<u16>() {
                        masters.push(((*id).to_owned(), Arc::new((host.to_owned(), port))));
                    }
                }
            }
        }
        for (id, node) in masters {
            let replicas = members.replicas_by_id.get(&id).copied().unwrap_or(0);
            members.replicas_by_address.insert(node, replicas);
        }
        members
    }

    /// How many replicas follow master `id`; `None` for an id CLUSTER NODES does not list
    /// (or none given), whose count is then not known.
    fn replicas_of(&self, id: &str) -> Option<u32> {
        self.ids
            .contains(id)
            .then(|| self.replicas_by_id.get(id).copied().unwrap_or(0))
    }
}

/// False for an endpoint CLUSTER SLOTS gives when it has none to give: empty (a node that
/// does not know its own address, `cluster-preferred-endpoint-type unknown-endpoint`) or
/// "?" (a node without a hostname, in hostname mode).
pub(crate) fn dialable(node: &Node) -> bool {
    !node.0.is_empty() && node.0 != "?"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_replicas_failing_ones_included() {
        let nodes = "\
a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
b1 127.0.0.1:7001@17001 master - 0 0 2 connected 5461-10922
c1 127.0.0.1:7002@17002 master,fail - 0 0 3 disconnected
c2 127.0.0.1:7005@17005 master - 0 0 7 connected 10923-16383
a2 127.0.0.1:7003@17003 slave a1 0 0 1 connected
b2 127.0.0.1:7004@17004 slave,fail b1 0 0 2 disconnected
x9 127.0.0.1:7009@17009 handshake,slave a1 0 0 0 disconnected
";
        let members = Members::read(nodes);
        assert_eq!(members.replicas_of("a1"), Some(1));
        // A failing replica may come back and be promoted: it counts.
        assert_eq!(members.replicas_of("b1"), Some(1));
        // A master promoted after a kill has no replica until the old one returns.
        assert_eq!(members.replicas_of("c2"), Some(0));
        // An id CLUSTER NODES does not list (or none) is not known.
        assert_eq!(members.replicas_of(""), None);
        assert_eq!(members.replicas_of("zz"), None);
        let at = |port: u16| Arc::new(("127.0.0.1".to_owned(), port));
        assert_eq!(members.replicas_by_address.get(&at(7000)), Some(&1));
        assert_eq!(members.replicas_by_address.get(&at(7005)), Some(&0));
    }
}
