//! Configuration: flags and environment, checked before anything starts, with errors that
//! say what to fix.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub use crate::duration::{format_duration, parse_duration};

use crate::db::DbError;
use crate::strategy::{Strategy, StrategySettings};
use crate::worker::WorkerSettings;

/// Where the service keeps its data.
#[derive(Debug, Clone, clap::Args)]
pub struct StoreArgs {
    /// Redis to use [default: a private redis-server; serve and reconcile keep its data in
    /// --data-dir, load and bench use a throwaway one].
    #[arg(long, env = "REDIS_URL")]
    pub redis_url: Option<String>,
    /// sqlite://PATH or postgres://USER:PASSWORD@HOST/DB [default: serve and reconcile
    /// use DATA_DIR/flashsale.db; load and bench a throwaway file].
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: Option<String>,
}

/// The knobs of the lock-based strategies.
#[derive(Debug, Clone, clap::Args)]
pub struct StrategyArgs {
    /// Stock segments per coupon for --strategy segmented (1 to 1024).
    #[arg(long, default_value_t = 8)]
    pub segments: u32,
    /// How long a purchase waits for a lock before answering 503 busy (1ms to 1m).
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub lock_wait: Duration,
    /// The lease of a purchase's lock (100ms to 10m). `serve` also refuses a lease shorter
    /// than the critical section it measures at start.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    pub lock_lease: Duration,
    /// How long a purchase may take from arrival to answer (100ms to 10m): one not sent to
    /// Redis by then is not sold, and lock waits end by it.
    #[arg(long, value_parser = parse_duration, default_value = "15s")]
    pub request_timeout: Duration,
    /// Most purchases of one coupon queued for the lua strategy; past it, purchases get 503
    /// `overloaded` with Retry-After at once, before anything is sold.
    #[arg(long, default_value_t = 4_096)]
    pub queue_limit: usize,
    /// Test hook: the lock strategy stops its own process (SIGSTOP) while it holds the
    /// lock for this user's purchase, before writing it.
    #[arg(long, hide = true, env = "FLASHSALE_FAULT_STOP_HOLDER_OF_USER")]
    pub fault_stop_holder_of_user: Option<i64>,
}

/// The shortest lease a lock strategy accepts. Below it, Redis's own round trips eat the
/// lease; the measured critical section usually sets a higher floor at start.
pub const MIN_LOCK_LEASE: Duration = Duration::from_millis(100);

impl StrategyArgs {
    /// Checks the knobs and builds the settings of `strategy`.
    pub fn settings(&self, strategy: Strategy) -> Result<StrategySettings, ConfigError> {
        if !(1..=1024).contains(&self.segments) {
            return Err(ConfigError::invalid(
                "--segments",
                "must be between 1 and 1024",
            ));
        }
        let ms = Duration::from_millis;
        in_range("--lock-wait", self.lock_wait, ms(1), ms(60_000))?;
        in_range("--lock-lease", self.lock_lease, MIN_LOCK_LEASE, ms(600_000))?;
        in_range(
            "--request-timeout",
            self.request_timeout,
            ms(100),
            ms(600_000),
        )?;
        if !(1..=1_000_000).contains(&self.queue_limit) {
            return Err(ConfigError::invalid(
                "--queue-limit",
                "must be between 1 and 1000000",
            ));
        }
        Ok(StrategySettings {
            strategy,
            segments: self.segments,
            lock_wait: self.lock_wait,
            lock_lease: self.lock_lease,
            fault_stop_holder_of_user: self.fault_stop_holder_of_user,
            request_timeout: self.request_timeout,
            queue_limit: self.queue_limit,
        })
    }
}

/// Refuses `value` of flag `what` outside `min..=max`.
pub fn in_range(
    what: &'static str,
    value: Duration,
    min: Duration,
    max: Duration,
) -> Result<(), ConfigError> {
    if (min..=max).contains(&value) {
        return Ok(());
    }
    Err(ConfigError::invalid(
        what,
        format!(
            "{} is out of range: must be between {} and {}",
            format_duration(value),
            format_duration(min),
            format_duration(max)
        ),
    ))
}

/// Everything [`Service::start`](crate::Service::start) needs.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// Where the HTTP server listens; port 0 picks a free one.
    pub listen: SocketAddr,
    /// Redis URL; `None` is the embedded mode: a private redis-server whose data lives in
    /// `data_dir`, and this instance the only one on it (see [`crate::embedded`]).
    pub redis_url: Option<String>,
    /// Database URL; `None` uses SQLite at `sqlite_path`.
    pub database_url: Option<String>,
    /// The SQLite file used when `database_url` is `None`; `None` is
    /// `data_dir/flashsale.db`.
    pub sqlite_path: Option<PathBuf>,
    /// Where the embedded mode keeps its data (and the default SQLite file).
    pub data_dir: PathBuf,
    /// The reservation strategy.
    pub strategy: StrategySettings,
    /// The order worker's settings; `None` runs no worker in this instance.
    pub worker: Option<WorkerSettings>,
    /// How long a graceful shutdown lets requests in flight finish before it cuts their
    /// connections (a client that stops sending must not keep the service up).
    pub shutdown_timeout: Duration,
    /// How long a client may take to send a request's headers, and then its body.
    pub read_timeout: Duration,
    /// Make this instance's Redis the store's stock authority, whatever the store records
    /// (`serve --take-over-store`; see [`crate::authority`]).
    pub take_over_store: bool,
    /// With `take_over_store`: take the store although its authority was not released
    /// (`--abandon-old-authority`).
    pub abandon_old_authority: bool,
    /// Create the store (the data directory, the SQLite file, the schema) if it does not
    /// exist. Only `serve` does, and `load` and `bench` for their throwaway store; every
    /// other use refuses a store that is not there ([`DbError::NoStore`]).
    pub create_store: bool,
}

/// Where `serve` keeps its data when REDIS_URL is unset, relative to the working directory.
pub const DEFAULT_DATA_DIR: &str = "flashsale-data";

/// How long a client may take to send a request's headers, and then its body, by default.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a graceful shutdown waits for requests in flight by default.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

impl ServiceConfig {
    /// Defaults: loopback on a free port, the embedded mode in `./flashsale-data`, the
    /// given strategy, and a worker.
    pub fn new(strategy: Strategy) -> Self {
        ServiceConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            redis_url: None,
            database_url: None,
            sqlite_path: None,
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            strategy: StrategySettings::new(strategy),
            worker: Some(WorkerSettings::new()),
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            read_timeout: DEFAULT_READ_TIMEOUT,
            take_over_store: false,
            abandon_old_authority: false,
            create_store: true,
        }
    }

    /// The database URL in effect. A path is percent-encoded where a URL would read it
    /// otherwise (`%`, `?`, `#`), so `/data/50%20off` names that directory.
    pub fn database_url(&self) -> String {
        self.database_url.clone().unwrap_or_else(|| {
            let path = self.sqlite_file().display().to_string();
            let mut encoded = String::with_capacity(path.len());
            for c in path.chars() {
                match c {
                    '%' => encoded.push_str("%25"),
                    '?' => encoded.push_str("%3F"),
                    '#' => encoded.push_str("%23"),
                    c => encoded.push(c),
                }
            }
            format!("sqlite://{encoded}")
        })
    }

    /// The SQLite file the database URL in effect names, if it is SQLite: the file an
    /// embedded instance must hold alone.
    pub fn sqlite_file_in_use(&self) -> Option<PathBuf> {
        match &self.database_url {
            Some(url) => crate::db::sqlite_path(url),
            None => Some(self.sqlite_file()),
        }
    }

    /// The SQLite file in effect when `database_url` is `None`.
    pub fn sqlite_file(&self) -> PathBuf {
        self.sqlite_path
            .clone()
            .unwrap_or_else(|| self.data_dir.join("flashsale.db"))
    }
}

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A flag or variable is out of range.
    #[error("invalid {what}: {reason}")]
    Invalid {
        /// The flag or variable.
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Redis could not be reached, or the URL is malformed.
    #[error("redis: {0} (set REDIS_URL, or unset it to run a private redis-server)")]
    Redis(#[source] distlock::Error),
    /// The Redis may evict keys under memory pressure.
    #[error(
        "the Redis at {target} has maxmemory-policy {policy}: under memory pressure it may \
         evict flashsale's stock counters, buyers and locks, and then sell a unit twice. On \
         that server, run CONFIG SET maxmemory-policy noeviction and set `maxmemory-policy \
         noeviction` in its redis.conf (so a restart keeps it), or give flashsale a Redis of \
         its own"
    )]
    EvictionPolicy {
        /// The server.
        target: String,
        /// Its policy.
        policy: String,
    },
    /// The private redis-server could not start.
    #[error("could not start a private redis-server: {0}")]
    EmbeddedRedis(#[source] private_redis::Error),
    /// Another instance runs on this data directory.
    #[error(
        "the data directory {} is in use by another flashsale serve{} ({} is locked). \
         With REDIS_URL unset, flashsale runs a private Redis and serves ONE instance per \
         data directory; give each instance its own --data-dir, or run a fleet on shared \
         servers by setting REDIS_URL and DATABASE_URL on every instance",
        data_dir.display(),
        holder.map(|pid| format!(" (pid {pid})")).unwrap_or_default(),
        lock.display()
    )]
    DataDirInUse {
        /// The data directory.
        data_dir: PathBuf,
        /// The lock file found held.
        lock: PathBuf,
        /// The holder's pid, when it could be read.
        holder: Option<u32>,
    },
    /// The lock strategy's lease does not fit its critical section.
    #[error(transparent)]
    Lease(#[from] crate::strategy::LeaseError),
    /// Another embedded instance uses this database.
    #[error(
        "the database {database} is in use by another flashsale serve in the embedded mode \
         (REDIS_URL unset): two private Redis servers would sell the same stock twice. Give \
         each embedded instance its own database, or run a fleet by setting REDIS_URL and \
         DATABASE_URL on every instance"
    )]
    DatabaseInUse {
        /// The SQLite file, or which PostgreSQL database.
        database: String,
    },
    /// The embedded mode's data directory is not there (a command other than `serve`).
    #[error(
        "no flashsale data directory at {}: {reason}; `flashsale serve` creates one (check \
         --data-dir, or set REDIS_URL and DATABASE_URL for a fleet's store)",
        path.display()
    )]
    NoDataDir {
        /// The directory.
        path: PathBuf,
        /// What is missing.
        reason: String,
    },
    /// The store holds no such coupon.
    #[error("the store holds no coupon {id}")]
    NoSuchCoupon {
        /// The id asked about.
        id: i64,
    },
    /// The SQLite file of the embedded mode could not be opened or locked.
    #[error("cannot {action} the SQLite file {}: {reason}", path.display())]
    SqliteFile {
        /// The file.
        path: PathBuf,
        /// `open` or `lock`.
        action: &'static str,
        /// The OS error.
        reason: String,
    },
    /// The store's stock is sold from another Redis.
    #[error(transparent)]
    Authority(Box<crate::authority::AuthorityError>),
    /// The database could not be opened or migrated.
    #[error("{0} (set DATABASE_URL, or unset it to use SQLite in a file)")]
    Db(#[source] DbError),
    /// The SQLite store's write lock is held by a process that does not let go of it
    /// (frozen with SIGSTOP mid-transaction, say): nothing can write to the store.
    #[error(
        "the store {database} is locked by {holders}, so nothing can write to it (a \
         take-over included); free the lock, then run this again"
    )]
    StoreLocked {
        /// The database, password masked.
        database: String,
        /// Who holds the lock and how to free it, for people.
        holders: String,
    },
    /// Loading stock at start failed.
    #[error("loading stock at start failed: {0}")]
    Load(#[source] crate::stock::LoadError),
    /// The order worker could not connect.
    #[error("the order worker could not connect to redis: {0}")]
    Worker(#[source] crate::worker::WorkerError),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl From<crate::authority::AuthorityError> for ConfigError {
    fn from(err: crate::authority::AuthorityError) -> Self {
        ConfigError::Authority(Box::new(err))
    }
}

impl ConfigError {
    /// A failure to connect to Redis, told in the operator's terms.
    pub fn redis(err: distlock::Error) -> Self {
        match err {
            distlock::Error::EvictionPolicy { target, policy } => {
                ConfigError::EvictionPolicy { target, policy }
            }
            other => ConfigError::Redis(other),
        }
    }

    /// An out-of-range setting.
    pub fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            what,
            reason: reason.into(),
        }
    }
}

/// The data stores of an in-process run (`load`, `bench`): REDIS_URL and DATABASE_URL when
/// set, otherwise a throwaway redis-server and a SQLite file in a scratch directory, both
/// gone when this is dropped (the Redis also when the process is killed). Every service the
/// run starts shares them.
pub struct Sandbox {
    redis_url: String,
    database_url: Option<String>,
    scratch: private_redis::ScratchDir,
    aof: bool,
    // Last, so the private Redis outlives the services built on it.
    private_redis: Option<private_redis::PrivateRedis>,
}

impl Sandbox {
    /// Starts what `store` leaves unset. With `aof`, the private Redis writes an
    /// append-only file synced every second, as the embedded `serve` does (to measure what
    /// that costs); its directory is still thrown away.
    pub async fn new(store: &StoreArgs, aof: bool) -> Result<Sandbox, ConfigError> {
        let (redis_url, private_redis) = match &store.redis_url {
            Some(url) => (url.clone(), None),
            None => {
                let persistence: &[&str] = if aof {
                    &["--appendonly", "yes", "--appendfsync", "everysec"]
                } else {
                    &[]
                };
                let server = private_redis::PrivateRedis::ephemeral()
                    .args(persistence)
                    .die_with_parent(true)
                    .start()
                    .await
                    .map_err(ConfigError::EmbeddedRedis)?;
                (server.url(), Some(server))
            }
        };
        // Swept by a later run if this one is killed.
        let scratch = private_redis::ScratchDir::new("flashsale-")
            .map_err(|err| ConfigError::invalid("scratch directory", err.to_string()))?;
        Ok(Sandbox {
            redis_url,
            database_url: store.database_url.clone(),
            scratch,
            aof,
            private_redis,
        })
    }

    /// A service configuration for `strategy` on these stores.
    pub fn config(
        &self,
        strategy: Strategy,
        knobs: &StrategyArgs,
    ) -> Result<ServiceConfig, ConfigError> {
        let mut config = ServiceConfig::new(strategy);
        config.redis_url = Some(self.redis_url.clone());
        config.database_url = self.database_url.clone();
        config.data_dir = self.scratch.path().to_owned();
        config.strategy = knobs.settings(strategy)?;
        // The throwaway store is the run's own; a DATABASE_URL must name an existing one.
        config.create_store = self.database_url.is_none();
        Ok(config)
    }

    /// A directory for the run's own files, removed with the sandbox.
    pub fn scratch(&self) -> &std::path::Path {
        self.scratch.path()
    }

    /// Whether both stores are private to this run.
    pub fn is_private(&self) -> bool {
        self.private_redis.is_some() && self.database_url.is_none()
    }

    /// One line for the user: which stores the run uses, and that private ones are
    /// thrown away.
    pub fn describe(&self) -> String {
        let redis = match &self.private_redis {
            Some(_) if self.aof => {
                "a throwaway redis-server (append-only file, fsync every second)".to_owned()
            }
            Some(_) => "a throwaway redis-server (no persistence)".to_owned(),
            None => format!("redis {}", crate::db::mask_password(&self.redis_url)),
        };
        let database = match &self.database_url {
            Some(url) => format!("database {}", crate::db::mask_password(url)),
            None => format!(
                "a throwaway SQLite file in {}",
                self.scratch.path().display()
            ),
        };
        let note = if self.private_redis.is_some() || self.database_url.is_none() {
            "; the throwaway stores are deleted when the run ends (set REDIS_URL and DATABASE_URL to keep the data)"
        } else {
            ""
        };
        format!("{redis}, {database}{note}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_dir_with_url_syntax_in_its_name_names_that_directory() {
        let mut config = ServiceConfig::new(Strategy::Lua);
        config.data_dir = PathBuf::from("/srv/50%20off?#x");
        let url = config.database_url();
        assert_eq!(url, "sqlite:///srv/50%2520off%3F%23x/flashsale.db");
        assert_eq!(
            ServiceConfig {
                database_url: Some(url),
                ..config.clone()
            }
            .sqlite_file_in_use(),
            Some(PathBuf::from("/srv/50%20off?#x/flashsale.db"))
        );
        config.database_url = Some("sqlite:shop.db?mode=rwc".into());
        assert_eq!(config.sqlite_file_in_use(), Some(PathBuf::from("shop.db")));
        config.database_url = Some("postgres://u@h/db".into());
        assert_eq!(config.sqlite_file_in_use(), None);
    }
}
