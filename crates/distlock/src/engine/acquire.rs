//! The acquisition engine: the one wait loop every primitive uses.
//!
//! A primitive supplies an [`Acquire`] implementation: one atomic attempt (a script call)
//! and the channel its releases are announced on. The engine:
//!
//! 1. tries once, without subscribing, so an uncontended acquisition costs one round trip
//!    (unless local waiters are queued: then it queues behind them, see below, and a
//!    caller that will not wait gets "busy" without trying);
//! 2. if that failed and the caller will wait, subscribes to the channel (shared with the
//!    client's other waiters), and only then tries again, so a release between the try and
//!    the wait cannot be missed (a primitive whose first try kept the waiter's place on
//!    the server, a fair lock's, makes a cheaper look instead: [`Acquire::look`]);
//! 3. waits for a release message, or for the holder's lease to run out (messages can be
//!    lost), or for the caller's deadline, and tries again.
//!
//! Local waiters take turns: a caller that finds other tasks of
//! this client already waiting for the primitive does not try ahead of them (a task that
//! releases and immediately asks again would otherwise win every time, because its
//! attempt reaches Redis before the woken waiter's). It queues, and each release message
//! wakes the waiter that has been waiting longest since its last attempt. Across clients there is no order: that is the fair lock's job.
//!
//! Once waiting, a connection error (a restart, a failover, a network blip) does not end
//! the wait: the engine tries again with backoff for as long as the caller's patience
//! lasts. Only the first attempt reports such an error, so `try_lock` on a dead server
//! fails at once instead of hiding the outage. A grant no replica acknowledged
//! ([`Error::NotReplicated`]) is the exception: the server is up and the lock was free, so
//! a caller with patience waits for the replicas as it would for a holder.
//!
//! Each attempt is [`Detached`]: if the caller's future is dropped while an attempt is in
//! flight (a timeout, a `select!`), the attempt still completes in a task on the client's
//! own runtime, and if it acquired, the guard it made is dropped, which releases the lock.
//! Cancellation therefore leaves neither a subscription nor a held lock behind.
//!
//! Every acquisition is its own owner (a fresh one per attempt, or one for the whole wait
//! where the waiter keeps a place on the server, as a fair lock's does), so two
//! acquisitions never share a hold, whatever task they run in, and an attempt whose reply
//! was lost can be given up without touching any other. (A fair lock takes up the owner
//! id of a past wait again only once nothing that wait sent can still land:
//! `fair_lock/owners.rs`.)

use std::future::Future;
use std::pin::pin;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::{join_all, select, select_all};
use tokio::sync::futures::Notified;
use tokio::time::Instant;
use tracing::Instrument;

use crate::engine::detach::Detached;
use crate::engine::observe;
use crate::engine::session::Core;
use crate::engine::subscriptions::{Subscription, WakeRule};
use crate::error::{Error, Result};

/// What one attempt found.
#[derive(Debug)]
pub(crate) enum Attempt<G> {
    /// The caller holds the primitive now.
    Acquired(G),
    /// Someone else holds it. `retry_after` is how long their lease has left, when known:
    /// the waiter tries again then even if no release is announced.
    Busy { retry_after: Option<Duration> },
}

/// A boxed attempt, owned so that it can run in a task of its own.
pub(crate) type AttemptFuture<G> = Pin<Box<dyn Future<Output = Result<Attempt<G>>> + Send>>;

/// A cheap read that tells whether an attempt is due ([`Acquire::look`]).
pub(crate) type LookFuture = Pin<Box<dyn Future<Output = Result<bool>> + Send>>;

/// A primitive's clean-up after an acquisition that ended without it, owned so that it
/// can run in a task of its own.
pub(crate) type AbandonFuture = Pin<Box<dyn Future<Output = Result<()>> + Send>>;

/// What a primitive tells the engine.
pub(crate) trait Acquire {
    /// What a successful attempt yields; dropping it must give the primitive back.
    type Guard: Send + 'static;

    /// One atomic attempt, as a new owner. If its reply is lost, the attempt itself gives
    /// up whatever it may have taken.
    fn attempt(&self) -> AttemptFuture<Self::Guard>;

    /// The channel on which releases of this primitive are published, on the client the
    /// engine is given.
    fn channel(&self) -> &str;

    /// What local waiters queue on: the primitive's key. Several primitives may share one
    /// channel (Redisson's layout gives `X` and `{X}` one), but each has its own queue, so
    /// a waiter never waits behind, or takes the wake-up of, a waiter for another lock.
    fn queue(&self) -> &str;

    /// The kind of primitive, for logs and metrics labels.
    fn kind(&self) -> &'static str;

    /// The primitive's key, for logs: its queue, unless that is a waiter's own (a fair
    /// lock's waiter queues on its channel).
    fn key(&self) -> &str {
        self.queue()
    }

    /// What a message on the channel means for this primitive's local waiters.
    fn wake_rule(&self) -> WakeRule {
        WakeRule::OneOrAll
    }

    /// How much a waiter asks for, for a queue kept in arrival order
    /// ([`WakeRule::UpTo`]): a semaphore's permits. 1 for everything else.
    fn ask(&self) -> u64 {
        1
    }

    /// A message on this waiter's own channel that hands it the primitive outright (a fair
    /// lock's direct grant): the guard, made without another round trip, or `None` for a
    /// message that only says "try now". `since` is when the waiter's last attempt that
    /// found the primitive busy was sent: the grant came after the server ran that
    /// attempt, so a lease it set started no earlier.
    fn granted(&self, payload: &[u8], since: Instant) -> Option<Self::Guard> {
        let _ = (payload, since);
        None
    }

    /// A read, cheaper than an attempt, made in place of the attempt that follows
    /// subscribing when the attempt before it found the primitive busy and the waiter's
    /// place is kept on the server (a fair lock's queue entry): it answers whether
    /// anything this waiter could not have heard of, before its subscription was live,
    /// makes an attempt due (a direct grant, or the primitive freed). `false` counts as
    /// a busy attempt; `true` or an error is followed by the attempt. `None` (the
    /// default): attempt again, as every primitive whose attempt queues nothing does.
    fn look(&self) -> Option<LookFuture> {
        None
    }

    /// True when the waiter's channel was live, and its messages kept for it, from before
    /// its first attempt was sent until now (a fair lock's owner id whose channel stayed
    /// subscribed since its last acquisition): a busy first attempt followed by an empty
    /// mailbox then needs no [`Acquire::look`], since nothing can have come unheard.
    fn heard_all_since_first_attempt(&self) -> bool {
        false
    }

    /// What must be undone on the server when an acquisition ends without the primitive
    /// (a timeout, an error, a cancelled or dropped future, a shutdown): a fair lock's
    /// waiter leaves its queue, and gives the lock back if it was granted meanwhile. The
    /// engine runs it exactly once, on the client's runtime, after any attempt still in
    /// flight. `None`: nothing to undo (an attempt cleans up after itself).
    fn abandon(&self) -> Option<AbandonFuture> {
        None
    }

    /// The fencing token a guard carries, for the acquisition's span: `None` for a
    /// primitive without tokens (a read hold, permits, a latch).
    fn token(&self, guard: &Self::Guard) -> Option<u64> {
        let _ = guard;
        None
    }

    /// Channels of the same primitive on other clients, each announcing its releases too
    /// (a RedLock's other masters): a waiter wakes on a message on any of them, so one
    /// node that is down or slow does not leave it sleeping.
    fn other_channels(&self) -> &[(Arc<Core>, Arc<str>)] {
        &[]
    }
}

/// How long a caller is prepared to wait.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Patience {
    /// One attempt.
    None,
    /// Until this instant.
    Until(Instant),
    /// As long as it takes.
    Forever,
}

impl Patience {
    /// `timeout` from now; a timeout too large for the clock is refused rather than
    /// silently turned into "forever".
    pub(crate) fn within(timeout: Duration) -> Result<Self> {
        Instant::now()
            .checked_add(timeout)
            .map(Patience::Until)
            .ok_or_else(|| Error::InvalidDuration {
                what: "wait timeout",
                reason: format!("{timeout:?} overflows the clock"),
            })
    }

    fn deadline(self) -> Option<Instant> {
        match self {
            Patience::Until(deadline) => Some(deadline),
            Patience::None | Patience::Forever => None,
        }
    }
}

/// While pub/sub is down a release goes unannounced; a waiter then looks again this often
/// rather than sleeping out a long lease.
const UNANNOUNCED_RETRY: Duration = Duration::from_millis(250);

/// A busy reply without a lease (a key with no expiry) gives no hint; look again after
/// this long unless a release is announced first.
const NO_HINT_RETRY: Duration = Duration::from_secs(1);

/// Backoff bounds for retrying after a connection error while waiting.
const MIN_ERROR_BACKOFF: Duration = Duration::from_millis(10);
const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(1);

/// Acquires `primitive`, waiting as `patience` allows. `Ok(None)` means the wait ended
/// without the primitive.
///
/// Every wait runs on a clock that is driven wherever the caller is polled (see
/// [`sleep_until_on`](crate::runtime::sleep_until_on)), and ends with
/// [`Error::Shutdown`] the moment the client starts shutting down.
pub(crate) async fn acquire<A: Acquire>(
    core: &Core,
    primitive: &A,
    patience: Patience,
) -> Result<Option<A::Guard>> {
    let span = observe::acquisition_span(primitive.kind(), primitive.key());
    async {
        let started = Instant::now();
        let mut abandon = Abandon::new(core, primitive.abandon());
        let outcome = wait_for(core, primitive, patience, &abandon).await;
        let ended = match &outcome {
            Ok(Some(guard)) => observe::Outcome::Acquired {
                token: primitive.token(guard),
            },
            Ok(None) => observe::Outcome::Busy,
            Err(_) => observe::Outcome::Error,
        };
        observe::acquisition(primitive.kind(), primitive.key(), started.elapsed(), ended);
        if matches!(outcome, Ok(Some(_))) {
            abandon.disarm();
        } else {
            // Done before the caller hears the outcome: a timed-out waiter has left the
            // queue when its call returns.
            abandon.run().await;
        }
        outcome
    }
    .instrument(span)
    .await
}

/// The acquisition itself; [`acquire`] adds the clean-up when it ends without the
/// primitive.
async fn wait_for<A: Acquire>(
    core: &Core,
    primitive: &A,
    patience: Patience,
    abandon: &Abandon<'_>,
) -> Result<Option<A::Guard>> {
    core.ensure_open()?;
    // Before any queueing: even a caller that would be told "busy" without trying.
    core.ensure_keys_stay()?;
    let subscriptions = core.subscriptions();
    let deadline = patience.deadline();
    let waiting_patiently = !matches!(patience, Patience::None)
        && deadline.is_none_or(|deadline| deadline > Instant::now());
    // When the last attempt that found the primitive busy was sent (see `granted`).
    let mut last_busy = None;
    // The first attempt's answer, when it found the primitive busy: the attempt after
    // subscribing is then a look ([`Acquire::look`]), busy with the same hint.
    let mut first_busy = None;
    // Waiters of a primitive that every message wakes all at once (a latch) do not take
    // turns: a newcomer looks at once, as the woken ones do.
    let takes_turns = primitive.wake_rule() != WakeRule::All;
    if takes_turns && subscriptions.has_waiters(primitive.channel(), primitive.queue()) {
        // Local waiters are queued: never try ahead of them. A caller that will not wait
        // is told "busy", as tokio's `try_lock` is while others wait.
        if !waiting_patiently {
            return Ok(None);
        }
    } else {
        let first = last_chance(core, primitive, abandon, &mut last_busy, &mut first_busy).await;
        // The first try may have taken all of the caller's patience (a synced write that
        // waited for replicas): its outcome is then the answer, not a reason to try again.
        let still_patient =
            waiting_patiently && deadline.is_none_or(|deadline| deadline > Instant::now());
        match first {
            Ok(acquired) if acquired.is_some() || !still_patient => return Ok(acquired),
            Ok(_) => {}
            // The server answered and the lock was free, but no replica acknowledged the
            // grant (given back already): a caller with patience waits for the replicas
            // as it would for a holder, with the backoff of the waiting loop below.
            Err(Error::NotReplicated { .. }) if still_patient => {}
            // A caller with a deadline waits through a failed first try (a reply that
            // timed out while its runtime was stalled, a connection being reopened) as
            // through later ones, and hears the failure only if its wait ends on one.
            // One without a deadline hears it now rather than wait on a dead server.
            // (A RedLock's missing quorum is answered at once, as before: its masters'
            // own timeouts have already been waited for.)
            Err(err) if still_patient && deadline.is_some() && is_store_unreachable(&err) => {
                tracing::debug!(error = %err, "the first attempt failed; waiting within the deadline");
            }
            Err(err) => return Err(err),
        }
    }
    let subscribing = async {
        let main = subscriptions
            .subscribe(
                primitive.channel(),
                primitive.queue(),
                primitive.wake_rule(),
                primitive.ask(),
            )
            .await;
        let others = join_all(primitive.other_channels().iter().map(|(core, channel)| {
            core.subscriptions().subscribe(
                channel,
                primitive.queue(),
                primitive.wake_rule(),
                primitive.ask(),
            )
        }))
        .await;
        (main, others)
    };
    let (subscription, others) = tokio::select! {
        subscribed = subscribing => subscribed,
        _ = core.background().sleep_until_some(deadline) => {
            return last_chance(core, primitive, abandon, &mut last_busy, &mut None).await;
        }
        _ = core.closing().cancelled() => return Err(Error::Shutdown),
    };
    let mut backoff = MIN_ERROR_BACKOFF;
    let mut my_turn = !takes_turns || !subscription.joined_a_queue();
    let live = || subscription.is_live() || others.iter().any(Subscription::is_live);
    loop {
        let mut released = pin!(subscription.notified());
        released.as_mut().enable();
        let mut released_elsewhere: Vec<Pin<Box<Notified<'_>>>> = others
            .iter()
            .map(|other| {
                let mut notified = Box::pin(other.notified());
                notified.as_mut().enable();
                notified
            })
            .collect();
        let released = any_release(released, &mut released_elsewhere);
        if !my_turn {
            // Behind other local waiters: wait to be woken (or for the fallback) first.
            if deadline.is_some_and(|deadline| deadline <= Instant::now()) {
                return Ok(None);
            }
            let fallback = if live() {
                NO_HINT_RETRY
            } else {
                UNANNOUNCED_RETRY
            };
            let wake_at = deadline.map_or(Instant::now() + fallback, |deadline| {
                deadline.min(Instant::now() + fallback)
            });
            let woken = wait(core, released, wake_at).await?;
            // In a queue kept in arrival order, the fallback timer is the head's alone: a
            // waiter behind it looks only when a message wakes it, so it never passes a
            // head asking for more than is free (tokio's semaphore is as strict).
            my_turn = woken == Woken::ByMessage || !subscription.is_behind();
            continue;
        }
        let heard_nothing = match grant_in_mail(core, primitive, &subscription, last_busy)? {
            Mail::Grant(guard) => return Ok(Some(guard)),
            Mail::Other => false,
            Mail::Empty => true,
        };
        // With the attempt's failure, if it failed: a wait that ends then reports it
        // rather than "busy" (the lock may be free, with no replica acknowledging, or the
        // server unreachable).
        let mut sent_at = Some(Instant::now());
        let looked_busy = match first_busy.take() {
            Some(retry_after) if heard_nothing && primitive.heard_all_since_first_attempt() => {
                // Nothing is sent: the first attempt's "busy" stands, and so does when it
                // was sent, which a grant still on its way counts its lease from (a grant
                // made after that attempt ran may reach the mailbox only now).
                sent_at = None;
                Some(retry_after)
            }
            Some(retry_after) => match primitive.look() {
                Some(look) => matches!(look.await, Ok(false)).then_some(retry_after),
                None => None,
            },
            None => None,
        };
        let outcome = match looked_busy {
            Some(retry_after) => Ok(Attempt::Busy { retry_after }),
            None => attempt(core, primitive, abandon).await,
        };
        let (retry_after, failure) = match outcome {
            Ok(Attempt::Acquired(guard)) => return Ok(Some(guard)),
            Ok(Attempt::Busy { retry_after }) => {
                last_busy = sent_at.or(last_busy);
                backoff = MIN_ERROR_BACKOFF;
                (retry_after.unwrap_or(NO_HINT_RETRY), None)
            }
            Err(err) if err.is_connection_error() => {
                tracing::warn!(error = %err, ?backoff, "acquire attempt failed while waiting; retrying");
                let wait = backoff;
                backoff = (backoff * 2).min(MAX_ERROR_BACKOFF);
                (wait, Some(err))
            }
            Err(err) => return Err(err),
        };
        let retry_after = if live() {
            retry_after
        } else {
            retry_after.min(UNANNOUNCED_RETRY)
        };
        let mut wake_at = Instant::now() + retry_after;
        if let Some(deadline) = deadline {
            if deadline <= Instant::now() {
                return failure.map_or(Ok(None), Err);
            }
            wake_at = wake_at.min(deadline);
        }
        if wait(core, released, wake_at).await? == Woken::ByTimer && subscription.is_behind() {
            my_turn = false;
        }
    }
}

/// Completes at the first release message on the main channel or any other one.
async fn any_release(main: Pin<&mut Notified<'_>>, elsewhere: &mut Vec<Pin<Box<Notified<'_>>>>) {
    if elsewhere.is_empty() {
        main.await;
    } else {
        select(main, select_all(elsewhere.iter_mut())).await;
    }
}

/// Waits for a release message or `wake_at`; fails if the client starts shutting down
/// meanwhile.
async fn wait(core: &Core, released: impl Future<Output = ()>, wake_at: Instant) -> Result<Woken> {
    tokio::select! {
        _ = released => Ok(Woken::ByMessage),
        _ = core.background().sleep_until(wake_at) => core.ensure_open().map(|()| Woken::ByTimer),
        _ = core.closing().cancelled() => Err(Error::Shutdown),
    }
}

/// What ended a wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Woken {
    /// A message (or a reconnect, which wakes everyone).
    ByMessage,
    /// The fallback timer, or the caller's deadline.
    ByTimer,
}

/// What a waiter found among the messages addressed to it.
enum Mail<G> {
    /// A direct grant: the guard it makes.
    Grant(G),
    /// Messages, none of them a grant it may take ("try now", a stale grant).
    Other,
    /// No message (or none read: no attempt found the primitive busy yet).
    Empty,
}

/// A direct grant among the messages addressed to this waiter, if one came: the guard it
/// makes. A grant that comes once the client is shutting down, or once the server may
/// evict keys, is given back (the guard is dropped) and the caller told why: the server
/// made the grant without asking, so the checks an attempt makes first are made here.
fn grant_in_mail<A: Acquire>(
    core: &Core,
    primitive: &A,
    subscription: &Subscription,
    last_busy: Option<Instant>,
) -> Result<Mail<A::Guard>> {
    // Before any attempt found it busy, nothing can have been granted to this waiter,
    // and a lease would have no safe start: the next attempt answers instead.
    let Some(since) = last_busy else {
        return Ok(Mail::Empty);
    };
    let mut mail = Mail::Empty;
    for payload in subscription.take_messages() {
        if let Some(guard) = primitive.granted(&payload, since) {
            if let Err(refused) = core.ensure_open().and_then(|()| core.ensure_keys_stay()) {
                drop(guard);
                return Err(refused);
            }
            return Ok(Mail::Grant(guard));
        }
        mail = Mail::Other;
    }
    Ok(mail)
}

/// One attempt, as an answer for a caller: the guard, or `None` if the primitive is busy.
///
/// A connection found dropped (a server restarted since this connection's last use), or
/// a server found to be a replica now (a failover since), is replaced because of that
/// failure; one more attempt, as a new owner, then tells whether the server is really
/// gone. The first attempt's owner gives itself up.
///
/// `last_busy` is set to when a busy attempt was sent, `busy_hint` to its retry hint.
async fn last_chance<A: Acquire>(
    core: &Core,
    primitive: &A,
    abandon: &Abandon<'_>,
    last_busy: &mut Option<Instant>,
    busy_hint: &mut Option<Option<Duration>>,
) -> Result<Option<A::Guard>> {
    let mut sent_at = Instant::now();
    let outcome = match attempt(core, primitive, abandon).await {
        Err(Error::Redis(err)) if went_stale(&err) => {
            tracing::debug!(error = %err, "connection went stale; trying once more");
            sent_at = Instant::now();
            attempt(core, primitive, abandon).await
        }
        other => other,
    };
    Ok(match outcome? {
        Attempt::Acquired(guard) => Some(guard),
        Attempt::Busy { retry_after } => {
            *last_busy = Some(sent_at);
            *busy_hint = Some(retry_after);
            None
        }
    })
}

/// One attempt, finished even if the caller goes away ([`Detached`]).
///
/// From before it checks that the client is open until its outcome is settled, it counts
/// as work in flight, which shutdown waits for; an attempt that acquired after the client
/// started shutting down gives the primitive back (its guard is dropped here) and fails.
/// Only attempts count: a caller parked between attempts holds nothing on the server, and
/// shutdown does not wait for it.
async fn attempt<A: Acquire>(
    core: &Core,
    primitive: &A,
    abandon: &Abandon<'_>,
) -> Result<Attempt<A::Guard>> {
    let _in_flight = core.background().in_flight();
    core.ensure_open()?;
    // Every attempt, not just the first: a wait that began before the server started to
    // evict keys must not take a lock there either.
    core.ensure_keys_stay()?;
    let outcome =
        Detached::from_boxed(core.background(), abandon.after(primitive.attempt())).await?;
    if matches!(outcome, Attempt::Acquired(_)) && core.ensure_open().is_err() {
        drop(outcome);
        return Err(Error::Shutdown);
    }
    Ok(outcome)
}

/// A failure of the store's connection itself (not a RedLock's quorum, which its
/// masters' own timeouts have already waited out).
fn is_store_unreachable(err: &Error) -> bool {
    match err {
        Error::Redis(err) => crate::error::is_connection_failure(err),
        Error::Store { .. } => err.is_connection_error(),
        _ => false,
    }
}

/// A failure that says the connection used was stale, not that the server is down: it
/// was dropped since its last use, or its server has become a replica (READONLY).
fn went_stale(err: &redis::RedisError) -> bool {
    err.is_connection_dropped()
        || matches!(
            err.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
        )
}

/// The clean-up of an acquisition that ends without the primitive ([`Acquire::abandon`]):
/// run on the client's runtime when this is dropped armed, which every way of ending
/// does (a return, a `?`, a dropped future), so it runs exactly once.
struct Abandon<'a> {
    /// The clean-up and the turn it waits for. In a mutex only so that `&Abandon` is
    /// `Send` (the acquisition holds one across its awaits); it is touched once, when
    /// dropped.
    work: std::sync::Mutex<Option<(AbandonFuture, Arc<tokio::sync::Mutex<()>>)>>,
    core: &'a Core,
    /// Held by each attempt while it runs, even one finishing in the background after its
    /// caller went away: the clean-up takes it first, so it never runs before an attempt
    /// of the same acquisition lands (which could queue the waiter again). Only made when
    /// there is a clean-up: an acquisition with none (the lease lock's) allocates nothing.
    turn: Option<Arc<tokio::sync::Mutex<()>>>,
}

impl<'a> Abandon<'a> {
    fn new(core: &'a Core, work: Option<AbandonFuture>) -> Self {
        let turn: Option<Arc<tokio::sync::Mutex<()>>> = work.as_ref().map(|_| Arc::default());
        Self {
            work: std::sync::Mutex::new(work.zip(turn.clone())),
            turn,
            core,
        }
    }

    /// The acquisition succeeded: nothing to undo.
    fn disarm(&mut self) {
        self.work = std::sync::Mutex::new(None);
    }

    /// Runs the clean-up now, to completion even if the caller goes away meanwhile.
    async fn run(mut self) {
        let Some((work, turn)) = self.take() else {
            return;
        };
        Detached::new(self.core.background(), clean_up(turn, work)).await;
    }

    /// The clean-up, with the turn it waits for, unless it was run or disarmed.
    fn take(&mut self) -> Option<(AbandonFuture, Arc<tokio::sync::Mutex<()>>)> {
        self.work
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
    }

    /// `attempt`, holding the turn while it runs when there is a clean-up to order after
    /// it (and as it is otherwise, without another allocation).
    fn after<G: Send + 'static>(&self, attempt: AttemptFuture<G>) -> AttemptFuture<G> {
        let Some(turn) = &self.turn else {
            return attempt;
        };
        let turn = Arc::clone(turn);
        Box::pin(async move {
            let _turn = turn.lock_owned().await;
            attempt.await
        })
    }
}

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        let Some((work, turn)) = self.take() else {
            return;
        };
        self.core.background().spawn(clean_up(turn, work));
    }
}

/// Runs a clean-up once the acquisition's last attempt has landed.
async fn clean_up(turn: Arc<tokio::sync::Mutex<()>>, work: AbandonFuture) {
    let _turn = turn.lock_owned().await;
    if let Err(err) = work.await {
        tracing::warn!(error = %err, "could not clean up after an acquisition that gave up; its entries expire by themselves");
    }
}
