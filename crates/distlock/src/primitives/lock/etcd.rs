//! The lease lock on etcd: a queue of keys under the lock's name, one per acquisition,
//! the first in creation order holding it (the recipe of etcd's own `concurrency.Mutex`).
//!
//! - A waiter's key is `<prefix><name>\0<owner>`, created once for the whole acquisition
//!   (its owner lives as long as the wait, as a Redis fair waiter's does), attached to
//!   the client's session lease. NUL ends the name, so no lock's queue holds another's.
//! - It holds the lock when no older key is left; its create revision, which etcd raises
//!   on every write of the cluster, is its fencing token.
//! - A waiter waits for its predecessor's deletion only (`first:<key>` topics, see
//!   `transport/etcd/watch.rs`): a release wakes the next waiter alone, in FIFO order.
//! - A watchdog-mode holding lives on the session lease, whose keepalive renews every
//!   key of the client at once; a fixed lease moves its key to a lease of its own when it
//!   takes the lock. Releasing deletes the key.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
};
use tokio::time::Instant;

use super::hold_ops::{HoldOps, OpFuture, ReleaseArgs};
use super::holding::{Acquired, Hold};
use crate::engine::acquire::{AbandonFuture, Acquire, Attempt, AttemptFuture};
use crate::engine::renewal::registry::{Renewal, RenewalKind};
use crate::engine::session::Core;
use crate::engine::subscriptions::WakeRule;
use crate::error::{Error, Result};
use crate::transport::etcd::{is_lease_gone, EtcdLink};

/// The shortest pause between a waiter's looks at its queue (it is woken by a watch; the
/// looks keep the session lease alive).
const MIN_RETRY: Duration = Duration::from_millis(250);

/// A lock hold on etcd, renewed by keeping its lease alive.
pub(crate) static ETCD_LOCK_RENEWAL: RenewalKind = RenewalKind {
    name: "lock hold",
    renew: Renewal::Leases,
};

/// The queue of lock `name`: the prefix of every waiter's key.
pub(crate) fn queue_of(link: &EtcdLink, name: &str) -> String {
    format!("{}{name}\0", link.prefix())
}

/// Refuses a name etcd's layout cannot keep: NUL ends a name in its keys.
pub(crate) fn validate_name(name: &str) -> Result<()> {
    if name.contains('\0') {
        return Err(Error::InvalidName {
            name: name.replace('\0', "\\0"),
            reason: "a NUL character ends a lock's name in its etcd keys",
        });
    }
    Ok(())
}

/// The first key of a queue (oldest first), with its create revision and lease.
fn first_of(queue: &str) -> (String, GetOptions) {
    (
        queue.to_owned(),
        GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1),
    )
}

/// One acquisition on etcd, tried as often as the engine needs, as one owner.
pub(crate) struct EtcdAttempt {
    pub(crate) core: Arc<Core>,
    pub(crate) link: EtcdLink,
    pub(crate) name: Arc<str>,
    /// The lock's queue: the prefix of every waiter's key.
    pub(crate) queue_prefix: Arc<str>,
    /// This waiter's key in it.
    pub(crate) own_key: Arc<str>,
    pub(crate) owner: Arc<str>,
    /// `first:<key>`: the topic the waiter waits on.
    pub(crate) topic: String,
    pub(crate) lease: Duration,
    pub(crate) renew: bool,
    /// The create revision of this waiter's key once placed (0: not yet, or gone): a
    /// waiter that has its place only reads the queue again, without a write.
    placed: Arc<AtomicI64>,
}

impl EtcdAttempt {
    pub(crate) fn new(
        core: Arc<Core>,
        link: EtcdLink,
        name: Arc<str>,
        lease: Duration,
        renew: bool,
    ) -> Self {
        let owner = core.next_owner();
        let queue: Arc<str> = queue_of(&link, &name).into();
        let key: Arc<str> = format!("{queue}{owner}").into();
        EtcdAttempt {
            topic: format!("first:{key}"),
            core,
            link,
            name,
            queue_prefix: queue,
            own_key: key,
            owner,
            lease,
            renew,
            placed: Arc::new(AtomicI64::new(0)),
        }
    }

    pub(crate) fn core(&self) -> &Core {
        &self.core
    }
}

impl Acquire for EtcdAttempt {
    type Guard = Hold;

    fn kind(&self) -> &'static str {
        "lock"
    }

    fn attempt(&self) -> AttemptFuture<Hold> {
        let (core, link) = (Arc::clone(&self.core), self.link.clone());
        let (name, queue, key, owner) = (
            Arc::clone(&self.name),
            Arc::clone(&self.queue_prefix),
            Arc::clone(&self.own_key),
            Arc::clone(&self.owner),
        );
        let (lease, renew, placed) = (self.lease, self.renew, Arc::clone(&self.placed));
        Box::pin(async move {
            let known = placed.load(Ordering::Acquire);
            let (session, spot) = match place(&link, &queue, &key, known).await {
                // The session lease expired between its check and the write: once more,
                // on a new one.
                Err(err) if is_lease_gone(&err) => place(&link, &queue, &key, 0).await?,
                other => other?,
            };
            placed.store(spot.own_revision, Ordering::Release);
            // Woken by its predecessor's watch; the retry only keeps the session lease
            // alive (and finds a lost watch's wake-up), so it comes a few times a TTL.
            let busy = Attempt::Busy {
                retry_after: Some((session.ttl / 4).max(MIN_RETRY)),
            };
            if !spot.is_first || spot.own_revision == 0 {
                return Ok(busy);
            }
            let (lease_id, sent_at, lease, token) = if renew && spot.created_now {
                // Created just now: its create revision is the newest write, so no
                // token handed out before is as large.
                let token = spot.own_revision.unsigned_abs();
                (
                    session.id,
                    session.confirmed_at,
                    lease.min(session.ttl),
                    token,
                )
            } else {
                // A waiter placed earlier (its create revision may be below a floor
                // advanced since), or a fixed lease, which counts from the moment it is
                // held on a lease of its own: the key is written again, and the token is
                // that write's revision.
                let sent_at = Instant::now();
                let own_lease = if renew {
                    None
                } else {
                    Some(link.grant(lease).await?)
                };
                let Some(taken) = take(&link, &key, spot.own_revision, own_lease).await? else {
                    if let Some(fixed) = own_lease {
                        link.revoke(fixed).await;
                    }
                    placed.store(0, Ordering::Release);
                    return Ok(busy);
                };
                match own_lease {
                    Some(fixed) => (fixed, sent_at, lease, taken),
                    None => (
                        session.id,
                        session.confirmed_at,
                        lease.min(session.ttl),
                        taken,
                    ),
                }
            };
            Ok(Attempt::Acquired(
                Acquired {
                    core,
                    name,
                    owner,
                    release: Arc::new(EtcdHold {
                        gone: format!("gone:{key}"),
                        link,
                        key,
                        revision: spot.own_revision,
                        lease: Mutex::new(lease_id),
                        ended: AtomicBool::new(false),
                    }),
                    token,
                    sent_at,
                    lease,
                    lease_ms: u64::try_from(lease.as_millis()).unwrap_or(u64::MAX),
                    renew,
                }
                .into_hold(),
            ))
        })
    }

    fn channel(&self) -> &str {
        &self.topic
    }

    // A waiter queues alone on its own topic (its predecessor wakes it alone).
    fn queue(&self) -> &str {
        &self.own_key
    }

    fn key(&self) -> &str {
        &self.name
    }

    fn wake_rule(&self) -> WakeRule {
        WakeRule::Addressed
    }

    fn abandon(&self) -> Option<AbandonFuture> {
        let (link, key) = (self.link.clone(), self.own_key.to_string());
        let revision = self.placed.load(Ordering::Acquire);
        Some(Box::pin(async move {
            let deleting = key.clone();
            let deleted = link
                .run(move |mut client| {
                    let key = deleting.clone();
                    async move { client.delete(key, None).await }
                })
                .await;
            if deleted.is_err() {
                // Left on the session lease, it would stay first in the queue for as
                // long as this client renews anything: deleted before the next renewal.
                link.doom(key, revision, Instant::now());
            }
            deleted.map(drop)
        }))
    }

    fn token(&self, guard: &Hold) -> Option<u64> {
        Some(guard.token())
    }
}

/// Where a waiter stands in its queue.
struct Spot {
    /// Its key's create revision (0: the key is not there).
    own_revision: i64,
    /// The key was created by this call.
    created_now: bool,
    /// No older key is left in the queue.
    is_first: bool,
}

/// Writes the waiter's `key` into `queue` unless it is there already (attached to the
/// session lease), and reads the queue's first key, in one transaction. A waiter whose
/// key was placed at `known` only reads, so that waiting costs no write. Forgets the
/// session lease when the cluster no longer knows it.
async fn place(
    link: &EtcdLink,
    queue: &str,
    key: &str,
    known: i64,
) -> Result<(crate::transport::etcd::Session, Spot)> {
    let session = link.session().await?;
    let (queue, key) = (queue.to_owned(), key.to_owned());
    if known > 0 {
        let (queue, own_key) = (queue.clone(), key.clone());
        let read = link
            .run(move |mut client| {
                let (queue, first) = first_of(&queue);
                let txn = Txn::new().and_then([
                    TxnOp::get(own_key.clone(), None),
                    TxnOp::get(queue, Some(first)),
                ]);
                async move { client.txn(txn).await }
            })
            .await?;
        let spot = spot_of(&read, &key, false);
        // A key gone (its session lease expired) is placed again, at the queue's end.
        if spot.own_revision == known {
            return Ok((session, spot));
        }
    }
    let own_key = key.clone();
    let placed = link
        .run(move |mut client| {
            let (queue, first) = first_of(&queue);
            let put = PutOptions::new().with_lease(session.id);
            let txn = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                .and_then([
                    TxnOp::put(key.clone(), "1", Some(put)),
                    TxnOp::get(queue.clone(), Some(first.clone())),
                ])
                .or_else([
                    TxnOp::get(key.clone(), None),
                    TxnOp::get(queue, Some(first)),
                ]);
            async move { client.txn(txn).await }
        })
        .await;
    match placed {
        Ok(placed) => {
            let created_now = placed.succeeded();
            Ok((session, spot_of(&placed, &own_key, created_now)))
        }
        Err(err) => {
            if is_lease_gone(&err) {
                link.session_gone(session.id).await;
            }
            Err(err)
        }
    }
}

/// Reads a placement's answer: `[own key or its put, the queue's first key]`.
fn spot_of(answer: &etcd_client::TxnResponse, key: &str, created_now: bool) -> Spot {
    let responses = answer.op_responses();
    let own_revision = if created_now {
        answer.header().map_or(0, |header| header.revision())
    } else {
        match responses.first() {
            Some(TxnOpResponse::Get(own)) => own.kvs().first().map_or(0, |kv| kv.create_revision()),
            _ => 0,
        }
    };
    let is_first = match responses.get(1) {
        Some(TxnOpResponse::Get(first)) => first
            .kvs()
            .first()
            .is_some_and(|kv| kv.key() == key.as_bytes()),
        _ => false,
    };
    Spot {
        own_revision,
        created_now,
        is_first,
    }
}

/// Takes the lock for the waiter whose `key` was created at `revision`: writes the key
/// again (onto `lease` if given, else on the lease it has) so that the write's revision,
/// newer than every token handed out or floor advanced before, is the holding's token.
/// `None` when the key is not that one any more.
async fn take(
    link: &EtcdLink,
    key: &str,
    revision: i64,
    lease: Option<i64>,
) -> Result<Option<u64>> {
    let key = key.to_owned();
    let taken = link
        .run(move |mut client| {
            let put = match lease {
                Some(lease) => PutOptions::new().with_lease(lease),
                None => PutOptions::new().with_ignore_lease(),
            };
            let txn = Txn::new()
                .when([Compare::create_revision(
                    key.clone(),
                    CompareOp::Equal,
                    revision,
                )])
                .and_then([TxnOp::put(key.clone(), "1", Some(put))]);
            async move { client.txn(txn).await }
        })
        .await?;
    Ok(taken.succeeded().then(|| {
        taken
            .header()
            .map_or(0, |header| header.revision())
            .unsigned_abs()
    }))
}

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
    fn lease(&self) -> i64 {
        *self
            .lease
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs `ops` if the key is still this holding's; answers whether it was.
    async fn if_held(&self, ops: Vec<TxnOp>) -> Result<bool> {
        Ok(self.if_held_tries(ops).await?.0)
    }

    /// [`Self::if_held`], and how many times it was sent (a member's failure sends it
    /// to the next member: a second "no" may answer the first try's change).
    async fn if_held_tries(&self, ops: Vec<TxnOp>) -> Result<(bool, u32)> {
        let (key, revision) = (self.key.to_string(), self.revision);
        let tries = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&tries);
        let done = self
            .link
            .run(move |mut client| {
                counted.fetch_add(1, Ordering::Relaxed);
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
        Ok((done.succeeded(), tries.load(Ordering::Relaxed)))
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
            let (freed, tries) = match self
                .if_held_tries(vec![TxnOp::delete(key.clone(), None)])
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
            if let Some(lease) = fixed {
                self.link.revoke(lease).await;
            }
            // A retry after a lost reply finds the key gone: only this holding deletes
            // its own key while its lease lives, so the first try freed it.
            Ok(if freed || args.retry || tries > 1 {
                0
            } else {
                -1
            })
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
            if self.link.current_session() != Some(old) {
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
    /// Whether the key's lease is the client's session lease (never revoked by a
    /// release), as far as this holding knows without asking.
    fn is_session_lease(&self) -> bool {
        self.link
            .current_session()
            .is_some_and(|session| session == self.lease())
    }
}

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

/// The cluster's revision: every later acquisition's token is larger.
pub(crate) async fn revision(link: &EtcdLink) -> Result<u64> {
    let now = link
        .run(|mut client| async move {
            client
                .get("\0", Some(GetOptions::new().with_count_only()))
                .await
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
    let deleted = link
        .run(move |mut client| {
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
    Ok(deleted.succeeded())
}
