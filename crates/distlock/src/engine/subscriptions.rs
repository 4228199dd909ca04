//! One pub/sub connection per client, and one server subscription per channel however many
//! local waiters share it.
//!
//! Waiters register interest with [`Subscriptions::subscribe`], which returns once the
//! server confirmed the SUBSCRIBE, so a release published after that cannot be missed.
//!
//! Local waiters queue per lock, not per channel: Redisson's layout gives `X` and `{X}`
//! one release channel, and a release message does not say which lock it frees. So each
//! message wakes one waiter of every lock queued on its channel, oldest first (tokio's
//! `Notify::notify_one`); a waiter woken for a lock still held looks, finds it busy, and
//! waits again. A waiter that is dropped after being woken hands the wake-up to the next
//! one of its lock.
//!
//! A task on the client's own runtime owns the connection (never the runtime of the first
//! waiter, which may end long before the client does). When it breaks, the task reconnects with
//! backoff, subscribes again to every channel still wanted, and then wakes every waiter,
//! because messages published while it was away are gone.
//!
//! On a Redis Cluster the hub holds a RESP3 cluster connection instead, whose pushes carry
//! the messages. On Redis 7 it subscribes with SSUBSCRIBE, so a release message reaches the
//! one shard that owns the lock rather than every node (and Redisson's waiters, which
//! listen the same way there, hear distlock's releases and the reverse). redis-rs then
//! follows each channel's shard by itself, through failovers and slot moves; the hub
//! wakes a channel's waiters whenever it is subscribed again, because a message sent
//! meanwhile is gone.
//!
//! A channel the server refuses (an ACL without the channel) is not a broken connection:
//! the hub warns once, marks the channel denied, and keeps the connection. Its waiters
//! then fall back to looking again every 250 ms or when the holder's lease runs out, as
//! they do while pub/sub is down; the channel is asked for again at each health check, so
//! a right granted later takes effect. A refused UNSUBSCRIBE is warned about once and
//! otherwise ignored.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub(crate) use crate::engine::waiters::WakeRule;
use crate::engine::waiters::{lock_mailbox, Mailbox, Queue};
use crate::runtime::sleep_until_on;
use crate::transport::pubsub::{open, Event, FeedSource, Sink};

/// Reconnect backoff bounds: fast enough to catch a restarted server, slow enough not to
/// spin against a dead one.
const MIN_BACKOFF: Duration = Duration::from_millis(20);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// A connection that lasted this long was healthy: the next reconnect starts from the
/// smallest backoff again.
const STABLE_AFTER: Duration = Duration::from_secs(5);

/// How often the hub PINGs, so a half-open connection is noticed and replaced instead of
/// silently delivering nothing.
const HEALTH_CHECK_EVERY: Duration = Duration::from_secs(3);

/// The client's registry of channels its waiters listen on.
pub(crate) struct Subscriptions {
    shared: Arc<Shared>,
    source: FeedSource,
    /// The client's own runtime, where the hub runs whoever waits first.
    runtime: tokio::runtime::Handle,
    hub_started: OnceLock<()>,
    nudge_rx: Mutex<Option<mpsc::UnboundedReceiver<()>>>,
}

struct Shared {
    channels: Mutex<HashMap<String, ChannelEntry>>,
    /// Tells the hub to bring the server's subscriptions in line with `channels`.
    nudge: mpsc::UnboundedSender<()>,
    timeout: Duration,
    shutdown: CancellationToken,
    /// The ACL warning is logged once per client, not once per channel.
    warned_denied: AtomicBool,
    /// Likewise for a refused UNSUBSCRIBE.
    warned_unsubscribe: AtomicBool,
}

struct ChannelEntry {
    state: Arc<ChannelState>,
    refs: usize,
    /// The local waiters of each lock announced on this channel, by lock key.
    queues: HashMap<String, Queue>,
}

struct ChannelState {
    /// Whether the server delivers this channel's messages.
    delivery: watch::Sender<Delivery>,
    /// How many times the channel's messages may have been lost (a reconnect, a
    /// subscription the server dropped and was asked for again): every such gap wakes
    /// the channel's waiters, and counts here for a [`KeptChannel`] that none were in.
    gaps: AtomicU64,
}

impl ChannelEntry {
    /// The local waiters of the primitive `queue` on this channel, made with `rule` if
    /// none were there.
    fn queue(&mut self, queue: &str, rule: WakeRule) -> &mut Queue {
        self.queues
            .entry(queue.to_owned())
            .or_insert_with(|| Queue::new(rule))
    }

    /// Applies a message to every queue on the channel, each by its own rule.
    fn deliver(&self, payload: &[u8]) {
        for queue in self.queues.values() {
            queue.deliver(payload);
        }
    }

    /// Wakes every waiter on the channel (messages may have been lost).
    fn wake_all(&self) {
        self.state.gaps.fetch_add(1, Ordering::AcqRel);
        for queue in self.queues.values() {
            queue.wake_all();
        }
    }
}

/// What the server does with a channel's messages for this client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Delivery {
    /// Not subscribed yet (or again, after a reconnect).
    Pending,
    /// Subscribed: the server delivers every message from now on.
    Live,
    /// The server refused the subscription (ACL): no message will come.
    Denied,
}

/// One waiter's interest in a lock's channel. Dropping it leaves the lock's queue, and
/// unsubscribes when it was the channel's last.
pub(crate) struct Subscription {
    shared: Arc<Shared>,
    channel: String,
    queue: String,
    state: Arc<ChannelState>,
    wake: Arc<Notify>,
    mailbox: Mailbox,
    /// Its place in an ordered queue (a semaphore's).
    ticket: Option<u64>,
    /// Other local waiters were already queued for the lock when this one joined.
    joined_a_queue: bool,
}

impl Shared {
    /// `channel`'s entry with one more interest in it: the hub is nudged to subscribe
    /// when it is the first.
    fn wanted<'a>(
        &self,
        channels: &'a mut HashMap<String, ChannelEntry>,
        channel: &str,
    ) -> &'a mut ChannelEntry {
        let entry = channels
            .entry(channel.to_owned())
            .or_insert_with(|| ChannelEntry {
                state: Arc::new(ChannelState {
                    delivery: watch::Sender::new(Delivery::Pending),
                    gaps: AtomicU64::new(0),
                }),
                refs: 0,
                queues: HashMap::new(),
            });
        entry.refs += 1;
        if entry.refs == 1 {
            let _ = self.nudge.send(());
        }
        entry
    }

    /// One interest in `channel` less; with `queue` gone when `leave` says it may go.
    /// The hub is nudged to unsubscribe when it was the last.
    fn unwanted(&self, channel: &str, queue: &str, leave: impl FnOnce(&mut Queue) -> bool) {
        let mut channels = self.channels();
        if let Some(entry) = channels.get_mut(channel) {
            if let Some(waiters) = entry.queues.get_mut(queue) {
                if leave(waiters) {
                    entry.queues.remove(queue);
                }
            }
            entry.refs = entry.refs.saturating_sub(1);
            if entry.refs == 0 {
                channels.remove(channel);
                let _ = self.nudge.send(());
            }
        }
    }

    fn channels(&self) -> MutexGuard<'_, HashMap<String, ChannelEntry>> {
        // A panic while holding this lock cannot leave the map half-updated (every
        // critical section is a single insert, remove or counter change), so a poisoned
        // lock is still consistent.
        self.channels
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Subscriptions {
    pub(crate) fn new(
        source: FeedSource,
        timeout: Duration,
        runtime: tokio::runtime::Handle,
        shutdown: CancellationToken,
    ) -> Self {
        let (nudge, nudge_rx) = mpsc::unbounded_channel();
        Self {
            shared: Arc::new(Shared {
                channels: Mutex::new(HashMap::new()),
                nudge,
                timeout,
                shutdown,
                warned_denied: AtomicBool::new(false),
                warned_unsubscribe: AtomicBool::new(false),
            }),
            source,
            runtime,
            hub_started: OnceLock::new(),
            nudge_rx: Mutex::new(Some(nudge_rx)),
        }
    }

    /// Queues a waiter for the lock `queue`, whose releases are announced on `channel`,
    /// and waits until the server confirmed the subscription, or until the connection
    /// timeout passed (then the waiter still works, by retrying when the holder's lease
    /// runs out: see [`Subscription::is_live`]).
    ///
    /// Cancel-safe: dropping the future drops the interest.
    pub(crate) async fn subscribe(
        &self,
        channel: &str,
        queue: &str,
        rule: WakeRule,
        ask: u64,
    ) -> Subscription {
        self.start_hub();
        let (state, place) = {
            let mut channels = self.shared.channels();
            let entry = self.shared.wanted(&mut channels, channel);
            let place = entry.queue(queue, rule).join(ask);
            (Arc::clone(&entry.state), place)
        };
        let subscription = Subscription {
            shared: Arc::clone(&self.shared),
            channel: channel.to_owned(),
            queue: queue.to_owned(),
            state,
            wake: place.wake,
            mailbox: place.mailbox,
            ticket: place.ticket,
            joined_a_queue: place.behind_others,
        };
        let mut delivery = subscription.state.delivery.subscribe();
        let answered = delivery.wait_for(|delivery| *delivery != Delivery::Pending);
        // Timed on a clock that is driven where the caller is polled (`sleep_until_on`).
        let give_up = sleep_until_on(&self.runtime, Instant::now() + self.shared.timeout);
        let confirmed = tokio::select! {
            _ = answered => true,
            _ = give_up => false,
        };
        if !confirmed {
            tracing::warn!(
                channel,
                "pub/sub subscription not confirmed in time; waiting falls back to lease expiry"
            );
        }
        subscription
    }

    /// Keeps `channel` subscribed, and the messages delivered to its queue `queue`, with
    /// or without waiters, until the returned handle is dropped: a fair lock's owner id
    /// between two acquisitions, so that the next one neither subscribes again nor misses
    /// a message published after it took the id up (see [`KeptChannel`]). Returns at
    /// once; the subscription is made in the background.
    pub(crate) fn keep(&self, channel: &str, queue: &str, rule: WakeRule) -> KeptChannel {
        self.start_hub();
        let mut channels = self.shared.channels();
        let entry = self.shared.wanted(&mut channels, channel);
        let mailbox = entry.queue(queue, rule).keep();
        KeptChannel {
            shared: Arc::clone(&self.shared),
            channel: channel.to_owned(),
            queue: queue.to_owned(),
            state: Arc::clone(&entry.state),
            mailbox,
        }
    }

    /// True if local waiters are queued for the lock `queue` on `channel` right now.
    pub(crate) fn has_waiters(&self, channel: &str, queue: &str) -> bool {
        self.shared
            .channels()
            .get(channel)
            .and_then(|entry| entry.queues.get(queue))
            .is_some_and(Queue::has_waiters)
    }

    fn start_hub(&self) {
        self.hub_started.get_or_init(|| {
            let receiver = self
                .nudge_rx
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .take();
            if let Some(receiver) = receiver {
                self.runtime.spawn(run_hub(
                    Arc::clone(&self.shared),
                    self.source.clone(),
                    receiver,
                ));
            }
        });
    }
}

impl Subscription {
    /// A future that completes at the next wake-up for this waiter. Call
    /// `enable()` on it (pinned) before trying the lock, so a release in between counts.
    pub(crate) fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.wake.notified()
    }

    /// The messages addressed to this waiter since it last looked, oldest first (only on
    /// a channel whose rule is [`WakeRule::Addressed`]).
    pub(crate) fn take_messages(&self) -> Vec<Vec<u8>> {
        std::mem::take(&mut *lock_mailbox(&self.mailbox))
    }

    /// True while this waiter is in a queue kept in arrival order and not at its head.
    pub(crate) fn is_behind(&self) -> bool {
        let Some(ticket) = self.ticket else {
            return false;
        };
        self.shared
            .channels()
            .get(&self.channel)
            .and_then(|entry| entry.queues.get(&self.queue))
            .is_some_and(|queue| !queue.is_head(ticket))
    }

    /// True if other local waiters were queued when this one joined: it should wait for
    /// its turn rather than try ahead of them.
    pub(crate) fn joined_a_queue(&self) -> bool {
        self.joined_a_queue
    }

    /// False while the pub/sub connection is down: a release may then go unannounced, and
    /// waiters must not sleep longer than they can afford to.
    pub(crate) fn is_live(&self) -> bool {
        *self.state.delivery.borrow() == Delivery::Live
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let ticket = self.ticket;
        self.shared
            .unwanted(&self.channel, &self.queue, |waiters| waiters.leave(ticket));
    }
}

/// A channel and one queue on it kept while no waiter may be in the queue
/// ([`Subscriptions::keep`]): the server keeps delivering, and the queue's mailbox keeps
/// what comes, for the next waiter to read.
pub(crate) struct KeptChannel {
    shared: Arc<Shared>,
    channel: String,
    queue: String,
    state: Arc<ChannelState>,
    mailbox: Mailbox,
}

/// A point in a kept channel's delivery: the channel was live, with this many gaps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unbroken(u64);

impl KeptChannel {
    /// Empties the mailbox and, if the server delivers the channel now, marks the point
    /// from which [`KeptChannel::heard_all_since`] can tell that nothing was missed.
    /// Called when the channel's next waiter takes it up, before it first tries.
    pub(crate) fn take_up(&self) -> Option<Unbroken> {
        lock_mailbox(&self.mailbox).clear();
        let gaps = self.state.gaps.load(Ordering::Acquire);
        self.is_live().then_some(Unbroken(gaps))
    }

    /// True if every message published on the channel since `mark` was delivered to the
    /// mailbox: the channel has been live since, without a gap.
    pub(crate) fn heard_all_since(&self, mark: Unbroken) -> bool {
        self.is_live() && self.state.gaps.load(Ordering::Acquire) == mark.0
    }

    /// True while the server delivers the channel's messages.
    pub(crate) fn is_live(&self) -> bool {
        *self.state.delivery.borrow() == Delivery::Live
    }
}

impl Drop for KeptChannel {
    fn drop(&mut self) {
        self.shared
            .unwanted(&self.channel, &self.queue, Queue::unkeep);
    }
}

async fn run_hub(shared: Arc<Shared>, source: FeedSource, mut nudges: mpsc::UnboundedReceiver<()>) {
    let mut backoff = MIN_BACKOFF;
    let mut first_attempt = true;
    loop {
        if !std::mem::replace(&mut first_attempt, false) {
            // Every reconnect waits, so a server that accepts and then drops us (a
            // restricted ACL user, say) is not hammered.
            tokio::select! {
                _ = shared.shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
        let connect = tokio::time::timeout(shared.timeout, open(&source));
        let opened = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            connected = connect => connected,
        };
        let (mut sink, mut events) = match opened {
            Ok(Ok(opened)) => opened,
            failure => {
                let reason = match failure {
                    Ok(Err(err)) => err.to_string(),
                    _ => "connection timed out".to_owned(),
                };
                tracing::warn!(%reason, ?backoff, "pub/sub connection failed; retrying");
                continue;
            }
        };
        let connected_at = tokio::time::Instant::now();
        let mut health = tokio::time::interval(HEALTH_CHECK_EVERY);
        health.tick().await;
        let mut on_server = HashSet::new();
        let mut denied = HashSet::new();
        if reconcile(&shared, &mut sink, &mut on_server, &mut denied).await {
            // Anything published while no connection listened is lost: let every
            // waiter look at its lock again.
            wake_everyone(&shared);
            loop {
                tokio::select! {
                    _ = shared.shutdown.cancelled() => return,
                    nudge = nudges.recv() => {
                        if nudge.is_none() {
                            return;
                        }
                        while nudges.try_recv().is_ok() {}
                        if !reconcile(&shared, &mut sink, &mut on_server, &mut denied).await {
                            break;
                        }
                    }
                    event = events.next() => match event {
                        Some(Event::Message { channel, payload }) => deliver(&shared, &channel, &payload),
                        // A renewed subscription follows a gap in which messages were
                        // lost: the channel's waiters look again.
                        Some(Event::Subscribed(channel)) => wake_channel(&shared, &channel),
                        // A channel still waited on, dropped by the server: its slot moved.
                        // Subscribe again (redis-rs sends it to the slot's new master) and
                        // wake its waiters, whose release message may have gone meanwhile.
                        Some(Event::Unsubscribed(channel)) => {
                            let wanted = shared.channels().contains_key(&channel);
                            if wanted && on_server.remove(&channel) {
                                tracing::debug!(%channel, "the server dropped a subscription (a slot moved?); subscribing again");
                                if !reconcile(&shared, &mut sink, &mut on_server, &mut denied).await {
                                    break;
                                }
                                wake_channel(&shared, &channel);
                            }
                        }
                        Some(Event::NodeLost) => {
                            tracing::debug!("a pub/sub node connection broke; redis-rs resubscribes");
                            wake_everyone(&shared);
                        }
                        Some(Event::Other) => {}
                        None => break,
                    },
                    _ = health.tick() => {
                        if !sink.healthy(shared.timeout).await {
                            break;
                        }
                        // A right granted since a refusal takes effect without a restart:
                        // ask for the refused channels again.
                        if !denied.is_empty() {
                            denied.clear();
                            if !reconcile(&shared, &mut sink, &mut on_server, &mut denied).await {
                                break;
                            }
                        }
                    }
                }
            }
        }
        tracing::warn!("pub/sub connection lost; reconnecting");
        if connected_at.elapsed() >= STABLE_AFTER {
            backoff = MIN_BACKOFF;
        }
        for entry in shared.channels().values() {
            entry.state.delivery.send_replace(Delivery::Pending);
        }
        wake_everyone(&shared);
    }
}

/// Subscribes to wanted channels the server does not deliver yet and unsubscribes from
/// the ones nobody waits on. Channels the server refused stay in `denied` while they are
/// wanted, and are not asked for again until the hub clears `denied` (at each health
/// check). Returns false when the connection must be rebuilt.
async fn reconcile(
    shared: &Shared,
    sink: &mut Sink,
    on_server: &mut HashSet<String>,
    denied: &mut HashSet<String>,
) -> bool {
    let (missing, stale): (Vec<String>, Vec<String>) = {
        let channels = shared.channels();
        denied.retain(|channel| channels.contains_key(channel));
        let missing = channels
            .keys()
            .filter(|channel| !on_server.contains(*channel) && !denied.contains(*channel))
            .cloned()
            .collect();
        let stale = on_server
            .iter()
            .filter(|channel| !channels.contains_key(*channel))
            .cloned()
            .collect();
        (missing, stale)
    };
    if !missing.is_empty() && !subscribe(shared, sink, missing, on_server, denied).await {
        return false;
    }
    if !stale.is_empty() {
        match tokio::time::timeout(shared.timeout, sink.unsubscribe(&stale)).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) if err.is_denied() => {
                // The connection is fine; the server just keeps sending these channels'
                // messages, which nobody is woken by. Rebuilding it would not help.
                if !shared.warned_unsubscribe.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        error = %err,
                        "the Redis user may not unsubscribe (ACL): channels nobody waits on \
                         stay subscribed until the connection ends; grant +unsubscribe"
                    );
                }
            }
            _ => return false,
        }
        for channel in &stale {
            on_server.remove(channel);
        }
    }
    // A channel dropped and wanted again between two nudges keeps its server subscription
    // but has a fresh state: mark every delivered channel live, every refused one denied.
    for (channel, entry) in shared.channels().iter() {
        let now = if on_server.contains(channel) {
            Delivery::Live
        } else if denied.contains(channel) {
            Delivery::Denied
        } else {
            continue;
        };
        entry
            .state
            .delivery
            .send_if_modified(|delivery| std::mem::replace(delivery, now) != now);
    }
    true
}

/// Subscribes to `channels`. The server refuses a whole SUBSCRIBE if one channel is not
/// allowed, so after a refusal each channel is asked for alone, to find which. Returns
/// false when the connection failed.
async fn subscribe(
    shared: &Shared,
    sink: &mut Sink,
    channels: Vec<String>,
    on_server: &mut HashSet<String>,
    denied: &mut HashSet<String>,
) -> bool {
    match tokio::time::timeout(shared.timeout, sink.subscribe(&channels)).await {
        Ok(Ok(())) => {
            on_server.extend(channels);
            return true;
        }
        Ok(Err(err)) if err.is_denied() => {}
        _ => return false,
    }
    for channel in channels {
        let one = std::slice::from_ref(&channel);
        match tokio::time::timeout(shared.timeout, sink.subscribe(one)).await {
            Ok(Ok(())) => {
                on_server.insert(channel);
            }
            Ok(Err(err)) if err.is_denied() => {
                if !shared.warned_denied.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        %channel,
                        error = %err,
                        "the Redis user may not subscribe to release channels (ACL): waiters \
                         are not woken by releases and look again every 250 ms or when the \
                         holder's lease runs out; grant the channels listed in distlock's \
                         docs/safety.md"
                    );
                } else {
                    tracing::debug!(%channel, "subscription refused by the server's ACL");
                }
                denied.insert(channel);
            }
            _ => return false,
        }
    }
    true
}

fn deliver(shared: &Shared, channel: &str, payload: &[u8]) {
    if let Some(entry) = shared.channels().get(channel) {
        entry.deliver(payload);
    }
}

fn wake_channel(shared: &Shared, channel: &str) {
    if let Some(entry) = shared.channels().get(channel) {
        entry.wake_all();
    }
}

fn wake_everyone(shared: &Shared) {
    for entry in shared.channels().values() {
        entry.wake_all();
    }
}
