//! The SQL store: coupons and orders, on SQLite or PostgreSQL through sqlx's Any driver.
//!
//! Every query is written once, in the SQL both databases accept (numbered `$n`
//! parameters, `RETURNING`, `ON CONFLICT DO NOTHING`). Only the migrations differ, in how
//! a table gets an identity column.

use std::str::FromStr;
use std::time::Duration;

use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::migrate::Migrator;
use sqlx::{AnyPool, Connection, Row};

use crate::keys::Keyspace;
use crate::model::{parse_order_id, unix_millis, Coupon, NewCoupon, Order, OrderEvent};

mod authority;
mod fenced_sale;
pub mod sqlite_lock;
pub use authority::{
    Admission, AuthorityRecord, Joined, LiveInstance, Release, StoreState, TakeOver,
};
pub use fenced_sale::{FencedCommitError, FencedSale};

static SQLITE_MIGRATIONS: Migrator = sqlx::migrate!("migrations/sqlite");
static POSTGRES_MIGRATIONS: Migrator = sqlx::migrate!("migrations/postgres");

/// One order by id, found through the primary key the id names (`c{coupon}-u{user}-…`):
/// the id column has no index, and a lookup by it alone scans the table.
pub(crate) const ORDER_BY_ID: &str =
    "SELECT id, coupon_id, user_id, created_at, stored_at FROM orders \
     WHERE coupon_id = $1 AND user_id = $2 AND id = $3";

/// Every SQLite connection's settings. Write-ahead logging: a commit is one append and
/// one fsync of the log instead of a rollback journal's several, which is what a sale of
/// the `lock` strategy pays inside its lock; and readers (health checks, lookups) no
/// longer wait for a writer. `synchronous = FULL` keeps every commit durable across a
/// power loss, as a 201 promises. The busy timeout is sqlx's, made explicit.
const SQLITE_SETUP: &str =
    "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA busy_timeout = 5000";

/// Every PostgreSQL connection's settings. A transaction left idle this long is ended by
/// the server: an instance frozen (SIGSTOP, a VM pause) inside one would otherwise hold
/// its row locks, and the store row's shared lock that every write takes
/// (`Db::begin_admitted`), until it woke, and no take-over could move the store meanwhile.
const POSTGRES_SETUP: &str = "SET idle_in_transaction_session_timeout = '10s'";

/// How long a query may wait for a pooled connection before it fails.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// Which database a URL points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// `sqlite:` URLs.
    Sqlite,
    /// `postgres:` and `postgresql:` URLs.
    Postgres,
}

impl Dialect {
    /// The dialect of `url`, or `None` for a scheme this service does not support.
    pub fn of_url(url: &str) -> Option<Dialect> {
        let scheme = url.split_once(':')?.0.to_ascii_lowercase();
        match scheme.as_str() {
            "sqlite" => Some(Dialect::Sqlite),
            "postgres" | "postgresql" => Some(Dialect::Postgres),
            _ => None,
        }
    }
}

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// The URL's scheme is neither SQLite nor PostgreSQL.
    #[error("unsupported database URL {url:?}: use sqlite://PATH or postgres://USER@HOST/DB")]
    UnsupportedUrl {
        /// The URL, with any password masked.
        url: String,
    },
    /// Connecting failed (bad URL, unreachable server, refused credentials).
    #[error("cannot connect to the database at {url}: {source}")]
    Connect {
        /// The URL, with any password masked.
        url: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// There is no flashsale store at the URL: no such file, or no schema in it. Only
    /// `serve` creates a store.
    #[error("no flashsale store at {url}: {reason}; `flashsale serve` creates one")]
    NoStore {
        /// The URL, with any password masked.
        url: String,
        /// What is missing.
        reason: String,
    },
    /// The migrations failed.
    #[error("database migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A query failed.
    #[error("database query failed: {0}")]
    Query(#[from] sqlx::Error),
    /// The store has moved past this instance's admission (a take-over or a release since
    /// it started), or went back in time under it (restored from a backup): the write was
    /// refused in its own transaction, and nothing was stored.
    #[error(
        "the store refused this instance's write: it was admitted at epoch {epoch}, and the \
         store has since been taken over or released, or restored from a backup"
    )]
    Evicted {
        /// The epoch the instance was admitted at.
        epoch: i64,
    },
}

/// What [`Db::store_orders`] did with a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoredOrders {
    /// Orders stored.
    pub inserted: u64,
    /// Orders refused as beyond their coupon's stock (kept in `orders_refused`).
    pub refused: u64,
}

/// A pool of connections to the store, cheap to clone.
#[derive(Debug, Clone)]
pub struct Db {
    pool: AnyPool,
    dialect: Dialect,
    keyspace: Keyspace,
}

/// The file a `sqlite:` URL names; `None` for another scheme or an in-memory database.
pub fn sqlite_path(url: &str) -> Option<std::path::PathBuf> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))?;
    let path = rest.split('?').next().unwrap_or_default();
    let path = percent_decode(path);
    (!path.is_empty() && path != ":memory:").then(|| std::path::PathBuf::from(path))
}

/// Decodes `%XX` escapes, as sqlx does for a SQLite URL's path; a malformed escape is
/// kept as it is.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|pair| std::str::from_utf8(pair).ok())
            .and_then(|pair| u8::from_str_radix(pair, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `user:password@` becomes `user:***@`, so URLs can go into errors and logs.
pub fn mask_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((credentials, host)) => match credentials.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host}{path}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

impl Db {
    /// Connects to `url` and runs the migrations, creating the store if it is new: what
    /// `serve` does.
    ///
    /// A `sqlite:` file is created if missing (`mode=rwc` is added unless the URL sets a
    /// mode).
    pub async fn connect(url: &str) -> Result<Db, DbError> {
        Db::open(url, true).await
    }

    /// Connects to the store at `url`, which must exist and hold the schema
    /// ([`DbError::NoStore`] otherwise), and runs any newer migrations: what every
    /// command but `serve` does, so that a typo in a path is an error, not a new, empty
    /// store that "adds up".
    pub async fn open_existing(url: &str) -> Result<Db, DbError> {
        Db::open(url, false).await
    }

    async fn open(url: &str, create: bool) -> Result<Db, DbError> {
        sqlx::any::install_default_drivers();
        let masked = mask_password(url);
        let dialect = Dialect::of_url(url).ok_or(DbError::UnsupportedUrl {
            url: masked.clone(),
        })?;
        let no_store = |reason: String| DbError::NoStore {
            url: masked.clone(),
            reason,
        };
        if let (false, Some(path)) = (create, sqlite_path(url)) {
            if !path.is_file() {
                return Err(no_store(format!("{} is not a file", path.display())));
            }
        }
        let url = match dialect {
            Dialect::Sqlite if !url.contains("mode=") => {
                let mode = if create { "rwc" } else { "rw" };
                let separator = if url.contains('?') { '&' } else { '?' };
                format!("{url}{separator}mode={mode}")
            }
            _ => url.to_owned(),
        };
        // One direct connection first: the pool retries a refused connection until its
        // acquire timeout and then reports only "pool timed out", where this reports the
        // cause (a malformed URL, a refused connection, bad credentials).
        let options =
            sqlx::any::AnyConnectOptions::from_str(&url).map_err(|source| DbError::Connect {
                url: masked.clone(),
                source,
            })?;
        let mut probe =
            tokio::time::timeout(ACQUIRE_TIMEOUT, sqlx::AnyConnection::connect_with(&options))
                .await
                .unwrap_or(Err(sqlx::Error::PoolTimedOut))
                .map_err(|source| DbError::Connect {
                    url: masked.clone(),
                    source,
                })?;
        // Read before anything is written (the pool's connections switch SQLite to WAL):
        // a command refused for want of a store must leave the file as it found it, and a
        // file that is not a database must say so, not time the pool out.
        let schema = sqlx::query("SELECT namespace FROM store WHERE id = 1")
            .fetch_optional(&mut probe)
            .await;
        match schema {
            Ok(Some(_)) => {}
            Ok(None) if !create => {
                return Err(no_store("its store row is missing".to_owned()));
            }
            Err(err) if !create => {
                return Err(no_store(format!("it holds no flashsale schema ({err})")));
            }
            // A new store: readable (an empty database), or the migrations create it.
            Ok(None) => {}
            Err(_) => {
                if let Err(source) = sqlx::query("SELECT 1").fetch_optional(&mut probe).await {
                    return Err(DbError::Connect {
                        url: masked.clone(),
                        source,
                    });
                }
                if dialect == Dialect::Sqlite {
                    // An unreadable file fails here rather than in every pooled connection.
                    let readable = sqlx::query("SELECT count(*) AS n FROM sqlite_master")
                        .fetch_one(&mut probe)
                        .await;
                    if let Err(source) = readable {
                        return Err(DbError::Connect {
                            url: masked.clone(),
                            source,
                        });
                    }
                }
            }
        }
        probe.close().await.map_err(DbError::Query)?;
        // SQLite allows one writer at a time; more connections would only queue on its lock.
        let max_connections = match dialect {
            Dialect::Sqlite => 4,
            Dialect::Postgres => 16,
        };
        let pool = AnyPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .after_connect(move |connection, _| {
                Box::pin(async move {
                    let setup = match dialect {
                        Dialect::Sqlite => SQLITE_SETUP,
                        Dialect::Postgres => POSTGRES_SETUP,
                    };
                    sqlx::query(setup).execute(connection).await?;
                    Ok(())
                })
            })
            .connect(&url)
            .await
            .map_err(|source| DbError::Connect {
                url: masked.clone(),
                source,
            })?;
        let migrator = match dialect {
            Dialect::Sqlite => &SQLITE_MIGRATIONS,
            Dialect::Postgres => &POSTGRES_MIGRATIONS,
        };
        // Two instances starting at once on a new SQLite file race to create the schema (on
        // PostgreSQL sqlx serializes them with an advisory lock): the loser's migration
        // fails on a table the winner just made. Running them again finds them applied.
        let mut attempts = 0;
        loop {
            match migrator.run(&pool).await {
                Ok(()) => break,
                Err(_) if dialect == Dialect::Sqlite && attempts < 10 => {
                    attempts += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(err) => return Err(err.into()),
            }
        }
        let row = sqlx::query("SELECT namespace FROM store WHERE id = 1")
            .fetch_one(&pool)
            .await?;
        let keyspace = Keyspace::new(&row.try_get::<String, _>("namespace")?);
        Ok(Db {
            pool,
            dialect,
            keyspace,
        })
    }

    /// The `n`th bind parameter. Every query is written with `$n`, which both accept; the
    /// bulk insert uses SQLite's anonymous `?`, because SQLite resolves each named
    /// parameter by a scan of all of them, which made a 1,000-parameter insert quadratic.
    fn placeholder(&self, n: usize) -> String {
        match self.dialect {
            Dialect::Sqlite => "?".to_owned(),
            Dialect::Postgres => format!("${n}"),
        }
    }

    /// The Redis key names of this store's data, from its namespace.
    pub fn keyspace(&self) -> &Keyspace {
        &self.keyspace
    }

    /// Which database this is.
    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// PostgreSQL: takes a session-level advisory lock on this store (keyed by its
    /// namespace) on a connection of its own, held for as long as that connection lives.
    /// `None` when another session holds it. An embedded instance holds its database this
    /// way, as it holds a SQLite file with a lock file.
    pub async fn lock_exclusively(&self) -> Result<Option<sqlx::AnyConnection>, DbError> {
        let key = i64::from_str_radix(
            self.keyspace
                .namespace()
                .get(..15)
                .unwrap_or(self.keyspace.namespace()),
            16,
        )
        .unwrap_or(0);
        let mut connection = self.pool.acquire().await?.detach();
        let held: bool = sqlx::query("SELECT pg_try_advisory_lock($1) AS held")
            .bind(key)
            .fetch_one(&mut connection)
            .await?
            .try_get("held")?;
        Ok(held.then_some(connection))
    }

    /// Closes every connection.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// One round trip, for health checks.
    pub async fn ping(&self) -> Result<(), DbError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// Proves the database takes writes, by updating its one health row: a locked SQLite
    /// file or a read-only replica answers `ping` but fails this.
    pub async fn check_writable(&self, now_ms: i64) -> Result<(), DbError> {
        sqlx::query("UPDATE health SET checked_at = $1 WHERE id = 1")
            .bind(now_ms)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Stores a validated coupon and returns it with its id.
    pub async fn create_coupon(&self, coupon: &NewCoupon, now_ms: i64) -> Result<Coupon, DbError> {
        let starts_at = unix_millis(coupon.starts_at);
        let ends_at = unix_millis(coupon.ends_at);
        let title = coupon.title.trim();
        let row = sqlx::query(
            "INSERT INTO coupons (title, stock, price, starts_at, ends_at, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
        )
        .bind(title)
        .bind(coupon.stock)
        .bind(coupon.price)
        .bind(starts_at)
        .bind(ends_at)
        .bind(now_ms)
        .fetch_one(&self.pool)
        .await?;
        Ok(Coupon {
            id: row.try_get("id")?,
            title: title.to_owned(),
            stock: coupon.stock,
            price: coupon.price,
            starts_at,
            ends_at,
            created_at: now_ms,
        })
    }

    /// The coupon with this id, if any.
    pub async fn coupon(&self, id: i64) -> Result<Option<Coupon>, DbError> {
        let row = sqlx::query(
            "SELECT id, title, stock, price, starts_at, ends_at, created_at FROM coupons \
             WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|row| coupon_from_row(&row)).transpose()
    }

    /// Coupons whose sale ends after `after_ms`, oldest first.
    pub async fn coupons_ending_after(&self, after_ms: i64) -> Result<Vec<Coupon>, DbError> {
        let rows = sqlx::query(
            "SELECT id, title, stock, price, starts_at, ends_at, created_at FROM coupons \
             WHERE ends_at > $1 ORDER BY id",
        )
        .bind(after_ms)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(coupon_from_row).collect()
    }

    /// The users with a stored order for this coupon, each with that order's id.
    pub async fn buyers(&self, coupon_id: i64) -> Result<Vec<(i64, String)>, DbError> {
        let rows = sqlx::query("SELECT user_id, id FROM orders WHERE coupon_id = $1")
            .bind(coupon_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| Ok((row.try_get::<i64, _>("user_id")?, row.try_get("id")?)))
            .collect()
    }

    /// How many orders are stored for this coupon.
    pub async fn order_count(&self, coupon_id: i64) -> Result<i64, DbError> {
        let row = sqlx::query("SELECT COUNT(*) AS n FROM orders WHERE coupon_id = $1")
            .bind(coupon_id)
            .fetch_one(&self.pool)
            .await?;
        Ok(row.try_get("n")?)
    }

    /// How many users hold more than one order of this coupon. The unique constraint keeps
    /// this at 0; the load generator reports it to prove so.
    pub async fn users_with_several_orders(&self, coupon_id: i64) -> Result<i64, DbError> {
        let row = sqlx::query(
            "SELECT COUNT(*) AS n FROM (SELECT user_id FROM orders WHERE coupon_id = $1 \
             GROUP BY user_id HAVING COUNT(*) > 1) AS repeated",
        )
        .bind(coupon_id)
        .fetch_one(&self.pool)
        .await?;
        Ok(row.try_get("n")?)
    }

    /// A user's orders, newest first.
    pub async fn user_orders(&self, user_id: i64) -> Result<Vec<Order>, DbError> {
        self.orders_where("user_id", user_id).await
    }

    /// One stored order by id; `None` for an id that is not an order id.
    pub async fn order(&self, order_id: &str) -> Result<Option<Order>, DbError> {
        let Some((coupon_id, user_id)) = parse_order_id(order_id) else {
            return Ok(None);
        };
        let row = sqlx::query(ORDER_BY_ID)
            .bind(coupon_id)
            .bind(user_id)
            .bind(order_id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(order_from_row).transpose()
    }

    /// A coupon's stored orders, oldest first.
    pub async fn coupon_orders(&self, coupon_id: i64) -> Result<Vec<Order>, DbError> {
        let mut orders = self.orders_where("coupon_id", coupon_id).await?;
        orders.reverse();
        Ok(orders)
    }

    /// The orders whose `column` (a fixed column name, never user input) is `value`,
    /// newest first.
    async fn orders_where(&self, column: &'static str, value: i64) -> Result<Vec<Order>, DbError> {
        let rows = sqlx::query(&format!(
            "SELECT id, coupon_id, user_id, created_at, stored_at FROM orders \
             WHERE {column} = $1 ORDER BY created_at DESC, id"
        ))
        .bind(value)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(order_from_row).collect()
    }

    /// Stores a batch of orders in one transaction, never beyond a coupon's stock, and
    /// says how many were new and how many were refused.
    ///
    /// An order already stored, or a second order of the same user for the same coupon,
    /// is skipped rather than failing the batch: the worker may see an event again after a
    /// crash between commit and acknowledgement, and that must be harmless. An order beyond
    /// its coupon's stock (`coupon_sales` counts the units sold, in the same transaction
    /// as every order) is not stored but kept in `orders_refused`, oldest first stored:
    /// Redis counted a unit that was gone (a Redis put back to an earlier state), and its
    /// buyer was told 201, so `reconcile` lists it.
    ///
    /// `admission` is the storing instance's: if the store has moved past it (taken over
    /// or released since the instance started), nothing is stored and the answer is
    /// [`DbError::Evicted`].
    pub async fn store_orders(
        &self,
        admission: &Admission,
        orders: &[OrderEvent],
        now_ms: i64,
    ) -> Result<StoredOrders, DbError> {
        let mut tx = self.begin_admitted(admission).await?;
        let mut stored = StoredOrders::default();
        let mut coupons: Vec<i64> = orders.iter().map(|order| order.coupon_id).collect();
        coupons.sort_unstable();
        coupons.dedup();
        for coupon in coupons {
            let batch: Vec<&OrderEvent> = orders
                .iter()
                .filter(|order| order.coupon_id == coupon)
                .collect();
            let room = self.units_left(&mut tx, coupon).await?;
            let fresh = self.new_buyers(&mut tx, coupon, &batch).await?;
            let (accepted, refused) = fresh.split_at(fresh.len().min(room));
            let inserted = self
                .insert_orders(&mut tx, "orders", accepted, now_ms)
                .await?;
            sqlx::query("UPDATE coupon_sales SET sold = sold + $1 WHERE coupon_id = $2")
                .bind(i64::try_from(inserted).unwrap_or(i64::MAX))
                .bind(coupon)
                .execute(&mut *tx)
                .await?;
            if !refused.is_empty() {
                self.insert_orders(&mut tx, "orders_refused", refused, now_ms)
                    .await?;
                tracing::error!(
                    coupon,
                    refused = refused.len(),
                    "orders beyond the coupon's stock were refused by the store (Redis \
                     counted units that were sold already: was it put back to an earlier \
                     state?); their buyers were told 201, and `flashsale reconcile` lists them"
                );
            }
            stored.inserted += inserted;
            stored.refused += refused.len() as u64;
        }
        tx.commit().await?;
        Ok(stored)
    }

    /// The units coupon `coupon` has left by the store's own count, its counter row
    /// locked (PostgreSQL) until the transaction ends, so two batches at once cannot both
    /// take the last ones. A coupon that is not in the store has none.
    async fn units_left(
        &self,
        tx: &mut sqlx::Transaction<'static, sqlx::Any>,
        coupon: i64,
    ) -> Result<usize, DbError> {
        sqlx::query(
            "INSERT INTO coupon_sales (coupon_id, sold) SELECT id, 0 FROM coupons WHERE id = $1 \
             ON CONFLICT (coupon_id) DO NOTHING",
        )
        .bind(coupon)
        .execute(&mut **tx)
        .await?;
        let lock = match self.dialect {
            Dialect::Sqlite => "",
            Dialect::Postgres => " FOR UPDATE OF s",
        };
        let row = sqlx::query(&format!(
            "SELECT c.stock - s.sold AS room FROM coupon_sales s JOIN coupons c \
             ON c.id = s.coupon_id WHERE s.coupon_id = $1{lock}"
        ))
        .bind(coupon)
        .fetch_optional(&mut **tx)
        .await?;
        let room: i64 = row.map(|row| row.try_get("room")).transpose()?.unwrap_or(0);
        Ok(usize::try_from(room).unwrap_or(0))
    }

    /// The orders of `batch` (one coupon's) whose buyers hold no order of it yet, the
    /// first of each buyer's in the batch: the orders a store would take.
    async fn new_buyers<'a>(
        &self,
        tx: &mut sqlx::Transaction<'static, sqlx::Any>,
        coupon: i64,
        batch: &[&'a OrderEvent],
    ) -> Result<Vec<&'a OrderEvent>, DbError> {
        const USERS_PER_STATEMENT: usize = 500;
        let mut holders = std::collections::HashSet::new();
        for chunk in batch.chunks(USERS_PER_STATEMENT) {
            let users: Vec<String> = (0..chunk.len()).map(|i| self.placeholder(i + 2)).collect();
            let sql = format!(
                "SELECT user_id FROM orders WHERE coupon_id = {} AND user_id IN ({})",
                self.placeholder(1),
                users.join(", ")
            );
            let mut query = sqlx::query(&sql).bind(coupon);
            for order in chunk {
                query = query.bind(order.user_id);
            }
            for row in query.fetch_all(&mut **tx).await? {
                holders.insert(row.try_get::<i64, _>("user_id")?);
            }
        }
        Ok(batch
            .iter()
            .copied()
            .filter(|order| holders.insert(order.user_id))
            .collect())
    }

    /// Inserts `orders` into `table` (`orders` or `orders_refused`, the same columns but
    /// the last), skipping any already there; returns how many were new.
    async fn insert_orders(
        &self,
        tx: &mut sqlx::Transaction<'static, sqlx::Any>,
        table: &'static str,
        orders: &[&OrderEvent],
        now_ms: i64,
    ) -> Result<u64, DbError> {
        // Multi-row VALUES lists keep a batch to one statement per chunk; the chunk keeps
        // the parameter count (5 per row) under SQLite's limit.
        const ROWS_PER_STATEMENT: usize = 200;
        let last = if table == "orders" {
            "stored_at"
        } else {
            "refused_at"
        };
        let mut inserted = 0;
        for chunk in orders.chunks(ROWS_PER_STATEMENT) {
            let mut sql =
                format!("INSERT INTO {table} (id, coupon_id, user_id, created_at, {last}) VALUES ");
            for row in 0..chunk.len() {
                if row > 0 {
                    sql.push_str(", ");
                }
                let base = row * 5;
                let params: Vec<String> = (1..=5).map(|i| self.placeholder(base + i)).collect();
                sql.push_str(&format!("({})", params.join(", ")));
            }
            sql.push_str(" ON CONFLICT DO NOTHING");
            let mut query = sqlx::query(&sql);
            for order in chunk {
                query = query
                    .bind(order.order_id.as_str())
                    .bind(order.coupon_id)
                    .bind(order.user_id)
                    .bind(order.created_at)
                    .bind(now_ms);
            }
            inserted += query.execute(&mut **tx).await?.rows_affected();
        }
        Ok(inserted)
    }

    /// The orders of coupon `coupon_id` the store refused as beyond its stock
    /// ([`Db::store_orders`]), oldest first.
    pub async fn refused_orders(&self, coupon_id: i64) -> Result<Vec<OrderEvent>, DbError> {
        let rows = sqlx::query(
            "SELECT id, coupon_id, user_id, created_at FROM orders_refused \
             WHERE coupon_id = $1 ORDER BY created_at, id",
        )
        .bind(coupon_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(OrderEvent {
                    order_id: row.try_get("id")?,
                    coupon_id: row.try_get("coupon_id")?,
                    user_id: row.try_get("user_id")?,
                    created_at: row.try_get("created_at")?,
                })
            })
            .collect()
    }

    /// Forgets coupon `coupon_id`'s refused orders: they were settled with their buyers.
    pub async fn forget_refused_orders(&self, coupon_id: i64) -> Result<(), DbError> {
        sqlx::query("DELETE FROM orders_refused WHERE coupon_id = $1")
            .bind(coupon_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

pub(crate) fn order_from_row(row: &AnyRow) -> Result<Order, DbError> {
    Ok(Order {
        order_id: row.try_get("id")?,
        coupon_id: row.try_get("coupon_id")?,
        user_id: row.try_get("user_id")?,
        created_at: row.try_get("created_at")?,
        stored_at: row.try_get("stored_at")?,
    })
}

fn coupon_from_row(row: &AnyRow) -> Result<Coupon, DbError> {
    Ok(Coupon {
        id: row.try_get("id")?,
        title: row.try_get("title")?,
        stock: row.try_get("stock")?,
        price: row.try_get("price")?,
        starts_at: row.try_get("starts_at")?,
        ends_at: row.try_get("ends_at")?,
        created_at: row.try_get("created_at")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dialects_and_masking() {
        assert_eq!(Dialect::of_url("sqlite://x.db"), Some(Dialect::Sqlite));
        assert_eq!(
            Dialect::of_url("postgres://u@h/db"),
            Some(Dialect::Postgres)
        );
        assert_eq!(Dialect::of_url("mysql://h/db"), None);
        assert_eq!(Dialect::of_url("nonsense"), None);
        assert_eq!(
            mask_password("postgres://app:s3cret@db:5432/shop"),
            "postgres://app:***@db:5432/shop"
        );
        assert_eq!(mask_password("sqlite://x.db"), "sqlite://x.db");
    }

    /// The order lookup goes through the primary key, not a scan of every order (review:
    /// 233 ms per lookup at 3M orders, and pollers took the database down).
    #[tokio::test]
    async fn an_order_is_looked_up_by_its_primary_key() {
        let dir = tempfile::tempdir().expect("dir");
        let db = Db::connect(&format!("sqlite://{}", dir.path().join("x.db").display()))
            .await
            .expect("db");
        let plan: Vec<String> = sqlx::query(&format!("EXPLAIN QUERY PLAN {ORDER_BY_ID}"))
            .bind(1_i64)
            .bind(2_i64)
            .bind("c1-u2-x")
            .fetch_all(&db.pool)
            .await
            .expect("plan")
            .iter()
            .map(|row| row.try_get::<String, _>("detail").expect("detail"))
            .collect();
        assert!(
            plan.iter().any(|step| step.contains("PRIMARY KEY")),
            "{plan:?}"
        );
        assert!(
            !plan.iter().any(|step| step.starts_with("SCAN")),
            "{plan:?}"
        );
    }
}
