//! The lease lock on ZooKeeper: a queue of ephemeral sequential nodes under the lock's
//! node, one per acquisition, the lowest sequence holding it.
//!
//! - The lock's node is `<prefix>/<name>` (a container node, which ZooKeeper deletes
//!   once its last child is gone; `%` and `/` in the name are escaped as `%25` and
//!   `%2F`, so a name is always one node). A waiter's node is
//!   `<prefix>/<name>/lock-<owner>-<sequence>`, created once for the whole acquisition
//!   (its owner lives as long as the wait), ephemeral: it lives as long as the client's
//!   session. The owner in the node's name lets a create whose reply was lost be found.
//! - It holds the lock when no sibling has a smaller sequence; its `czxid` (the zxid of
//!   its creation, which every write of the ensemble raises, across sessions and
//!   leaders) is its fencing token.
//! - A waiter waits for its predecessor's deletion only (`first:` topics, see
//!   `transport/zk/watch.rs`): a release wakes the next waiter alone, in FIFO order.
//! - The session is the lease. zookeeper-client's heartbeats keep it alive; the watchdog
//!   reads the client's nodes (one multi-read per batch), and each answer proves the
//!   session was alive when the read was sent, so a holding is trusted until then plus
//!   the session timeout (less the usual margin). A client cut off from the ensemble
//!   stops trusting its holdings before the ensemble can expire its session; an expired
//!   session (its nodes gone) ends them at the next read or watch event.
//! - A fixed lease (`Lock::with_lease`) cannot be honoured: a node has no lifetime of its
//!   own shorter than its session's. It is refused with `Error::Unsupported`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use zookeeper_client::{Acls, Client, CreateMode, Error as ZkError};

use super::hold_ops::{HoldOps, OpFuture, ReleaseArgs};
use super::holding::{Acquired, Hold};
use crate::engine::acquire::{AbandonFuture, Acquire, Attempt, AttemptFuture};
use crate::engine::renewal::registry::{Renewal, RenewalKind};
use crate::engine::session::Core;
use crate::engine::subscriptions::WakeRule;
use crate::error::{Error, Result};
use crate::transport::zk::watch::sequence_of;
use crate::transport::zk::{ZkLink, STORE};

/// A lock hold on ZooKeeper, renewed by reading its node in the client's session.
pub(crate) static ZK_LOCK_RENEWAL: RenewalKind = RenewalKind {
    name: "lock hold",
    renew: Renewal::Nodes,
};

/// What a ZooKeeper client cannot do with a fixed lease.
pub(crate) const NO_FIXED_LEASE: &str =
    "a fixed lease (Lock::with_lease): a ZooKeeper node lives exactly as long as its session";

/// The lock's node: the prefix, then the escaped name.
pub(crate) fn node_of(link: &ZkLink, name: &str) -> String {
    format!("{}/{}", link.prefix(), escape(name))
}

/// `name` as one node name: `%` and `/` escaped.
fn escape(name: &str) -> String {
    name.replace('%', "%25").replace('/', "%2F")
}

/// A waiter's node name, up to its sequence number.
fn node_prefix(owner: &str) -> String {
    format!("lock-{owner}-")
}

/// The owner a waiter's node name carries.
fn owner_in(node: &str) -> Option<&str> {
    node.strip_prefix("lock-")
        .and_then(|rest| rest.rsplit_once('-'))
        .map(|(owner, _)| owner)
}

/// Refuses a name ZooKeeper cannot keep as a node name (after `%` and `/` are escaped):
/// `.` and `..`, and the characters ZooKeeper refuses in a path.
pub(crate) fn validate_name(name: &str) -> Result<()> {
    if name == "." || name == ".." {
        return Err(Error::InvalidName {
            name: name.to_owned(),
            reason: "`.` and `..` cannot name a ZooKeeper node",
        });
    }
    let refused = |c: char| {
        c <= '\u{1f}'
            || ('\u{7f}'..='\u{9f}').contains(&c)
            || ('\u{e000}'..='\u{f8ff}').contains(&c)
            || ('\u{fff0}'..='\u{ffff}').contains(&c)
    };
    if name.chars().any(refused) {
        return Err(Error::InvalidName {
            name: name.escape_debug().to_string(),
            reason: "ZooKeeper refuses NUL, control characters, U+E000–U+F8FF and \
                     U+FFF0–U+FFFF in a node's name",
        });
    }
    Ok(())
}

/// A waiter's node, as this acquisition created it.
#[derive(Clone)]
struct Placed {
    path: String,
    czxid: i64,
    /// The session that created it (its ephemeral owner).
    session: i64,
}

/// One acquisition on ZooKeeper, tried as often as the engine needs, as one owner.
pub(crate) struct ZkAttempt {
    state: Arc<State>,
    /// `first:<parent>/lock-<owner>-`: the topic the waiter waits on.
    topic: String,
}

/// What every try of one acquisition shares.
struct State {
    core: Arc<Core>,
    link: ZkLink,
    name: Arc<str>,
    /// The lock's node.
    parent: Arc<str>,
    owner: Arc<str>,
    /// `lock-<owner>-`: this waiter's node name before its sequence number.
    prefix: Arc<str>,
    placed: Mutex<Option<Placed>>,
    /// A create was sent: its node may exist even if no reply said so.
    tried: AtomicBool,
}

impl ZkAttempt {
    pub(crate) fn new(core: Arc<Core>, link: ZkLink, name: Arc<str>) -> Self {
        let owner = core.next_owner();
        let parent: Arc<str> = node_of(&link, &name).into();
        let prefix: Arc<str> = node_prefix(&owner).into();
        ZkAttempt {
            topic: format!("first:{parent}/{prefix}"),
            state: Arc::new(State {
                core,
                link,
                name,
                parent,
                owner,
                prefix,
                placed: Mutex::new(None),
                tried: AtomicBool::new(false),
            }),
        }
    }

    pub(crate) fn core(&self) -> &Core {
        &self.state.core
    }
}

impl State {
    fn placed(&self) -> Option<Placed> {
        self.placed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    fn set_placed(&self, placed: Option<Placed>) {
        *self
            .placed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = placed;
    }

    /// The waiter's node in `client`'s session: the one placed before, or a new one.
    async fn place(&self, client: &Client) -> Result<Placed> {
        let session = client.session_id().0;
        if let Some(placed) = self.placed().filter(|placed| placed.session == session) {
            return Ok(placed);
        }
        let (parent, prefix) = (self.parent.to_string(), self.prefix.to_string());
        let (lock_root, search) = (
            self.link.prefix().to_owned(),
            self.tried.swap(true, Ordering::AcqRel),
        );
        let (path, czxid) = self
            .link
            .run_on(client.clone(), move |client| async move {
                create_node(&client, &lock_root, &parent, &prefix, search).await
            })
            .await?;
        let placed = Placed {
            path,
            czxid,
            session,
        };
        self.set_placed(Some(placed.clone()));
        Ok(placed)
    }
}

/// Creates the waiter's ephemeral sequential node `<parent>/<prefix><sequence>` (the
/// parent as a container node when missing), unless `search` finds one a create whose
/// reply was lost made. Answers its path and czxid.
async fn create_node(
    client: &Client,
    lock_root: &str,
    parent: &str,
    prefix: &str,
    search: bool,
) -> std::result::Result<(String, i64), ZkError> {
    if search {
        if let Some(found) = find_own(client, parent, prefix).await? {
            return Ok(found);
        }
    }
    let ephemeral = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
    let container = CreateMode::Container.with_acls(Acls::anyone_all());
    let persistent = CreateMode::Persistent.with_acls(Acls::anyone_all());
    let base = format!("{parent}/{prefix}");
    // A container emptied by another waiter's release may be deleted by the ensemble
    // between our creating it and our node: a few rounds, then the error.
    let mut rounds = 0;
    loop {
        rounds += 1;
        match client.create(&base, b"1", &ephemeral).await {
            Ok((stat, sequence)) => return Ok((format!("{base}{sequence}"), stat.czxid)),
            Err(ZkError::NoNode) if rounds < 4 => {
                match client.create(parent, b"", &container).await {
                    Ok(_) | Err(ZkError::NodeExists) => {}
                    // The prefix itself is gone (deleted by hand): made again.
                    Err(ZkError::NoNode) => client.mkdir(lock_root, &persistent).await?,
                    Err(err) => return Err(err),
                }
            }
            Err(err) => return Err(err),
        }
    }
}

/// The node of `parent` whose name starts with `prefix` (this waiter's), with its czxid.
async fn find_own(
    client: &Client,
    parent: &str,
    prefix: &str,
) -> std::result::Result<Option<(String, i64)>, ZkError> {
    let children = match client.list_children(parent).await {
        Ok(children) => children,
        Err(ZkError::NoNode) => return Ok(None),
        Err(err) => return Err(err),
    };
    let Some(own) = children.iter().find(|child| child.starts_with(prefix)) else {
        return Ok(None);
    };
    let path = format!("{parent}/{own}");
    Ok(client
        .check_stat(&path)
        .await?
        .map(|stat| (path, stat.czxid)))
}

/// The children of `parent` that are waiters' nodes, lowest sequence first.
fn queue(children: &[String]) -> Vec<(i64, &str)> {
    let mut queue: Vec<(i64, &str)> = children
        .iter()
        .filter(|child| child.starts_with("lock-"))
        .filter_map(|child| sequence_of(child).map(|sequence| (sequence, child.as_str())))
        .collect();
    queue.sort_unstable();
    queue
}

impl Acquire for ZkAttempt {
    type Guard = Hold;

    fn kind(&self) -> &'static str {
        "lock"
    }

    fn attempt(&self) -> AttemptFuture<Hold> {
        let state = Arc::clone(&self.state);
        Box::pin(async move { state.attempt().await })
    }

    fn channel(&self) -> &str {
        &self.topic
    }

    // A waiter queues alone on its own topic (its predecessor wakes it alone).
    fn queue(&self) -> &str {
        &self.topic
    }

    fn key(&self) -> &str {
        &self.state.name
    }

    fn wake_rule(&self) -> WakeRule {
        WakeRule::Addressed
    }

    fn abandon(&self) -> Option<AbandonFuture> {
        let state = Arc::clone(&self.state);
        Some(Box::pin(async move { state.abandon().await }))
    }

    fn token(&self, guard: &Hold) -> Option<u64> {
        Some(guard.token())
    }
}

impl State {
    /// One try: the waiter's node placed (once), then whether it is the first.
    async fn attempt(&self) -> Result<Attempt<Hold>> {
        let client = self.link.client().await?;
        // A node found gone (a force-unlock of a waiter) is made once more.
        for _ in 0..2 {
            let placed = self.place(&client).await?;
            let parent = self.parent.to_string();
            let sent_at = Instant::now();
            let children = self
                .link
                .run_on(client.clone(), move |client| async move {
                    match client.list_children(&parent).await {
                        Err(ZkError::NoNode) => Ok(Vec::new()),
                        other => other,
                    }
                })
                .await?;
            let own = placed.path.rsplit_once('/').map_or("", |(_, node)| node);
            let queue = queue(&children);
            if !queue.iter().any(|(_, node)| *node == own) {
                self.set_placed(None);
                continue;
            }
            if queue.first().map(|(_, node)| *node) != Some(own) {
                return Ok(Attempt::Busy { retry_after: None });
            }
            let lease = self.link.lease();
            let path: Arc<str> = placed.path.into();
            return Ok(Attempt::Acquired(
                Acquired {
                    core: Arc::clone(&self.core),
                    name: Arc::clone(&self.name),
                    owner: Arc::clone(&self.owner),
                    release: Arc::new(ZkHold {
                        gone: format!("gone:{path}"),
                        link: self.link.clone(),
                        path,
                        czxid: placed.czxid,
                        session: placed.session,
                        done: AtomicBool::new(false),
                    }),
                    token: placed.czxid.unsigned_abs(),
                    // The listing was answered in the node's session: the ensemble
                    // keeps that session at least a timeout from when it was sent.
                    sent_at,
                    lease,
                    lease_ms: u64::try_from(lease.as_millis()).unwrap_or(u64::MAX),
                    renew: true,
                }
                .into_hold(),
            ));
        }
        Ok(Attempt::Busy { retry_after: None })
    }

    /// Deletes the node this acquisition knows, and any a create whose reply was lost
    /// made.
    async fn abandon(&self) -> Result<()> {
        let (parent, prefix) = (self.parent.to_string(), self.prefix.to_string());
        let placed = self.placed();
        let session = placed.as_ref().map(|placed| placed.session);
        let deleted = self
            .link
            .run(move |client| async move {
                if let Some(placed) = placed {
                    match client.delete(&placed.path, None).await {
                        Ok(()) | Err(ZkError::NoNode) => {}
                        Err(err) => return Err(err),
                    }
                }
                while let Some((path, _)) = find_own(&client, &parent, &prefix).await? {
                    match client.delete(&path, None).await {
                        Ok(()) | Err(ZkError::NoNode) => {}
                        Err(err) => return Err(err),
                    }
                }
                Ok(())
            })
            .await;
        if let Err(err) = &deleted {
            if err.is_connection_error() {
                // Left behind, the node would keep its place (and then the lock) for as
                // long as the client's session lives: deleted once the ensemble answers.
                let session = session.unwrap_or_else(|| self.link_session());
                self.link.reap(
                    self.parent.to_string(),
                    self.prefix.to_string(),
                    session,
                    Duration::ZERO,
                );
            }
        }
        deleted
    }

    /// The current session's id, as far as known without asking.
    fn link_session(&self) -> i64 {
        self.link.session_id()
    }
}

/// A holding's calls on ZooKeeper, on its own node (whose path no other acquisition
/// ever has: it carries the owner).
pub(crate) struct ZkHold {
    link: ZkLink,
    path: Arc<str>,
    /// `gone:<path>`: the topic a holding listening for a force-unlock waits on.
    gone: String,
    czxid: i64,
    session: i64,
    /// A final release was answered (the node deleted, or found gone).
    done: AtomicBool,
}

impl Drop for ZkHold {
    /// A holding that ends without an answered release (left to expire, or its release
    /// failed) leaves its node to its session, which the client keeps alive: the node is
    /// deleted a session timeout later, when a crashed holder's would have gone.
    fn drop(&mut self) {
        if self.done.load(Ordering::Acquire) {
            return;
        }
        let Some((parent, node)) = self.path.rsplit_once('/') else {
            return;
        };
        self.link.reap(
            parent.to_owned(),
            node.to_owned(),
            self.session,
            self.link.lease(),
        );
    }
}

impl HoldOps for ZkHold {
    fn release<'a>(
        &'a self,
        _core: &'a Core,
        _name: &'a str,
        _owner: &'a str,
        _latch: &'a str,
        args: &'a ReleaseArgs<'a>,
    ) -> OpFuture<'a, i64> {
        Box::pin(async move {
            let path = self.path.to_string();
            let (left, retry) = (args.left, args.retry);
            let answer = self
                .link
                .run(move |client| async move {
                    if left > 0 {
                        return match client
                            .set_data(&path, left.to_string().as_bytes(), None)
                            .await
                        {
                            Ok(_) => Ok(i64::from(left)),
                            Err(ZkError::NoNode) => Ok(-1),
                            Err(err) => Err(err),
                        };
                    }
                    match client.delete(&path, None).await {
                        Ok(()) => Ok(0),
                        // A retry after a lost reply finds the node gone: only this
                        // holding deletes its own node while its session lives, so the
                        // first try freed it.
                        Err(ZkError::NoNode) => Ok(if retry { 0 } else { -1 }),
                        Err(err) => Err(err),
                    }
                })
                .await;
            if left == 0 && answer.is_ok() {
                self.done.store(true, Ordering::Release);
            }
            answer
        })
    }

    fn reenter<'a>(
        &'a self,
        _core: &'a Core,
        _name: &'a str,
        _owner: &'a str,
        holds: u32,
        _lease_ms: u64,
    ) -> OpFuture<'a, i64> {
        Box::pin(async move {
            let path = self.path.to_string();
            self.link
                .run(move |client| async move {
                    match client
                        .set_data(&path, holds.to_string().as_bytes(), None)
                        .await
                    {
                        Ok(_) => Ok(1),
                        Err(ZkError::NoNode) => Ok(0),
                        Err(err) => Err(err),
                    }
                })
                .await
        })
    }

    fn extend<'a>(
        &'a self,
        _core: &'a Core,
        _name: &'a str,
        _owner: &'a str,
        _lease_ms: u64,
    ) -> OpFuture<'a, bool> {
        Box::pin(async move {
            Err(Error::Unsupported {
                store: STORE,
                what: NO_FIXED_LEASE,
            })
        })
    }

    fn verify<'a>(
        &'a self,
        _core: &'a Core,
        _name: &'a str,
        _owner: &'a str,
    ) -> OpFuture<'a, bool> {
        Box::pin(async move {
            let path = self.path.to_string();
            let stat = self
                .link
                .run(move |client| async move { client.check_stat(&path).await })
                .await?;
            Ok(stat.is_some_and(|stat| {
                stat.czxid == self.czxid && stat.ephemeral_owner == self.session
            }))
        })
    }

    // A partial release rewrites the hold count only: the session, which the node lives
    // on, is not renewed by it.
    fn partial_release_renews(&self) -> bool {
        false
    }

    fn renewal(&self, _owner: &Arc<str>) -> (&'static RenewalKind, Arc<str>) {
        (&ZK_LOCK_RENEWAL, Arc::clone(&self.path))
    }

    fn unlock_channel(&self) -> Option<&str> {
        Some(&self.gone)
    }
}

/// Who holds the lock: the owner and path of the lowest node of its queue.
pub(crate) async fn first(link: &ZkLink, name: &str) -> Result<Option<(String, String)>> {
    let parent = node_of(link, name);
    link.run(move |client| async move {
        let children = match client.list_children(&parent).await {
            Ok(children) => children,
            Err(ZkError::NoNode) => return Ok(None),
            Err(err) => return Err(err),
        };
        Ok(queue(&children).first().map(|(_, node)| {
            (
                owner_in(node).unwrap_or_default().to_owned(),
                format!("{parent}/{node}"),
            )
        }))
    })
    .await
}

/// A token below every later acquisition's: while the queue has nodes, one less than its
/// first node's czxid (that node holds, or holds next, and every node behind it was
/// created later); with none, the zxid of the queue's last change (a node created later
/// gets a larger czxid). Previous holders' tokens are never larger.
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
                if let Some((_, first)) = queue(&children).first() {
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

/// Deletes the holder's node (only `owner`'s, unless it is empty): the next waiter's
/// watch wakes it.
pub(crate) async fn force_unlock(link: &ZkLink, name: &str, owner: &str) -> Result<bool> {
    let Some((holder, path)) = first(link, name).await? else {
        return Ok(false);
    };
    if !owner.is_empty() && holder != owner {
        return Ok(false);
    }
    link.run(move |client| async move {
        match client.delete(&path, None).await {
            Ok(()) => Ok(true),
            Err(ZkError::NoNode) => Ok(false),
            Err(err) => Err(err),
        }
    })
    .await
}
