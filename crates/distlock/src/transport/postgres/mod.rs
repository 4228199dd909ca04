//! How a client reaches a PostgreSQL database: a small pool of connections that lives on
//! the client's own runtime, the statements sent over it, what their failures mean, and
//! (in [`listen`]) the one connection that LISTENs for the engine's subscription hub.
//!
//! Like the Redis transport, it knows nothing about locks: the primitives write the SQL,
//! this module sends it and classifies what comes back.
//!
//! Every statement runs in a task on the client's runtime, never the caller's: a pooled
//! connection's socket belongs to the runtime that opened it, and a caller's runtime may
//! end (or stop being driven) while the client still needs the pool. A statement whose
//! caller went away still finishes there, so its effect is never half-known.

pub(crate) mod listen;

use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::Postgres;
use tokio::runtime::Handle;

use crate::config::Config;
use crate::error::{Error, Result, StoreFailure};
use crate::transport::endpoint::mask_password;
use crate::transport::on_runtime::{self, StoreAt, NO_ANSWER};

/// The store's name in errors and logs.
pub(crate) const STORE: &str = "PostgreSQL";

/// Connections one client keeps at most for its lock calls (the pool opens them as
/// needed), and apart from them for its upkeep (renewals, releases, verifications), so
/// that a burst of acquisitions never holds up the renewal of what is held. With the one
/// that LISTENs, a client keeps at most 11.
const POOL_SIZE: u32 = 8;
const UPKEEP_POOL_SIZE: u32 = 2;

/// How long a pooled connection may sit idle before it is pinged ahead of its next use.
const PING_AFTER_IDLE: Duration = Duration::from_millis(250);

/// The URL parameter naming the schema distlock's table and sequence live in (distlock's
/// own; taken out before the driver reads the URL).
const SCHEMA_PARAMETER: &str = "distlock_schema";

/// A pool, and a gate with as many permits as it has connections: a call waits at the
/// gate for a free connection, so that the wait (a burst of calls larger than the pool)
/// does not count against the call's response timeout, which is for the database's
/// answer.
#[derive(Clone)]
struct Gated {
    pool: PgPool,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Gated {
    fn new(pool: PgPool, size: u32) -> Gated {
        Gated {
            pool,
            gate: Arc::new(tokio::sync::Semaphore::new(
                usize::try_from(size).unwrap_or(1),
            )),
        }
    }
}

/// The link to one database, shared by the client's calls, its renewals and its hub.
#[derive(Clone)]
pub(crate) struct PgLink {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Gated,
    /// Renewals, releases and verifications: never queued behind acquisitions.
    upkeep: Gated,
    /// How long a call may wait for one of its pool's connections to be free (the
    /// connection timeout), before its response timeout starts.
    queue_limit: Duration,
    /// For the connection that LISTENs, which opens its own one-connection pool.
    options: PgConnectOptions,
    runtime: Handle,
    /// `host:port/database`, for errors.
    target: String,
    response_timeout: Duration,
}

impl PgLink {
    /// Opens the pools on `runtime` (the client's) and checks that the database answers
    /// within the connection timeout, then runs `setup` (the statements that create what
    /// the primitives need) if what they create is missing, serialized with any other
    /// client doing the same at the same moment, and then `check` (statements that fail
    /// when the tables lack what the primitives use).
    pub(crate) async fn connect(
        url: &str,
        config: &Config,
        runtime: &Handle,
        (setup, check): (&'static [&'static str], &'static [&'static str]),
    ) -> Result<PgLink> {
        let (url, schema) = take_schema(url)?;
        let options = PgConnectOptions::from_str(&url)
            .map_err(|err| Error::InvalidUrl {
                url: mask_password(&url),
                reason: err.to_string(),
            })?
            .options(session_settings(&schema));
        let target = format!(
            "{}:{}/{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or(options.get_username())
        );
        let acquire_timeout = config.connection_timeout;
        let pool_options = options.clone();
        // Built inside the client's runtime: a pool spawns its upkeep where it is made.
        let (pool, upkeep) = runtime
            .spawn(async move {
                let pool = |size: u32| {
                    PgPoolOptions::new()
                        .max_connections(size)
                        .min_connections(0)
                        .acquire_timeout(acquire_timeout)
                        // A connection idle for a while may have been closed by the
                        // server (a restart, pg_terminate_backend, idle_session_timeout):
                        // it is pinged before use, and replaced if it does not answer. A
                        // busy one is not: a ping before every statement would double
                        // each call's round trips.
                        .test_before_acquire(false)
                        .before_acquire(|connection, meta| {
                            Box::pin(async move {
                                if meta.idle_for < PING_AFTER_IDLE {
                                    return Ok(true);
                                }
                                Ok(sqlx::Connection::ping(connection).await.is_ok())
                            })
                        })
                        .connect_lazy_with(pool_options.clone())
                };
                (pool(POOL_SIZE), pool(UPKEEP_POOL_SIZE))
            })
            .await
            .map_err(|err| Error::Runtime(std::io::Error::other(err.to_string())))?;
        let link = PgLink {
            inner: Arc::new(Inner {
                pool: Gated::new(pool, POOL_SIZE),
                upkeep: Gated::new(upkeep, UPKEEP_POOL_SIZE),
                queue_limit: config.connection_timeout,
                options,
                runtime: runtime.clone(),
                target,
                response_timeout: config.response_timeout,
            }),
        };
        let probe = link.run_within(config.connection_timeout, |mut conn| async move {
            sqlx::query_scalar::<_, i32>("SELECT 1")
                .fetch_one(&mut *conn)
                .await
        });
        match probe.await {
            Ok(_) => {}
            Err(Error::Store {
                failure: StoreFailure::Connection,
                detail,
                ..
            }) if detail.starts_with(NO_ANSWER) => {
                return Err(Error::ConnectTimeout {
                    target: link.target().to_owned(),
                    after: config.connection_timeout,
                })
            }
            Err(err) => return Err(err),
        }
        let owned = |statements: &[&str]| -> Vec<String> {
            statements
                .iter()
                .map(|statement| (*statement).to_owned())
                .collect()
        };
        let (setup, check) = (owned(setup), owned(check));
        // Part of connecting, bounded as the probe is: creating the schema the first
        // time (a table, functions) may take longer than a lock call's response timeout.
        let connecting = config.connection_timeout;
        link.run_within(connecting, move |conn| set_up(conn, setup, connecting))
            .await
            .map_err(|err| match err {
                Error::Store {
                    store,
                    target,
                    failure: StoreFailure::PermissionDenied,
                    detail,
                } => Error::Store {
                    store,
                    target,
                    failure: StoreFailure::PermissionDenied,
                    detail: format!(
                        "{detail}; creating distlock's tables, or completing those an older \
                         distlock made, needs their owner (or CREATE on the schema for new \
                         ones): connect once as that user, or have it run \
                         primitives/lock/sql/schema.sql, primitives/rw_lock/sql/schema.sql, \
                         then primitives/permit_semaphore/sql/schema.sql"
                    ),
                },
                other => other,
            })?;
        link.run_within(connecting, move |mut conn| async move {
            for statement in check {
                sqlx::query(&statement).execute(&mut *conn).await?;
            }
            Ok(())
        })
        .await
        .map_err(|err| match err {
            Error::Store {
                store,
                target,
                failure: StoreFailure::Request,
                detail,
            } => Error::Store {
                store,
                target,
                failure: StoreFailure::Request,
                detail: format!(
                    "the lock table does not have what distlock needs ({detail}); was it made \
                     by another tool or an older distlock? See docs/safety.md"
                ),
            },
            other => other,
        })?;
        Ok(link)
    }

    /// `host:port/database`, as errors name the store.
    pub(crate) fn target(&self) -> &str {
        &self.inner.target
    }

    /// The options every connection of the client is opened with.
    pub(crate) fn options(&self) -> &PgConnectOptions {
        &self.inner.options
    }

    /// [`PgLink::run`] on the upkeep pool: for what keeps a holding alive or ends it.
    pub(crate) async fn run_upkeep<T, F, Fut>(&self, work: F) -> Result<T>
    where
        F: FnOnce(PoolConnection<Postgres>) -> Fut + Send + 'static,
        Fut: Future<Output = sqlx::Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        let upkeep = self.inner.upkeep.clone();
        self.spawn_within(self.inner.response_timeout, upkeep, work)
            .await
    }

    /// Runs `work` on the client's runtime with a pooled connection, within the response
    /// timeout; its failure is classified for the caller (see [`classify`]).
    pub(crate) async fn run<T, F, Fut>(&self, work: F) -> Result<T>
    where
        F: FnOnce(PoolConnection<Postgres>) -> Fut + Send + 'static,
        Fut: Future<Output = sqlx::Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        self.run_within(self.inner.response_timeout, work).await
    }

    async fn run_within<T, F, Fut>(&self, limit: Duration, work: F) -> Result<T>
    where
        F: FnOnce(PoolConnection<Postgres>) -> Fut + Send + 'static,
        Fut: Future<Output = sqlx::Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        let pool = self.inner.pool.clone();
        self.spawn_within(limit, pool, work).await
    }

    /// Runs `work` on `pooled`'s pool once one of its connections is free (waiting at
    /// most the connection timeout, else the pool's timeout error), then within `limit`.
    async fn spawn_within<T, F, Fut>(&self, limit: Duration, pooled: Gated, work: F) -> Result<T>
    where
        F: FnOnce(PoolConnection<Postgres>) -> Fut + Send + 'static,
        Fut: Future<Output = sqlx::Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        let at = StoreAt {
            store: STORE,
            target: &self.inner.target,
        };
        let queue_limit = self.inner.queue_limit;
        let gated = async move {
            let Ok(Ok(_permit)) =
                tokio::time::timeout(queue_limit, pooled.gate.acquire_owned()).await
            else {
                return Err(Some(sqlx::Error::PoolTimedOut));
            };
            // Taking the connection (opening one if the pool has none idle) is still
            // the wait: bounded by the pool's own timeout, the connection timeout.
            let connection = pooled.pool.acquire().await.map_err(Some)?;
            match tokio::time::timeout(limit, work(connection)).await {
                Ok(answer) => answer.map_err(Some),
                Err(_elapsed) => Err(None),
            }
        };
        // The outer limit only catches a runtime that stopped driving the task.
        let outer = queue_limit + limit + Duration::from_millis(50);
        on_runtime::run(
            &self.inner.runtime,
            at,
            outer,
            gated,
            |target, failed| match failed {
                Some(err) => classify(target, err),
                None => on_runtime::no_answer(at, limit),
            },
        )
        .await
    }

    /// Sends one renewal `statement` for a batch of leases: `$1` the lease in
    /// milliseconds, `$2` the names, `$3` the owners. It answers one row `(name, owner)`
    /// for each lease still held (and set again); the answer says, per lease, whether it
    /// was.
    pub(crate) async fn renew(
        &self,
        statement: &'static str,
        lease_ms: u64,
        leases: Vec<(Arc<str>, Arc<str>)>,
    ) -> Result<Vec<bool>> {
        let names: Vec<String> = leases.iter().map(|(name, _)| name.to_string()).collect();
        let owners: Vec<String> = leases.iter().map(|(_, owner)| owner.to_string()).collect();
        // Milliseconds as a double: exact far past any lease (2^53 ms).
        let lease_ms = lease_ms as f64;
        let renewed: Vec<(String, String)> = self
            .run_upkeep(move |mut conn| async move {
                sqlx::query_as(statement)
                    .bind(lease_ms)
                    .bind(names)
                    .bind(owners)
                    .fetch_all(&mut *conn)
                    .await
            })
            .await?;
        Ok(leases
            .iter()
            .map(|(name, owner)| {
                renewed
                    .iter()
                    .any(|(held, by)| **held == **name && **by == **owner)
            })
            .collect())
    }
}

/// Runs `setup` in one transaction. Two clients creating the same table at once can
/// collide on the catalog's unique index; a transaction-scoped advisory lock on a fixed
/// key makes them take turns.
async fn set_up(
    mut connection: PoolConnection<Postgres>,
    setup: Vec<String>,
    lock_timeout: Duration,
) -> sqlx::Result<()> {
    use sqlx::Executor;

    // What exists is used as it is: creating it again (even IF NOT EXISTS) needs CREATE
    // on the schema, which a least-privileged user does not have.
    // The newest part of the schema (the permit semaphore's) stands for all of it: a
    // schema an older distlock made is completed.
    let present: bool = sqlx::query_scalar(
        "SELECT to_regclass('distlock_locks') IS NOT NULL \
            AND to_regclass('distlock_tokens') IS NOT NULL \
            AND to_regclass('distlock_readers') IS NOT NULL \
            AND to_regprocedure('distlock_read_extend(text,text,double precision,text)') IS NOT NULL \
            AND to_regclass('distlock_permits') IS NOT NULL \
            AND to_regprocedure('distlock_permit_set(text,bigint,text)') IS NOT NULL",
    )
    .fetch_one(&mut *connection)
    .await?;
    if present {
        return Ok(());
    }
    // Sent as simple queries: a setup file may hold several statements.
    // A table lock it waits for (an ALTER behind a long reader of the table) is given up
    // within the connection timeout on the server too: left queued there, it would hold
    // every other client's statements on the table behind it.
    let mut script = format!(
        "BEGIN; SET LOCAL lock_timeout = {}; SELECT pg_advisory_xact_lock(7254039528390146201);\n",
        lock_timeout.as_millis().max(1)
    );
    for statement in &setup {
        script.push_str(statement);
        script.push_str(";\n");
    }
    script.push_str("COMMIT;");
    if let Err(err) = connection.execute(script.as_str()).await {
        let _ = connection.execute("ROLLBACK").await;
        return Err(err);
    }
    Ok(())
}

/// The URL without distlock's own `distlock_schema` parameter, and the schema it names
/// (`public` when it names none).
fn take_schema(url: &str) -> Result<(String, String)> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), "public".to_owned()));
    };
    let mut schema = None;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| match pair.split_once('=') {
            Some((SCHEMA_PARAMETER, value)) => {
                schema = Some(value.to_owned());
                false
            }
            _ => true,
        })
        .collect();
    let schema = schema.unwrap_or_else(|| "public".to_owned());
    let plain = !schema.is_empty()
        && schema
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || byte == b'_')
        && !schema.as_bytes()[0].is_ascii_digit();
    if !plain {
        return Err(Error::InvalidUrl {
            url: mask_password(url),
            reason: format!(
                "{SCHEMA_PARAMETER} must be a plain identifier (letters, digits, _), not {schema:?}"
            ),
        });
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((url, schema))
}

/// The settings every connection of the client starts with, whatever the database's or
/// the user's defaults, because the lock's statements count on them:
///
/// - `search_path` is the one schema: two clients on one database must find the same
///   table, whatever schema their users have (PostgreSQL's default `"$user", public`
///   would give each user a table of its own) and whatever the URL's `options` say;
/// - no statement, lock or idle-transaction timeout of the server's: the client keeps
///   its own response timeout, and a statement the server cancels would turn a wait into
///   an error;
/// - read committed: an acquisition's upsert must wait for the row and see the latest
///   version, where a serializable default fails it instead.
fn session_settings(schema: &str) -> [(&'static str, String); 5] {
    [
        ("search_path", schema.to_owned()),
        ("statement_timeout", "0".to_owned()),
        ("lock_timeout", "0".to_owned()),
        ("idle_in_transaction_session_timeout", "0".to_owned()),
        // The space escaped: options are split at blanks.
        (
            "default_transaction_isolation",
            "read\\ committed".to_owned(),
        ),
    ]
}

/// What a driver error means for the caller: the connection (try again later: the
/// statement may or may not have run), a missing right (asking again will not help), or
/// a refusal of the statement itself.
pub(crate) fn classify(target: &str, err: sqlx::Error) -> Error {
    let (failure, detail) = match &err {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|code| code.into_owned()).unwrap_or_default();
            let failure = match code.as_str() {
                // insufficient_privilege; invalid password or authorization.
                "42501" | "28000" | "28P01" => StoreFailure::PermissionDenied,
                // Connection exceptions (08…), a shutting-down or starting server (57P…),
                // a statement cancelled by the server, too many connections, a standby
                // that took over read-only, and the conflicts a retry resolves
                // (serialization, deadlock, a row lock not granted in time).
                code if code.starts_with("08")
                    || code.starts_with("57P")
                    || code == "57014"
                    || code == "55P03"
                    || code == "53300"
                    || code == "25006"
                    || code == "40001"
                    || code == "40P01" =>
                {
                    StoreFailure::Connection
                }
                _ => StoreFailure::Request,
            };
            let hint = if failure == StoreFailure::PermissionDenied {
                "; grant the user the rights listed in distlock's docs/safety.md"
            } else {
                ""
            };
            (failure, format!("{} (SQLSTATE {code}){hint}", db.message()))
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => (StoreFailure::Connection, err.to_string()),
        _ => (StoreFailure::Request, err.to_string()),
    };
    Error::Store {
        store: STORE,
        target: target.to_owned(),
        failure,
        detail,
    }
}
