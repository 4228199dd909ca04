//! One running instance: Redis, the database, the stock loader, the order worker and the
//! HTTP server, started in that order and stopped in reverse.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::authority::{Claim, Tenure};
use crate::config::{ConfigError, ServiceConfig};
use crate::db::Db;
use crate::embedded::Embedded;
use crate::http::{router, AppState};
use crate::metrics::Metrics;
use crate::stock::{LoadReport, StockLoader};
use crate::strategy::{Reserver, StrategySettings};
use crate::worker::{Drain, Watched, Worker};

/// How long requests in flight get to finish when the private Redis died.
pub const REDIS_GONE_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// A running service. Call [`shutdown`](Self::shutdown) to stop it gracefully; dropping it
/// stops it abruptly (as a crash would, which some tests want).
pub struct Service {
    addr: SocketAddr,
    redis_url: String,
    load_report: LoadReport,
    state: Arc<AppState>,
    stop_http: CancellationToken,
    /// How long `shutdown` waits for requests in flight.
    shutdown_timeout: std::time::Duration,
    stop_worker: CancellationToken,
    http: JoinHandle<()>,
    worker: Option<JoinHandle<Drain>>,
    /// Removes stale segmented claims every few seconds.
    claim_repair: JoinHandle<()>,
    /// This instance's admission to the store, and whether it may sell now.
    tenure: Arc<Tenure>,
    /// Beats in the store while this instance sells.
    heartbeat: JoinHandle<()>,
    /// An embedded instance's hold on a PostgreSQL store (an advisory lock's session).
    store_lock: Option<sqlx::AnyConnection>,
    // Last, so the private Redis outlives everything that uses it.
    embedded: Option<Embedded>,
}

impl Service {
    /// Starts an instance: connects to Redis (or, in the embedded mode, takes the data
    /// directory and starts the private redis-server), migrates the database, loads active
    /// coupons' stock under the loader lock, starts the worker and serves HTTP.
    ///
    /// A SQLite store whose write lock another process holds without letting go (frozen
    /// mid-transaction) fails with [`ConfigError::StoreLocked`], naming that process.
    pub async fn start(config: ServiceConfig) -> Result<Service, ConfigError> {
        let database_url = config.database_url();
        Service::start_unnamed(config)
            .await
            .map_err(|err| name_the_lock_holder(err, &database_url))
    }

    async fn start_unnamed(config: ServiceConfig) -> Result<Service, ConfigError> {
        // First what can fail without consequence: a start that fails later must not have
        // taken the store over from instances that were serving it.
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| ConfigError::Listen {
                addr: config.listen,
                source,
            })?;
        let addr = listener
            .local_addr()
            .map_err(|source| ConfigError::Listen {
                addr: config.listen,
                source,
            })?;
        let (redis_url, embedded) = Embedded::open_unless_redis_url(&config).await?;
        let locks = distlock::Client::connect(&redis_url)
            .await
            .map_err(ConfigError::redis)?;
        crate::scripts::preload(&mut locks.connection())
            .await
            .map_err(|err| ConfigError::Redis(distlock::Error::Redis(err)))?;
        let db = if config.create_store {
            Db::connect(&config.database_url()).await
        } else {
            Db::open_existing(&config.database_url()).await
        }
        .map_err(ConfigError::Db)?;
        let store_lock = match (&embedded, db.dialect()) {
            (Some(_), crate::db::Dialect::Postgres) => Some(
                db.lock_exclusively()
                    .await
                    .map_err(ConfigError::Db)?
                    .ok_or_else(|| ConfigError::DatabaseInUse {
                        database: crate::db::mask_password(&config.database_url()),
                    })?,
            ),
            _ => None,
        };
        crate::strategy::check_lease(&config.strategy, &locks, &db).await?;
        // One Redis sells a store's stock: refuse to sell it from another one.
        let location =
            crate::authority::location(&redis_url, embedded.as_ref().map(Embedded::data_dir));
        let claim = if config.take_over_store {
            Claim::TakeOver {
                abandon: config.abandon_old_authority,
            }
        } else {
            Claim::Establish
        };
        let instance = uuid::Uuid::new_v4().simple().to_string();
        let admitting = std::time::Instant::now();
        let admission = crate::authority::admit(
            &db,
            &mut locks.connection(),
            &location,
            claim,
            &instance,
            &crate::db::mask_password(&config.database_url()),
        )
        .await?;
        let tenure = Tenure::new(admission, admitting);
        let heartbeat = crate::authority::spawn_heartbeat(db.clone(), tenure.clone());
        if embedded.is_some() {
            Embedded::release_locks_of_earlier_runs(&locks, db.keyspace())
                .await
                .map_err(ConfigError::redis)?;
        }
        let metrics = Metrics::new();
        let settings: StrategySettings = config.strategy.clone();
        let loader = StockLoader::new(
            locks.clone(),
            db.clone(),
            settings.stock_segments(),
            metrics.clone(),
        )
        .sole_owner(embedded.is_some())
        .tenure(tenure.clone());
        let load_report = loader.load_active().await.map_err(ConfigError::Load)?;
        tracing::info!(loaded = ?load_report.loaded, skipped = ?load_report.skipped, "stock loading done");
        let watched = Watched::default();
        watch_unstored_past_the_window(&db, &mut locks.connection(), &watched)
            .await
            .map_err(|err| ConfigError::Load(err.into()))?;

        let stop_worker = CancellationToken::new();
        let worker = match config.worker {
            Some(mut settings) => {
                // The data directory's lock makes this worker the only reader of the
                // private Redis's streams.
                settings.sole_consumer |= embedded.is_some();
                settings.drain_timeout = config.shutdown_timeout;
                let worker = Worker::connect(
                    &locks,
                    db.clone(),
                    tenure.clone(),
                    settings,
                    watched.clone(),
                    metrics.clone(),
                )
                .await
                .map_err(ConfigError::Worker)?;
                Some(tokio::spawn(worker.run(stop_worker.clone())))
            }
            None => None,
        };

        let claim_repair = crate::reconcile::spawn_claim_repair(
            locks.clone(),
            db.keyspace().clone(),
            watched.clone(),
            metrics.clone(),
        );
        let state = Arc::new(AppState {
            reserver: Reserver::new(
                settings,
                locks.clone(),
                db.clone(),
                tenure.clone(),
                metrics.clone(),
            ),
            db,
            locks,
            loader,
            watched,
            metrics,
            coupons: Default::default(),
            runs_worker: worker.is_some(),
            started: std::time::Instant::now(),
            read_timeout: config.read_timeout,
        });
        let stop_http = CancellationToken::new();
        let app = router(state.clone());
        let stopped = stop_http.clone();
        let http = tokio::spawn(crate::server::serve(
            listener,
            app,
            config.read_timeout,
            stopped,
        ));
        tracing::info!(%addr, strategy = %state.reserver.settings().strategy, "flashsale listening");
        Ok(Service {
            addr,
            redis_url,
            load_report,
            state,
            stop_http,
            shutdown_timeout: config.shutdown_timeout,
            stop_worker,
            http,
            worker,
            claim_repair,
            tenure,
            heartbeat,
            store_lock,
            embedded,
        })
    }

    /// Where the HTTP server listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, the base of every route.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The Redis in use (the private one's URL if it was started).
    pub fn redis_url(&self) -> &str {
        &self.redis_url
    }

    /// The data directory of the embedded mode; `None` when REDIS_URL was given.
    pub fn data_dir(&self) -> Option<&std::path::Path> {
        self.embedded.as_ref().map(Embedded::data_dir)
    }

    /// `Some(its last log lines)` if this instance's private Redis has exited on its own.
    pub fn private_redis_exited(&mut self) -> Option<Vec<String>> {
        self.embedded.as_mut().and_then(Embedded::redis_exited)
    }

    /// Whether an embedded instance's hold on its PostgreSQL store is gone: the session of
    /// its advisory lock ended (a database restart, a killed backend, a network reset), so
    /// another embedded instance may now take the store. Asks the session, bounded by 1 s.
    pub async fn store_lock_lost(&mut self) -> bool {
        let Some(session) = self.store_lock.as_mut() else {
            return false;
        };
        let alive = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            sqlx::query("SELECT 1").execute(&mut *session),
        )
        .await;
        !matches!(alive, Ok(Ok(_)))
    }

    /// Whether the store has moved past this instance (taken over, or released, while it
    /// was frozen or cut off): it refused a beat or a write, the instance no longer sells
    /// or stores, and should stop.
    pub fn authority_moved(&self) -> bool {
        self.tenure.moved()
    }

    /// This instance's admission to the store: what its writes carry.
    pub fn admission(&self) -> &crate::db::Admission {
        self.tenure.admission()
    }

    /// What loading stock at start did.
    pub fn load_report(&self) -> &LoadReport {
        &self.load_report
    }

    /// The database, for reports and tests.
    pub fn db(&self) -> &Db {
        &self.state.db
    }

    /// The distlock client, whose connection also carries the service's Redis commands.
    pub fn locks(&self) -> &distlock::Client {
        &self.state.locks
    }

    /// Stops gracefully: the HTTP server finishes its requests (for at most the
    /// configured shutdown timeout, then cuts the connections left), then the worker
    /// stores every order event it can still read (for at most the shutdown timeout
    /// again), then the database and a private Redis close. Returns how the drain ended
    /// ([`Drain::Complete`] when this instance runs no worker).
    pub async fn shutdown(self) -> Drain {
        let timeout = self.shutdown_timeout;
        self.stop(timeout, true).await
    }

    /// Stops without draining: after this instance's private Redis died (nothing can be
    /// read; the append-only file keeps every queued order for the next start), or after
    /// the store was taken over from it (the new authority gave the units of its unstored
    /// orders back to sale: storing them now would sell those units twice). Requests in
    /// flight get their answers for at most the shutdown timeout, and at most
    /// [`REDIS_GONE_GRACE`].
    pub async fn shutdown_without_drain(self) -> Drain {
        let timeout = self.shutdown_timeout.min(REDIS_GONE_GRACE);
        self.stop(timeout, false).await
    }

    async fn stop(mut self, timeout: std::time::Duration, drain: bool) -> Drain {
        self.stop_http.cancel();
        match tokio::time::timeout(timeout, &mut self.http).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => tracing::error!(error = %err, "the HTTP server task failed"),
            Err(_) => {
                tracing::warn!(
                    after = ?timeout,
                    "requests still in flight at the shutdown deadline; cutting their connections"
                );
                self.http.abort();
            }
        }
        self.claim_repair.abort();
        self.stop_worker.cancel();
        let drain = match self.worker.take() {
            Some(worker) if !drain => {
                worker.abort();
                Drain::Incomplete {
                    read_not_stored: 0,
                    reason: "stopped without draining".to_owned(),
                }
            }
            Some(worker) => worker.await.unwrap_or_else(|err| {
                tracing::error!(error = %err, "the order worker task failed");
                Drain::Incomplete {
                    read_not_stored: 0,
                    reason: format!("the order worker task failed: {err}"),
                }
            }),
            None => Drain::Complete,
        };
        // Gone from the store's beats first, then the release: of instances stopping
        // together, the last to leave sees no other beat and releases. (Looking before
        // leaving, two stopping at once each saw the other and neither released.)
        self.heartbeat.abort();
        crate::faults::stop_at(crate::faults::STOPPING);
        // A database that stopped answering does not hold the exit up past the shutdown
        // timeout. With a timeout shorter than the database takes, the beat may be left
        // behind: instances stopping at the same moment then see this one still selling and
        // keep the store until the take-over silence has passed.
        let leave = self.state.db.leave(&self.tenure.admission().instance);
        match tokio::time::timeout(timeout, leave).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => tracing::warn!(error = %err, "could not remove this instance's beat"),
            Err(_) => tracing::warn!(
                after = ?timeout,
                "the database did not remove this instance's beat before the shutdown deadline"
            ),
        }
        if drain == Drain::Complete && !self.tenure.moved() {
            let mut conn = self.state.locks.connection();
            match release_if_last(&self.state.db, &mut conn, self.tenure.admission()).await {
                Ok(()) => {
                    tracing::info!("released the store: `serve --take-over-store` may move it now")
                }
                Err(why) => tracing::info!(%why, "the store stays with this authority"),
            }
        }
        // A connection stuck in a statement (a database that stopped answering) does not
        // hold the exit up past the shutdown timeout.
        if tokio::time::timeout(timeout, self.state.db.close())
            .await
            .is_err()
        {
            tracing::warn!("database connections were still busy at the shutdown deadline");
        }
        // Any release of a dropped lock guard is sent before the client's runtime stops;
        // a Redis that is gone does not hold the exit up past the shutdown timeout.
        let flushed = tokio::time::timeout(timeout, self.state.locks.shutdown()).await;
        if flushed.is_err() {
            tracing::warn!("releases of lock guards were not all sent before the shutdown deadline; their leases free the locks");
        }
        if let Some(embedded) = self.embedded.take() {
            embedded.stop().await;
        }
        drain
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.heartbeat.abort();
        self.http.abort();
        self.claim_repair.abort();
        if let Some(worker) = &self.worker {
            worker.abort();
        }
    }
}

/// Adds to `watched` every coupon whose sale ended before the workers' watch window and
/// whose stream still holds events no worker stored (no worker ran for a day after its
/// sale): they were told 201, and the worker stores them like any other.
async fn watch_unstored_past_the_window(
    db: &Db,
    conn: &mut distlock::Connection,
    watched: &Watched,
) -> Result<(), crate::order_events::OrderEventsError> {
    let window_start = crate::model::now_millis() - crate::worker::WATCH_AFTER_END_MS;
    for coupon in db.coupons_ending_after(i64::MIN).await? {
        if coupon.ends_at > window_start {
            continue;
        }
        let keys = db.keyspace().coupon(coupon.id);
        let backlog = crate::order_events::stream_backlog(conn, &keys).await?;
        if backlog.lag + backlog.pending > 0 {
            tracing::warn!(
                coupon = coupon.id,
                unstored = backlog.lag + backlog.pending,
                "a coupon whose sale ended over a day ago still has orders no worker stored: \
                 storing them"
            );
            watched.add(coupon.id);
        }
    }
    Ok(())
}

/// `err` as [`ConfigError::StoreLocked`] when it is SQLite's "database is locked" and
/// another process holds the store's write lock: the error then names that process and
/// says how to free the lock, instead of leaving the operator to guess.
fn name_the_lock_holder(err: ConfigError, database_url: &str) -> ConfigError {
    let Some(path) = crate::db::sqlite_path(database_url) else {
        return err;
    };
    if !err.to_string().contains("database is locked") {
        return err;
    }
    let holders = crate::db::sqlite_lock::write_lock_holders(&path);
    if holders.is_empty() {
        return err;
    }
    ConfigError::StoreLocked {
        database: crate::db::mask_password(database_url),
        holders: holders
            .iter()
            .map(crate::db::sqlite_lock::describe)
            .collect::<Vec<_>>()
            .join("; and by "),
    }
}

/// Releases the store after a graceful stop, if this was the last instance of its tenure
/// and every order event in the store's streams is stored: then a take-over may move the
/// store without losing or reselling anything. The release is conditional on the epoch
/// read before anything was looked at, so an instance that started meanwhile (and may be
/// selling into the streams just walked) keeps the store. Returns why not, when it did not.
async fn release_if_last(
    db: &Db,
    conn: &mut distlock::Connection,
    admission: &crate::db::Admission,
) -> Result<(), String> {
    let unreadable = |err: &dyn std::fmt::Display| format!("the store could not be read: {err}");
    let expected = db
        .store_state()
        .await
        .map_err(|err| unreadable(&err))?
        .epoch;
    let silence = crate::authority::silence_ms();
    let another_sells = |instance: crate::db::LiveInstance| {
        format!("another instance ({}) still sells", instance.described)
    };
    if let Some(instance) = db
        .another_instance_selling(admission, silence)
        .await
        .map_err(|err| unreadable(&err))?
    {
        return Err(another_sells(instance));
    }
    // Every coupon, however long ago its sale ended: an order told and not stored is one
    // whatever its age.
    let coupons = db
        .coupons_ending_after(i64::MIN)
        .await
        .map_err(|err| unreadable(&err))?;
    for coupon in coupons {
        let keys = db.keyspace().coupon(coupon.id);
        let backlog = crate::order_events::stream_backlog(conn, &keys)
            .await
            .map_err(|err| format!("Redis could not be read: {err}"))?;
        let unstored = backlog.lag + backlog.pending;
        if unstored > 0 {
            return Err(format!(
                "coupon {} has {unstored} order events not stored yet",
                coupon.id
            ));
        }
        // Stored once and lost by SQL since (a restored database): a take-over would
        // rebuild from SQL and sell their units again.
        let lost = crate::order_events::lost_by_sql(db, conn, coupon.id)
            .await
            .map_err(|err| format!("the orders could not be compared: {err}"))?;
        if !lost.is_empty() {
            return Err(format!(
                "coupon {} has {} orders its buyers were told of that SQL no longer holds (a \
                 restored database?): start an instance, which stores them again, and stop it",
                coupon.id,
                lost.len()
            ));
        }
    }
    crate::faults::stop_at(crate::faults::RELEASE);
    match db.release(admission, expected, silence).await {
        Ok(crate::db::Release::Released) => Ok(()),
        Ok(crate::db::Release::AnotherSells(instance)) => Err(another_sells(instance)),
        Ok(crate::db::Release::Moved) => Err(
            "the store moved while this instance looked: another instance started, or the \
             store was taken over"
                .to_owned(),
        ),
        Err(err) => Err(format!("the store could not be written: {err}")),
    }
}
