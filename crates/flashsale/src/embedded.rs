//! The embedded mode: `flashsale serve` with no REDIS_URL runs its own Redis, and keeps
//! everything in one data directory that survives kills and restarts.
//!
//! - The private redis-server writes an append-only file in `DATA_DIR/redis`, synced every
//!   second. A reply leaves Redis only after its write reached the kernel, so a kill of
//!   the service or of Redis loses no reservation a buyer was told about; only a crash of
//!   the machine can lose the last second.
//! - It stops with the service, kill -9 included (a parent-death signal), and a server
//!   left by an earlier crash is stopped before a new one starts (its pid file).
//! - One instance owns the directory (an exclusive lock), because a private Redis cannot
//!   be shared: a second instance would sell the same stock again from its own counter.
//!   Fleets point every instance at shared servers with REDIS_URL and DATABASE_URL.

use std::path::{Path, PathBuf};

use std::fs::{File, OpenOptions};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use private_redis::{DirLock, PrivateRedis};

use crate::config::ConfigError;

/// The lock file of a data directory.
const LOCK_FILE: &str = "flashsale.lock";

/// A data directory held by this instance, and the Redis running in it.
pub struct Embedded {
    data_dir: PathBuf,
    redis: PrivateRedis,
    // Released last, after Redis was told to stop.
    _locks: Vec<DirLock>,
    /// The SQLite file, held with `flock` on the file itself.
    _database: Option<Flock<File>>,
}

impl Embedded {
    /// Takes `data_dir` (created if missing, readable by its owner only) and, when the
    /// database is a SQLite file, that file too; then starts the private Redis on the
    /// directory's data.
    ///
    /// Without `create`, the directory, its Redis data and the SQLite file must exist
    /// already ([`ConfigError::NoDataDir`]): only `serve` creates a store.
    pub async fn open(
        data_dir: &Path,
        sqlite_path: Option<&Path>,
        create: bool,
    ) -> Result<Embedded, ConfigError> {
        if !create {
            let missing = |reason: String| ConfigError::NoDataDir {
                path: data_dir.to_owned(),
                reason,
            };
            if !data_dir.is_dir() {
                return Err(missing("no such directory".to_owned()));
            }
            if !data_dir.join("redis").is_dir() {
                return Err(missing("it holds no redis/ directory".to_owned()));
            }
            if let Some(path) = sqlite_path.filter(|path| !path.is_file()) {
                return Err(missing(format!(
                    "there is no SQLite file {}",
                    path.display()
                )));
            }
        }
        std::fs::create_dir_all(data_dir).map_err(|err| {
            ConfigError::invalid(
                "--data-dir",
                format!("cannot create {}: {err}", data_dir.display()),
            )
        })?;
        // Orders, and the Redis password, are nobody else's business.
        use std::os::unix::fs::PermissionsExt;
        if let Err(err) = std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o700))
        {
            tracing::warn!(error = %err, dir = %data_dir.display(), "could not make the data directory private");
        }
        let data_dir = std::fs::canonicalize(data_dir).map_err(|err| {
            ConfigError::invalid(
                "--data-dir",
                format!("cannot resolve {}: {err}", data_dir.display()),
            )
        })?;
        let locks = vec![take(&data_dir.join(LOCK_FILE), &data_dir)?];
        // Two instances with private Redis servers on one SQLite file would each sell the
        // whole stock, so the file is held too, however it was named (the default,
        // --sqlite-path or DATABASE_URL, a symlink, a hard link): a data directory of its
        // own does not make the database its own.
        let database = sqlite_path.map(hold_database_file).transpose()?;
        let redis = PrivateRedis::persistent(data_dir.join("redis"))
            .start()
            .await
            .map_err(ConfigError::EmbeddedRedis)?;
        Ok(Embedded {
            data_dir,
            redis,
            _database: database,
            _locks: locks,
        })
    }

    /// The Redis to use for `config`: its REDIS_URL, or else this mode, opened on its data
    /// directory and database (the URL is then the private Redis's).
    pub async fn open_unless_redis_url(
        config: &crate::ServiceConfig,
    ) -> Result<(String, Option<Embedded>), ConfigError> {
        if let Some(url) = &config.redis_url {
            return Ok((url.clone(), None));
        }
        let sqlite = config.sqlite_file_in_use();
        let embedded =
            Embedded::open(&config.data_dir, sqlite.as_deref(), config.create_store).await?;
        Ok((embedded.redis_url(), Some(embedded)))
    }

    /// The URL of the private Redis (with its password).
    pub fn redis_url(&self) -> String {
        self.redis.url()
    }

    /// `Some(its last log lines)` once the private Redis has exited on its own: the
    /// service cannot go on without it.
    pub fn redis_exited(&mut self) -> Option<Vec<String>> {
        self.redis.has_exited().then(|| self.redis.recent_log())
    }

    /// The data directory, absolute.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// Releases every lock of the store's coupons, and the stock loader's, that the
    /// private Redis kept from an earlier run. This instance is its Redis's only client
    /// and has taken no lock yet, so any lock there belongs to a process that is gone:
    /// its append-only file kept it, with up to a whole lease (30 s by default) to run,
    /// and purchases would wait for it and get `busy`. Returns how many were released.
    pub async fn release_locks_of_earlier_runs(
        locks: &distlock::Client,
        keyspace: &crate::keys::Keyspace,
    ) -> Result<usize, distlock::Error> {
        let mut conn = locks.connection();
        let mut names = vec![keyspace.stock_loader_lock()];
        let mut cursor = 0_u64;
        loop {
            let (next, page): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(keyspace.coupon_locks_pattern())
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await?;
            names.extend(page);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        let mut released = 0;
        for name in names {
            if locks.lock(&name)?.force_unlock().await? {
                tracing::warn!(lock = %name, "released a lock an earlier run of this data directory held when it died");
                released += 1;
            }
        }
        Ok(released)
    }

    /// Stops Redis gracefully, so its append-only file is complete.
    pub async fn stop(self) {
        if let Err(err) = self.redis.stop().await {
            tracing::error!(error = %err, "stopping the private redis-server failed");
        }
    }
}

/// Holds the SQLite file at `path` (created empty if missing, which SQLite takes for a
/// new database) with an exclusive `flock` on the file itself. The lock belongs to the
/// file, not to a name, so a symlink or a hard link to it finds it held. SQLite's own
/// locks are `fcntl` locks, which `flock` does not touch.
fn hold_database_file(path: &Path) -> Result<Flock<File>, ConfigError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|err| ConfigError::SqliteFile {
            path: path.to_owned(),
            action: "open",
            reason: err.to_string(),
        })?;
    Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| match errno {
        Errno::EWOULDBLOCK => ConfigError::DatabaseInUse {
            database: path.display().to_string(),
        },
        other => ConfigError::SqliteFile {
            path: path.to_owned(),
            action: "lock",
            reason: other.to_string(),
        },
    })
}

fn take(lock: &Path, data_dir: &Path) -> Result<DirLock, ConfigError> {
    DirLock::acquire(lock).map_err(|err| match err {
        private_redis::Error::InUse { path, holder } => ConfigError::DataDirInUse {
            data_dir: data_dir.to_owned(),
            lock: path,
            holder,
        },
        other => ConfigError::EmbeddedRedis(other),
    })
}
