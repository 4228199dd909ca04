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
    /// Starting, signalling or stopping a redis-server failed.
    #[error(transparent)]
    Server(#[from] private_redis::Error),

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

    /// A consensus store's server (etcd, ZooKeeper) was not found.
    #[error("{store} is not installed: {hint}")]
    StoreNotInstalled {
        /// `etcd` or `ZooKeeper`.
        store: &'static str,
        /// Where the testkit looked and how to install it.
        hint: String,
    },

    /// An etcd member or ZooKeeper server did not start, did not become ready, or
    /// answered something the testkit cannot interpret.
    #[error("{store}: {what}; recent output:\n{output}")]
    Store {
        /// `etcd` or `ZooKeeper`.
        store: &'static str,
        /// What failed.
        what: String,
        /// The last lines the process(es) wrote, if any.
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

    /// A topology did not reach the awaited state within its time limit.
    #[error("timed out after {waited:?} waiting for {what}; last seen: {last}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long the testkit waited.
        waited: Duration,
        /// The last state observed, or why it could not be observed.
        last: String,
    },

    /// `redis-cli` (used to create a cluster) failed.
    #[error("redis-cli {what} failed ({status}); output:\n{output}")]
    RedisCli {
        /// What redis-cli was asked to do.
        what: String,
        /// Exit status, or why there is none.
        status: String,
        /// Its stdout and stderr.
        output: String,
    },

    /// A topology operation was asked of a node in the wrong state, e.g. a failover of a
    /// node that is not a master, or of a master without a live replica.
    #[error("invalid topology operation: {0}")]
    Topology(String),
}

impl TestkitError {
    /// Builds a closure mapping an [`io::Error`] to [`TestkitError::Io`],
    /// for use with `map_err`.
    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(io::Error) -> TestkitError {
        let context = context.into();
        move |source| TestkitError::Io { context, source }
    }
}
