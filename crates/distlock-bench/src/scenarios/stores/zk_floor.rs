//! The baselines on ZooKeeper, sent raw through `zookeeper-client` on a session of the
//! same server distlock and the peer are connected to (a follower, see `deploy.rs`).
//!
//! **The floor is a write**: a `set_data` of one node, which the follower forwards to the
//! leader, the leader proposes, a quorum (the leader and one follower) logs, and the
//! follower answers once it has applied the commit. A lock cycle's requests that cost
//! are writes (the waiter's node created, then deleted), so a write is the round trip a
//! cycle is counted in. A read (`get_data` of one node) is measured beside it: the
//! connected server answers it from its own copy, without the leader, so it is only the
//! client-to-server loopback trip and the server's request pipeline.
//!
//! Beside them, the cycle's ideals, no library around them:
//!
//! - a create of an ephemeral sequential node, then its delete: two writes, the least a
//!   queue-of-nodes lock can send for a lock and a release;
//! - that create, a listing of the parent's children, then the delete: what an
//!   uncontended distlock cycle sends (`primitives/lock/zk`: its node created, the queue
//!   listed to see that it is first, the node deleted at release).

use std::time::Duration;

use tokio::time::Instant;
use zookeeper_client::{Acls, Client, CreateMode, Error as ZkError};

use crate::scenarios::BenchResult;
use crate::stats::Latencies;

/// What a probe sends, back to back, from one task.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum ZkRaw {
    /// `set_data` of one node: a write (the floor).
    Set,
    /// `get_data` of one node: a read the connected server answers alone.
    Get,
    /// Create an ephemeral sequential node, delete it.
    Pair,
    /// Create one, list its parent's children, delete it.
    Cycle,
}

/// The raw probes' node: beside distlock's prefix and the peer's, not under them.
pub fn raw_root(prefix: &str) -> String {
    format!("{prefix}-raw")
}

/// One caller sends `raw` back to back for `length`, in a task of its own (as the cycles
/// run), under `root`. Returns requests (or raw cycles) per second and their latencies.
pub async fn measure(
    client: &Client,
    root: &str,
    raw: ZkRaw,
    length: Duration,
) -> BenchResult<(f64, Latencies)> {
    tokio::spawn(probe(client.clone(), root.to_owned(), raw, length)).await?
}

async fn probe(
    client: Client,
    root: String,
    raw: ZkRaw,
    length: Duration,
) -> BenchResult<(f64, Latencies)> {
    let persistent = CreateMode::Persistent.with_acls(Acls::anyone_all());
    let ephemeral = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
    client.mkdir(&root, &persistent).await?;
    let base = format!("{root}/n-");
    let started = Instant::now();
    let until = started + length;
    let mut latencies = Latencies::new();
    while Instant::now() < until {
        let sent = Instant::now();
        match raw {
            ZkRaw::Set => {
                client.set_data(&root, b"1", None).await?;
            }
            ZkRaw::Get => {
                client.get_data(&root).await?;
            }
            ZkRaw::Pair | ZkRaw::Cycle => {
                let (_, sequence) = client.create(&base, b"1", &ephemeral).await?;
                let node = format!("{base}{sequence}");
                if raw == ZkRaw::Cycle {
                    let children = client.list_children(&root).await?;
                    if children.len() != 1 {
                        return Err(format!(
                            "the raw cycle found {} nodes where its own should be alone",
                            children.len()
                        )
                        .into());
                    }
                }
                match client.delete(&node, None).await {
                    Ok(()) => {}
                    Err(ZkError::NoNode) => {
                        return Err("the raw cycle's node was gone before its delete".into())
                    }
                    Err(err) => return Err(err.into()),
                }
            }
        }
        latencies.record(sent.elapsed());
    }
    let rate = latencies.len() as f64 / started.elapsed().as_secs_f64();
    Ok((rate, latencies))
}
