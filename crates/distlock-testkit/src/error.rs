//! The single error type of the testkit.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong while running test infrastructure.
///
/// Variants that wrap a lower-level error repeat its message in `Display`
/// because these errors mostly end up in test failure output, where the
/// whole story on one line matters more than a tidy source chain.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    /// The `redis-server` binary could not be found on `PATH`.
    #[error(
        "redis-server is not installed or not on PATH; install it with `apt-get install redis-server` (Debian/Ubuntu)"
    )]
    RedisNotInstalled,

    /// `DISTLOCK_REDIS_SERVER` names a binary that does not exist.
    #[error("DISTLOCK_REDIS_SERVER points to `{}`, which does not exist", path.display())]
    RedisBinaryNotFound {
        /// The path taken from the environment variable.
        path: PathBuf,
    },

    /// Spawning `redis-server` failed for a reason other than "not found".
    #[error("failed to spawn `{}`: {source}", binary.display())]
    Spawn {
        /// The binary that was being spawned.
        binary: PathBuf,
        /// The underlying OS error.
        source: io::Error,
    },

    /// `redis-server` exited before it reported being ready.
    #[error(
        "redis-server on port {port} exited before it was ready ({status}); output:\n{output}"
    )]
    ServerExited {
        /// Port the server was asked to listen on.
        port: u16,
        /// Exit status as reported by the OS.
        status: String,
        /// The server's recent stdout/stderr lines.
        output: String,
    },

    /// `redis-server` did not report readiness in time.
    #[error("redis-server on port {port} was not ready within {timeout:?}; output:\n{output}")]
    StartTimeout {
        /// Port the server was asked to listen on.
        port: u16,
        /// How long we waited.
        timeout: Duration,
        /// The server's recent stdout/stderr lines.
        output: String,
    },

    /// Every attempt to bind a port failed because it was already in use.
    #[error(
        "redis-server could not bind a port after {attempts} attempts (last tried {port}); output:\n{output}"
    )]
    PortUnavailable {
        /// The last port tried.
        port: u16,
        /// Number of attempts made.
        attempts: u32,
        /// The server's output from the last attempt.
        output: String,
    },

    /// The operation needs a running server, but it has been killed.
    #[error("redis-server is not running")]
    NotRunning,

    /// Sending a signal to the server process failed.
    #[error("failed to send {signal} to redis-server (pid {pid}): {source}")]
    Signal {
        /// Name of the signal, e.g. `SIGSTOP`.
        signal: &'static str,
        /// Target process id.
        pid: u32,
        /// The underlying errno.
        source: nix::Error,
    },

    /// PostgreSQL's binaries (initdb, postgres) were not found.
    #[error(
        "PostgreSQL is not installed: no initdb in $DISTLOCK_PG_BIN, /usr/lib/postgresql/*/bin or PATH; install it with `apt-get install postgresql`"
    )]
    PostgresNotInstalled,

    /// initdb or postgres failed or did not become ready.
    #[error("postgres: {what}; output:\n{output}")]
    Postgres {
        /// What failed.
        what: String,
        /// The process's output.
        output: String,
    },

    /// A filesystem or process I/O operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What the testkit was doing.
        context: String,
        /// The underlying OS error.
        source: io::Error,
    },

    /// A Redis command or connection failed.
    #[error("redis error: {0}")]
    Redis(#[from] redis::RedisError),

    /// Serialising an interval to JSON failed.
    #[error("failed to encode interval as JSON: {0}")]
    JsonEncode(serde_json::Error),

    /// A line of a JSONL interval file could not be parsed.
    #[error("invalid interval on line {line} of `{}`: {source}", path.display())]
    JsonDecode {
        /// The file being read.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The parse error.
        source: serde_json::Error,
    },

    /// Redis answered with something the testkit cannot interpret.
    #[error("unexpected reply from redis: {0}")]
    UnexpectedReply(String),
}

impl TestkitError {
    /// Builds a closure mapping an [`io::Error`] to [`TestkitError::Io`],
    /// for use with `map_err`.
    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(io::Error) -> TestkitError {
        let context = context.into();
        move |source| TestkitError::Io { context, source }
    }
}
