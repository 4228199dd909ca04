//! The store's stock authority, its epoch, and the beats of the instances that sell under
//! it (see [`crate::authority`] for the rules they keep).
//!
//! The store fences itself:
//!
//! - **Every move is one transaction.** An instance's start ([`Db::join`]), a take-over
//!   ([`Db::take_over`]) and a release ([`Db::release`]) first lock the store row against
//!   every other move, then check what they found (the authority, the epoch, the beats)
//!   and move the epoch on. So of two moves at once, the second sees the first's outcome.
//! - **Every write carries its admission.** An instance is admitted at the epoch its start
//!   moved the store to. Each of its writes (orders, fenced sales, beats) first holds the
//!   store row shared and checks, in its own transaction, that the store still records its
//!   authority, unreleased, and that the current tenure began at or before its epoch
//!   ([`Db::begin_admitted`]). A move waits for writes in flight, and a write after a move
//!   that evicted its instance is refused however long that instance slept.
//! - **Time is the database's.** Beats and the silence a take-over waits for are read by
//!   the database's clock ([`Db::now_ms_sql`]), never an instance's.

use sqlx::any::AnyRow;
use sqlx::Row;

use super::{Db, DbError, Dialect};

/// The stock authority a store records (see [`crate::authority`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthorityRecord {
    /// The authority's id, also kept in its Redis.
    pub id: String,
    /// Where it is, for people: the Redis URL without credentials, or the embedded
    /// mode's data directory.
    pub location: String,
    /// Since when, Unix ms.
    pub since_ms: i64,
    /// Whether its last instance stopped gracefully with every order stored, so that a
    /// take-over may move the store.
    pub released: bool,
}

/// Where the store stands: its authority, its epoch, and the epoch at which the current
/// authority's tenure began.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreState {
    /// The authority it records; `None` until first used.
    pub authority: Option<AuthorityRecord>,
    /// Moved on by every start, take-over and release; only grows.
    pub epoch: i64,
    /// The epoch of the current tenure's first admission: instances admitted before it
    /// belong to an earlier tenure, and their writes are refused.
    pub tenure_epoch: i64,
    /// The current (or, released, the last) tenure's random id (`None` in a store from
    /// before tenures had ids).
    pub tenure_id: Option<String>,
    /// The tenure just before the current one, when it ended with a release.
    pub previous_tenure_id: Option<String>,
}

/// An instance's right to write to the store: the authority it sells under, the epoch it
/// was admitted at, and how many of its beats the store has confirmed. Every write
/// carries it. Clones share the count of beats.
#[derive(Debug, Clone)]
pub struct Admission {
    /// The instance's id in the store's beats.
    pub instance: String,
    /// The authority it sells under.
    pub authority: String,
    /// The epoch its start moved the store to.
    pub epoch: i64,
    /// The id of its authority's tenure: what its Redis's order streams must belong to
    /// (`stock::StockLoader`). Random, so a restore that takes the epoch back cannot make
    /// two tenures look alike.
    pub tenure: String,
    /// The beats the store confirmed, as the store counted them: a store whose count is
    /// below this was restored from a backup taken before the last of them.
    beats: std::sync::Arc<std::sync::atomic::AtomicI64>,
}

impl Admission {
    /// An admission the store has not recorded: for a process that only reads (a test's
    /// worker that never commits). The store refuses every write it carries.
    pub fn unrecorded(instance: &str) -> Admission {
        Admission::new(instance, "", 0, String::new())
    }

    fn new(instance: &str, authority: &str, epoch: i64, tenure: String) -> Admission {
        Admission {
            instance: instance.to_owned(),
            authority: authority.to_owned(),
            epoch,
            tenure,
            beats: Default::default(),
        }
    }

    /// How many beats the store has confirmed.
    pub fn beats(&self) -> i64 {
        self.beats.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// An instance that sells a store's stock, as its last beat recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveInstance {
    /// Host and process, for people.
    pub described: String,
    /// The authority it sells under.
    pub authority: String,
    /// How long ago it last beat, by the database's clock.
    pub ago_ms: i64,
}

/// What [`Db::join`] found.
#[derive(Debug, Clone)]
pub enum Joined {
    /// The instance is admitted.
    Admitted(Admission),
    /// The store records another authority than the one expected (`None`: none at all).
    Moved(Option<AuthorityRecord>),
}

/// What [`Db::take_over`] found.
#[derive(Debug, Clone)]
pub enum TakeOver {
    /// The store records the new authority, and this instance is admitted under it.
    Taken {
        /// The authority it replaced, if any.
        previous: Option<AuthorityRecord>,
        /// This instance's admission.
        admission: Admission,
    },
    /// The current authority was not released, and the take-over does not abandon it.
    NotReleased(AuthorityRecord),
    /// An instance of the current tenure beat within the silence.
    StillInUse {
        /// The authority it sells under.
        owner: AuthorityRecord,
        /// The instance most recently heard from.
        instance: LiveInstance,
    },
}

/// What [`Db::release`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Release {
    /// The store is released: a plain take-over may move it.
    Released,
    /// Another instance of this tenure beat within the silence.
    AnotherSells(LiveInstance),
    /// The store moved since the releasing instance looked (an instance started, or a
    /// take-over).
    Moved,
}

/// How long a move waits for the store row before it gives up (PostgreSQL). Longer than
/// the idle-in-transaction timeout that ends the transaction of a frozen instance.
const MOVE_LOCK_TIMEOUT: &str = "30s";

const STORE_STATE: &str = "SELECT authority, authority_location, authority_since, \
     authority_released, epoch, tenure_epoch, tenure_id, previous_tenure_id FROM store \
     WHERE id = 1";

type Tx = sqlx::Transaction<'static, sqlx::Any>;

impl Db {
    /// The database's clock, in Unix ms, as an SQL expression. Every instance's beat and
    /// every silence is measured by it, so no instance's clock can open a window.
    pub(crate) fn now_ms_sql(&self) -> &'static str {
        match self.dialect {
            // One host's clock: SQLite runs inside the processes of one machine.
            Dialect::Sqlite => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
            Dialect::Postgres => "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        }
    }

    /// A write transaction. On SQLite it takes the write lock at once (`BEGIN
    /// IMMEDIATE`): a transaction that read first and wrote later could fail on a snapshot
    /// another writer made stale.
    pub(crate) async fn begin_write(&self) -> Result<Tx, sqlx::Error> {
        match self.dialect {
            Dialect::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await,
            Dialect::Postgres => self.pool.begin().await,
        }
    }

    /// A write transaction of an instance admitted by `admission`, refused with
    /// [`DbError::Evicted`] if the store has moved past it. The store row stays locked
    /// against moves (shared on PostgreSQL, the write lock on SQLite) until the
    /// transaction ends, so the check holds for every write made in it.
    pub(crate) async fn begin_admitted(&self, admission: &Admission) -> Result<Tx, DbError> {
        let mut tx = self.begin_write().await?;
        let shared = match self.dialect {
            Dialect::Sqlite => "",
            Dialect::Postgres => " FOR SHARE",
        };
        // The instance's own row keeps the count of its beats: a count below what the
        // instance was told means the database was restored under it.
        let admitted = sqlx::query(&format!(
            "SELECT 1 AS admitted FROM store WHERE id = 1 AND authority = $1 \
             AND authority_released = 0 AND tenure_epoch <= $2 AND EXISTS (SELECT 1 FROM \
             store_instances WHERE id = $3 AND beats >= $4){shared}"
        ))
        .bind(admission.authority.as_str())
        .bind(admission.epoch)
        .bind(admission.instance.as_str())
        .bind(admission.beats())
        .fetch_optional(&mut *tx)
        .await?;
        if admitted.is_none() {
            return Err(DbError::Evicted {
                epoch: admission.epoch,
            });
        }
        Ok(tx)
    }

    /// A transaction holding the store row against every other move, and what it holds.
    async fn begin_move(&self) -> Result<(Tx, StoreState), DbError> {
        let mut tx = self.begin_write().await?;
        let exclusive = match self.dialect {
            Dialect::Sqlite => "",
            Dialect::Postgres => {
                sqlx::query(&format!("SET LOCAL lock_timeout = '{MOVE_LOCK_TIMEOUT}'"))
                    .execute(&mut *tx)
                    .await?;
                " FOR UPDATE"
            }
        };
        let row = sqlx::query(&format!("{STORE_STATE}{exclusive}"))
            .fetch_one(&mut *tx)
            .await?;
        Ok((tx, store_state(&row)?))
    }

    /// Where the store stands now.
    pub async fn store_state(&self) -> Result<StoreState, DbError> {
        let row = sqlx::query(STORE_STATE).fetch_one(&self.pool).await?;
        store_state(&row)
    }

    /// The stock authority this store records; `None` until the store is first used.
    pub async fn authority(&self) -> Result<Option<AuthorityRecord>, DbError> {
        Ok(self.store_state().await?.authority)
    }

    /// Admits instance `instance` (`described` for people) under authority `expected`,
    /// moving the store to a new epoch. A released store starts a new tenure. With
    /// `first_use`, a store that records no authority yet records `expected`.
    pub async fn join(
        &self,
        expected: &AuthorityRecord,
        first_use: bool,
        instance: &str,
        described: &str,
    ) -> Result<Joined, DbError> {
        let (mut tx, state) = self.begin_move().await?;
        let now = self.now_ms_sql();
        let new_tenure = match &state.authority {
            Some(current) if current.id == expected.id => current.released,
            None if first_use => {
                sqlx::query(&format!(
                    "UPDATE store SET authority = $1, authority_location = $2, \
                     authority_since = {now} WHERE id = 1"
                ))
                .bind(expected.id.as_str())
                .bind(expected.location.as_str())
                .execute(&mut *tx)
                .await?;
                true
            }
            other => return Ok(Joined::Moved(other.clone())),
        };
        let epoch = state.epoch + 1;
        let released = state
            .authority
            .as_ref()
            .is_some_and(|current| current.released);
        let (tenure_epoch, tenure, previous) = match state.tenure_id {
            Some(tenure) if !new_tenure => (state.tenure_epoch, tenure, state.previous_tenure_id),
            // A store from before tenures had ids names its tenure now.
            None if !new_tenure => (state.tenure_epoch, new_tenure_id(), None),
            ended => (epoch, new_tenure_id(), ended.filter(|_| released)),
        };
        sqlx::query(
            "UPDATE store SET epoch = $1, tenure_epoch = $2, tenure_id = $3, \
             previous_tenure_id = $4, authority_released = 0 WHERE id = 1",
        )
        .bind(epoch)
        .bind(tenure_epoch)
        .bind(tenure.as_str())
        .bind(previous.as_deref())
        .execute(&mut *tx)
        .await?;
        forget_earlier_tenures(&mut tx, tenure_epoch).await?;
        let admission = Admission::new(instance, &expected.id, epoch, tenure);
        self.record_instance(&mut tx, &admission, described).await?;
        tx.commit().await?;
        Ok(Joined::Admitted(admission))
    }

    /// Makes `candidate` the store's authority and admits instance `instance` under it, in
    /// one transaction: if the current authority is released, or `abandon` says to take
    /// it regardless; and in either case only once no instance of the current tenure has
    /// beaten for `silence_ms`, by the database's clock. The store is never seen released
    /// between the take-over and the admission, so a second take-over at the same moment
    /// finds this one selling.
    pub async fn take_over(
        &self,
        candidate: &AuthorityRecord,
        abandon: bool,
        silence_ms: i64,
        instance: &str,
        described: &str,
    ) -> Result<TakeOver, DbError> {
        let (mut tx, state) = self.begin_move().await?;
        if let Some(current) = &state.authority {
            if !current.released && !abandon {
                return Ok(TakeOver::NotReleased(current.clone()));
            }
            let live = self
                .heard_within(&mut tx, &current.id, state.tenure_epoch, silence_ms, "")
                .await?;
            if let Some(instance) = live {
                return Ok(TakeOver::StillInUse {
                    owner: current.clone(),
                    instance,
                });
            }
        }
        let epoch = state.epoch + 1;
        let tenure = new_tenure_id();
        // A tenure that ended with a release left everything stored; an abandoned one did not.
        let previous = state.tenure_id.clone().filter(|_| {
            state
                .authority
                .as_ref()
                .is_some_and(|current| current.released)
        });
        sqlx::query(&format!(
            "UPDATE store SET authority = $1, authority_location = $2, authority_since = {}, \
             authority_released = 0, epoch = $3, tenure_epoch = $3, tenure_id = $4, \
             previous_tenure_id = $5 WHERE id = 1",
            self.now_ms_sql()
        ))
        .bind(candidate.id.as_str())
        .bind(candidate.location.as_str())
        .bind(epoch)
        .bind(tenure.as_str())
        .bind(previous.as_deref())
        .execute(&mut *tx)
        .await?;
        forget_earlier_tenures(&mut tx, epoch).await?;
        let admission = Admission::new(instance, &candidate.id, epoch, tenure);
        self.record_instance(&mut tx, &admission, described).await?;
        tx.commit().await?;
        Ok(TakeOver::Taken {
            previous: state.authority,
            admission,
        })
    }

    /// Releases the store, which `admission`'s instance found at epoch `expected_epoch`
    /// with every order stored: if it is still at that epoch (no instance started, no
    /// take-over since) and no other instance of the tenure beat within `silence_ms`. The
    /// instance's beat is removed with it.
    pub async fn release(
        &self,
        admission: &Admission,
        expected_epoch: i64,
        silence_ms: i64,
    ) -> Result<Release, DbError> {
        let (mut tx, state) = self.begin_move().await?;
        let ours = state
            .authority
            .as_ref()
            .is_some_and(|current| current.id == admission.authority && !current.released);
        if !ours || state.tenure_epoch > admission.epoch {
            return Ok(Release::Moved);
        }
        let live = self
            .heard_within(
                &mut tx,
                &admission.authority,
                state.tenure_epoch,
                silence_ms,
                &admission.instance,
            )
            .await?;
        if let Some(instance) = live {
            return Ok(Release::AnotherSells(instance));
        }
        if state.epoch != expected_epoch {
            return Ok(Release::Moved);
        }
        sqlx::query(
            "UPDATE store SET authority_released = 1, epoch = $1, tenure_epoch = $1 \
             WHERE id = 1",
        )
        .bind(state.epoch + 1)
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM store_instances WHERE id = $1")
            .bind(admission.instance.as_str())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Release::Released)
    }

    /// The instance of `authority`'s tenure (admitted at `tenure_epoch` or later) other
    /// than `except` heard from most recently within `silence_ms`, if any.
    async fn heard_within(
        &self,
        conn: &mut sqlx::AnyConnection,
        authority: &str,
        tenure_epoch: i64,
        silence_ms: i64,
        except: &str,
    ) -> Result<Option<LiveInstance>, DbError> {
        let now = self.now_ms_sql();
        let row = sqlx::query(&format!(
            "SELECT described, authority, {now} - seen_at AS ago FROM store_instances \
             WHERE authority = $1 AND epoch >= $2 AND seen_at > {now} - $3 AND id <> $4 \
             ORDER BY seen_at DESC LIMIT 1"
        ))
        .bind(authority)
        .bind(tenure_epoch)
        .bind(silence_ms)
        .bind(except)
        .fetch_optional(&mut *conn)
        .await?;
        row.map(|row| {
            Ok(LiveInstance {
                described: row.try_get("described")?,
                authority: row.try_get("authority")?,
                ago_ms: row.try_get("ago")?,
            })
        })
        .transpose()
    }

    /// Another instance of `admission`'s tenure heard from within `silence_ms`, if any: a
    /// stopping instance looks before it walks every stream to see whether it may release.
    pub async fn another_instance_selling(
        &self,
        admission: &Admission,
        silence_ms: i64,
    ) -> Result<Option<LiveInstance>, DbError> {
        let tenure = self.store_state().await?.tenure_epoch;
        let mut conn = self.pool.acquire().await?;
        self.heard_within(
            &mut conn,
            &admission.authority,
            tenure,
            silence_ms,
            &admission.instance,
        )
        .await
    }

    async fn record_instance(
        &self,
        tx: &mut Tx,
        admission: &Admission,
        described: &str,
    ) -> Result<(), DbError> {
        sqlx::query(&format!(
            "INSERT INTO store_instances (id, described, authority, seen_at, epoch) \
             VALUES ($1, $2, $3, {}, $4)",
            self.now_ms_sql()
        ))
        .bind(admission.instance.as_str())
        .bind(described)
        .bind(admission.authority.as_str())
        .bind(admission.epoch)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    /// Records that `admission`'s instance still sells, by the database's clock, if the
    /// store still admits it ([`Db::begin_admitted`]: the store row held shared, so a beat
    /// never lands after a move that evicted its instance, and the instance's count of
    /// beats not behind what it was told); returns whether it does. The store counts the
    /// beat, and the instance learns the count: a database restored under it shows a
    /// smaller one (or no row) at its next beat or write.
    pub async fn beat(&self, admission: &Admission) -> Result<bool, DbError> {
        let mut tx = match self.begin_admitted(admission).await {
            Ok(tx) => tx,
            Err(DbError::Evicted { .. }) => return Ok(false),
            Err(err) => return Err(err),
        };
        let row = sqlx::query(&format!(
            "UPDATE store_instances SET seen_at = {}, beats = beats + 1 WHERE id = $1 \
             RETURNING beats",
            self.now_ms_sql()
        ))
        .bind(admission.instance.as_str())
        .fetch_one(&mut *tx)
        .await?;
        let beats: i64 = row.try_get("beats")?;
        tx.commit().await?;
        admission
            .beats
            .fetch_max(beats, std::sync::atomic::Ordering::SeqCst);
        Ok(true)
    }

    /// Removes instance `id`'s beat: it stopped selling.
    pub async fn leave(&self, id: &str) -> Result<(), DbError> {
        sqlx::query("DELETE FROM store_instances WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

/// A tenure id: random, never given twice.
fn new_tenure_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// Removes the beats of instances of tenures before the one beginning at `tenure_epoch`:
/// the store refuses them anyway. Rows of the current tenure stay until their instance
/// leaves (a killed one's stays silent), whatever the clock says: a clock that jumped
/// forward must not take a live instance's row away.
async fn forget_earlier_tenures(tx: &mut Tx, tenure_epoch: i64) -> Result<(), DbError> {
    sqlx::query("DELETE FROM store_instances WHERE epoch < $1")
        .bind(tenure_epoch)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

fn store_state(row: &AnyRow) -> Result<StoreState, DbError> {
    let id: Option<String> = row.try_get("authority")?;
    let authority = match id {
        Some(id) => Some(AuthorityRecord {
            id,
            location: row
                .try_get::<Option<String>, _>("authority_location")?
                .unwrap_or_default(),
            since_ms: row
                .try_get::<Option<i64>, _>("authority_since")?
                .unwrap_or_default(),
            released: row.try_get::<i32, _>("authority_released")? != 0,
        }),
        None => None,
    };
    Ok(StoreState {
        authority,
        epoch: row.try_get("epoch")?,
        tenure_epoch: row.try_get("tenure_epoch")?,
        tenure_id: row.try_get("tenure_id")?,
        previous_tenure_id: row.try_get("previous_tenure_id")?,
    })
}
