//! What a lock's other calls read or change on etcd: its holder, the holder's lease,
//! the cluster's revision (the floor of later tokens), a force-unlock.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp};

use super::{first_of, queue_of};
use crate::error::Result;
use crate::transport::etcd::EtcdLink;

/// Whether the lock is held, and by whom: the first key of its queue.
pub(crate) async fn first(link: &EtcdLink, name: &str) -> Result<Option<(String, i64, i64)>> {
    let queue = queue_of(link, name);
    let found = link
        .run(move |mut client| {
            let (queue, first) = first_of(&queue);
            async move { client.get(queue, Some(first)).await }
        })
        .await?;
    Ok(found.kvs().first().map(|kv| {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        let owner = key
            .rsplit_once('\0')
            .map_or("", |(_, owner)| owner)
            .to_owned();
        (owner, kv.create_revision(), kv.lease())
    }))
}

/// How long the holder's lease has left, whole seconds as etcd keeps them.
pub(crate) async fn lease_left(link: &EtcdLink, name: &str) -> Result<Option<Duration>> {
    let Some((_, _, lease)) = first(link, name).await? else {
        return Ok(None);
    };
    let left = link
        .run(move |mut client| async move { client.lease_time_to_live(lease, None).await })
        .await?;
    Ok(Some(Duration::from_secs(left.ttl().max(0).unsigned_abs())))
}

/// The cluster's revision: every later acquisition's token is larger. (Read on a key
/// under the prefix, where a least-privileged user has rights; the revision in the
/// answer is the cluster's.)
pub(crate) async fn revision(link: &EtcdLink) -> Result<u64> {
    let key = link.prefix().to_owned();
    let now = link
        .run(move |mut client| {
            let key = key.clone();
            async move {
                client
                    .get(key, Some(GetOptions::new().with_count_only()))
                    .await
            }
        })
        .await?;
    Ok(now
        .header()
        .map_or(0, |header| header.revision())
        .unsigned_abs())
}

/// Deletes the holder's key (only `owner`'s, unless it is empty): the next waiter's
/// watch wakes it.
pub(crate) async fn force_unlock(link: &EtcdLink, name: &str, owner: &str) -> Result<bool> {
    let Some((holder, revision, _)) = first(link, name).await? else {
        return Ok(false);
    };
    if !owner.is_empty() && holder != owner {
        return Ok(false);
    }
    let key = format!("{}{holder}", queue_of(link, name));
    let (deleted, resent) = link
        .run_noting_resends(move |mut client| {
            let txn = Txn::new()
                .when([Compare::create_revision(
                    key.clone(),
                    CompareOp::Equal,
                    revision,
                )])
                .and_then([TxnOp::delete(key.clone(), None)]);
            async move { client.txn(txn).await }
        })
        .await?;
    // A send answered "not there" after an earlier send that may have been applied:
    // that earlier send deleted it (nothing else deletes a key at that revision so fast
    // that telling it apart would matter more than not deleting the next holder's).
    Ok(deleted.succeeded() || resent)
}
