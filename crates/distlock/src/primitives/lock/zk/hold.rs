//! A holding's calls on ZooKeeper: give back (all or one hold), re-enter, extend,
//! verify, and what its renewal names. A watchdog-mode holding ([`ZkHold`]) works on its
//! ephemeral node, a fixed-lease one ([`FixedHold`]) on its `held-<owner>` node.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use zookeeper_client::Error as ZkError;

use super::{fixed, ZK_LOCK_RENEWAL};
use crate::engine::renewal::registry::RenewalKind;
use crate::engine::session::Core;
use crate::error::{Error, Result};
use crate::primitives::lock::hold_ops::{HoldOps, OpFuture, ReleaseArgs};
use crate::transport::zk::{ZkLink, STORE};

/// A watchdog-mode holding's calls on ZooKeeper, on its own node (whose path no other
/// acquisition ever has: it carries the owner).
pub(super) struct ZkHold {
    link: ZkLink,
    path: Arc<str>,
    /// `gone:<path>`: the topic a holding listening for a force-unlock waits on.
    gone: String,
    czxid: i64,
    session: i64,
    /// A final release was answered (the node deleted, or found gone).
    done: AtomicBool,
}

impl ZkHold {
    /// The holding of the node at `path`, created at `czxid` in session `session`.
    pub(super) fn new(link: ZkLink, path: Arc<str>, czxid: i64, session: i64) -> ZkHold {
        ZkHold {
            gone: format!("gone:{path}"),
            link,
            path,
            czxid,
            session,
            done: AtomicBool::new(false),
        }
    }
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
            Some(self.session),
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
            let (left, retry, session) = (args.left, args.retry, self.session);
            let answer = self
                .link
                .run(move |client| async move {
                    // A retry in another session (the node's expired meanwhile) cannot
                    // tell its own earlier delete from the session's end: the lock was
                    // lost, or may have been, so it does not answer "released".
                    let retry = retry && client.session_id().0 == session;
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

    // Never called: `LockGuard::extend` refuses a watchdog-mode holding, and a MultiLock
    // (which may fix a member's lease) is refused on ZooKeeper.
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
                what: "turning a watchdog-mode holding into a fixed lease",
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

/// A fixed-lease holding's calls on ZooKeeper, on its persistent `held-<owner>` node
/// (whose path no other acquisition ever has). Nothing renews it: its lease ends at its
/// node's mtime plus the lease its data gives, by the ensemble's clock.
pub(super) struct FixedHold {
    link: ZkLink,
    path: Arc<str>,
    /// The lock's node, written to learn the ensemble's clock.
    parent: String,
    /// `gone:<path>`: the topic a holding listening for a force-unlock waits on.
    gone: String,
}

impl FixedHold {
    /// The holding of the node at `path`, in the lock's node `parent`.
    pub(super) fn new(link: ZkLink, path: Arc<str>, parent: String) -> FixedHold {
        FixedHold {
            gone: format!("gone:{path}"),
            link,
            path,
            parent,
        }
    }

    /// Whether its node is still there (only this holding writes it, and a waiter deletes
    /// it only once its lease is over).
    async fn exists(&self) -> Result<bool> {
        let path = self.path.to_string();
        let stat = self
            .link
            .run(move |client| async move { client.check_stat(&path).await })
            .await?;
        Ok(stat.is_some())
    }
}

// A holding left to expire (or whose release failed) leaves its node to its lease: no
// Drop deletes it, and it outlives the client's session on purpose.
impl HoldOps for FixedHold {
    fn release<'a>(
        &'a self,
        _core: &'a Core,
        _name: &'a str,
        _owner: &'a str,
        _latch: &'a str,
        args: &'a ReleaseArgs<'a>,
    ) -> OpFuture<'a, i64> {
        Box::pin(async move {
            // A partial release leaves the node as it is: a write would move its mtime,
            // and so its lease's end.
            if args.left > 0 {
                return Ok(if self.exists().await? {
                    i64::from(args.left)
                } else {
                    -1
                });
            }
            let (path, parent, retry) = (self.path.to_string(), self.parent.clone(), args.retry);
            self.link
                .run(move |client| async move {
                    let Some((_, node)) = path.rsplit_once('/') else {
                        return Ok(-1);
                    };
                    let children = vec![node.to_owned()];
                    // A lease that ran out is lost, even while its node is still there
                    // (no waiter came to delete it): the node goes either way.
                    for _ in 0..3 {
                        let Some(now) = fixed::server_now(&client, &parent, b"").await? else {
                            return Ok(if retry { 0 } else { -1 });
                        };
                        let Some(held) = fixed::read_held(&client, &parent, &children, now)
                            .await?
                            .pop()
                        else {
                            // A retry after a lost reply finds the node gone: only this
                            // holding deletes it while its lease lasts, so the first try
                            // freed it.
                            return Ok(if retry { 0 } else { -1 });
                        };
                        match client.delete(&path, Some(held.version)).await {
                            Ok(()) => return Ok(if held.is_live() { 0 } else { -1 }),
                            Err(ZkError::NoNode) => return Ok(if retry { 0 } else { -1 }),
                            // Written since it was read (an extension whose reply was
                            // lost): read again.
                            Err(ZkError::BadVersion) => continue,
                            Err(err) => return Err(err),
                        }
                    }
                    Err(ZkError::BadVersion)
                })
                .await
        })
    }

    // The hold count lives on the client only: a write would move the node's mtime, and
    // so its lease's end, which a re-entry leaves where it is.
    fn reenter<'a>(
        &'a self,
        _core: &'a Core,
        _name: &'a str,
        _owner: &'a str,
        _holds: u32,
        _lease_ms: u64,
    ) -> OpFuture<'a, i64> {
        Box::pin(async move { Ok(i64::from(self.exists().await?)) })
    }

    // The new lease counts from this write (its mtime). Not version-checked: only this
    // holding writes its node, and it writes only while it trusts its lease, which it
    // stops doing before the ensemble's clock ends it; a version-checked write whose
    // reply was lost would make every later extension fail.
    fn extend<'a>(
        &'a self,
        _core: &'a Core,
        _name: &'a str,
        _owner: &'a str,
        lease_ms: u64,
    ) -> OpFuture<'a, bool> {
        Box::pin(async move {
            let path = self.path.to_string();
            self.link
                .run(move |client| async move {
                    match client
                        .set_data(&path, lease_ms.to_string().as_bytes(), None)
                        .await
                    {
                        Ok(_) => Ok(true),
                        Err(ZkError::NoNode) => Ok(false),
                        Err(err) => Err(err),
                    }
                })
                .await
        })
    }

    fn verify<'a>(
        &'a self,
        _core: &'a Core,
        _name: &'a str,
        _owner: &'a str,
    ) -> OpFuture<'a, bool> {
        Box::pin(self.exists())
    }

    fn partial_release_renews(&self) -> bool {
        false
    }

    // Never renewed (a fixed lease); named for the registry alone.
    fn renewal(&self, _owner: &Arc<str>) -> (&'static RenewalKind, Arc<str>) {
        (&ZK_LOCK_RENEWAL, Arc::clone(&self.path))
    }

    fn unlock_channel(&self) -> Option<&str> {
        Some(&self.gone)
    }
}
