//! The baselines on etcd, sent raw through `etcd-client` to the first member (the one
//! distlock prefers while it answers): a linearizable `get` of one key (the floor: one
//! round trip, which on a follower includes its read-index exchange with the leader),
//! distlock's placement transaction alone (one Raft write), and a raw cycle, the
//! placement then the release transaction (two Raft writes), which is what an
//! uncontended distlock cycle sends.
//!
//! The transactions are written as `primitives/lock/etcd.rs` writes them (its `place`
//! and `EtcdHold::release`); they are copied, not called, because the library keeps them
//! private, and a change there should show up here as a gap between the raw cycle and
//! distlock's.

use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
};
use tokio::time::Instant;

use crate::scenarios::BenchResult;
use crate::stats::Latencies;

/// What a probe sends, back to back, from one task.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum EtcdRaw {
    /// `get` of one existing key, linearizable (etcd's default, as distlock reads).
    Get,
    /// distlock's placement: put the waiter's key if absent, read the queue's first key.
    Place,
    /// The placement, then the release: delete the key if it is still that one.
    Cycle,
}

/// The lease the raw keys live on, for one slice: every key is gone when it is revoked.
const RAW_LEASE_SECS: i64 = 60;
const GET_KEY: &str = "bench:stores:raw:get";

/// The queue's first key, as distlock reads it (oldest first).
fn first_of(queue: &str) -> (String, GetOptions) {
    (
        queue.to_owned(),
        GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1),
    )
}

/// distlock's placement transaction for `key` in `queue`, on `lease`.
fn placement(queue: &str, key: &str, lease: i64) -> Txn {
    let (queue, first) = first_of(queue);
    Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then([
            TxnOp::put(key, "1", Some(PutOptions::new().with_lease(lease))),
            TxnOp::get(queue.clone(), Some(first.clone())),
        ])
        .or_else([TxnOp::get(key, None), TxnOp::get(queue, Some(first))])
}

/// One caller sends `raw` back to back for `length`, in a task of its own (as the cycles
/// run). Returns requests (or raw cycles) per second and their latencies.
pub async fn measure(
    client: &Client,
    raw: EtcdRaw,
    length: Duration,
) -> BenchResult<(f64, Latencies)> {
    let client = client.clone();
    tokio::spawn(probe(client, raw, length)).await?
}

async fn probe(
    mut client: Client,
    raw: EtcdRaw,
    length: Duration,
) -> BenchResult<(f64, Latencies)> {
    let lease = client.lease_grant(RAW_LEASE_SECS, None).await?.id();
    client
        .put(GET_KEY, "1", Some(PutOptions::new().with_lease(lease)))
        .await?;
    let started = Instant::now();
    let until = started + length;
    let mut latencies = Latencies::new();
    let mut request = 0u64;
    let measured = async {
        while Instant::now() < until {
            request += 1;
            let sent = Instant::now();
            match raw {
                EtcdRaw::Get => {
                    client.get(GET_KEY, None).await?;
                }
                EtcdRaw::Place => {
                    // A queue of its own each time, so that every placement is a write
                    // (a key already there would take the read-only branch) and no queue
                    // grows (its first key is read sorted).
                    let queue = format!("bench:stores:raw:{request}\0");
                    let key = format!("{queue}owner");
                    let placed = client.txn(placement(&queue, &key, lease)).await?;
                    if !placed.succeeded() {
                        return Err("the raw placement found its key there already".into());
                    }
                }
                EtcdRaw::Cycle => {
                    let queue = "bench:stores:raw:cycle\0";
                    let key = format!("{queue}owner");
                    let placed = client.txn(placement(queue, &key, lease)).await?;
                    let revision = placed.header().map_or(0, |header| header.revision());
                    if !placed.succeeded() {
                        return Err("the raw cycle found its key still there".into());
                    }
                    let release = Txn::new()
                        .when([Compare::create_revision(
                            key.clone(),
                            CompareOp::Equal,
                            revision,
                        )])
                        .and_then([TxnOp::delete(key, None)]);
                    if !client.txn(release).await?.succeeded() {
                        return Err("the raw release found its key changed".into());
                    }
                }
            }
            latencies.record(sent.elapsed());
        }
        BenchResult::Ok(())
    }
    .await;
    let rate = latencies.len() as f64 / started.elapsed().as_secs_f64();
    // The slice's keys go with their lease, whatever happened.
    let _ = client.lease_revoke(lease).await;
    measured?;
    Ok((rate, latencies))
}
