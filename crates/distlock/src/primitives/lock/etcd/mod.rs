//! The lease lock on etcd: a queue of keys under the lock's name, one per acquisition,
//! the first in creation order holding it (the recipe of etcd's own `concurrency.Mutex`).
//!
//! - A waiter's key is `<prefix><name>\0<owner>`, created once for the whole acquisition
//!   (its owner lives as long as the wait, as a Redis fair waiter's does), attached to
//!   the client's session lease. NUL ends the name, so no lock's queue holds another's.
//! - It holds the lock when no older key is left. Its fencing token is the revision of
//!   the write that took it (its creation, or a write of its key when a waiter's turn
//!   comes), which etcd raises on every write of the cluster.
//! - A shared holding's key (an `RwLock` reader's) is `<prefix><name>\0\x7f<owner>`: the
//!   exclusive keys (an owner starts with hex digits) sort below `\0\x7f`, so one range
//!   read finds the oldest exclusive key, and a reader holds when no exclusive key is
//!   older than its own (etcd's `recipes.RWMutex`). It carries no token.
//! - A permit semaphore's queue is `<prefix>\0permits\0<name>\0` (no lock's queue starts
//!   with NUL), each key's value the permits it asks for, and its total at
//!   `<prefix>\0permits\0<name>`. A waiter holds when the permits of every older key plus
//!   its own fit the total ([`permits_fit`]), so the queue is served strictly in order,
//!   as tokio's semaphore serves its waiters. Permits carry no token.
//! - A waiter waits for its predecessor's deletion only (`first:<key>` topics, see
//!   `transport/etcd/watch.rs`): a release wakes the next waiter alone, in FIFO order.
//! - A watchdog-mode holding lives on the session lease, whose keepalive renews every
//!   key of the client at once; a fixed lease moves its key to a lease of its own when it
//!   takes the lock. Releasing deletes the key.
//!
//! Here: the acquisition. [`hold`]: what a holding does with its key. [`inspect`]: what
//! the lock's other calls read or change (its holder, the cluster's revision, a
//! force-unlock).

mod hold;
mod inspect;

pub(crate) use inspect::{force_unlock, holders, lease_left, owners, revision};

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
};
use tokio::time::Instant;

use super::holding::{Acquired, Hold};
use crate::engine::acquire::{AbandonFuture, Acquire, Attempt, AttemptFuture};
use crate::engine::renewal::registry::{Renewal, RenewalKind};
use crate::engine::session::Core;
use crate::engine::subscriptions::WakeRule;
use crate::error::{Error, Result};
use crate::transport::etcd::watch::{permits_fit, SHARED};
use crate::transport::etcd::{is_lease_gone, EtcdLink};
use hold::EtcdHold;

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

/// The queue of permit semaphore `name` (see the module's docs); its total's key is the
/// queue without its last NUL.
pub(crate) fn permits_queue_of(link: &EtcdLink, name: &str) -> String {
    format!("{}\0permits\0{name}\0", link.prefix())
}

/// What a placement reads after the waiter's own key: the first key it waits for (see
/// [`blocker_of`]), or for a permit waiter its semaphore's total and its whole queue.
fn reads_of(queue: &str, shared: bool, permits: Option<u32>) -> Vec<TxnOp> {
    if permits.is_some() {
        let total = queue.strip_suffix('\0').unwrap_or(queue);
        let everyone = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        return vec![TxnOp::get(total, None), TxnOp::get(queue, Some(everyone))];
    }
    let (queue, first) = blocker_of(queue, shared);
    vec![TxnOp::get(queue, Some(first))]
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

/// What a waiter must find older than its own key to wait: any key of the queue, or for
/// a `shared` one the oldest exclusive key (see [`SHARED`]).
fn blocker_of(queue: &str, shared: bool) -> (String, GetOptions) {
    if !shared {
        return first_of(queue);
    }
    (
        queue.to_owned(),
        GetOptions::new()
            .with_range(format!("{queue}{SHARED}"))
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
    /// A shared holding (an `RwLock` reader's), which waits for exclusive keys only.
    pub(crate) shared: bool,
    /// A permit semaphore's waiter, asking for this many permits (see [`permits_fit`]).
    permits: Option<u32>,
    /// The create revision of this waiter's key once placed (0: not yet, or gone): a
    /// waiter that has its place only reads the queue again, without a write.
    placed: Arc<AtomicI64>,
    /// The placement was sent more than once, an earlier send maybe applied late: once
    /// the key is deleted, the link looks for it coming back (see `place`).
    resent: Arc<AtomicBool>,
}

impl EtcdAttempt {
    /// An acquisition of lock `name` as `owner`, alone or `shared` (with the other shared
    /// ones), for `lease` (renewed by the session's keepalive if `renew`).
    pub(crate) fn new(
        core: Arc<Core>,
        link: EtcdLink,
        name: Arc<str>,
        owner: Arc<str>,
        shared: bool,
        (lease, renew): (Duration, bool),
    ) -> Self {
        let queue: Arc<str> = queue_of(&link, &name).into();
        let kind = if shared { SHARED } else { "" };
        let key: Arc<str> = format!("{queue}{kind}{owner}").into();
        EtcdAttempt {
            topic: format!("first:{key}"),
            permits: None,
            core,
            link,
            name,
            queue_prefix: queue,
            own_key: key,
            owner,
            lease,
            renew,
            shared,
            placed: Arc::new(AtomicI64::new(0)),
            resent: Arc::new(AtomicBool::new(false)),
        }
    }

    /// An acquisition of `permits` permits of semaphore `name` as `owner`: a key in the
    /// semaphore's queue whose value is `permits`, waiting on a `fits:` topic.
    pub(crate) fn permits(
        core: Arc<Core>,
        link: EtcdLink,
        name: Arc<str>,
        owner: Arc<str>,
        permits: u32,
        (lease, renew): (Duration, bool),
    ) -> Self {
        let queue: Arc<str> = permits_queue_of(&link, &name).into();
        let key: Arc<str> = format!("{queue}{owner}").into();
        EtcdAttempt {
            topic: format!("fits:{key}"),
            permits: Some(permits),
            core,
            link,
            name,
            queue_prefix: queue,
            own_key: key,
            owner,
            lease,
            renew,
            shared: false,
            placed: Arc::new(AtomicI64::new(0)),
            resent: Arc::new(AtomicBool::new(false)),
        }
    }

    pub(crate) fn core(&self) -> &Core {
        &self.core
    }
}

impl Acquire for EtcdAttempt {
    type Guard = Hold;

    fn kind(&self) -> &'static str {
        if self.permits.is_some() {
            "permit_semaphore"
        } else if self.shared {
            "read_lock"
        } else {
            "lock"
        }
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
        let (resent, shared, permits) = (Arc::clone(&self.resent), self.shared, self.permits);
        // Shared holdings and permits carry no token.
        let tokenless = shared || permits.is_some();
        let value = permits.map_or_else(|| "1".to_owned(), |permits| permits.to_string());
        Box::pin(async move {
            let known = placed.load(Ordering::Acquire);
            let waiter = (&*queue, shared, permits);
            let spot = place(&link, waiter, &key, known, &resent).await;
            let (session, spot) = match spot {
                // The session lease expired between its check and the write: once more,
                // on a new one.
                Err(err) if is_lease_gone(&err) => place(&link, waiter, &key, 0, &resent).await?,
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
            let (lease_id, sent_at, lease, token) = if renew && (spot.created_now || tokenless) {
                // Created just now: its create revision is the newest write, so no
                // token handed out before is as large. (A shared holding has no token,
                // and its key, on the session lease already, needs no write.)
                let token = if tokenless {
                    0
                } else {
                    spot.own_revision.unsigned_abs()
                };
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
                let Some(taken) = take(&link, (&key, &value), spot.own_revision, own_lease).await?
                else {
                    if let Some(fixed) = own_lease {
                        link.revoke(fixed).await;
                    }
                    placed.store(0, Ordering::Release);
                    return Ok(busy);
                };
                let taken = if tokenless { 0 } else { taken };
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
                    release: Arc::new(EtcdHold::new(
                        link,
                        key,
                        spot.own_revision,
                        lease_id,
                        !renew,
                        resent.load(Ordering::Acquire),
                    )),
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
        let (placed, resent) = (Arc::clone(&self.placed), Arc::clone(&self.resent));
        // Read when the give-up runs, not when it is prepared (the engine prepares it as
        // the acquisition starts, before any placement was sent).
        Some(Box::pin(async move {
            let revision = placed.load(Ordering::Acquire);
            if resent.load(Ordering::Acquire) {
                link.watch_for_late_copy(key.clone());
            }
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
        (!self.shared && self.permits.is_none()).then(|| guard.token())
    }
}

/// Where a waiter stands in its queue.
struct Spot {
    /// Its key's create revision (0: the key is not there).
    own_revision: i64,
    /// The key was created by this call.
    created_now: bool,
    /// No older key it waits for is left in the queue.
    is_first: bool,
}

/// Writes the waiter's `key` into `queue` unless it is there already (attached to the
/// session lease), and reads the queue's first key (the first exclusive one for a
/// `shared` waiter), in one transaction. A waiter whose
/// key was placed at `known` only reads, so that waiting costs no write. Forgets the
/// session lease when the cluster no longer knows it.
///
/// A placement sent again after a member's failure (the first send maybe still on its
/// way through a slow member) sets `resent`: its compare (the key does not exist) would
/// let that first send write the key again after a give-up or a release deleted it.
async fn place(
    link: &EtcdLink,
    (queue, shared, permits): (&str, bool, Option<u32>),
    key: &str,
    known: i64,
    resent: &AtomicBool,
) -> Result<(crate::transport::etcd::Session, Spot)> {
    let session = link.session().await?;
    let (queue, key) = (queue.to_owned(), key.to_owned());
    if known > 0 {
        let (queue, own_key) = (queue.clone(), key.clone());
        let read = link
            .run(move |mut client| {
                let mut ops = vec![TxnOp::get(own_key.clone(), None)];
                ops.extend(reads_of(&queue, shared, permits));
                let txn = Txn::new().and_then(ops);
                async move { client.txn(txn).await }
            })
            .await?;
        let spot = spot_of(&read, (&key, shared, permits), false);
        // A key gone (its session lease expired) is placed again, at the queue's end.
        if spot.own_revision == known {
            return Ok((session, spot));
        }
    }
    let own_key = key.clone();
    // A permit waiter's value is what it asks for; a lock waiter's its hold count.
    let value = permits.map_or_else(|| "1".to_owned(), |permits| permits.to_string());
    let placed = link
        .run_noting_resends(move |mut client| {
            let put = PutOptions::new().with_lease(session.id);
            let mut placing = vec![TxnOp::put(key.clone(), value.clone(), Some(put))];
            placing.extend(reads_of(&queue, shared, permits));
            let mut reading = vec![TxnOp::get(key.clone(), None)];
            reading.extend(reads_of(&queue, shared, permits));
            let txn = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                .and_then(placing)
                .or_else(reading);
            async move { client.txn(txn).await }
        })
        .await;
    match placed {
        Ok((placed, sent_twice)) => {
            if sent_twice {
                resent.store(true, Ordering::Release);
            }
            let created_now = placed.succeeded();
            Ok((
                session,
                spot_of(&placed, (&own_key, shared, permits), created_now),
            ))
        }
        Err(err) => {
            if is_lease_gone(&err) {
                link.session_gone(session.id).await;
            }
            Err(err)
        }
    }
}

/// Reads a placement's answer: `[own key or its put, the queue's first key]` (its first
/// exclusive key for a `shared` waiter, which holds unless that key is older).
fn spot_of(
    answer: &etcd_client::TxnResponse,
    (key, shared, permits): (&str, bool, Option<u32>),
    created_now: bool,
) -> Spot {
    let responses = answer.op_responses();
    let own_revision = if created_now {
        answer.header().map_or(0, |header| header.revision())
    } else {
        match responses.first() {
            Some(TxnOpResponse::Get(own)) => own.kvs().first().map_or(0, |kv| kv.create_revision()),
            _ => 0,
        }
    };
    if permits.is_some() {
        // `[own key or its put, the total, the whole queue]`.
        let total = match responses.get(1) {
            Some(TxnOpResponse::Get(total)) => total.kvs().first(),
            _ => None,
        };
        let fits = match responses.get(2) {
            Some(TxnOpResponse::Get(queue)) => permits_fit(total, queue.kvs(), own_revision),
            _ => false,
        };
        return Spot {
            own_revision,
            created_now,
            is_first: fits,
        };
    }
    let is_first = match responses.get(1) {
        Some(TxnOpResponse::Get(first)) if shared => first
            .kvs()
            .first()
            .is_none_or(|kv| kv.create_revision() > own_revision),
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
/// again with `value` (onto `lease` if given, else on the lease it has) so that the write's revision,
/// newer than every token handed out or floor advanced before, is the holding's token.
/// `None` when the key is not that one any more.
async fn take(
    link: &EtcdLink,
    (key, value): (&str, &str),
    revision: i64,
    lease: Option<i64>,
) -> Result<Option<u64>> {
    let (key, value) = (key.to_owned(), value.to_owned());
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
                .and_then([TxnOp::put(key.clone(), value.clone(), Some(put))]);
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
