//! Configuration: flags and environment, checked before anything starts, with errors that
//! say what to fix.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::db::DbError;
use crate::strategy::{Strategy, StrategySettings};
use crate::worker::WorkerSettings;

/// Where the service keeps its data.
#[derive(Debug, Clone, clap::Args)]
pub struct StoreArgs {
    /// Redis to use. Unset: a private redis-server (`serve` keeps its data in --data-dir;
    /// `load` and `bench` use a throwaway one).
    #[arg(long, env = "REDIS_URL")]
    pub redis_url: Option<String>,
    /// sqlite://PATH or postgres://USER:PASSWORD@HOST/DB. Unset: SQLite in a file.
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: Option<String>,
}

/// The knobs of the lock-based strategies.
#[derive(Debug, Clone, clap::Args)]
pub struct StrategyArgs {
    /// Stock segments per coupon for --strategy segmented (1 to 1024).
    #[arg(long, default_value_t = 8)]
    pub segments: u32,
    /// How long a purchase waits for a lock before answering 503 busy, in ms.
    #[arg(long, default_value_t = 10_000)]
    pub lock_wait_ms: u64,
    /// The lease of a purchase's lock, in ms (at least 100). `serve` also refuses a lease
    /// shorter than the critical section it measures at start.
    #[arg(long, default_value_t = 30_000)]
    pub lock_lease_ms: u64,
    /// How long a purchase may take from arrival to answer, in ms: one not sent to Redis
    /// by then is not sold, and lock waits end by it.
    #[arg(long, default_value_t = 15_000)]
    pub request_timeout_ms: u64,
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
        if self.lock_wait_ms == 0 || self.lock_wait_ms > 60_000 {
            return Err(ConfigError::invalid(
                "--lock-wait-ms",
                "must be between 1 and 60000",
            ));
        }
        let min_lease = MIN_LOCK_LEASE.as_millis() as u64;
        if !(min_lease..=600_000).contains(&self.lock_lease_ms) {
            return Err(ConfigError::invalid(
                "--lock-lease-ms",
                format!("must be between {min_lease} and 600000"),
            ));
        }
        if !(100..=600_000).contains(&self.request_timeout_ms) {
            return Err(ConfigError::invalid(
                "--request-timeout-ms",
                "must be between 100 and 600000",
            ));
        }
        if !(1..=1_000_000).contains(&self.queue_limit) {
            return Err(ConfigError::invalid(
                "--queue-limit",
                "must be between 1 and 1000000",
            ));
        }
        Ok(StrategySettings {
            strategy,
            segments: self.segments,
            lock_wait: Duration::from_millis(self.lock_wait_ms),
            lock_lease: Duration::from_millis(self.lock_lease_ms),
            fault_stop_holder_of_user: self.fault_stop_holder_of_user,
            request_timeout: Duration::from_millis(self.request_timeout_ms),
            queue_limit: self.queue_limit,
        })
    }
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
        let Some(url) = &self.database_url else {
            return Some(self.sqlite_file());
        };
        let rest = url
            .strip_prefix("sqlite://")
            .or_else(|| url.strip_prefix("sqlite:"))?;
        let path = rest.split('?').next().unwrap_or_default();
        let path = percent_decode(path);
        (!path.is_empty() && path != ":memory:").then(|| PathBuf::from(path))
    }

    /// The SQLite file in effect when `database_url` is `None`.
    pub fn sqlite_file(&self) -> PathBuf {
        self.sqlite_path
            .clone()
            .unwrap_or_else(|| self.data_dir.join("flashsale.db"))
    }
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
    /// The lock's lease is too short for the critical section it guards.
    #[error(
        "invalid --lock-lease-ms: a lease of {} ms is shorter than {} × the critical section's \
         p99 measured at start ({:.1} ms for a Redis check and a committed SQL write); a \
         holder would routinely lose its lock mid-sale. Use at least {} ms",
        lease.as_millis(),
        crate::strategy::LEASE_HEADROOM,
        p99.as_secs_f64() * 1000.0,
        (p99.as_millis() + 1) * u128::from(crate::strategy::LEASE_HEADROOM)
    )]
    LeaseTooShort {
        /// The configured lease.
        lease: Duration,
        /// The measured p99 of the critical section.
        p99: Duration,
    },
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
    /// The store's stock is sold from another Redis.
    #[error(transparent)]
    Authority(Box<crate::authority::AuthorityError>),
    /// The database could not be opened or migrated.
    #[error("{0} (set DATABASE_URL, or unset it to use SQLite in a file)")]
    Db(#[source] DbError),
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
