//! What a lock's other calls read or change on ZooKeeper: its holders (live fixed-lease
//! holdings, and the queued nodes whose turn has come), how long their leases have left,
//! the last token, a force-unlock.

use std::time::Duration;

use zookeeper_client::{Client, Error as ZkError};

use super::{fixed, node_of, owner_in, queue};
use crate::error::Result;
use crate::transport::zk::watch::{waits_for, EXCLUSIVE, SHARED};
use crate::transport::zk::ZkLink;

/// Who holds a lock, as its node's children say.
struct Holder {
    owner: String,
    /// Its node.
    path: String,
    /// How long a fixed lease has left, by the ensemble's clock; `None`: a watchdog-mode
    /// holding (or a waiter whose turn has come, about to hold).
    left: Option<Duration>,
}

/// The holders of the lock whose node is `parent`: its live fixed-lease holdings, and the
/// queued nodes whose turn has come (no node they wait for ahead of them, and no live
/// fixed-lease holding they wait for): one writer, or any number of readers (a
/// downgrade's reader beside its writer too). The ensemble's clock is learned (from a
/// write of the lock's node) only when a fixed-lease holding is there to judge.
async fn holders(client: &Client, parent: &str) -> std::result::Result<Vec<Holder>, ZkError> {
    let children = match client.list_children(parent).await {
        Ok(children) => children,
        Err(ZkError::NoNode) => return Ok(Vec::new()),
        Err(err) => return Err(err),
    };
    let mut found = Vec::new();
    if children.iter().any(|child| child.starts_with(fixed::HELD)) {
        if let Some(now) = fixed::server_now(client, parent, b"").await? {
            for held in fixed::read_held(client, parent, &children, now).await? {
                if held.is_live() {
                    found.push(Holder {
                        owner: fixed::held_owner(&held.node).unwrap_or_default().to_owned(),
                        path: format!("{parent}/{}", held.node),
                        left: Some(held.left),
                    });
                }
            }
        }
    }
    let live_held: Vec<String> = found
        .iter()
        .filter_map(|holder| {
            holder
                .path
                .rsplit_once('/')
                .map(|(_, node)| node.to_owned())
        })
        .collect();
    let queue = queue(&children);
    for &(sequence, node) in &queue {
        let shared = node.starts_with(SHARED);
        let behind = queue
            .iter()
            .take_while(|(ahead, _)| *ahead < sequence)
            .any(|(_, ahead)| waits_for(node, ahead));
        let held_off = live_held.iter().any(|held| fixed::waits_for(shared, held));
        if !behind && !held_off {
            found.push(Holder {
                owner: owner_in(node).unwrap_or_default().to_owned(),
                path: format!("{parent}/{node}"),
                left: None,
            });
        }
    }
    Ok(found)
}

/// Who holds the lock: the owner and path of each holder's node (see [`holders`]).
pub(crate) async fn holding(link: &ZkLink, name: &str) -> Result<Vec<(String, String)>> {
    let parent = node_of(link, name);
    let found = link
        .run(move |client| async move { holders(&client, &parent).await })
        .await?;
    Ok(found
        .into_iter()
        .map(|holder| (holder.owner, holder.path))
        .collect())
}

/// How long the holders' leases have left, the longest of them: a fixed lease's rest,
/// or a watchdog-mode holding's session timeout (its node outlives a holder that stops
/// answering by at most that). `None` while the lock is free.
pub(crate) async fn lease_left(link: &ZkLink, name: &str) -> Result<Option<Duration>> {
    let parent = node_of(link, name);
    let found = link
        .run(move |client| async move { holders(&client, &parent).await })
        .await?;
    Ok(found
        .into_iter()
        .map(|holder| holder.left.unwrap_or_else(|| link.lease()))
        .max())
}

/// A token below every later acquisition's: while the queue has exclusive nodes, one less
/// than its first one's czxid (that node holds, or holds next, and every node behind it was
/// created later); with none, the zxid of the queue's last change (a node created later
/// gets a larger czxid). Previous holders' tokens are never larger (a fixed-lease
/// holding's is its waiter's node's czxid, below those of the nodes queued behind it).
pub(crate) async fn last_token(link: &ZkLink, name: &str) -> Result<u64> {
    let (parent, root) = (node_of(link, name), link.prefix().to_owned());
    let token = link
        .run(move |client| async move {
            // A first node deleted between the listing and its read: read again.
            loop {
                let children = match client.list_children(&parent).await {
                    Ok(children) => children,
                    Err(ZkError::NoNode) => Vec::new(),
                    Err(err) => return Err(err),
                };
                // Exclusive nodes only: a shared one may sort ahead of older ones (a
                // downgrade's), and its holding has no token.
                let exclusive = queue(&children)
                    .into_iter()
                    .find(|(_, node)| node.starts_with(EXCLUSIVE));
                if let Some((_, first)) = exclusive {
                    match client.check_stat(&format!("{parent}/{first}")).await? {
                        Some(stat) => return Ok(stat.czxid - 1),
                        None => continue,
                    }
                }
                let changed = match client.check_stat(&parent).await? {
                    Some(stat) => stat.pzxid.max(stat.czxid),
                    // No queue: the prefix's last change is at least its deletion.
                    None => client
                        .check_stat(&root)
                        .await?
                        .map_or(0, |stat| stat.pzxid.max(stat.czxid)),
                };
                return Ok(changed);
            }
        })
        .await?;
    Ok(token.max(0).unsigned_abs())
}

/// Deletes every holder's node (only `owner`'s, unless it is empty): the waiters'
/// watches wake them. True when a node was deleted.
pub(crate) async fn force_unlock(link: &ZkLink, name: &str, owner: &str) -> Result<bool> {
    let parent = node_of(link, name);
    let owner = owner.to_owned();
    link.run(move |client| async move {
        let mut deleted = false;
        for holder in holders(&client, &parent).await? {
            if !owner.is_empty() && holder.owner != owner {
                continue;
            }
            match client.delete(&holder.path, None).await {
                Ok(()) => deleted = true,
                Err(ZkError::NoNode) => {}
                Err(err) => return Err(err),
            }
        }
        Ok(deleted)
    })
    .await
}
