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

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use tokio::runtime::Handle;

use crate::config::Config;
use crate::error::{Error, Result, StoreFailure};
use crate::transport::endpoint::mask_password;

/// The store's name in errors and logs.
pub(crate) const STORE: &str = "PostgreSQL";

/// Connections one client keeps at most: enough for a process's concurrent lock calls and
/// its renewals, few enough that a fleet of a hundred processes fits PostgreSQL's default
/// `max_connections` (100) only if each holds few; the pool opens them as needed.
const POOL_SIZE: u32 = 8;

/// The link to one database, shared by the client's calls, its renewals and its hub.
#[derive(Clone)]
pub(crate) struct PgLink {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    runtime: Handle,
    /// `host:port/database`, for errors.
    target: String,
    response_timeout: Duration,
}

impl PgLink {
    /// Opens the pool on `runtime` (the client's) and checks that the database answers
    /// within the connection timeout, then runs `setup` (the statements that create what
    /// the primitives need, if missing) once, serialized with any other client doing the
    /// same at the same moment.
    pub(crate) async fn connect(
        url: &str,
        config: &Config,
        runtime: &Handle,
        setup: &'static [&'static str],
    ) -> Result<PgLink> {
        let options = PgConnectOptions::from_str(url).map_err(|err| Error::InvalidUrl {
            url: mask_password(url),
            reason: err.to_string(),
        })?;
        let target = format!(
            "{}:{}/{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or(options.get_username())
        );
        let acquire_timeout = config.connection_timeout;
        // Built inside the client's runtime: the pool spawns its upkeep where it is made.
        let pool = runtime
            .spawn(async move {
                PgPoolOptions::new()
                    .max_connections(POOL_SIZE)
                    .min_connections(0)
                    .acquire_timeout(acquire_timeout)
                    .connect_lazy_with(options)
            })
            .await
            .map_err(|err| Error::Runtime(std::io::Error::other(err.to_string())))?;
        let link = PgLink {
            inner: Arc::new(Inner {
                pool,
                runtime: runtime.clone(),
                target,
                response_timeout: config.response_timeout,
            }),
        };
        let probe = link.run_within(config.connection_timeout, |pool| async move {
            sqlx::query_scalar::<_, i32>("SELECT 1")
                .fetch_one(&pool)
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
        let setup: Vec<String> = setup
            .iter()
            .map(|statement| (*statement).to_owned())
            .collect();
        link.run(move |pool| set_up(pool, setup)).await?;
        Ok(link)
    }

    /// `host:port/database`, as errors name the store.
    pub(crate) fn target(&self) -> &str {
        &self.inner.target
    }

    pub(crate) fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// Runs `work` on the client's runtime with a pooled connection, within the response
    /// timeout; its failure is classified for the caller (see [`classify`]).
    pub(crate) async fn run<T, F, Fut>(&self, work: F) -> Result<T>
    where
        F: FnOnce(PgPool) -> Fut + Send + 'static,
        Fut: Future<Output = sqlx::Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        self.run_within(self.inner.response_timeout, work).await
    }

    async fn run_within<T, F, Fut>(&self, limit: Duration, work: F) -> Result<T>
    where
        F: FnOnce(PgPool) -> Fut + Send + 'static,
        Fut: Future<Output = sqlx::Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        let pool = self.inner.pool.clone();
        let running = self
            .inner
            .runtime
            .spawn(async move { tokio::time::timeout(limit, work(pool)).await });
        match running.await {
            Ok(Ok(answer)) => answer.map_err(|err| classify(&self.inner.target, err)),
            Ok(Err(_elapsed)) => Err(Error::Store {
                store: STORE,
                target: self.inner.target.clone(),
                failure: StoreFailure::Connection,
                detail: format!("{NO_ANSWER} within {limit:?}"),
            }),
            Err(err) => Err(Error::Runtime(std::io::Error::other(format!(
                "the client's runtime did not run the statement (was the client shut down?): {err}"
            )))),
        }
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
            .run(move |pool| async move {
                sqlx::query_as(statement)
                    .bind(lease_ms)
                    .bind(names)
                    .bind(owners)
                    .fetch_all(&pool)
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
async fn set_up(pool: PgPool, setup: Vec<String>) -> sqlx::Result<()> {
    use sqlx::Executor;

    let mut connection = pool.acquire().await?;
    // Sent as simple queries: a setup file may hold several statements.
    let mut script = String::from("BEGIN; SELECT pg_advisory_xact_lock(7254039528390146201);\n");
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

/// How a statement that got no answer in time is described (and recognised at connect).
const NO_ANSWER: &str = "no answer";

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
                // too many connections, a standby that took over read-only, and the
                // conflicts a retry resolves (serialization, deadlock).
                code if code.starts_with("08")
                    || code.starts_with("57P")
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
