//! The error type of the crate.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong while running a private redis-server.
///
/// Variants that wrap a lower-level error repeat its message in `Display`: these errors
/// end up in a service's startup failure or a test's output, where the whole story on one
/// line matters more than a tidy source chain.
#[derive(Debug, thiserror::Error)]
pub enum Error {
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

    /// The operation needs a running server, but it has been killed or stopped.
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

    /// Another process holds the data directory.
    #[error("{} is in use by another process{}", path.display(), holder.map(|pid| format!(" (pid {pid})")).unwrap_or_default())]
    InUse {
        /// The lock file that is held.
        path: PathBuf,
        /// The process id the holder wrote into the lock file, when readable.
        holder: Option<u32>,
    },

    /// A redis-server left running in the data directory by an earlier owner would not
    /// stop.
    #[error("a redis-server left by an earlier run (pid {pid}) in {} did not stop within {waited:?}", dir.display())]
    StaleServer {
        /// Its process id, from the pid file.
        pid: u32,
        /// The data directory.
        dir: PathBuf,
        /// How long it was given after SIGTERM and SIGKILL.
        waited: Duration,
    },

    /// A filesystem or process I/O operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying OS error.
        source: io::Error,
    },
}

impl Error {
    /// A closure mapping an [`io::Error`] to [`Error::Io`], for `map_err`.
    pub fn io(context: impl Into<String>) -> impl FnOnce(io::Error) -> Error {
        let context = context.into();
        move |source| Error::Io { context, source }
    }
}
