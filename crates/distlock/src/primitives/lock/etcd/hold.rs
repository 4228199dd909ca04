//! A holding's calls on etcd: give back (all or one hold), re-enter, extend, verify, and
//! what its renewal names.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use tokio::time::Instant;

use super::ETCD_LOCK_RENEWAL;
use crate::engine::renewal::registry::RenewalKind;
use crate::engine::session::Core;
use crate::error::Result;
use crate::primitives::lock::hold_ops::{HoldOps, OpFuture, ReleaseArgs};
use crate::transport::etcd::EtcdLink;

/// Moves `key` (created at `revision`) onto `lease`; false when the key is not that one
/// any more.
async fn move_to(link: &EtcdLink, key: &str, revision: i64, lease: i64) -> Result<bool> {
    let key = key.to_owned();
    let moved = link
        .run(move |mut client| {
            let put = PutOptions::new().with_lease(lease).with_ignore_value();
            let txn = Txn::new()
                .when([Compare::create_revision(
                    key.clone(),
                    CompareOp::Equal,
                    revision,
                )])
                .and_then([TxnOp::put(key.clone(), "", Some(put))]);
            async move { client.txn(txn).await }
        })
        .await?;
    Ok(moved.succeeded())
}

/// A holding's calls on etcd: every change compares the key's create revision, so it
/// never touches another holding's key of the same owner name.
pub(crate) struct EtcdHold {
    link: EtcdLink,
    key: Arc<str>,
    /// `gone:<key>`: the topic a holding listening for a force-unlock waits on.
    gone: String,
    revision: i64,
    /// The lease the key is attached to: the session's, or a fixed lease's own.
    lease: Mutex<i64>,
    /// The key is on a lease of its own (a fixed lease, or one `extend` moved it to),
    /// not on the session lease, which its release must never revoke.
    own_lease: AtomicBool,
    /// The key's placement was sent more than once: after its delete, the link looks
    /// for a late copy of it writing the key again.
    late_copy_risk: bool,
    /// The server has answered the final release (or the holding was found lost), or the
    /// key's deletion is left to the link: nothing is left to do when it is dropped.
    ended: AtomicBool,
}

impl Drop for EtcdHold {
    /// A holding that ends without its release reaching the server (left to expire, or
    /// its client going away) must not outlive its lease because the session lease, which
    /// the client renews for its other holdings, carries its key: the link deletes it
    /// when the lease would have run out.
    fn drop(&mut self) {
        if self.ended.load(Ordering::Acquire) || !self.is_session_lease() {
            return;
        }
        self.link.doom(
            self.key.to_string(),
            self.revision,
            self.link.session_expiry(),
        );
    }
}

impl EtcdHold {
    /// The holding of `key`, created at `revision`, on lease `lease`.
    pub(super) fn new(
        link: EtcdLink,
        key: Arc<str>,
        revision: i64,
        lease: i64,
        own_lease: bool,
        late_copy_risk: bool,
    ) -> EtcdHold {
        EtcdHold {
            gone: format!("gone:{key}"),
            link,
            key,
            revision,
            lease: Mutex::new(lease),
            own_lease: AtomicBool::new(own_lease),
            late_copy_risk,
            ended: AtomicBool::new(false),
        }
    }

    fn lease(&self) -> i64 {
        *self
            .lease
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs `ops` if the key is still this holding's; answers whether it was.
    async fn if_held(&self, ops: Vec<TxnOp>) -> Result<bool> {
        Ok(self.if_held_noting_resends(ops).await?.0)
    }

    /// [`Self::if_held`], and whether an earlier send of it may have been applied (a
    /// member's failure sends it to the next member: a second "no" may answer the
    /// first send's change).
    async fn if_held_noting_resends(&self, ops: Vec<TxnOp>) -> Result<(bool, bool)> {
        let (key, revision) = (self.key.to_string(), self.revision);
        let (done, resent) = self
            .link
            .run_noting_resends(move |mut client| {
                let txn = Txn::new()
                    .when([Compare::create_revision(
                        key.clone(),
                        CompareOp::Equal,
                        revision,
                    )])
                    .and_then(ops.clone());
                async move { client.txn(txn).await }
            })
            .await?;
        Ok((done.succeeded(), resent))
    }
}

impl HoldOps for EtcdHold {
    fn release<'a>(
        &'a self,
        _core: &'a Core,
        _name: &'a str,
        _owner: &'a str,
        _latch: &'a str,
        args: &'a ReleaseArgs<'a>,
    ) -> OpFuture<'a, i64> {
        Box::pin(async move {
            let key = self.key.to_string();
            if args.left > 0 {
                let count = PutOptions::new().with_ignore_lease();
                let kept = self
                    .if_held(vec![TxnOp::put(key, args.left.to_string(), Some(count))])
                    .await?;
                return Ok(if kept { i64::from(args.left) } else { -1 });
            }
            let fixed = (!self.is_session_lease()).then(|| self.lease());
            let (freed, resent) = match self
                .if_held_noting_resends(vec![TxnOp::delete(key.clone(), None)])
                .await
            {
                Ok(answer) => answer,
                Err(err) => {
                    if fixed.is_none() && !self.ended.swap(true, Ordering::AcqRel) {
                        // Unanswered: the session lease must not keep the key alive for
                        // the client's other holdings; the link deletes it before the
                        // next renewal. (A fixed lease runs out by itself.)
                        self.link.doom(key, self.revision, Instant::now());
                    }
                    return Err(err);
                }
            };
            self.ended.store(true, Ordering::Release);
            if self.late_copy_risk {
                self.link.watch_for_late_copy(key);
            }
            if let Some(lease) = fixed {
                self.link.revoke(lease).await;
            }
            // A retry after a lost reply finds the key gone: only this holding deletes
            // its own key while its lease lives, so the first try freed it.
            Ok(if freed || args.retry || resent { 0 } else { -1 })
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
            let count = PutOptions::new().with_ignore_lease();
            let held = self
                .if_held(vec![TxnOp::put(
                    self.key.to_string(),
                    holds.to_string(),
                    Some(count),
                )])
                .await?;
            Ok(i64::from(held))
        })
    }

    fn extend<'a>(
        &'a self,
        _core: &'a Core,
        _name: &'a str,
        _owner: &'a str,
        lease_ms: u64,
    ) -> OpFuture<'a, bool> {
        Box::pin(async move {
            let fresh = self.link.grant(Duration::from_millis(lease_ms)).await?;
            if !move_to(&self.link, &self.key, self.revision, fresh).await? {
                self.link.revoke(fresh).await;
                return Ok(false);
            }
            let old = std::mem::replace(
                &mut *self
                    .lease
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner()),
                fresh,
            );
            // The session lease carries the client's other keys: only a lease of the
            // holding's own is revoked.
            if self.own_lease.swap(true, Ordering::AcqRel) {
                self.link.revoke(old).await;
            }
            Ok(true)
        })
    }

    fn verify<'a>(
        &'a self,
        _core: &'a Core,
        _name: &'a str,
        _owner: &'a str,
    ) -> OpFuture<'a, bool> {
        Box::pin(async move {
            let (key, revision) = (self.key.to_string(), self.revision);
            let found = self
                .link
                .run(move |mut client| {
                    let key = key.clone();
                    async move { client.get(key, None).await }
                })
                .await?;
            Ok(found
                .kvs()
                .first()
                .is_some_and(|kv| kv.create_revision() == revision))
        })
    }

    // A partial release rewrites the hold count only: the session lease, which the key
    // lives on, is renewed by the watchdog alone.
    fn partial_release_renews(&self) -> bool {
        false
    }

    // The renewal keeps the lease alive and checks that the key is still there: a key
    // deleted by a force-unlock or by hand leaves the lease alive.
    fn renewal(&self, _owner: &Arc<str>) -> (&'static RenewalKind, Arc<str>) {
        let renewed_as = crate::transport::etcd::Renewed {
            lease: self.lease(),
            key: &self.key,
            revision: self.revision,
        };
        (&ETCD_LOCK_RENEWAL, renewed_as.encode().into())
    }

    fn unlock_channel(&self) -> Option<&str> {
        Some(&self.gone)
    }
}

impl EtcdHold {
    /// Whether the key is on the client's session lease (never revoked by a release),
    /// as the holding was made and extended.
    fn is_session_lease(&self) -> bool {
        !self.own_lease.load(Ordering::Acquire)
    }
}
