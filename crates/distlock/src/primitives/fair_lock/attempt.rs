//! One acquisition of a fair lock, as the engine tries it: one owner for the whole wait
//! (its place in the queue), an attempt that takes the lock in turn or refreshes the
//! place, the direct grant read from the waiter's own channel, and leaving the queue when
//! the acquisition gives up. A waiting acquisition's owner id, once it ended for good,
//! serves the client's next wait on the lock, its channel still subscribed (`owners.rs`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::owners::OwnerEnd;
use super::scripts::{FAIR_ACQUIRE, FAIR_LEAVE, FAIR_LOOK, FAIR_RELEASE};
use super::FairKeys;
use crate::engine::acquire::{AbandonFuture, Acquire, Attempt, AttemptFuture, LookFuture};
use crate::engine::renewal::registry::safety_margin;
use crate::engine::session::Core;
use crate::engine::subscriptions::{KeptChannel, Unbroken, WakeRule};
use crate::primitives::lock::{Acquired, Hold, HoldOps, HoldScripts, ReleaseArgs};
use crate::transport::script::ScriptCall;

/// One acquisition of a fair lock, tried as often as the engine needs, as one owner.
pub(crate) struct FairAttempt {
    pub(super) owner: Arc<Owner>,
    /// Set when the owner's channel was kept live from before this acquisition's first
    /// attempt: its mailbox then holds every message since, and an empty one after a busy
    /// attempt needs no look.
    pub(super) heard_from: Option<Unbroken>,
    /// Whether it queues when the lock cannot be taken now (a caller that will wait).
    pub(super) queue: bool,
    /// How often a queued waiter refreshes its place, and how long it stays alive
    /// without doing so.
    pub(super) refresh: Duration,
    pub(super) alive_ms: u64,
    /// The highest token handed out as of this owner's last attempt that found the lock
    /// busy: a grant message with a token not above it was made before that attempt (a
    /// grant that ran out while the waiter was stalled, its lock since taken by another),
    /// and is stale.
    pub(super) busy_at_token: Arc<AtomicU64>,
    /// Set when an attempt gave its grant back (no replica had it, or its reply was
    /// lost): a grant message still in the mailbox may be the one given back, or older.
    /// Grant messages are refused until an attempt finds the lock busy again, which
    /// raises `busy_at_token` past every grant made before it.
    pub(super) gave_back: Arc<AtomicBool>,
}

/// The acquisition's owner, and what a holding it gets is made of. Its holding's calls
/// go through it (it is the holding's [`HoldOps`]), so it knows when everything the id
/// did has ended, and gives the id back to the lock's pool then (see `owners.rs`).
pub(crate) struct Owner {
    pub(super) core: Arc<Core>,
    pub(super) keys: Arc<FairKeys>,
    /// Its place in the queue, kept for the whole wait.
    pub(super) owner: Arc<str>,
    /// The owner's own channel: the lock's channel, `:`, the owner.
    pub(super) channel: String,
    pub(super) lease: Duration,
    pub(super) lease_ms: u64,
    pub(super) renew: bool,
    /// The channel kept subscribed for the id's next acquisitions: taken up with the id,
    /// or kept from when a first attempt queued it.
    pub(super) kept: std::sync::OnceLock<KeptChannel>,
    /// Whether the id may serve another acquisition once this one is over.
    pub(super) end: OwnerEnd,
    /// Only a waiting acquisition's id is kept: one that only tries never subscribes.
    pub(super) reusable: bool,
}

impl Drop for Owner {
    fn drop(&mut self) {
        if !self.reusable || !self.end.is_settled() {
            return;
        }
        if let Some(kept) = self.kept.take() {
            let owner = Arc::clone(&self.owner);
            self.keys
                .owners
                .give_back(&self.core, owner, kept, self.lease_ms, self.renew);
        }
    }
}

impl FairAttempt {
    /// The session the attempt runs in.
    pub(crate) fn core(&self) -> &Core {
        &self.owner.core
    }
}

impl Owner {
    /// The first hold of a holding this owner got, its lease counted from `sent_at`.
    fn hold(self: &Arc<Self>, token: u64, sent_at: Instant) -> Hold {
        Acquired {
            core: Arc::clone(&self.core),
            name: Arc::clone(&self.keys.lock),
            owner: Arc::clone(&self.owner),
            release: Arc::clone(self) as Arc<dyn HoldOps>,
            token,
            sent_at,
            lease: self.lease,
            lease_ms: self.lease_ms,
            renew: self.renew,
        }
        .into_hold()
    }

    /// Keeps the owner's channel subscribed from now on, for the id's next acquisitions,
    /// unless it is kept already.
    fn keep_channel(&self) {
        if self.reusable {
            self.kept.get_or_init(|| {
                self.core
                    .subscriptions()
                    .keep(&self.channel, &self.channel, WakeRule::Addressed)
            });
        }
    }
}

impl Acquire for FairAttempt {
    type Guard = Hold;

    fn kind(&self) -> &'static str {
        "fair_lock"
    }

    fn attempt(&self) -> AttemptFuture<Hold> {
        let keys = &self.owner.keys;
        let mut call = ScriptCall::new(
            &FAIR_ACQUIRE,
            &[
                &keys.lock,
                &keys.queue,
                &keys.timeouts,
                &keys.waiters,
                &keys.token_key,
                &keys.channel,
            ],
            7,
        );
        call.arg(self.owner.lease_ms)
            .arg(&*self.owner.owner)
            .arg(&*keys.other_token_key)
            .arg(if self.queue { "1" } else { "0" })
            .arg(self.alive_ms)
            .arg(keys.redisson_wait_ms)
            .arg(self.owner.core.deployment().publish_command());
        let (owner, refresh) = (Arc::clone(&self.owner), self.refresh);
        let busy_at_token = Arc::clone(&self.busy_at_token);
        let gave_back = Arc::clone(&self.gave_back);
        let sent_at = Instant::now();
        let queue = self.queue;
        Box::pin(async move {
            let core = &owner.core;
            core.ensure_keys_stay()?;
            owner.end.reopen();
            // A grant no replica acknowledged, or one whose reply was lost, is given on:
            // the owner leaves the queue (a waiting call queues again at the back).
            let reply: redis::Value = core
                .take(
                    &call,
                    &owner.keys.lock,
                    |reply| matches!(read_reply(reply), Ok(Reply::Token(_))),
                    |_| {
                        gave_back.store(true, Ordering::Release);
                        leave(&owner)
                    },
                )
                .await
                .inspect_err(|_| owner.end.in_doubt())?;
            Ok(
                match read_reply(&reply).inspect_err(|_| owner.end.in_doubt())? {
                    Reply::Token(token) => Attempt::Acquired(owner.hold(token, sent_at)),
                    // Queued (or not, for a caller that will not wait): look again when the
                    // place needs refreshing, or when the waiter's channel says so.
                    Reply::Busy { highest_token } => {
                        if queue {
                            owner.keep_channel();
                        }
                        busy_at_token.fetch_max(highest_token, Ordering::AcqRel);
                        gave_back.store(false, Ordering::Release);
                        Attempt::Busy {
                            retry_after: Some(refresh),
                        }
                    }
                },
            )
        })
    }

    fn channel(&self) -> &str {
        &self.owner.channel
    }

    fn queue(&self) -> &str {
        &self.owner.channel
    }

    fn key(&self) -> &str {
        &self.owner.keys.lock
    }

    fn wake_rule(&self) -> WakeRule {
        WakeRule::Addressed
    }

    fn token(&self, guard: &Hold) -> Option<u64> {
        Some(guard.token())
    }

    fn granted(&self, payload: &[u8], since: Instant) -> Option<Hold> {
        // "0" says "try now" (a Redisson release, or a grant the releaser could not
        // make); a token says the lock is this owner's already.
        let token: u64 = std::str::from_utf8(payload).ok()?.parse().ok()?;
        if token == 0 {
            return None;
        }
        // With replica sync on, a grant made by the releasing script was followed by no
        // WAIT of its own: the waiter's next attempt takes the granted lock afresh (the
        // acquire script answers a granted owner with a token) and waits for replicas.
        if self.owner.core.synced().is_some() {
            return None;
        }
        if self.gave_back.load(Ordering::Acquire) {
            tracing::debug!(owner = %self.owner.owner, token, "a grant read after this waiter gave one back is not taken");
            return None;
        }
        if token <= self.busy_at_token.load(Ordering::Acquire) {
            tracing::debug!(owner = %self.owner.owner, token, "a stale grant (made before the last look at the lock) is ignored");
            return None;
        }
        // Read after its lease ran out (the waiter's runtime stalled while the client
        // took the message): the lock may be another's by now. The next attempt looks:
        // it takes the lock afresh if it is still this owner's, or queues again.
        let lease = self.owner.lease;
        if Instant::now() >= since + lease.saturating_sub(safety_margin(lease)) {
            tracing::debug!(owner = %self.owner.owner, token, "a grant read after its lease ran out is not taken");
            return None;
        }
        Some(self.owner.hold(token, since))
    }

    /// The waiter's first attempt queued it: once subscribed, it only needs to know
    /// whether a grant or a "try now" came before the subscription did (fair_look.lua),
    /// a read of two fields instead of the whole queueing script again.
    fn look(&self) -> Option<LookFuture> {
        if !self.queue {
            return None;
        }
        let mut call = ScriptCall::new(&FAIR_LOOK, &[&self.owner.keys.lock], 1);
        call.arg(&*self.owner.owner);
        let core = Arc::clone(&self.owner.core);
        Some(Box::pin(async move {
            // A read: harmless to send again on a connection found dropped.
            let call = &call;
            let due: i64 = core
                .request(|mut connection| async move { call.invoke(&mut connection).await })
                .await?;
            Ok(due != 0)
        }))
    }

    fn heard_all_since_first_attempt(&self) -> bool {
        match (self.heard_from, self.owner.kept.get()) {
            (Some(mark), Some(kept)) => kept.heard_all_since(mark),
            _ => false,
        }
    }

    fn abandon(&self) -> Option<AbandonFuture> {
        if !self.queue {
            return None;
        }
        let leaving = leave(&self.owner);
        Some(Box::pin(async move {
            leaving.await;
            Ok(())
        }))
    }
}

/// `owner` leaves the queue, and gives the lock on if it was granted meanwhile: the
/// clean-up of a wait that ends without the lock, and the give-back of a grant that
/// cannot be trusted.
fn leave(owner: &Arc<Owner>) -> impl std::future::Future<Output = ()> + Send + 'static {
    let keys = &owner.keys;
    let mut call = ScriptCall::new(
        &FAIR_LEAVE,
        &[
            &keys.lock,
            &keys.queue,
            &keys.timeouts,
            &keys.waiters,
            &keys.token_key,
            &keys.channel,
        ],
        4,
    );
    call.arg(&*owner.owner)
        .arg(owner.core.deployment().publish_command())
        .arg(&*keys.other_token_key)
        .arg(keys.redisson_wait_ms);
    let owner = Arc::clone(owner);
    async move {
        let mut connection = owner.core.connection();
        match call.invoke::<i64>(&mut connection).await {
            Ok(_) => owner.end.settled(),
            Err(err) => {
                owner.end.in_doubt();
                tracing::warn!(lock = %owner.keys.lock, error = %err, "could not leave a fair lock's queue; the place runs out with its alive time");
            }
        }
    }
}

/// What `fair_acquire.lua` answered.
enum Reply {
    Token(u64),
    Busy { highest_token: u64 },
}

fn read_reply(reply: &redis::Value) -> redis::RedisResult<Reply> {
    let unexpected = || {
        redis::RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "the fair lock's acquire script answered something else than a token or busy",
        ))
    };
    let text = match reply {
        redis::Value::Int(token @ 1..) => return Ok(Reply::Token(token.unsigned_abs())),
        redis::Value::BulkString(bytes) => std::str::from_utf8(bytes).map_err(|_| unexpected())?,
        redis::Value::SimpleString(text) => text.as_str(),
        _ => return Err(unexpected()),
    };
    match text.strip_prefix("busy:") {
        Some(highest) => Ok(Reply::Busy {
            highest_token: highest.parse().map_err(|_| unexpected())?,
        }),
        // A token from 2^53 on comes as its exact text.
        None => match text.parse::<u64>() {
            Ok(token @ 1..) => Ok(Reply::Token(token)),
            _ => Err(unexpected()),
        },
    }
}

/// A fair holding's calls: the fair release, and the lease lock's others; its end tells
/// the owner whether its id may serve again.
impl HoldScripts for Owner {
    fn release(&self, name: &str, owner: &str, latch: &str, args: &ReleaseArgs<'_>) -> ScriptCall {
        self.keys.release(name, owner, latch, args)
    }

    fn settled(&self) {
        self.end.settled();
    }

    fn unsettled(&self) {
        self.end.in_doubt();
    }
}

impl FairKeys {
    /// The fair release of one hold by `owner`: the last one hands the lock to the head
    /// of the queue.
    fn release(&self, name: &str, owner: &str, latch: &str, args: &ReleaseArgs<'_>) -> ScriptCall {
        let mut call = ScriptCall::new(
            &FAIR_RELEASE,
            &[
                name,
                &self.queue,
                &self.timeouts,
                &self.waiters,
                &self.token_key,
                &self.channel,
                latch,
            ],
            8,
        );
        call.arg(owner)
            .arg(args.left)
            .arg(args.lease_ms)
            .arg(args.latch_ttl_ms)
            .arg(if args.retry { "1" } else { "0" })
            .arg(args.publish)
            .arg(&*self.other_token_key)
            .arg(self.redisson_wait_ms);
        call
    }
}
