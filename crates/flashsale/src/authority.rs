//! One stock authority per SQL store, and a store that fences itself.
//!
//! The stock of a store is sold from counters in one Redis: the authority. Two Redis
//! servers (an embedded instance's private one and a fleet's, two fleets' servers, or two
//! logical databases of one server) on one store would each load the whole stock from SQL
//! and each sell it: a review sold 100 orders for a stock of 50 that way. So the store
//! records its authority when it is first used, and every instance checks it at start.
//!
//! - **In SQL**, the `store` row names the authority: a random id, where it is (for
//!   people), since when, and the store's **epoch**: a number that only grows, moved on by
//!   every start, take-over and release ([`crate::db::Db::join`]).
//! - **In Redis**, the authority keeps the same id under [`Keyspace::authority`]. A Redis
//!   that holds the id is the authority, whatever URL or host name reaches it.
//! - **A Redis without the id** is either the authority after it lost its data (a restart
//!   without persistence: the stock is then reloaded from SQL, as before) or another
//!   server. It is taken for the first only when it is reached the way the authority was
//!   recorded: the same URL (credentials left out), or the same embedded data directory.
//! - **Every write is fenced by the store itself.** An instance is admitted at the epoch
//!   its start moved the store to ([`Admission`]), and every write it makes (orders,
//!   fenced sales, beats) is refused by the database, in the write's own transaction, once
//!   a take-over or a release has moved the store past that epoch, or gone back under it
//!   (restored from a backup: the store counts each instance's beats). So a frozen, slow
//!   or clock-skewed instance can never write to the store after a take-over, however
//!   long it slept; what it had sold and not stored stays in its Redis, and `flashsale
//!   reconcile` on that Redis lists it. A new tenure of a Redis sets aside the order
//!   streams an earlier one left there (`stock::StockLoader`), so taking an abandoned
//!   Redis back never stores them either.
//! - **Moving on purpose** is `serve --take-over-store`, and only from a *released*
//!   authority: its last instance stopped gracefully, with no other instance beating and
//!   every order event of the store's streams stored (`Service::shutdown`), the release
//!   conditional on the epoch it read before it looked. The take-over and this instance's
//!   admission are one transaction, so a second take-over at the same moment finds it
//!   selling; then this Redis's counters of the store's open coupons are cleared, to be
//!   rebuilt from SQL and its own streams. An old Redis lost for good is taken with
//!   `--abandon-old-authority`, once every instance has been silent for
//!   [`TAKEOVER_SILENCE`] by the database's clock; what it held that SQL lacks is lost.
//! - **Never two selling at once.** Every instance beats in the store every
//!   [`BEAT_EVERY`] (the database records the time) and removes its beat when it stops
//!   gracefully; it sells only while a beat sent within [`SALES_LEASE`] (by its own
//!   monotonic clock) was accepted, shorter than that silence, checked when a purchase
//!   arrives and again right before its write.
//! - **A Redis behind SQL** (a restored backup, a copied data directory) keeps the id but
//!   not the sales since: each start repairs its counters (`stock::repair_stock`). **SQL
//!   behind Redis** (a restored database) is given back, at start, every order Redis holds
//!   that a worker had already stored (`stock::restore_orders`).
//!
//! [`Keyspace::authority`]: crate::keys::Keyspace::authority

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use redis::AsyncCommands;

use crate::db::{Admission, AuthorityRecord, Db, DbError, Joined, TakeOver};
use crate::model::now_millis;

/// How often an instance records that it sells under its authority, and checks that the
/// store still admits it.
pub const BEAT_EVERY: Duration = Duration::from_millis(500);
/// An instance sells only while a beat sent this recently was accepted. A store that
/// cannot be written for this long stops its sales (503 `unavailable`, nothing sold).
pub const SALES_LEASE: Duration = Duration::from_secs(10);
/// An abandoning take-over waits until every instance has been silent this long, by the
/// database's clock: longer than [`SALES_LEASE`], so a silent instance has stopped selling.
pub const TAKEOVER_SILENCE: Duration = Duration::from_secs(15);

/// The beat, the sales lease and the take-over silence in force: the constants above,
/// unless the hidden test hook `FLASHSALE_TEST_AUTHORITY_TIMING=BEAT_MS,LEASE_MS,SILENCE_MS`
/// shortens them (tests of a frozen instance would otherwise wait 15 s).
struct Timing {
    beat: Duration,
    lease: Duration,
    silence: Duration,
}

static TIMING: std::sync::LazyLock<Timing> = std::sync::LazyLock::new(|| {
    let defaults = Timing {
        beat: BEAT_EVERY,
        lease: SALES_LEASE,
        silence: TAKEOVER_SILENCE,
    };
    let Ok(hook) = std::env::var("FLASHSALE_TEST_AUTHORITY_TIMING") else {
        return defaults;
    };
    let ms: Vec<u64> = hook
        .split(',')
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    let timing = match ms[..] {
        [beat, lease, silence] if beat > 0 && beat < lease && lease < silence => Timing {
            beat: Duration::from_millis(beat),
            lease: Duration::from_millis(lease),
            silence: Duration::from_millis(silence),
        },
        _ => defaults,
    };
    // A silent instance may have sent a write to Redis just before it went silent: the
    // silence outlasts that write's fence, so it has landed or never will before a
    // take-over.
    let fence = timing.beat + crate::model::WRITE_WINDOW + crate::model::CLOCK_GRACE;
    Timing {
        silence: timing.silence.max(fence),
        ..timing
    }
});

/// The take-over silence in force, in ms: how long every instance of a tenure must have
/// been silent before an abandoning take-over, and how recently another instance must
/// have beaten to keep a stopping one from releasing the store.
pub fn silence_ms() -> i64 {
    i64::try_from(TIMING.silence.as_millis()).unwrap_or(i64::MAX)
}

/// This instance's hold on the store: its admission, and whether it may sell now.
#[derive(Debug)]
pub struct Tenure {
    admission: Admission,
    since: Instant,
    /// When the last accepted beat was sent, in ms after `since`.
    confirmed_ms: AtomicU64,
    /// The store no longer admits this instance.
    moved: AtomicBool,
}

impl Tenure {
    /// The tenure of an instance admitted by `admission`, whose admission was sent at
    /// `sent` (the admission is a beat).
    pub fn new(admission: Admission, sent: Instant) -> Arc<Tenure> {
        Arc::new(Tenure {
            admission,
            since: sent,
            confirmed_ms: AtomicU64::new(0),
            moved: AtomicBool::new(false),
        })
    }

    /// What every write of this instance carries.
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    fn confirm_from(&self, sent: Instant) {
        let ms = sent.saturating_duration_since(self.since).as_millis();
        self.confirmed_ms
            .fetch_max(u64::try_from(ms).unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// Whether the store was found to have moved past this instance (a take-over, or a
    /// release while it was frozen).
    pub fn moved(&self) -> bool {
        self.moved.load(Ordering::SeqCst)
    }

    /// Records that the store refused a write of this instance: it was taken over or
    /// released since the instance started. From now on the instance sells nothing.
    pub fn evict(&self) {
        if !self.moved.swap(true, Ordering::SeqCst) {
            tracing::error!(
                epoch = self.admission.epoch,
                "the store no longer admits this instance (taken over or released while it \
                 was frozen or cut off, or restored from a backup under it): it sells and \
                 stores nothing more"
            );
        }
    }

    /// Whether this instance may sell: a beat sent within [`SALES_LEASE`] was accepted,
    /// and the store has not moved past it.
    pub fn may_sell(&self) -> bool {
        let confirmed =
            self.since + Duration::from_millis(self.confirmed_ms.load(Ordering::SeqCst));
        !self.moved() && confirmed.elapsed() < TIMING.lease
    }
}

/// Beats for `tenure`'s instance every [`BEAT_EVERY`] until aborted, confirming it; stops
/// once the store refuses a beat (it moved past this instance).
///
/// A beat is not cut short at a deadline of its own: it is warned about after two beats,
/// and waited for until the sales lease has passed since it was sent, when it can no
/// longer confirm anything. Its answer counts from when it was sent, so a late
/// confirmation is safe, and a late refusal is how an instance that woke from a freeze
/// into a busy store learns it was taken over. (Cut at two beats, every beat of an
/// instance whose store took longer than that to answer was thrown away: it never
/// confirmed, and never heard that it had been evicted.)
///
/// One beat is out at a time, as long as it answers within a quarter of the lease. On
/// PostgreSQL a beat out longer than that (a connection that stopped answering) gets a
/// second one beside it, on another connection, so sales do not stop for it; never more,
/// since every beat holds the store row (FOR SHARE) until it commits, and beats that
/// always overlapped would keep a take-over from ever getting the row. On SQLite a second
/// beat would only wait for the same file lock, and take a connection from the readers.
pub fn spawn_heartbeat(db: Db, tenure: Arc<Tenure>) -> tokio::task::JoinHandle<()> {
    let at_most = match db.dialect() {
        crate::db::Dialect::Sqlite => 1,
        crate::db::Dialect::Postgres => 2,
    };
    let stuck_after = TIMING.lease / 4;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(TIMING.beat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut in_flight = FuturesUnordered::new();
        // When each beat in flight was sent.
        let mut out_since: Vec<Instant> = Vec::with_capacity(at_most);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let all_stuck = out_since.iter().all(|sent| sent.elapsed() >= stuck_after);
                    if out_since.len() < at_most && all_stuck {
                        let sent = Instant::now();
                        out_since.push(sent);
                        in_flight.push(beat_once(db.clone(), Arc::clone(&tenure), sent));
                    }
                }
                Some((sent, answer)) = in_flight.next() => {
                    if let Some(index) = out_since.iter().position(|out| *out == sent) {
                        out_since.swap_remove(index);
                    }
                    match answer {
                        Some(Ok(true)) => tenure.confirm_from(sent),
                        Some(Ok(false)) => {
                            tenure.evict();
                            return;
                        }
                        Some(Err(err)) => {
                            tracing::warn!(error = %err, "could not confirm the store's stock authority; sales stop if this lasts {:?}", TIMING.lease)
                        }
                        None => tracing::warn!(
                            "the store did not answer an authority beat within the sales lease ({:?}); sales stop until a beat is confirmed",
                            TIMING.lease
                        ),
                    }
                }
            }
        }
    })
}

/// One beat, sent at `sent`: when it was sent, and the store's answer, or `None` if none
/// came within the sales lease.
async fn beat_once(
    db: Db,
    tenure: Arc<Tenure>,
    sent: Instant,
) -> (Instant, Option<Result<bool, DbError>>) {
    let beat = db.beat(tenure.admission());
    tokio::pin!(beat);
    let answer = match tokio::time::timeout(TIMING.beat * 2, &mut beat).await {
        Ok(answer) => Some(answer),
        Err(_) => {
            tracing::warn!(
                "the store is slow to answer an authority beat; sales stop if no beat is confirmed for {:?}",
                TIMING.lease
            );
            tokio::time::timeout_at((sent + TIMING.lease).into(), beat)
                .await
                .ok()
        }
    };
    (sent, answer)
}

/// This process, for people: host and pid.
pub fn instance_description() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}, pid {}", host.trim(), std::process::id())
}

/// How an instance takes its place at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Serve under the recorded authority, or become it if none is recorded (`serve`,
    /// `load`, `bench`).
    Establish,
    /// Become the authority (`serve --take-over-store`): if the current one is released,
    /// or, with `abandon` (`--abandon-old-authority`), whatever it holds.
    TakeOver {
        /// Take it although it was not released: its unstored orders are given up.
        abandon: bool,
    },
}

/// Why an instance may not use this store with its Redis.
#[derive(Debug, thiserror::Error)]
pub enum AuthorityError {
    /// The store's stock is sold from another Redis.
    #[error(
        "the store {database} belongs to another stock authority: its stock is sold from \
         {owner} (since {since}), and this instance would sell it from {ours}. Two Redis \
         counters for one stock oversell, so this is refused. If the setting is a mistake, \
         point this instance at {owner}. To move the store to {ours} on purpose: stop every \
         instance using {owner} with SIGTERM (they store every queued order before \
         exiting), then start one `flashsale serve --take-over-store` on {ours}",
        owner = owner.location,
        since = rfc3339(owner.since_ms)
    )]
    Foreign {
        /// The database, password masked.
        database: String,
        /// The authority the store records.
        owner: AuthorityRecord,
        /// Where this instance's Redis is.
        ours: String,
    },
    /// This Redis keeps the stock of this store for an authority the store does not
    /// record: the store was taken over by another Redis, or the database was restored
    /// or copied.
    #[error(
        "{ours} holds counters of the store {database} for another stock authority \
         ({marker}) than the one the store records ({owner} since {since}). The store was \
         taken over by {owner}, or the database was restored or copied, and these counters \
         are stale. Point this instance at {owner}, or, to move the store here on purpose, \
         stop every instance using {owner} with SIGTERM and start one `flashsale serve \
         --take-over-store` on {ours}",
        owner = owner.location,
        since = rfc3339(owner.since_ms)
    )]
    StaleRedis {
        /// The database, password masked.
        database: String,
        /// The authority the store records.
        owner: AuthorityRecord,
        /// The id this Redis holds.
        marker: String,
        /// Where this instance's Redis is.
        ours: String,
    },
    /// A take-over of an authority that was not released.
    #[error(
        "the store {database} is sold from {owner} (since {since}), which was not released: \
         its last instance has not stopped gracefully with every order stored, so its Redis \
         may hold orders SQL lacks, and taking the store over now would sell their units \
         again. Stop every instance using {owner} with SIGTERM (the last one stores every \
         queued order and releases the store); if they were killed, start one on {owner} and \
         stop it with SIGTERM. Only if {owner} is lost for good, add --abandon-old-authority: \
         orders it held that SQL lacks are then never stored (`flashsale reconcile` on it \
         lists them) and their units are sold again",
        owner = owner.location,
        since = rfc3339(owner.since_ms)
    )]
    NotReleased {
        /// The database, password masked.
        database: String,
        /// The authority the store records.
        owner: AuthorityRecord,
    },
    /// An abandoning take-over while instances still sell the store's stock.
    #[error(
        "the store {database} is still being sold: an instance ({instance}, under \
         {owner}) reported {ago:.1} s ago by the database's clock. Two authorities must never sell at once: stop \
         every instance with SIGTERM, and take over without --abandon-old-authority. An \
         instance that was killed is taken for gone after {silence} s of silence",
        owner = owner.location,
        ago = *ago_ms as f64 / 1000.0,
        silence = TIMING.silence.as_secs_f64()
    )]
    StillInUse {
        /// The database, password masked.
        database: String,
        /// The authority the store records.
        owner: AuthorityRecord,
        /// The instance most recently heard from.
        instance: String,
        /// How long ago it beat.
        ago_ms: i64,
    },
    /// Reading or writing the store failed.
    #[error(transparent)]
    Db(#[from] DbError),
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// Admits instance `instance` to the store with this Redis, as `claim` allows, and
/// returns its admission: what every write it makes carries.
///
/// `location` names this instance's Redis ([`redis_location`], [`embedded_location`]);
/// `database` names the store in errors.
pub async fn admit(
    db: &Db,
    conn: &mut distlock::Connection,
    location: &str,
    claim: Claim,
    instance: &str,
    database: &str,
) -> Result<Admission, AuthorityError> {
    let described = instance_description();
    let key = db.keyspace().authority();
    let refusal = Refusal { database, location };
    if let Claim::TakeOver { abandon } = claim {
        return take_over(db, conn, location, database, abandon, instance, &described).await;
    }
    let marker: Option<String> = conn.get(&key).await?;
    let (recorded, first_use) = match db.authority().await? {
        Some(recorded) => (recorded, false),
        // First use. A Redis that already holds an id for this namespace keeps it (a
        // database restored from before it recorded one): its counters are this store's.
        None => (
            AuthorityRecord {
                id: marker
                    .clone()
                    .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string()),
                location: location.to_owned(),
                since_ms: now_millis(),
                released: false,
            },
            true,
        ),
    };
    if !first_use {
        if let Some(refused) = refusal.refuses(&marker, &recorded) {
            return Err(refused);
        }
        if refusal.put_marker(conn, &key, &recorded).await? {
            tracing::warn!(authority = %recorded.location, "this Redis had no stock authority id for the store (it lost its data, or a take-over was cut short); put it there");
        }
    }
    let owner = match db.join(&recorded, first_use, instance, &described).await? {
        Joined::Admitted(admission) => {
            if first_use {
                let _: bool = refusal.put_marker(conn, &key, &recorded).await?;
                tracing::info!(authority = %recorded.location, "this Redis is now the store's stock authority");
            }
            return Ok(admission);
        }
        Joined::Moved(owner) => owner,
    };
    match owner {
        // Another instance recorded the store's first authority a moment before this one:
        // serve under it if this Redis is it (two instances of one fleet starting at once).
        Some(owner) if first_use => {
            if let Some(refused) = refusal.refuses(&marker, &owner) {
                return Err(refused);
            }
            let _: bool = refusal.put_marker(conn, &key, &owner).await?;
            match db.join(&owner, false, instance, &described).await? {
                Joined::Admitted(admission) => Ok(admission),
                Joined::Moved(moved) => Err(refusal.foreign(moved.unwrap_or(owner))),
            }
        }
        // Taken over between the check and now.
        owner => Err(refusal.foreign(owner.unwrap_or(recorded))),
    }
}

/// What a Redis is to the store, as `reconcile` finds it (it writes nothing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verified {
    /// The store records no authority yet.
    Unrecorded,
    /// This Redis is the store's authority (or is reached as it was recorded, its id lost
    /// with its data).
    Authority(AuthorityRecord),
    /// This Redis holds the id of another authority of this store than the one recorded:
    /// a former authority, taken over (its counters are stale, and its streams may hold
    /// orders it told buyers about that the store never got).
    Former {
        /// The id this Redis holds.
        marker: String,
        /// The authority the store records.
        owner: AuthorityRecord,
    },
}

/// What this Redis is to the store, for `reconcile`. A Redis that holds no id of the store
/// and is not reached as its authority was recorded is [`AuthorityError::Foreign`].
pub async fn verify(
    db: &Db,
    conn: &mut distlock::Connection,
    location: &str,
    database: &str,
) -> Result<Verified, AuthorityError> {
    let marker: Option<String> = conn.get(db.keyspace().authority()).await?;
    let Some(recorded) = db.authority().await? else {
        return Ok(Verified::Unrecorded);
    };
    let refusal = Refusal { database, location };
    match marker {
        Some(marker) if marker != recorded.id => Ok(Verified::Former {
            marker,
            owner: recorded,
        }),
        marker => match refusal.refuses(&marker, &recorded) {
            Some(refused) => Err(refused),
            None => Ok(Verified::Authority(recorded)),
        },
    }
}

/// The refusals of one instance's start: which store, which Redis.
struct Refusal<'a> {
    database: &'a str,
    location: &'a str,
}

impl Refusal<'_> {
    fn foreign(&self, owner: AuthorityRecord) -> AuthorityError {
        AuthorityError::Foreign {
            database: self.database.to_owned(),
            owner,
            ours: self.location.to_owned(),
        }
    }

    fn stale(&self, owner: AuthorityRecord, marker: String) -> AuthorityError {
        AuthorityError::StaleRedis {
            database: self.database.to_owned(),
            owner,
            marker,
            ours: self.location.to_owned(),
        }
    }

    /// Why this Redis, holding `marker`, may not serve `recorded`; `None` when it may: it
    /// holds its id, or holds none and is reached as the authority was recorded.
    fn refuses(
        &self,
        marker: &Option<String>,
        recorded: &AuthorityRecord,
    ) -> Option<AuthorityError> {
        match marker {
            Some(marker) if *marker == recorded.id => None,
            Some(marker) => Some(self.stale(recorded.clone(), marker.clone())),
            None if recorded.location != self.location => Some(self.foreign(recorded.clone())),
            None => None,
        }
    }

    /// Puts `recorded`'s id into this Redis if it has none (new, or lost with its data);
    /// returns whether it did.
    async fn put_marker(
        &self,
        conn: &mut distlock::Connection,
        key: &str,
        recorded: &AuthorityRecord,
    ) -> Result<bool, AuthorityError> {
        match confirm(conn, key, &recorded.id).await {
            Ok(put) => Ok(put),
            Err(ConfirmError::Redis(err)) => Err(AuthorityError::Redis(err)),
            Err(ConfirmError::Another(marker)) => Err(self.stale(recorded.clone(), marker)),
        }
    }
}

/// Why [`confirm`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ConfirmError {
    /// Redis holds another authority's id for this store.
    #[error("this Redis now serves another stock authority ({0}) for this store")]
    Another(String),
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// Checks, before stock is loaded, that this Redis holds authority `id` at `key`, and
/// puts it there if it has none (a new authority, or one that lost its data). Returns
/// whether it was put there.
pub async fn confirm(
    conn: &mut distlock::Connection,
    key: &str,
    id: &str,
) -> Result<bool, ConfirmError> {
    let set: bool = redis::cmd("SET")
        .arg(key)
        .arg(id)
        .arg("NX")
        .query_async::<Option<String>>(conn)
        .await?
        .is_some();
    if set {
        return Ok(true);
    }
    let held: Option<String> = conn.get(key).await?;
    match held {
        Some(held) if held != id => Err(ConfirmError::Another(held)),
        _ => Ok(false),
    }
}

/// Makes this Redis the store's authority and admits this instance under it, in one
/// transaction ([`Db::take_over`]): if the current authority is released (its last
/// instance stopped gracefully with every order stored), or `abandon` says to take it
/// regardless, and in both cases only once every instance of the current tenure has been
/// silent for the take-over silence, by the database's clock.
///
/// Then this Redis's id is set; what an earlier tenure left here (counters, order streams)
/// is set aside by the loader before the new tenure loads. A take-over cut short between
/// its commit and the id leaves the store recorded here and this Redis without an id (a
/// stale one was removed first): a plain start on this Redis then puts the id there (it
/// is reached as recorded), and its loader sets the earlier tenure's state aside.
async fn take_over(
    db: &Db,
    conn: &mut distlock::Connection,
    location: &str,
    database: &str,
    abandon: bool,
    instance: &str,
    described: &str,
) -> Result<Admission, AuthorityError> {
    let candidate = AuthorityRecord {
        id: uuid::Uuid::new_v4().simple().to_string(),
        location: location.to_owned(),
        since_ms: now_millis(),
        released: false,
    };
    // An id of an earlier tenure here is stale whatever happens next: without it, a
    // take-over cut short after it committed leaves a Redis that a plain start on it
    // takes for the authority (reached as recorded), instead of refusing it as stale.
    let key = db.keyspace().authority();
    let marker: Option<String> = conn.get(&key).await?;
    let current = db.authority().await?.map(|record| record.id);
    if marker.is_some() && marker != current {
        let () = conn.del(&key).await?;
    }
    let taken = db
        .take_over(&candidate, abandon, silence_ms(), instance, described)
        .await?;
    let (previous, admission) = match taken {
        TakeOver::Taken {
            previous,
            admission,
        } => (previous, admission),
        TakeOver::NotReleased(owner) => {
            return Err(AuthorityError::NotReleased {
                database: database.to_owned(),
                owner,
            })
        }
        TakeOver::StillInUse { owner, instance } => {
            return Err(AuthorityError::StillInUse {
                database: database.to_owned(),
                owner,
                instance: instance.described,
                ago_ms: instance.ago_ms,
            })
        }
    };
    crate::faults::stop_at(crate::faults::TAKEN_OVER);
    // This Redis's counters and order streams are an earlier tenure's: the loader sets
    // them aside before this tenure loads anything (`stock::StockLoader`), also when this
    // start is cut short here and the next one finishes it.
    let () = conn.set(&key, &candidate.id).await?;
    tracing::warn!(
        previous = previous.map(|p| p.location).unwrap_or_else(|| "none".into()),
        now = %candidate.location,
        abandon,
        epoch = admission.epoch,
        "took the store over: its counters here are rebuilt from SQL"
    );
    Ok(admission)
}

/// Where an instance's Redis is: the embedded mode's data directory, when it runs one,
/// or else its URL.
pub fn location(redis_url: &str, embedded_data_dir: Option<&std::path::Path>) -> String {
    match embedded_data_dir {
        Some(data_dir) => embedded_location(data_dir),
        None => redis_location(redis_url),
    }
}

/// How a Redis URL names its server and logical database, for comparing authorities:
/// credentials and options dropped, the host in lower case, the default port and
/// database made explicit. `redis://:pw@Cache:6379` is `redis://cache:6379/0`, and
/// `redis+unix:///run/redis.sock?db=2` is `unix:///run/redis.sock/2`. Sentinel and Cluster
/// URLs keep their hosts, path and `db`.
pub fn redis_location(url: &str) -> String {
    use redis::{ConnectionAddr, IntoConnectionInfo};
    if let Ok(info) = url.into_connection_info() {
        let db = info.redis_settings().db();
        return match info.addr() {
            ConnectionAddr::Tcp(host, port) => {
                format!("redis://{}:{port}/{db}", host.to_ascii_lowercase())
            }
            ConnectionAddr::TcpTls { host, port, .. } => {
                format!("rediss://{}:{port}/{db}", host.to_ascii_lowercase())
            }
            ConnectionAddr::Unix(path) => format!("unix://{}/{db}", path.display()),
            #[allow(unreachable_patterns)]
            other => format!("{other:?}/{db}"),
        };
    }
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let scheme = scheme.to_ascii_lowercase();
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let hosts = authority
        .rsplit_once('@')
        .map_or(authority, |(_, hosts)| hosts)
        .to_ascii_lowercase();
    let db = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("db="))
        .map(|db| format!("?db={db}"))
        .unwrap_or_default();
    format!("{scheme}://{hosts}{}{db}", path.trim_end_matches('/'))
}

/// How the embedded mode's private Redis is named: by its data directory and host.
fn embedded_location(data_dir: &std::path::Path) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!(
        "the embedded Redis of data directory {} on {}",
        data_dir.display(),
        host.trim()
    )
}

fn rfc3339(ms: i64) -> String {
    crate::model::format_millis(ms)
}

#[cfg(test)]
mod tests {
    use super::redis_location;

    #[test]
    fn a_redis_url_is_named_without_credentials_and_with_its_defaults() {
        for (url, location) in [
            ("redis://:pw@Cache:6379", "redis://cache:6379/0"),
            ("redis://cache", "redis://cache:6379/0"),
            (
                "redis://user:pw@cache:6380/2?protocol=resp3",
                "redis://cache:6380/2",
            ),
            ("rediss://cache:6379/", "rediss://cache:6379/0"),
            (
                "redis+sentinel://s1:26379,s2:26379/mymaster",
                "redis+sentinel://s1:26379,s2:26379/mymaster",
            ),
            (
                "redis+sentinel://u:pw@s1:26379/mymaster?db=3",
                "redis+sentinel://s1:26379/mymaster?db=3",
            ),
            ("redis+unix:///run/r.sock", "unix:///run/r.sock/0"),
            ("unix:///run/r.sock?db=2&pass=x", "unix:///run/r.sock/2"),
        ] {
            assert_eq!(redis_location(url), location, "{url}");
        }
        // A review found both unix-socket URLs of one server taken for one authority,
        // and sold a stock twice from its db 0 and db 1.
        for (a, b) in [
            ("redis://cache:6379/0", "redis://cache:6379/1"),
            ("redis+unix:///r.sock?db=0", "redis+unix:///r.sock?db=1"),
            ("unix:///r.sock", "unix:///r.sock?db=1"),
            ("redis+sentinel://s1/m", "redis+sentinel://s1/m?db=1"),
        ] {
            assert_ne!(redis_location(a), redis_location(b), "{a} vs {b}");
        }
    }
}
