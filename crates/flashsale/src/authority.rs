//! One stock authority per SQL store.
//!
//! The stock of a store is sold from counters in one Redis: the authority. Two Redis
//! servers (an embedded instance's private one and a fleet's, two fleets' servers, or two
//! logical databases of one server) on one store would each load the whole stock from SQL
//! and each sell it: a review sold 100 orders for a stock of 50 that way. So the store
//! records its authority when it is first used, and every instance checks it at start.
//!
//! - **In SQL**, the `store` row names the authority: a random id, where it is (for
//!   people), and since when.
//! - **In Redis**, the authority keeps the same id under [`Keyspace::authority`]. A Redis
//!   that holds the id is the authority, whatever URL or host name reaches it.
//! - **A Redis without the id** is either the authority after it lost its data (a restart
//!   without persistence: the stock is then reloaded from SQL, as before) or another
//!   server. It is taken for the first only when it is reached the way the authority was
//!   recorded: the same URL (credentials left out), or the same embedded data directory.
//! - **Moving on purpose** is `serve --take-over-store`, and only from a *released*
//!   authority: its last instance stopped gracefully, with no other instance beating and
//!   every order event of the store's streams stored (`Service::shutdown`). The take-over
//!   records this Redis in one conditional statement, then clears this Redis's counters
//!   of the store's open coupons (rebuilt from SQL and its own streams). An old Redis lost
//!   for good is taken with `--abandon-old-authority`, once every instance has been
//!   silent for [`TAKEOVER_SILENCE`]; what it held that SQL lacks is lost.
//! - **Never two at once.** Every instance beats in the store every [`BEAT_EVERY`] and
//!   removes its beat when it stops gracefully; it sells only while its last beat
//!   confirmed its authority within [`SALES_LEASE`], shorter than that silence, checked
//!   when a purchase arrives and again right before its write. So an instance frozen
//!   (SIGSTOP, a VM pause) past an abandoning take-over sells nothing when it wakes: its
//!   next beat finds the store moved, and it stops without storing its backlog.
//! - **A Redis behind SQL** (a restored backup, a copied data directory) keeps the id but
//!   not the sales since: each start repairs its counters (`stock::repair_stock`).
//!
//! [`Keyspace::authority`]: crate::keys::Keyspace::authority

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use crate::db::{AuthorityRecord, Db, DbError, LiveInstance};
use crate::model::now_millis;

/// How often an instance records that it sells under its authority, and checks that the
/// store still records it.
pub const BEAT_EVERY: Duration = Duration::from_millis(500);
/// An instance sells only while its authority was confirmed this recently. A store that
/// cannot be written for this long stops its sales (503 `unavailable`, nothing sold).
pub const SALES_LEASE: Duration = Duration::from_secs(10);
/// A take-over waits until every instance has been silent this long (or stopped
/// gracefully): longer than [`SALES_LEASE`], with room for clocks that differ by seconds.
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
    // A silent instance may have sent a write just before it went silent: the silence
    // outlasts that write's fence, so it has landed or never will before a take-over.
    let fence = timing.beat + crate::model::WRITE_WINDOW + crate::model::CLOCK_GRACE;
    Timing {
        silence: timing.silence.max(fence),
        ..timing
    }
});

/// This instance's hold on the store's authority: whether it may sell now.
#[derive(Debug)]
pub struct Tenure {
    since: Instant,
    /// When the authority was last confirmed, in ms after `since`.
    confirmed_ms: AtomicU64,
    /// The store records another authority now.
    moved: AtomicBool,
}

impl Tenure {
    /// A tenure confirmed now.
    pub fn new() -> Arc<Tenure> {
        Arc::new(Tenure {
            since: Instant::now(),
            confirmed_ms: AtomicU64::new(0),
            moved: AtomicBool::new(false),
        })
    }

    fn confirm(&self) {
        let ms = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.confirmed_ms.fetch_max(ms, Ordering::SeqCst);
    }

    /// Whether the store was found to record another authority.
    pub fn moved(&self) -> bool {
        self.moved.load(Ordering::SeqCst)
    }

    /// Whether this instance may sell: its authority was confirmed within
    /// [`SALES_LEASE`] and has not moved.
    pub fn may_sell(&self) -> bool {
        let confirmed =
            self.since + Duration::from_millis(self.confirmed_ms.load(Ordering::SeqCst));
        !self.moved() && confirmed.elapsed() < TIMING.lease
    }
}

/// Beats for instance `instance` under authority `authority` every [`BEAT_EVERY`] until
/// aborted, confirming `tenure`; stops once the store records another authority.
pub fn spawn_heartbeat(
    db: Db,
    authority: String,
    instance: String,
    tenure: Arc<Tenure>,
) -> tokio::task::JoinHandle<()> {
    let described = instance_description();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(TIMING.beat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let beat = db.beat(&instance, &described, &authority, now_millis());
            match tokio::time::timeout(TIMING.beat * 2, beat).await {
                Ok(Ok(true)) => tenure.confirm(),
                Ok(Ok(false)) => {
                    tenure.moved.store(true, Ordering::SeqCst);
                    tracing::error!("the store records another stock authority now (a take-over): this instance stops selling");
                    let _ = db.leave(&instance).await;
                    return;
                }
                Ok(Err(err)) => {
                    tracing::warn!(error = %err, "could not confirm the store's stock authority; sales stop if this lasts {SALES_LEASE:?}")
                }
                Err(_) => tracing::warn!(
                    "the store did not answer the authority beat in time; sales stop if this lasts {SALES_LEASE:?}"
                ),
            }
        }
    })
}

/// This process, for people: host and pid.
fn instance_description() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}, pid {}", host.trim(), std::process::id())
}

/// What an instance may do about the store's authority at start.
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
    /// Check only, write nothing (`reconcile`).
    Verify,
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
         orders it held that SQL lacks are then lost and their units sold again",
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
         {owner}) reported {ago:.1} s ago. Two authorities must never sell at once: stop \
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

/// Settles which authority this instance serves under, as `claim` allows, and returns
/// it; `None` only for [`Claim::Verify`] on a store that records none yet.
///
/// `location` names this instance's Redis ([`redis_location`], [`embedded_location`]);
/// `database` names the store in errors.
pub async fn establish(
    db: &Db,
    conn: &mut distlock::Connection,
    location: &str,
    claim: Claim,
    database: &str,
) -> Result<Option<AuthorityRecord>, AuthorityError> {
    if let Claim::TakeOver { abandon } = claim {
        take_over(db, conn, location, database, abandon).await?;
    }
    let Some(recorded) = resolve(db, conn, location, claim, database).await? else {
        return Ok(None);
    };
    if claim != Claim::Verify && !db.occupy_authority(&recorded.id).await? {
        // Taken over between the check and now.
        let owner = db.authority().await?.unwrap_or(recorded);
        return Err(AuthorityError::Foreign {
            database: database.to_owned(),
            owner,
            ours: location.to_owned(),
        });
    }
    Ok(Some(recorded))
}

/// Which authority this Redis serves for the store, as `claim` allows.
async fn resolve(
    db: &Db,
    conn: &mut distlock::Connection,
    location: &str,
    claim: Claim,
    database: &str,
) -> Result<Option<AuthorityRecord>, AuthorityError> {
    let key = db.keyspace().authority();
    let marker: Option<String> = conn.get(&key).await?;
    let mut first_use = false;
    let recorded = match db.authority().await? {
        Some(recorded) => recorded,
        None if claim == Claim::Verify => return Ok(None),
        None => {
            // First use. A Redis that already holds an id for this namespace keeps it (a
            // database restored from before it recorded one): its counters are this
            // store's.
            let ours = AuthorityRecord {
                id: marker
                    .clone()
                    .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string()),
                location: location.to_owned(),
                since_ms: now_millis(),
                released: false,
            };
            let recorded = db.record_first_authority(&ours).await?;
            first_use = recorded.id == ours.id;
            recorded
        }
    };
    match marker {
        Some(marker) if marker == recorded.id => Ok(Some(recorded)),
        Some(marker) => Err(AuthorityError::StaleRedis {
            database: database.to_owned(),
            owner: recorded,
            marker,
            ours: location.to_owned(),
        }),
        None if recorded.location != location => Err(AuthorityError::Foreign {
            database: database.to_owned(),
            owner: recorded,
            ours: location.to_owned(),
        }),
        // Reached as the authority was recorded: it is the authority, and its id is new or
        // was lost with its data. Reconcile writes nothing.
        None if claim == Claim::Verify => Ok(Some(recorded)),
        None => {
            let put = confirm(conn, &key, &recorded.id)
                .await
                .map_err(|err| match err {
                    ConfirmError::Redis(err) => AuthorityError::Redis(err),
                    ConfirmError::Another(marker) => AuthorityError::StaleRedis {
                        database: database.to_owned(),
                        owner: recorded.clone(),
                        marker,
                        ours: location.to_owned(),
                    },
                })?;
            if first_use {
                tracing::info!(authority = %recorded.location, "this Redis is now the store's stock authority");
            } else if put {
                tracing::warn!(authority = %recorded.location, "this Redis had lost the store's stock authority id with its data; put it back");
            }
            Ok(Some(recorded))
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

/// Makes this Redis the store's authority, if the current one is released (its last
/// instance stopped gracefully with every order stored) or `abandon` says to take it
/// regardless, once every instance has been silent for the take-over silence.
///
/// The store records this Redis first, in one conditional statement, so of two take-overs
/// at once, or a take-over and a start of the old authority, only one wins. Then the
/// store's counters in this Redis are cleared, to be rebuilt from SQL and its own streams,
/// and its id is set. A take-over cut short between the two leaves the store recorded
/// and released: a start on this Redis is then refused or repaired at start, and the
/// take-over can simply be run again.
async fn take_over(
    db: &Db,
    conn: &mut distlock::Connection,
    location: &str,
    database: &str,
    abandon: bool,
) -> Result<(), AuthorityError> {
    let now = now_millis();
    let previous = db.authority().await?;
    if let Some(previous) = previous.as_ref().filter(|previous| !previous.released) {
        if !abandon {
            return Err(AuthorityError::NotReleased {
                database: database.to_owned(),
                owner: previous.clone(),
            });
        }
        if let Some(instance) = an_instance_still_selling(db).await? {
            return Err(AuthorityError::StillInUse {
                database: database.to_owned(),
                owner: previous.clone(),
                instance: instance.described,
                ago_ms: now - instance.seen_ms,
            });
        }
    }
    let ours = AuthorityRecord {
        id: uuid::Uuid::new_v4().simple().to_string(),
        location: location.to_owned(),
        since_ms: now,
        released: true,
    };
    if !db.take_over_authority(&ours, abandon).await? {
        let owner = db.authority().await?.unwrap_or(ours);
        return Err(AuthorityError::NotReleased {
            database: database.to_owned(),
            owner,
        });
    }
    // Coupons whose sale ended keep their counters: nothing sells them any more.
    for coupon in db.coupons_ending_after(now).await? {
        let keys = db.keyspace().coupon(coupon.id);
        let () = conn.del(&[&keys.stock, &keys.buyers, &keys.claims]).await?;
    }
    let () = conn.set(db.keyspace().authority(), &ours.id).await?;
    tracing::warn!(
        previous = previous.map(|p| p.location).unwrap_or_else(|| "none".into()),
        now = %ours.location,
        abandon,
        "took over the store's stock: its counters here are rebuilt from SQL"
    );
    Ok(())
}

/// An instance that beat within the take-over silence, if any: the store is still sold.
pub async fn an_instance_still_selling(db: &Db) -> Result<Option<LiveInstance>, DbError> {
    let now = now_millis();
    let silence = i64::try_from(TIMING.silence.as_millis()).unwrap_or(i64::MAX);
    Ok(db
        .live_instances(now - silence, now)
        .await?
        .into_iter()
        .next())
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
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|at| at.format(&Rfc3339).ok())
        .unwrap_or_else(|| ms.to_string())
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
