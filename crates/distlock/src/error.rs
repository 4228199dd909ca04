//! The one error type of the crate.

use std::time::Duration;

/// Everything that can go wrong in distlock.
///
/// Invalid input is reported before anything is sent to Redis, so a caller can tell a
/// programming mistake ([`Error::InvalidName`], [`Error::InvalidDuration`],
/// [`Error::InvalidUrl`]) from a failure of the server or the network.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A lock name was empty or otherwise unusable as a Redis key.
    #[error("invalid lock name {name:?}: {reason}")]
    InvalidName {
        /// The name as given.
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },

    /// A duration was zero, or too large to be expressed in Redis milliseconds.
    #[error("invalid {what}: {reason}")]
    InvalidDuration {
        /// Which setting the duration was given for.
        what: &'static str,
        /// Why it was refused.
        reason: String,
    },

    /// An argument of a call is out of its range: zero permits, a count a latch cannot
    /// hold. Nothing was sent to Redis.
    #[error("invalid {what}: {reason}")]
    InvalidArgument {
        /// Which argument.
        what: &'static str,
        /// Why it was refused.
        reason: String,
    },

    /// A client setting is out of its range.
    #[error("invalid setting {what}: {reason}")]
    InvalidConfig {
        /// Which setting.
        what: &'static str,
        /// Why it was refused.
        reason: String,
    },

    /// The connection URL could not be parsed or uses an unsupported scheme.
    #[error("invalid connection URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given, with any password masked.
        url: String,
        /// Why it was refused.
        reason: String,
    },

    /// Redis could not be reached or refused the connection handshake.
    #[error("cannot connect to Redis at {target}: {source}")]
    Connect {
        /// Where the client tried to connect.
        target: String,
        /// The underlying failure.
        #[source]
        source: redis::RedisError,
    },

    /// Connecting took longer than the configured connection timeout.
    #[error("timed out after {after:?} connecting to Redis at {target}")]
    ConnectTimeout {
        /// Where the client tried to connect.
        target: String,
        /// The configured timeout.
        after: Duration,
    },

    /// The peer accepted the connection but did not answer like a Redis server.
    #[error("the server at {target} does not answer like Redis: {detail}")]
    NotRedis {
        /// Where the client connected.
        target: String,
        /// What it answered instead.
        detail: String,
    },

    /// The server may evict keys under memory pressure, which breaks locks: an evicted
    /// lock key hands the lock to another client while its holder still trusts it, and an
    /// evicted fencing counter restarts tokens. Set `maxmemory-policy noeviction`, or
    /// accept the risk with [`ClientBuilder::allow_eviction`](crate::ClientBuilder::allow_eviction).
    #[error(
        "the Redis at {target} has maxmemory-policy {policy}: evicted lock keys break mutual \
         exclusion; set it to noeviction, or opt in with ClientBuilder::allow_eviction(true)"
    )]
    EvictionPolicy {
        /// Where the client connected.
        target: String,
        /// The server's policy.
        policy: String,
    },

    /// The lock is not held by the owner that tried to release it: it was never taken,
    /// it was already released, or its lease expired.
    #[error("lock {name:?} is not held by owner {owner}")]
    NotHeld {
        /// The lock name.
        name: String,
        /// The owner (`<client id>:<n>`) of the holding that tried to release it.
        owner: String,
    },

    /// A Redis command failed: the connection broke, a response timed out, or the server
    /// answered with an error (for example a key of the wrong type at the lock name).
    #[error("Redis command failed: {0}")]
    Redis(redis::RedisError),

    /// The Redis user is not allowed a command, key or channel that distlock needs (an
    /// ACL refused it). The call that was refused changed nothing; docs/safety.md lists
    /// the minimal ACL.
    #[error(
        "the Redis user lacks a permission distlock needs ({detail}); \
         see the minimal ACL in distlock's docs/safety.md"
    )]
    NoPermission {
        /// What the server refused, in its words.
        detail: String,
        /// The server's error.
        #[source]
        source: redis::RedisError,
    },

    /// The client was shut down ([`Client::shutdown`](crate::Client::shutdown)): it no
    /// longer acquires, because nothing would renew or release what it took.
    #[error("the distlock client was shut down")]
    Shutdown,

    /// The client's own runtime (a thread with a tokio runtime) could not be started.
    #[error("cannot start the distlock client's runtime: {0}")]
    Runtime(#[source] std::io::Error),

    /// A RedLock could not reach enough of its masters to decide: more of them failed
    /// (no reply within the node timeout, a refused connection, an error) than a majority
    /// can spare. Whatever the reachable masters granted was given back.
    #[error(
        "RedLock {name:?} needs {needed} of {nodes} masters, but {} failed: {}",
        failures.len(),
        failures.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    )]
    QuorumUnavailable {
        /// The lock name.
        name: String,
        /// How many masters must grant the lock.
        needed: usize,
        /// How many masters the RedLock has.
        nodes: usize,
        /// The masters that failed, and how.
        failures: Vec<NodeFailure>,
    },

    /// Fewer replicas acknowledged an acquisition than replica sync requires, so it was
    /// given back: a failover could have promoted a replica without it. Returned by
    /// `try_lock`; a call willing to wait retries until a replica acknowledges or its
    /// patience ends. See [`ReplicaSync`](crate::ReplicaSync).
    #[error(
        "lock {name:?}: {acknowledged} replica(s) acknowledged the acquisition within \
         {timeout:?}, {required} required; it was given back"
    )]
    NotReplicated {
        /// The lock name.
        name: String,
        /// How many replicas acknowledged.
        acknowledged: u32,
        /// How many replica sync requires.
        required: u32,
        /// How long it waited.
        timeout: Duration,
    },

    /// A store other than Redis (PostgreSQL) failed a request: the connection, a
    /// permission, or the request itself. [`Error::is_connection_error`] is true for the
    /// first kind, after which the same call may succeed.
    #[error("{store} at {target}: {detail}")]
    Store {
        /// Which store: `"PostgreSQL"`.
        store: &'static str,
        /// Where the client connected (`host:port/database`).
        target: String,
        /// What kind of failure it was.
        failure: StoreFailure,
        /// What the store said, and what to do about it.
        detail: String,
    },

    /// The client's store does not offer this primitive or call: a fair lock on
    /// PostgreSQL, say. Nothing was sent. docs/safety.md lists what each store offers.
    #[error("{what} is not available on {store}; docs/safety.md lists what each store offers")]
    Unsupported {
        /// The client's store.
        store: &'static str,
        /// What was asked for.
        what: &'static str,
    },

    /// A script answered with a shape that distlock does not expect. This points at a key
    /// written by something that does not follow the lock's data layout.
    #[error("unexpected reply from the {script} script: {detail}")]
    UnexpectedReply {
        /// The script name.
        script: &'static str,
        /// What was wrong with the reply.
        detail: String,
    },
}

/// What kind of failure an [`Error::Store`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreFailure {
    /// The connection failed or timed out, or the store is not taking requests (a
    /// shutdown, a failover): the request may or may not have run, and may succeed later.
    Connection,
    /// The store's user lacks a right distlock needs (a table, a sequence, LISTEN).
    PermissionDenied,
    /// The store refused the request itself.
    Request,
}

/// One master of a RedLock that did not answer an attempt usefully.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFailure {
    /// The master, as `host:port`.
    pub node: String,
    /// What went wrong there.
    pub reason: String,
    /// True if the failure was of the connection or the node's time (a timeout, a
    /// refused or broken connection), which may clear by itself.
    pub transient: bool,
}

impl std::fmt::Display for NodeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.node, self.reason)
    }
}

impl From<redis::RedisError> for Error {
    fn from(err: redis::RedisError) -> Self {
        if is_permission_denied(&err) {
            let detail = err.detail().unwrap_or("permission denied").to_owned();
            return Error::NoPermission {
                detail,
                source: err,
            };
        }
        Error::Redis(err)
    }
}

/// An ACL refusal: NOPERM for a command sent directly, or the error Redis raises inside a
/// script ("The user executing the script can't ...", with the code ERR).
pub(crate) fn is_permission_denied(err: &redis::RedisError) -> bool {
    matches!(
        err.kind(),
        redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm)
    ) || err
        .detail()
        .is_some_and(|detail| detail.contains("user executing the script can't"))
}

impl Error {
    /// True for failures of the connection rather than of the request: a broken or
    /// refused connection, a reply that did not come in time, or a deployment in
    /// transition (a failover, a cluster slot on the move: TRYAGAIN, CLUSTERDOWN,
    /// READONLY, LOADING). The same call may succeed later; whether a timed-out command
    /// ran is unknown.
    pub fn is_connection_error(&self) -> bool {
        match self {
            Error::Redis(err) => is_connection_failure(err),
            Error::Connect { .. } | Error::ConnectTimeout { .. } | Error::NotReplicated { .. } => {
                true
            }
            Error::QuorumUnavailable { failures, .. } => {
                failures.iter().all(|failure| failure.transient)
            }
            Error::Store { failure, .. } => *failure == StoreFailure::Connection,
            _ => false,
        }
    }

    /// True when the store's user lacks a right distlock needs (a Redis ACL, a
    /// PostgreSQL grant): asking again will not help.
    pub(crate) fn is_denied(&self) -> bool {
        matches!(
            self,
            Error::NoPermission { .. }
                | Error::Store {
                    failure: StoreFailure::PermissionDenied,
                    ..
                }
        )
    }
}

/// A failure of the connection, after which a command may or may not have run, or a
/// refusal of a deployment in transition, after which it did not run: either way the
/// same command may succeed if sent again.
pub(crate) fn is_connection_failure(err: &redis::RedisError) -> bool {
    use redis::ServerErrorKind as Kind;
    err.is_io_error()
        || err.is_timeout()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || matches!(
            err.kind(),
            redis::ErrorKind::Server(
                Kind::TryAgain
                    | Kind::ClusterDown
                    | Kind::Moved
                    | Kind::Ask
                    | Kind::MasterDown
                    | Kind::ReadOnly
                    | Kind::BusyLoading
            )
        )
}

/// Shorthand for results whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
