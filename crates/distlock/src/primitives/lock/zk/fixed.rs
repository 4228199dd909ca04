//! Holdings on a fixed lease (`Lock::with_lease`): a persistent node `held-<owner>` in
//! the lock's node, which outlives its holder's session (a holder that leaves its lock
//! to expire may exit), and expires by a rule every client applies.
//!
//! - Its data is the lease in milliseconds; the lease runs from its `mtime`, the
//!   leader's wall clock at the write that created it or last extended it.
//! - It is expired once the ensemble's "now" reaches `mtime + lease`. A client learns
//!   the ensemble's now from a write's answer (the `mtime` it sets), never from its own
//!   clock, so that only the leader's clock judges a lease (docs/safety.md: a leader
//!   change to a server whose clock differs moves the expiry by the difference).
//! - A live one keeps every acquisition waiting, whatever its queue position; the first
//!   waiter that finds one expired deletes it (version-checked: an extension since the
//!   read keeps it).

use std::time::Duration;

use zookeeper_client::{Acls, Client, CreateMode, Error as ZkError, MultiWriteError};

pub(super) use crate::transport::zk::watch::{HELD, SHARED_HELD};

/// The node of `owner`'s fixed-lease holding in the lock's node `parent`: `held-<owner>`,
/// or `held-read-<owner>` for a `shared` one. (An owner is `<uuid>:<n>`, so no owner
/// starts with `read-`.)
pub(super) fn held_path(parent: &str, owner: &str, shared: bool) -> String {
    let kind = if shared { SHARED_HELD } else { HELD };
    format!("{parent}/{kind}{owner}")
}

/// The owner a fixed-lease holding's node name carries.
pub(super) fn held_owner(node: &str) -> Option<&str> {
    node.strip_prefix(SHARED_HELD)
        .or_else(|| node.strip_prefix(HELD))
}

/// Whether a waiter (`shared` or not) must wait for the fixed-lease holding `node` while
/// it is live (the rule the hub's watch follows too).
pub(super) fn waits_for(shared: bool, node: &str) -> bool {
    crate::transport::zk::watch::waits_for_held(shared, node)
}

/// The lease a fixed-lease holding's node gives. Data that is not one (a node written
/// by hand) gives none: such a node holds nothing, so it is expired at once.
fn lease_in(data: &[u8]) -> Option<i64> {
    std::str::from_utf8(data)
        .ok()
        .and_then(|text| text.trim().parse::<i64>().ok())
        .filter(|lease| *lease > 0)
}

/// A fixed-lease holding's node as read, and how it stands at the ensemble's `now`.
pub(super) struct Held {
    pub(super) node: String,
    pub(super) version: i32,
    /// How long it has left at `now`; zero once expired.
    pub(super) left: Duration,
}

impl Held {
    pub(super) fn is_live(&self) -> bool {
        !self.left.is_zero()
    }
}

/// The ensemble's clock now, as the leader set it on a write of `path` (whose data is
/// written again unchanged in meaning: `data`). `None` when the node is gone.
pub(super) async fn server_now(
    client: &Client,
    path: &str,
    data: &[u8],
) -> Result<Option<i64>, ZkError> {
    match client.set_data(path, data, None).await {
        Ok(stat) => Ok(Some(stat.mtime)),
        Err(ZkError::NoNode) => Ok(None),
        Err(err) => Err(err),
    }
}

/// The fixed-lease holdings among `children` of `parent`, read after the ensemble's
/// clock said `now` (so a lease judged expired had ended by then).
pub(super) async fn read_held(
    client: &Client,
    parent: &str,
    children: &[String],
    now: i64,
) -> Result<Vec<Held>, ZkError> {
    let mut found = Vec::new();
    for node in children.iter().filter(|child| child.starts_with(HELD)) {
        let (data, stat) = match client.get_data(&format!("{parent}/{node}")).await {
            Ok(read) => read,
            Err(ZkError::NoNode) => continue,
            Err(err) => return Err(err),
        };
        let ends = lease_in(&data).map_or(0, |lease| stat.mtime.saturating_add(lease));
        let left = u64::try_from(ends.saturating_sub(now)).unwrap_or(0);
        found.push(Held {
            node: node.clone(),
            version: stat.version,
            left: Duration::from_millis(left),
        });
    }
    Ok(found)
}

/// What stands between the first waiter of a queue and the lock.
pub(super) enum Clear {
    /// Nothing: no fixed-lease holding is left (expired ones were deleted).
    Free,
    /// A live fixed-lease holding, with this long left at most.
    Live(Duration),
    /// The waiter's own node is gone.
    Gone,
}

/// Deletes the expired fixed-lease holdings among `children` of `parent` that the waiter
/// whose node is `own` (written to learn the ensemble's now) waits for, and tells whether
/// a live one is left. A `shared` waiter waits for exclusive holdings only.
pub(super) async fn clear(
    client: &Client,
    parent: &str,
    own: &str,
    children: &[String],
    shared: bool,
) -> Result<Clear, ZkError> {
    let children: Vec<String> = children
        .iter()
        .filter(|child| child.starts_with(HELD) && waits_for(shared, child))
        .cloned()
        .collect();
    if children.is_empty() {
        return Ok(Clear::Free);
    }
    let Some(now) = server_now(client, own, b"1").await? else {
        return Ok(Clear::Gone);
    };
    let mut live = Duration::ZERO;
    for held in read_held(client, parent, &children, now).await? {
        if held.is_live() {
            live = live.max(held.left);
            continue;
        }
        let path = format!("{parent}/{}", held.node);
        match client.delete(&path, Some(held.version)).await {
            Ok(()) | Err(ZkError::NoNode) => {}
            // Extended since it was read: looked at again soon, as live.
            Err(ZkError::BadVersion) => live = live.max(Duration::from_millis(10)),
            Err(err) => return Err(err),
        }
    }
    Ok(if live.is_zero() {
        Clear::Free
    } else {
        Clear::Live(live)
    })
}

/// Turns the waiter's node `queue_node`, whose turn it is, into the fixed-lease holding
/// of `lease_ms` at `held` (its [`held_path`]), in one multi-op: the persistent node
/// created, the waiter's node deleted. False when the waiter's node is gone (nothing
/// changed). A holding found made (by an earlier try whose reply was lost) counts as
/// made.
pub(super) async fn convert(
    client: &Client,
    held: &str,
    queue_node: &str,
    lease_ms: u64,
) -> Result<bool, ZkError> {
    let persistent = CreateMode::Persistent.with_acls(Acls::anyone_all());
    let mut multi = client.new_multi_writer();
    multi.add_create(held, lease_ms.to_string().as_bytes(), &persistent)?;
    multi.add_delete(queue_node, None)?;
    match multi.commit().await {
        Ok(_) => Ok(true),
        Err(MultiWriteError::OperationFailed {
            source: ZkError::NodeExists,
            ..
        }) => {
            // Made by a try whose reply was lost; the waiter's node (placed again
            // since) goes.
            match client.delete(queue_node, None).await {
                Ok(()) | Err(ZkError::NoNode) => Ok(true),
                Err(err) => Err(err),
            }
        }
        Err(MultiWriteError::OperationFailed {
            source: ZkError::NoNode,
            ..
        }) => Ok(false),
        Err(err) => Err(err.into()),
    }
}
