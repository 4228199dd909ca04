//! The permit semaphore on etcd: its queue and total keys (see `lock/etcd/mod.rs`), and
//! the calls that set, change and count them. An acquisition is an etcd waiter like a
//! lock's ([`EtcdAttempt::permits`](crate::primitives::lock::etcd::EtcdAttempt::permits)),
//! holding when the permits asked ahead of it plus its own fit the total.

use etcd_client::{
    Compare, CompareOp, GetOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
};

use crate::error::{Error, Result};
use crate::primitives::lock::etcd::permits_queue_of;
use crate::transport::etcd::watch::count_of;
use crate::transport::etcd::EtcdLink;

/// The semaphore's queue and the key of its total.
fn keys_of(link: &EtcdLink, name: &str) -> (String, String) {
    let queue = permits_queue_of(link, name);
    let total = queue.strip_suffix('\0').unwrap_or(&queue).to_owned();
    (queue, total)
}

/// Sets semaphore `name`'s total to `total` if it has none: `None` when this call set
/// it, or the total it found.
pub(crate) async fn set_permits(link: &EtcdLink, name: &str, total: i64) -> Result<Option<i64>> {
    let (_, key) = keys_of(link, name);
    let answer = link
        .run(move |mut client| {
            let txn = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key.clone(), total.to_string(), None)])
                .or_else([TxnOp::get(key.clone(), None)]);
            async move { client.txn(txn).await }
        })
        .await?;
    if answer.succeeded() {
        return Ok(None);
    }
    let found = match answer.op_responses().first() {
        Some(TxnOpResponse::Get(got)) => got.kvs().first().and_then(|kv| count_of(kv.value())),
        _ => None,
    };
    // A total that is not a count (written by hand) reads as none.
    Ok(Some(found.unwrap_or(0)))
}

/// Adds `delta` to semaphore `name`'s total (creating it with `delta`), compare-and-set
/// on the total's revision, and answers the permits free after it.
pub(crate) async fn add_permits(link: &EtcdLink, name: &str, delta: i64) -> Result<i64> {
    let (_, key) = keys_of(link, name);
    loop {
        let read = {
            let key = key.clone();
            link.run(move |mut client| {
                let key = key.clone();
                async move { client.get(key, None).await }
            })
            .await?
        };
        let (now, revision) = read.kvs().first().map_or((0, 0), |kv| {
            (count_of(kv.value()).unwrap_or(0), kv.mod_revision())
        });
        let next = now
            .checked_add(delta)
            .ok_or_else(|| Error::InvalidArgument {
                what: "permits",
                reason: format!("adding {delta} to {now} permits overflows"),
            })?;
        let key = key.clone();
        let written = link
            .run(move |mut client| {
                let unchanged = if revision == 0 {
                    Compare::create_revision(key.clone(), CompareOp::Equal, 0)
                } else {
                    Compare::mod_revision(key.clone(), CompareOp::Equal, revision)
                };
                let txn = Txn::new().when([unchanged]).and_then([TxnOp::put(
                    key.clone(),
                    next.to_string(),
                    None,
                )]);
                async move { client.txn(txn).await }
            })
            .await?;
        if written.succeeded() {
            let (total, taken) = counts(link, name).await?;
            return Ok(total.saturating_sub(taken));
        }
        // Another client changed the total in between: read it again.
    }
}

/// Semaphore `name`'s total and the permits it has no free of, read at one revision: the
/// permits of the queue's oldest keys that fit the total, added up in order (its holders,
/// or waiters about to notice they hold); and when a waiter that does not fit is left
/// behind them, every other permit too, since nobody queued behind that waiter can take
/// them (tokio's semaphore counts them alike). So the free count is never more than an
/// acquisition can take.
pub(crate) async fn counts(link: &EtcdLink, name: &str) -> Result<(i64, i64)> {
    let (queue, total) = keys_of(link, name);
    let read = link
        .run(move |mut client| {
            let everyone = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend);
            let txn = Txn::new().and_then([
                TxnOp::get(total.clone(), None),
                TxnOp::get(queue.clone(), Some(everyone)),
            ]);
            async move { client.txn(txn).await }
        })
        .await?;
    let responses = read.op_responses();
    let total = match responses.first() {
        Some(TxnOpResponse::Get(got)) => got.kvs().first().and_then(|kv| count_of(kv.value())),
        _ => None,
    }
    .unwrap_or(0);
    let mut taken: i64 = 0;
    if let Some(TxnOpResponse::Get(queue)) = responses.get(1) {
        for key in queue.kvs() {
            let asked = count_of(key.value()).unwrap_or(i64::MAX);
            match taken.checked_add(asked) {
                Some(next) if next <= total => taken = next,
                // A waiter that does not fit: what is left is kept for it.
                _ => return Ok((total, taken.max(total))),
            }
        }
    }
    Ok((total, taken))
}
