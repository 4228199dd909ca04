//! The order worker: reads order events from the coupons' streams in a consumer group and
//! stores them in SQL.
//!
//! The stream is the queue that shaves the peak: purchases answer as soon as the event is
//! appended, and the worker writes at the database's pace. An entry is acknowledged (XACK)
//! only after its transaction commits, so a worker that dies between reading and
//! acknowledging leaves the entry pending; another worker claims it (XAUTOCLAIM) once it
//! has been idle for `reclaim_idle`. Storing is idempotent, so an entry stored twice (a
//! crash after commit, before XACK) is harmless.

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use redis::streams::{
    StreamAutoClaimOptions, StreamAutoClaimReply, StreamId, StreamReadOptions, StreamReadReply,
};
use redis::AsyncCommands;
use tokio_util::sync::CancellationToken;

use crate::authority::Tenure;
use crate::db::{Db, DbError};
use crate::keys::{Keyspace, ORDER_GROUP};
use crate::metrics::Metrics;
use crate::model::{now_millis, OrderEvent};
use crate::order_events::ensure_group;

/// How long after its sale ended a coupon's stream is still watched, so late entries and
/// entries of a crashed worker are still stored.
const WATCH_AFTER_END: Duration = Duration::from_secs(24 * 3600);
/// [`WATCH_AFTER_END`] in Unix ms, for queries.
pub const WATCH_AFTER_END_MS: i64 = 24 * 3600 * 1000;
/// How often the list of coupons to watch is re-read from SQL, for coupons another
/// instance created.
const REFRESH_EVERY: Duration = Duration::from_secs(1);
/// Pause after a failed round, so a down database is not hammered.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// The worker's knobs.
#[derive(Debug, Clone)]
pub struct WorkerSettings {
    /// This worker's consumer name in the group; unique per process.
    pub consumer: String,
    /// How long an entry must sit unacknowledged with another consumer before this worker
    /// takes it over.
    pub reclaim_idle: Duration,
    /// Most entries read per round.
    pub batch: usize,
    /// How long one read waits for new entries.
    pub block: Duration,
    /// After a read that did not fill a batch, how long to let entries accumulate before
    /// the next one. Orders reach SQL up to this much later; in exchange, a rush is stored
    /// in a few large transactions instead of many small ones, which leaves the CPU to the
    /// purchases. Zero stores every entry as soon as it is read.
    pub linger: Duration,
    /// How long the drain after a shutdown may take. A drain that cannot finish by then
    /// (Redis or the database is gone) stops and says what it left ([`Drain`]).
    pub drain_timeout: Duration,
    /// No other worker reads these streams (the embedded mode, whose data directory one
    /// instance owns). Then entries left pending by an earlier run are taken over at
    /// start without waiting `reclaim_idle`, and the consumers that run left are deleted.
    pub sole_consumer: bool,
}

impl WorkerSettings {
    /// Defaults: a random consumer name, 30 s reclaim idle, batches of up to 2,000,
    /// 250 ms reads, 50 ms linger.
    pub fn new() -> Self {
        WorkerSettings {
            consumer: format!("worker-{}", uuid::Uuid::new_v4().simple()),
            reclaim_idle: Duration::from_secs(30),
            batch: 2_000,
            block: Duration::from_millis(250),
            linger: Duration::from_millis(50),
            drain_timeout: Duration::from_secs(10),
            sole_consumer: false,
        }
    }
}

impl Default for WorkerSettings {
    fn default() -> Self {
        Self::new()
    }
}

/// Why a worker round failed. The running worker logs it and tries again.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A Redis command failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Storing failed; the entries stay pending and are retried.
    #[error(transparent)]
    Db(#[from] DbError),
    /// The worker's own connection could not be opened.
    #[error("cannot open the worker's connection: {0}")]
    Connect(#[from] distlock::Error),
}

impl WorkerError {
    /// Whether the store refused to take this worker's writes: it moved past this
    /// instance's admission. Retrying cannot help.
    fn is_evicted(&self) -> bool {
        matches!(self, WorkerError::Db(DbError::Evicted { .. }))
    }
}

/// The coupons whose streams a worker reads, shared with the HTTP layer so a coupon
/// created here is watched at once.
#[derive(Debug, Clone, Default)]
pub struct Watched(Arc<Mutex<BTreeSet<i64>>>);

impl Watched {
    /// Starts watching a coupon's stream.
    pub fn add(&self, coupon_id: i64) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(coupon_id);
    }

    /// The watched coupons.
    pub fn coupons(&self) -> Vec<i64> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .copied()
            .collect()
    }
}

/// One entry handed to this worker.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The stream it came from.
    pub stream: String,
    /// Its entry id.
    pub id: String,
    /// The order, or `None` if the entry is not an order event this service wrote.
    pub event: Option<OrderEvent>,
}

/// What storing a batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Committed {
    /// Orders inserted.
    pub stored: u64,
    /// Orders skipped as already stored (same order, or same user and coupon).
    pub duplicates: u64,
    /// Orders refused as beyond their coupon's stock (kept in the store's
    /// `orders_refused`, listed by `reconcile`).
    pub refused: u64,
    /// Entries acknowledged without storing, because they were not order events.
    pub malformed: u64,
}

/// How long a worker on a cluster waits before it reads again when a round found nothing:
/// there it cannot block on every stream at once (see [`Worker::read`]).
const CLUSTER_IDLE_POLL: Duration = Duration::from_millis(20);

/// A worker: one dedicated Redis connection (its reads block) and the database.
pub struct Worker {
    conn: distlock::Connection,
    /// On a Redis Cluster, one XREADGROUP may only name streams of one slot.
    cluster: bool,
    db: Db,
    /// This instance's admission, which every commit carries; evicted when the store
    /// refuses one.
    tenure: Arc<Tenure>,
    settings: WorkerSettings,
    watched: Watched,
    metrics: Metrics,
    grouped: HashSet<i64>,
    last_refresh: Option<Instant>,
    last_reclaim: Option<Instant>,
    /// Whether a sole consumer has taken over everything an earlier run left pending.
    adopted: bool,
    /// Whether entries may be pending for this very consumer that it never stored: a read
    /// whose reply was lost (Redis had already delivered them) or a commit that failed.
    /// Then the next round reads its own history (`XREADGROUP … 0`) first.
    own_pending_unread: bool,
    /// Entries this worker read whose orders are not committed yet: those of a commit in
    /// progress, or of one that failed.
    read_not_stored: usize,
}

/// How a worker's drain ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Drain {
    /// Every order event appended before the HTTP server stopped is stored.
    Complete,
    /// The drain could not finish within its time.
    Incomplete {
        /// Order events this worker read and could not store. They stay pending in Redis
        /// for this consumer, and another worker (or the next run, in the embedded mode)
        /// stores them.
        read_not_stored: usize,
        /// What stopped it: Redis or the database failing, or the time running out.
        reason: String,
    },
}

impl Worker {
    /// Opens the worker's own connection to the deployment of `locks` (one server, a
    /// Sentinel-managed master or a cluster): its reads block, which would hold up the
    /// shared connection's lock operations.
    pub async fn connect(
        locks: &distlock::Client,
        db: Db,
        tenure: Arc<Tenure>,
        settings: WorkerSettings,
        watched: Watched,
        metrics: Metrics,
    ) -> Result<Worker, WorkerError> {
        // Reads block for `settings.block`, so replies may take that long.
        let conn = locks
            .dedicated_connection(settings.block + Duration::from_secs(2))
            .await?;
        Ok(Worker {
            conn,
            cluster: locks.is_cluster(),
            db,
            tenure,
            settings,
            watched,
            metrics,
            grouped: HashSet::new(),
            last_refresh: None,
            last_reclaim: None,
            adopted: false,
            own_pending_unread: false,
            read_not_stored: 0,
        })
    }

    /// Reads new entries from every watched stream, waiting up to `block` for one (no
    /// wait when `None`). The entries are pending for this worker until committed.
    pub async fn read_new(
        &mut self,
        block: Option<Duration>,
    ) -> Result<Vec<Delivery>, WorkerError> {
        self.read(">", block).await
    }

    /// Reads the entries delivered to this worker and not yet acknowledged (its own
    /// history, `XREADGROUP … 0`): what a lost read reply or a failed commit left behind.
    pub async fn read_own_pending(&mut self) -> Result<Vec<Delivery>, WorkerError> {
        self.read("0", None).await
    }

    /// `XREADGROUP` from `from` (`>` new entries, `0` this consumer's pending ones) on
    /// every watched stream.
    async fn read(
        &mut self,
        from: &str,
        block: Option<Duration>,
    ) -> Result<Vec<Delivery>, WorkerError> {
        self.refresh_watched().await?;
        let streams: Vec<String> = self.stream_keys();
        if streams.is_empty() {
            if let Some(block) = block {
                tokio::time::sleep(block).await;
            }
            return Ok(Vec::new());
        }
        let ids = vec![from; streams.len()];
        let mut options = StreamReadOptions::default()
            .group(ORDER_GROUP, &self.settings.consumer)
            .count(self.settings.batch);
        if let Some(block) = block {
            options = options.block(usize::try_from(block.as_millis()).unwrap_or(usize::MAX));
        }
        let replies = if self.cluster && streams.len() > 1 {
            self.read_per_slot(&streams, from, block).await
        } else {
            self.conn
                .xread_options::<_, _, Option<StreamReadReply>>(&streams, &ids, &options)
                .await
                .map(|reply| vec![reply])
        };
        let replies = match replies {
            Ok(replies) => replies,
            Err(err) if err.code() == Some("NOGROUP") => {
                // Redis lost the group (a restart without persistence): recreate on the
                // next round.
                self.grouped.clear();
                return Err(err.into());
            }
            Err(err) => return Err(err.into()),
        };
        let keyspace = self.db.keyspace();
        Ok(replies
            .into_iter()
            .flatten()
            .flat_map(|reply| reply.keys)
            .flat_map(|stream| {
                let key = stream.key;
                stream
                    .ids
                    .into_iter()
                    .map(move |entry| delivery(keyspace, &key, entry))
            })
            .collect())
    }

    /// A cluster refuses an XREADGROUP over streams of several slots, and each coupon's
    /// stream has a slot of its own: one read per slot, all at once, none blocking (a
    /// blocking read would hold its node's connection, and the reads of the other streams
    /// on that node would wait behind it). A round that found nothing waits
    /// [`CLUSTER_IDLE_POLL`] (at most `block`) before the caller reads again.
    async fn read_per_slot(
        &self,
        streams: &[String],
        from: &str,
        block: Option<Duration>,
    ) -> redis::RedisResult<Vec<Option<StreamReadReply>>> {
        let mut by_slot: std::collections::HashMap<redis::cluster_routing::Slot, Vec<&String>> =
            Default::default();
        for stream in streams {
            by_slot
                .entry(redis::cluster_routing::Slot::for_key(stream))
                .or_default()
                .push(stream);
        }
        let reads = by_slot.into_values().map(|streams| {
            let mut conn = self.conn.clone();
            let ids = vec![from; streams.len()];
            let options = StreamReadOptions::default()
                .group(ORDER_GROUP, &self.settings.consumer)
                .count(self.settings.batch);
            async move {
                conn.xread_options::<_, _, Option<StreamReadReply>>(&streams, &ids, &options)
                    .await
            }
        });
        let replies = futures_util::future::try_join_all(reads).await?;
        let found = replies.iter().flatten().any(|reply| !reply.keys.is_empty());
        if !found {
            if let Some(block) = block {
                tokio::time::sleep(block.min(CLUSTER_IDLE_POLL)).await;
            }
        }
        Ok(replies)
    }

    /// Takes over entries that another consumer read but has not acknowledged for
    /// `reclaim_idle`: the other worker is presumed dead. A sole consumer takes over every
    /// pending entry until it has adopted all an earlier run left.
    pub async fn reclaim(&mut self) -> Result<Vec<Delivery>, WorkerError> {
        self.refresh_watched().await?;
        let idle = if self.settings.sole_consumer && !self.adopted {
            Duration::ZERO
        } else {
            self.settings.reclaim_idle
        };
        let idle_ms = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
        let mut claimed = Vec::new();
        for stream in self.stream_keys() {
            let mut start = "0-0".to_owned();
            loop {
                let options = StreamAutoClaimOptions::default().count(self.settings.batch);
                let reply: StreamAutoClaimReply = self
                    .conn
                    .xautoclaim_options(
                        &stream,
                        ORDER_GROUP,
                        &self.settings.consumer,
                        idle_ms,
                        &start,
                        options,
                    )
                    .await?;
                claimed.extend(
                    reply
                        .claimed
                        .into_iter()
                        .map(|entry| delivery(self.db.keyspace(), &stream, entry)),
                );
                if reply.next_stream_id == "0-0" || claimed.len() >= self.settings.batch {
                    break;
                }
                start = reply.next_stream_id;
            }
        }
        if !claimed.is_empty() {
            tracing::warn!(
                entries = claimed.len(),
                "reclaimed order events of a worker that stopped"
            );
            self.metrics.orders_reclaimed.inc_by(claimed.len() as u64);
        }
        Ok(claimed)
    }

    /// Stores the orders of `deliveries` in one transaction, then acknowledges them all.
    pub async fn commit(&mut self, deliveries: &[Delivery]) -> Result<Committed, WorkerError> {
        if deliveries.is_empty() {
            return Ok(Committed::default());
        }
        let started = Instant::now();
        let orders: Vec<OrderEvent> = deliveries.iter().filter_map(|d| d.event.clone()).collect();
        self.read_not_stored = deliveries.len();
        crate::faults::stop_at(crate::faults::WORKER_COMMIT);
        let stored = match self
            .db
            .store_orders(self.tenure.admission(), &orders, now_millis())
            .await
        {
            Ok(stored) => stored,
            Err(err) => {
                if matches!(err, DbError::Evicted { .. }) {
                    self.tenure.evict();
                }
                return Err(err.into());
            }
        };
        self.read_not_stored = 0;
        let committed = Committed {
            stored: stored.inserted,
            duplicates: orders.len() as u64 - stored.inserted - stored.refused,
            refused: stored.refused,
            malformed: (deliveries.len() - orders.len()) as u64,
        };
        for delivery in deliveries.iter().filter(|d| d.event.is_none()) {
            tracing::error!(stream = %delivery.stream, id = %delivery.id, "skipping a stream entry that is not an order event");
        }
        let mut by_stream: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
        for delivery in deliveries {
            by_stream
                .entry(&delivery.stream)
                .or_default()
                .push(&delivery.id);
        }
        for (stream, ids) in by_stream {
            let _: i64 = self.conn.xack(stream, ORDER_GROUP, &ids).await?;
        }
        self.metrics
            .worker_commit_seconds
            .observe(started.elapsed().as_secs_f64());
        self.metrics.orders_stored.inc_by(committed.stored);
        self.metrics.orders_duplicate.inc_by(committed.duplicates);
        self.metrics.orders_malformed.inc_by(committed.malformed);
        Ok(committed)
    }

    /// Reads, stores and acknowledges until `shutdown` fires, then drains: it keeps going
    /// until a round finds nothing new and nothing of its own pending, so every event
    /// appended before the HTTP server stopped is stored before the process exits. The
    /// drain takes at most [`WorkerSettings::drain_timeout`]; then it stops and says what
    /// it could not do.
    pub async fn run(mut self, shutdown: CancellationToken) -> Drain {
        let mut last_error = None;
        while !shutdown.is_cancelled() {
            // A round waiting on a Redis that is gone (a reconnect can take seconds) must
            // not hold up the drain: cut, its entries stay pending, to be read again.
            let round = tokio::select! {
                round = self.round(Some(self.settings.block)) => round,
                () = shutdown.cancelled() => {
                    self.own_pending_unread = true;
                    break;
                }
            };
            match round {
                Ok(_) => {
                    self.metrics.worker_succeeded();
                    last_error = None;
                }
                Err(err) if err.is_evicted() => return self.evicted(),
                Err(err) => {
                    tracing::warn!(error = %err, "order worker round failed; retrying");
                    self.metrics.worker_errors.inc();
                    self.own_pending_unread = true;
                    last_error = Some(err.to_string());
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
        let deadline = tokio::time::Instant::now() + self.settings.drain_timeout;
        // Whatever happened before, nothing this consumer holds is left unstored.
        self.own_pending_unread = true;
        loop {
            // A round cut at the deadline leaves its entries pending, not lost: they are
            // acknowledged only after their commit, and storing them again is harmless.
            let round = tokio::time::timeout_at(deadline, self.round(None)).await;
            match round {
                Ok(Ok(0)) if !self.own_pending_unread => {
                    tracing::info!(consumer = %self.settings.consumer, "order worker drained");
                    return Drain::Complete;
                }
                Ok(Ok(_)) => {}
                Ok(Err(err)) if err.is_evicted() => return self.evicted(),
                Ok(Err(err)) => {
                    self.metrics.worker_errors.inc();
                    self.own_pending_unread = true;
                    tracing::warn!(error = %err, "order worker drain round failed; retrying");
                    last_error = Some(err.to_string());
                    if tokio::time::timeout_at(deadline, tokio::time::sleep(RETRY_PAUSE))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
        let reason = match last_error {
            Some(err) => format!(
                "it could not finish within {:?}: {err}",
                self.settings.drain_timeout
            ),
            None => format!(
                "it did not finish within {:?}: Redis or the database did not answer",
                self.settings.drain_timeout
            ),
        };
        tracing::error!(read_not_stored = self.read_not_stored, %reason, "order worker gave up draining");
        Drain::Incomplete {
            read_not_stored: self.read_not_stored,
            reason,
        }
    }

    /// How a worker the store refused ends: at once, its entries left pending in this
    /// instance's Redis. The store moved to another authority, which put their units back
    /// on sale; storing them now would sell those units twice. `flashsale reconcile` on
    /// this Redis lists them, as orders told and never stored.
    fn evicted(&self) -> Drain {
        tracing::error!(
            read_not_stored = self.read_not_stored,
            "the store refused this worker's orders: it was taken over or released while this \
             instance was frozen or cut off. Its unstored orders stay in this Redis; run \
             `flashsale reconcile` against it to list them"
        );
        Drain::Incomplete {
            read_not_stored: self.read_not_stored,
            reason: "the store moved to another authority and refuses this instance's orders \
                     (`flashsale reconcile` on this Redis lists them)"
                .to_owned(),
        }
    }

    /// One round: this consumer's own unstored entries if any may exist, reclaim if due,
    /// read new entries, commit. Returns the entries handled.
    async fn round(&mut self, block: Option<Duration>) -> Result<usize, WorkerError> {
        let reclaim_due = self
            .last_reclaim
            .is_none_or(|at| at.elapsed() >= self.settings.reclaim_idle / 2);
        let mut handled = 0;
        if self.own_pending_unread {
            let mine = self.read_own_pending().await?;
            handled += mine.len();
            self.commit(&mine).await?;
            if mine.len() < self.settings.batch {
                self.own_pending_unread = false;
            }
        }
        if reclaim_due || (self.settings.sole_consumer && !self.adopted) {
            self.last_reclaim = Some(Instant::now());
            let claimed = self.reclaim().await?;
            handled += claimed.len();
            self.commit(&claimed).await?;
            if self.settings.sole_consumer && !self.adopted && claimed.len() < self.settings.batch {
                self.forget_departed_consumers().await?;
                self.adopted = true;
            }
        }
        let fresh = self.read_new(block).await?;
        handled += fresh.len();
        self.commit(&fresh).await?;
        if block.is_some() && !fresh.is_empty() && fresh.len() < self.settings.batch {
            tokio::time::sleep(self.settings.linger).await;
        }
        Ok(handled)
    }

    /// Deletes the consumers of earlier runs that hold no pending entry, so a sole
    /// consumer's group does not collect one dead consumer per restart. One with entries
    /// is kept: deleting it would drop them.
    async fn forget_departed_consumers(&mut self) -> Result<(), WorkerError> {
        for stream in self.stream_keys() {
            let info: redis::streams::StreamInfoConsumersReply =
                self.conn.xinfo_consumers(&stream, ORDER_GROUP).await?;
            for consumer in info.consumers {
                if consumer.name != self.settings.consumer && consumer.pending == 0 {
                    let _: i64 = redis::cmd("XGROUP")
                        .arg("DELCONSUMER")
                        .arg(&stream)
                        .arg(ORDER_GROUP)
                        .arg(&consumer.name)
                        .query_async(&mut self.conn)
                        .await?;
                }
            }
        }
        Ok(())
    }

    /// Picks up coupons created by other instances, and creates the consumer group of any
    /// stream that lacks one.
    async fn refresh_watched(&mut self) -> Result<(), WorkerError> {
        if self
            .last_refresh
            .is_none_or(|at| at.elapsed() >= REFRESH_EVERY)
        {
            let horizon = now_millis().saturating_sub(WATCH_AFTER_END.as_millis() as i64);
            for coupon in self.db.coupons_ending_after(horizon).await? {
                self.watched.add(coupon.id);
            }
            self.last_refresh = Some(Instant::now());
        }
        for coupon_id in self.watched.coupons() {
            if !self.grouped.contains(&coupon_id) {
                ensure_group(&mut self.conn, &self.db.keyspace().coupon(coupon_id)).await?;
                self.grouped.insert(coupon_id);
            }
        }
        Ok(())
    }

    fn stream_keys(&self) -> Vec<String> {
        self.watched
            .coupons()
            .into_iter()
            .filter(|id| self.grouped.contains(id))
            .map(|id| self.db.keyspace().coupon(id).orders)
            .collect()
    }
}

fn delivery(keyspace: &Keyspace, stream: &str, entry: StreamId) -> Delivery {
    let event = (|| {
        Some(OrderEvent {
            order_id: entry.get("order")?,
            coupon_id: entry.get("coupon")?,
            user_id: entry.get("user")?,
            created_at: entry.get("at")?,
        })
    })();
    // An event for another coupon than its stream's would be stored under the wrong key.
    let event = event.filter(|event| keyspace.coupon_of_stream(stream) == Some(event.coupon_id));
    Delivery {
        stream: stream.to_owned(),
        id: entry.id,
        event,
    }
}
