//! `flashsale serve`: the service as a long-running process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};

use crate::config::{
    in_range, ConfigError, ServiceConfig, StoreArgs, StrategyArgs, DEFAULT_DATA_DIR,
};
use crate::strategy::Strategy;
use crate::worker::{Drain, WorkerSettings};
use crate::{CliResult, Service};

/// Flags of `flashsale serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "FLASHSALE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// How purchases reserve stock.
    #[arg(long, value_enum, default_value_t = Strategy::Lua)]
    pub strategy: Strategy,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub knobs: StrategyArgs,
    /// Where the data lives when REDIS_URL is unset: the private Redis's append-only file
    /// and, unless DATABASE_URL or --sqlite-path say otherwise, the SQLite database. Reused
    /// across restarts; one instance at a time.
    #[arg(long, env = "FLASHSALE_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// The SQLite file used when DATABASE_URL is unset [default: DATA_DIR/flashsale.db].
    #[arg(long)]
    pub sqlite_path: Option<PathBuf>,
    /// How long another worker's unacknowledged order event waits before this one takes
    /// it over (at least 100ms).
    #[arg(long, value_parser = crate::config::parse_duration, default_value = "30s")]
    pub reclaim_idle: Duration,
    /// Run no order worker in this instance (another instance must).
    #[arg(long)]
    pub no_worker: bool,
    /// How long a graceful shutdown (SIGTERM, Ctrl-C) lets requests in flight finish
    /// before it cuts their connections, and then how long the order worker gets to store
    /// what was sold (100ms to 10m).
    #[arg(long, value_parser = crate::config::parse_duration, default_value = "10s")]
    pub shutdown_timeout: Duration,
    /// How long a client may take to send a request's headers, and then its body (100ms
    /// to 10m); a slower one is cut off (headers) or answered 408 (body).
    #[arg(long, value_parser = crate::config::parse_duration, default_value = "10s")]
    pub read_timeout: Duration,
    /// Serve `--strategy unsafe` anyway. It oversells by design (a GET, then a DECR): it
    /// exists to show what the other strategies prevent, not to take real orders.
    #[arg(long)]
    pub allow_unsafe: bool,
    /// Make this instance's Redis the store's stock authority, though the store records
    /// another. Stop every instance of the old one with SIGTERM first: they store every
    /// queued order before exiting. Counters of the store in this Redis are rebuilt from
    /// SQL.
    #[arg(long)]
    pub take_over_store: bool,
    /// With --take-over-store: take the store although its authority was not released,
    /// once every instance of it has been silent for 15s by the database's clock. Only for
    /// an old Redis lost for good: orders it held that SQL lacks are never stored, and their
    /// units are sold again (`flashsale reconcile` against the old Redis lists them).
    #[arg(long, requires = "take_over_store")]
    pub abandon_old_authority: bool,
}

impl ServeArgs {
    /// The service configuration these flags describe.
    pub fn config(&self) -> Result<ServiceConfig, ConfigError> {
        if self.strategy == Strategy::Unsafe && !self.allow_unsafe {
            return Err(ConfigError::invalid(
                "--strategy",
                "unsafe oversells by design; pass --allow-unsafe to serve it anyway",
            ));
        }
        let ms = Duration::from_millis;
        in_range("--reclaim-idle", self.reclaim_idle, ms(100), ms(86_400_000))?;
        in_range("--read-timeout", self.read_timeout, ms(100), ms(600_000))?;
        in_range(
            "--shutdown-timeout",
            self.shutdown_timeout,
            ms(100),
            ms(600_000),
        )?;
        let worker = (!self.no_worker).then(|| WorkerSettings {
            reclaim_idle: self.reclaim_idle,
            ..WorkerSettings::new()
        });
        Ok(ServiceConfig {
            listen: self.listen,
            redis_url: self.store.redis_url.clone(),
            database_url: self.store.database_url.clone(),
            sqlite_path: self.sqlite_path.clone(),
            data_dir: self.data_dir.clone(),
            strategy: self.knobs.settings(self.strategy)?,
            worker,
            shutdown_timeout: self.shutdown_timeout,
            read_timeout: self.read_timeout,
            take_over_store: self.take_over_store,
            abandon_old_authority: self.abandon_old_authority,
            create_store: true,
        })
    }
}

/// What a second signal received before the startup line ends with.
fn stopped_while_starting() -> ExitCode {
    eprintln!("flashsale: the start was cut by a second signal; nothing was served");
    ExitCode::FAILURE
}

/// How often `serve` checks that its private Redis still runs.
const REDIS_WATCH_INTERVAL: Duration = Duration::from_millis(500);

/// Serves until SIGTERM or SIGINT, then shuts down gracefully: in-flight requests finish
/// and the worker stores every queued order it can read.
pub async fn run(args: ServeArgs) -> CliResult {
    let config = args.config()?;
    let database = crate::db::mask_password(&config.database_url());
    // Installed before the startup line: a supervisor that stops the service as soon as it
    // announced itself gets a graceful stop, not the signal's default (an exit without
    // draining, releasing or removing its beat).
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    // A signal while starting (a take-over waiting for the store, a slow database) stops
    // the service as soon as it has started, gracefully: a start cut in the middle could
    // leave its beat in the store, which would keep its fleet from releasing the store for
    // the take-over silence. A second signal cuts the start.
    let start = Service::start(config);
    tokio::pin!(start);
    let mut stop_once_started = false;
    let mut service = loop {
        let signalled = tokio::select! {
            started = &mut start => break started?,
            _ = terminate.recv() => true,
            _ = interrupt.recv() => true,
        };
        if signalled && stop_once_started {
            return Ok(stopped_while_starting());
        }
        stop_once_started = true;
        eprintln!("flashsale: stopping as soon as the start finishes (a second signal cuts it)");
    };
    if let Some(data_dir) = service.data_dir() {
        eprintln!(
            "flashsale: embedded mode: a private Redis keeps its data in {redis}, with an \
             append-only file (a kill or restart loses no order); this serves ONE instance \
             per data directory. For a fleet, set REDIS_URL and DATABASE_URL on every \
             instance.",
            redis = data_dir.join("redis").display()
        );
    }
    eprintln!(
        "flashsale: {} (strategy {}, redis {}, database {database})",
        service.base_url(),
        args.strategy,
        crate::db::mask_password(service.redis_url())
    );
    let mut watch = tokio::time::interval(REDIS_WATCH_INTERVAL);
    // Asked to stop while starting: straight to the graceful stop.
    if !stop_once_started {
        loop {
            tokio::select! {
                _ = terminate.recv() => break,
                _ = interrupt.recv() => break,
                _ = watch.tick() => {
                    let redis_died = service.private_redis_exited();
                    let why = if let Some(log) = &redis_died {
                        format!(
                            "the private redis-server exited unexpectedly; stopping (a restart \
                             replays its append-only file). Its last lines:\n{}",
                            log.join("\n")
                        )
                    } else if service.authority_moved() {
                        "the store no longer admits this instance: it was taken over (serve \
                         --take-over-store --abandon-old-authority) or released while this \
                         instance was frozen or cut off, and refuses its writes. It sells nothing \
                         more and stops; its unstored orders stay in this Redis (their units were \
                         put back on sale): `flashsale reconcile` against it lists them"
                            .to_owned()
                    } else if service.store_lock_lost().await {
                        "the session holding the database's lock ended (a database restart, a \
                         killed backend): another embedded instance could now take it; stopping \
                         (a restart takes it again)"
                            .to_owned()
                    } else {
                        continue;
                    };
                    // Nothing can be sold safely on, and the data directory stays locked while
                    // this process lives: exit, so a supervisor restarts the service. Requests
                    // in flight still get their answers, and the worker stores what it can,
                    // both within the shutdown timeout.
                    eprintln!("flashsale: {why}");
                    let drained = if redis_died.is_some() || service.authority_moved() {
                        service.shutdown_without_drain().await
                    } else {
                        service.shutdown().await
                    };
                    if let Drain::Incomplete { read_not_stored, reason } = drained {
                        eprintln!(
                            "flashsale: the order queue was NOT drained: {reason}; {read_not_stored} \
                             order events read and not stored stay in Redis"
                        );
                    }
                    return Ok(ExitCode::FAILURE);
                }
            }
        }
    }
    eprintln!("flashsale: shutting down; draining the order queue");
    match service.shutdown().await {
        Drain::Complete => Ok(ExitCode::SUCCESS),
        Drain::Incomplete {
            read_not_stored,
            reason,
        } => {
            eprintln!(
                "flashsale: the order queue was NOT drained: {reason}. Order events this \
                 instance read and could not store: {read_not_stored}. They, and any event \
                 no worker read yet, stay in Redis's streams and are stored by another \
                 instance's worker (after --reclaim-idle) or by the next start; nothing \
                 is lost while Redis keeps its data. Exit code {}",
                crate::exit_code::UNDRAINED
            );
            Ok(ExitCode::from(crate::exit_code::UNDRAINED))
        }
    }
}
