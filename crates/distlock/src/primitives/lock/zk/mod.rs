//! The lease lock on ZooKeeper: a queue of ephemeral sequential nodes under the lock's
//! node, one per acquisition, the lowest sequence holding it unless a holding on a fixed
//! lease is live.
//!
//! - The lock's node is `<prefix>/<name>` (a container node, which ZooKeeper deletes
//!   once its last child is gone; `%` and `/` in the name are escaped as `%25` and
//!   `%2F`, so a name is always one node). A waiter's node is
//!   `<prefix>/<name>/lock-<owner>-<sequence>`, created once for the whole acquisition
//!   (its owner lives as long as the wait), ephemeral: it lives as long as the client's
//!   session. The owner in the node's name lets a create whose reply was lost be found.
//! - An acquisition holds the lock when no sibling has a smaller sequence and no live
//!   fixed-lease holding (`held-<owner>`, see [`fixed`]) is left; its node's `czxid`
//!   (the zxid of its creation, which every write of the ensemble raises, across
//!   sessions and leaders) is its fencing token. Nodes hold in the order they were
//!   created, so tokens grow.
//! - A waiter waits for its predecessor's deletion only (`first:` topics, see
//!   `transport/zk/watch.rs`): a release wakes the next waiter alone, in FIFO order. The
//!   first waiter behind a fixed-lease holding waits for that node's deletion (a change
//!   of the queue) or for its lease's end, whichever comes first.
//! - In watchdog mode the session is the lease. zookeeper-client's heartbeats keep it
//!   alive; the watchdog reads the client's nodes (one multi-read per batch), and each
//!   answer proves the session was alive when the read was sent, so a holding is
//!   trusted until then plus the session timeout (less the usual margin). A client cut
//!   off from the ensemble stops trusting its holdings before the ensemble can expire
//!   its session; an expired session (its nodes gone) ends them at the next read or
//!   watch event.
//! - A fixed lease (`Lock::with_lease`) must outlive its holder's session (a holder may
//!   leave it to expire and exit): when its turn comes, the waiter's node is turned into
//!   a persistent `held-<owner>` node, whose lease the ensemble's clock judges
//!   ([`fixed`]). Its token stays its waiter's node's czxid.
//!
//! Here: the acquisition. [`hold`]: what a holding does with its node. [`inspect`]: what
//! the lock's other calls read or change (its holder, its last token, a force-unlock).

mod beside;
mod fixed;
mod hold;
mod inspect;

pub(crate) use inspect::{force_unlock, holding, last_token, lease_left};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use zookeeper_client::{Acls, Client, CreateMode, Error as ZkError};

use super::holding::{Acquired, Hold};
use crate::engine::acquire::{AbandonFuture, Acquire, Attempt, AttemptFuture};
use crate::engine::renewal::registry::{Renewal, RenewalKind};
use crate::engine::session::Core;
use crate::engine::subscriptions::WakeRule;
use crate::error::{Error, Result};
use crate::transport::zk::watch::{sequence_of, waits_for, EXCLUSIVE, SHARED};
use crate::transport::zk::ZkLink;
use fixed::Clear;
use hold::{FixedHold, ZkHold};

/// A lock hold on ZooKeeper, renewed by reading its node in the client's session.
pub(crate) static ZK_LOCK_RENEWAL: RenewalKind = RenewalKind {
    name: "lock hold",
    renew: Renewal::Nodes,
};

/// The lock's node: the prefix, then the escaped name.
pub(crate) fn node_of(link: &ZkLink, name: &str) -> String {
    format!("{}/{}", link.prefix(), escape(name))
}

/// `name` as one node name: `%` and `/` escaped.
fn escape(name: &str) -> String {
    name.replace('%', "%25").replace('/', "%2F")
}

/// A waiter's node name, up to its sequence number: `lock-<owner>-`, or `read-<owner>-`
/// for a shared holding.
fn node_prefix(owner: &str, shared: bool) -> String {
    let kind = if shared { SHARED } else { EXCLUSIVE };
    format!("{kind}{owner}-")
}

/// The owner a waiter's node name carries.
fn owner_in(node: &str) -> Option<&str> {
    node.strip_prefix(EXCLUSIVE)
        .or_else(|| node.strip_prefix(SHARED))
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
    /// A shared holding (an `RwLock` reader's), which waits for exclusive ones only.
    shared: bool,
    /// `lock-<owner>-` (`read-<owner>-` if shared): this waiter's node name before its
    /// sequence number.
    prefix: Arc<str>,
    placed: Mutex<Option<Placed>>,
    /// A create was sent: its node may exist even if no reply said so.
    tried: AtomicBool,
    /// The fixed lease asked for (`None`: watchdog mode), in milliseconds too.
    fixed: Option<(Duration, u64)>,
    /// When the first conversion of the waiter's node into a fixed-lease holding was
    /// sent, and that node's czxid (the holding's token): the holding may exist even if
    /// no reply said so, and its lease counts from then.
    converting: Mutex<Option<(Instant, i64)>>,
}

impl ZkAttempt {
    /// An acquisition of lock `name` as `owner`, alone or `shared` (with the other shared
    /// ones), on a fixed lease of `fixed` (checked to be whole milliseconds by the
    /// caller), or in watchdog mode.
    pub(crate) fn new(
        core: Arc<Core>,
        link: ZkLink,
        name: Arc<str>,
        owner: Arc<str>,
        shared: bool,
        fixed: Option<(Duration, u64)>,
    ) -> Self {
        let parent: Arc<str> = node_of(&link, &name).into();
        let prefix: Arc<str> = node_prefix(&owner, shared).into();
        ZkAttempt {
            topic: format!("first:{parent}/{prefix}"),
            state: Arc::new(State {
                core,
                link,
                name,
                parent,
                owner,
                shared,
                prefix,
                placed: Mutex::new(None),
                tried: AtomicBool::new(false),
                fixed,
                converting: Mutex::new(None),
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
        // The create whose reply was lost may have been applied through the leader while
        // this session's server lags behind: a sync first catches the server up, so the
        // search sees it rather than making a second node that would block the queue.
        match client.sync(parent).await {
            Ok(()) | Err(ZkError::NoNode) => {}
            Err(err) => return Err(err),
        }
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

/// The children of `parent` that are waiters' nodes (exclusive and shared), lowest
/// sequence first.
fn queue(children: &[String]) -> Vec<(i64, &str)> {
    let mut queue: Vec<(i64, &str)> = children
        .iter()
        .filter(|child| child.starts_with(EXCLUSIVE) || child.starts_with(SHARED))
        .filter_map(|child| sequence_of(child).map(|sequence| (sequence, child.as_str())))
        .collect();
    queue.sort_unstable();
    queue
}

impl Acquire for ZkAttempt {
    type Guard = Hold;

    fn kind(&self) -> &'static str {
        if self.state.shared {
            "read_lock"
        } else {
            "lock"
        }
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
        (!self.state.shared).then(|| guard.token())
    }
}

impl State {
    /// One try: the waiter's node placed (once), then whether no node it waits for is
    /// queued ahead of it (none at all, or for a shared one no exclusive one) and no live
    /// fixed-lease holding it waits for is left; the turn taken in watchdog mode, or
    /// turned into a fixed-lease holding.
    async fn attempt(&self) -> Result<Attempt<Hold>> {
        let client = self.link.client().await?;
        // A node found gone (a force-unlock of a waiter) is made once more.
        for _ in 0..2 {
            if let Some(held) = self.converted(&client).await? {
                return Ok(Attempt::Acquired(held));
            }
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
            let Some(&(sequence, _)) = queue.iter().find(|(_, node)| *node == own) else {
                self.set_placed(None);
                continue;
            };
            let blocked = queue
                .iter()
                .take_while(|(ahead, _)| *ahead < sequence)
                .any(|(_, node)| waits_for(own, node));
            if blocked {
                return Ok(Attempt::Busy { retry_after: None });
            }
            let (parent, path, shared) =
                (self.parent.to_string(), placed.path.clone(), self.shared);
            let clear = self
                .link
                .run_on(client.clone(), move |client| async move {
                    fixed::clear(&client, &parent, &path, &children, shared).await
                })
                .await?;
            match clear {
                Clear::Free => {}
                // Woken by the holding's deletion (a change of the queue), or tried
                // again at its lease's end.
                Clear::Live(left) => {
                    return Ok(Attempt::Busy {
                        retry_after: Some(left),
                    })
                }
                Clear::Gone => {
                    self.set_placed(None);
                    continue;
                }
            }
            let Some((lease, lease_ms)) = self.fixed else {
                return Ok(Attempt::Acquired(self.session_hold(placed, sent_at)));
            };
            // The local deadline counts from before the write whose mtime starts the
            // ensemble's: the holder stops trusting the lock before anyone can take it. A
            // conversion of the same node sent before (its reply lost) may be the one
            // that lands: the earliest counts.
            let sent_at = {
                let mut converting = self
                    .converting
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                match *converting {
                    Some(earlier) if earlier.1 == placed.czxid => earlier,
                    _ => *converting.insert((Instant::now(), placed.czxid)),
                }
            };
            let (held, path) = (self.held_path(), placed.path.clone());
            let converted = self
                .link
                .run_on(client.clone(), move |client| async move {
                    fixed::convert(&client, &held, &path, lease_ms).await
                })
                .await?;
            self.set_placed(None);
            if converted {
                return Ok(Attempt::Acquired(self.fixed_hold(sent_at, lease)));
            }
            // The waiter's node was gone, and the multi-op changed nothing: a node
            // placed again converts with its own token.
            *self
                .converting
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
        }
        Ok(Attempt::Busy { retry_after: None })
    }

    /// The fixed-lease holding an earlier try made, if its reply was lost.
    async fn converted(&self, client: &Client) -> Result<Option<Hold>> {
        let converting = *self
            .converting
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let (Some(sent_at), Some((lease, _))) = (converting, self.fixed) else {
            return Ok(None);
        };
        let held = self.held_path();
        let found = self
            .link
            .run_on(client.clone(), move |client| async move {
                client.check_stat(&held).await
            })
            .await?;
        Ok(found.map(|_| self.fixed_hold(sent_at, lease)))
    }

    /// This acquisition's fixed-lease holding's node.
    fn held_path(&self) -> String {
        fixed::held_path(&self.parent, &self.owner, self.shared)
    }

    /// The fencing token of a holding whose queue node was created at `czxid`: none
    /// (0) for a shared one, as readers do not write.
    fn token(&self, czxid: i64) -> u64 {
        if self.shared {
            0
        } else {
            czxid.unsigned_abs()
        }
    }

    /// The watchdog-mode holding of `placed`, trusted from `sent_at` (a request its
    /// session answered).
    fn session_hold(&self, placed: Placed, sent_at: Instant) -> Hold {
        let lease = self.link.lease();
        let path: Arc<str> = placed.path.into();
        Acquired {
            core: Arc::clone(&self.core),
            name: Arc::clone(&self.name),
            owner: Arc::clone(&self.owner),
            release: Arc::new(ZkHold::new(
                self.link.clone(),
                path,
                placed.czxid,
                placed.session,
            )),
            token: self.token(placed.czxid),
            // The listing was answered in the node's session: the ensemble keeps that
            // session at least a timeout from when it was sent.
            sent_at,
            lease,
            lease_ms: u64::try_from(lease.as_millis()).unwrap_or(u64::MAX),
            renew: true,
        }
        .into_hold()
    }

    /// The fixed-lease holding of `lease` whose conversion was first sent at `sent_at`
    /// (with the token of the waiter's node it replaced).
    fn fixed_hold(&self, (sent_at, token): (Instant, i64), lease: Duration) -> Hold {
        let path: Arc<str> = self.held_path().into();
        Acquired {
            core: Arc::clone(&self.core),
            name: Arc::clone(&self.name),
            owner: Arc::clone(&self.owner),
            release: Arc::new(FixedHold::new(
                self.link.clone(),
                path,
                self.parent.to_string(),
            )),
            token: self.token(token),
            sent_at,
            lease,
            lease_ms: u64::try_from(lease.as_millis()).unwrap_or(u64::MAX),
            renew: false,
        }
        .into_hold()
    }

    /// Deletes the node this acquisition knows, and any a create whose reply was lost
    /// made; and a fixed-lease holding a conversion whose reply was lost made (it was
    /// never handed out).
    async fn abandon(&self) -> Result<()> {
        let (parent, prefix) = (self.parent.to_string(), self.prefix.to_string());
        let placed = self.placed();
        let session = placed.as_ref().map(|placed| placed.session);
        let converted = self
            .converting
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .is_some()
            .then(|| self.held_path());
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
                if let Some(held) = converted {
                    match client.delete(&held, None).await {
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
                // (A fixed-lease holding left behind ends with its lease.)
                let session = session.unwrap_or_else(|| self.link_session());
                self.link.reap(
                    self.parent.to_string(),
                    self.prefix.to_string(),
                    Some(session),
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
