//! What a lock's other calls read or change on etcd: its holders (a writer, or readers),
//! their leases, the cluster's revision (the floor of later tokens), a force-unlock.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, SortOrder, SortTarget, Txn, TxnOp};

use super::queue_of;
use crate::error::Result;
use crate::transport::etcd::watch::SHARED;
use crate::transport::etcd::EtcdLink;

/// One holder of a lock, as its queue says.
pub(crate) struct Holder {
    /// As its guard gives it (a reader's without the key's shared mark).
    pub(crate) owner: String,
    /// Its key, and the key's create revision and lease.
    key: Vec<u8>,
    revision: i64,
    lease: i64,
}

/// The holders of lock `name`: the first key of its queue if a writer's, else the
/// readers' keys ahead of the first writer's (oldest first).
pub(crate) async fn holders(link: &EtcdLink, name: &str) -> Result<Vec<Holder>> {
    let queue = queue_of(link, name);
    let found = {
        let queue = queue.clone();
        link.run(move |mut client| {
            let options = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend);
            let queue = queue.clone();
            async move { client.get(queue, Some(options)).await }
        })
        .await?
    };
    let mut holders = Vec::new();
    for (index, kv) in found.kvs().iter().enumerate() {
        let own = kv.key().get(queue.len()..).unwrap_or_default();
        let (shared, owner) = match own.strip_prefix(SHARED.as_bytes()) {
            Some(owner) => (true, owner),
            None => (false, own),
        };
        if !shared && index > 0 {
            break;
        }
        holders.push(Holder {
            owner: String::from_utf8_lossy(owner).into_owned(),
            key: kv.key().to_vec(),
            revision: kv.create_revision(),
            lease: kv.lease(),
        });
        if !shared {
            break;
        }
    }
    Ok(holders)
}

/// Who holds the lock: each holder's owner.
pub(crate) async fn owners(link: &EtcdLink, name: &str) -> Result<Vec<String>> {
    Ok(holders(link, name)
        .await?
        .into_iter()
        .map(|holder| holder.owner)
        .collect())
}

/// How long the holders' leases have left, the longest (whole seconds, as etcd keeps
/// them); `None` while the lock is free.
pub(crate) async fn lease_left(link: &EtcdLink, name: &str) -> Result<Option<Duration>> {
    let mut longest = None;
    for holder in holders(link, name).await? {
        let lease = holder.lease;
        let left = link
            .run(move |mut client| async move { client.lease_time_to_live(lease, None).await })
            .await?;
        let left = Duration::from_secs(left.ttl().max(0).unsigned_abs());
        longest = longest.max(Some(left));
    }
    Ok(longest)
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

/// Deletes every holder's key (only `owner`'s, unless it is empty): the next waiters'
/// watches wake them. True when a key was deleted.
pub(crate) async fn force_unlock(link: &EtcdLink, name: &str, owner: &str) -> Result<bool> {
    let mut any = false;
    for holder in holders(link, name).await? {
        if !owner.is_empty() && holder.owner != owner {
            continue;
        }
        let (key, revision) = (holder.key, holder.revision);
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
        // A send answered "not there" after an earlier send that may have been
        // applied: that earlier send deleted it (nothing else deletes a key at that
        // revision so fast that telling it apart would matter more than not deleting
        // the next holder's).
        any |= deleted.succeeded() || resent;
    }
    Ok(any)
}
