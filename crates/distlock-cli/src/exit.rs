//! The command's exit codes, and how a failure maps to one. Listed in `--help`, the
//! README and docs/cli.md; a test checks each.

use std::process::ExitCode;

/// Bad arguments (clap's own code for a usage error).
pub const USAGE: u8 = 2;
/// Something went wrong in distlock itself.
pub const INTERNAL: u8 = 70;
/// Redis could not be reached, or did not answer in time.
pub const UNAVAILABLE: u8 = 69;
/// The lock is held by someone else (`--no-wait`, or `--wait` ran out): the default of
/// `--conflict-exit-code`. EX_TEMPFAIL: try again later.
pub const CONFLICT: u8 = 75;
/// Redis refused the user (ACL) or the server cannot hold locks safely (eviction).
pub const REFUSED: u8 = 77;
/// The lock was lost while the command ran; the command was stopped.
pub const LOST: u8 = 79;
/// The command could not be run (not executable).
pub const CANNOT_EXECUTE: u8 = 126;
/// The command was not found.
pub const NOT_FOUND: u8 = 127;

/// The table `--help` prints after the options.
pub const TABLE: &str = "\
Exit codes:
  <the command's own>  run, elect: the command's exit status, passed through
  128+N                the command was killed by signal N
  2                    bad arguments
  69                   Redis could not be reached, or did not answer in time
  70                   an internal error
  75                   the lock is held by someone else (--no-wait, or --wait ran out);
                       change it with --conflict-exit-code
  77                   Redis refused: the ACL user may not do this, or the server may
                       evict keys (maxmemory-policy)
  79                   the lock was lost while the command ran; the command was stopped
  126, 127             the command could not be run, or was not found";

/// A failure the command reports in one line on stderr, with its exit code.
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub message: String,
}

impl Failure {
    pub fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// Prints the message and gives the code.
    pub fn report(self) -> ExitCode {
        crate::out::say(&self.message);
        ExitCode::from(self.code)
    }
}

impl From<distlock::Error> for Failure {
    fn from(err: distlock::Error) -> Self {
        use distlock::Error;
        let code = match &err {
            Error::InvalidName { .. }
            | Error::InvalidDuration { .. }
            | Error::InvalidArgument { .. }
            | Error::InvalidConfig { .. }
            | Error::InvalidUrl { .. } => USAGE,
            Error::NoPermission { .. } | Error::EvictionPolicy { .. } => REFUSED,
            Error::Redis(redis)
                if redis.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm) =>
            {
                REFUSED
            }
            Error::Connect { source, .. } if is_refused_auth(source) => REFUSED,
            Error::Connect { .. }
            | Error::ConnectTimeout { .. }
            | Error::NotRedis { .. }
            | Error::Redis(_)
            | Error::NotReplicated { .. }
            | Error::QuorumUnavailable { .. } => UNAVAILABLE,
            _ => INTERNAL,
        };
        let message = match &err {
            Error::EvictionPolicy { target, policy } => format!(
                "the Redis at {target} has maxmemory-policy {policy}: it may evict lock keys, \
                 which hands a held lock to another; set maxmemory-policy noeviction"
            ),
            _ => err.to_string(),
        };
        // A lock, a semaphore and another application's key cannot share a name.
        if message.contains("WRONGTYPE") {
            return Failure::new(
                USAGE,
                format!(
                    "the name is taken by a key of another kind (a lock and a semaphore, or \
                     another application's key, cannot share a name): {message}"
                ),
            );
        }
        Failure::new(code, message)
    }
}

impl From<redis::RedisError> for Failure {
    fn from(err: redis::RedisError) -> Self {
        Failure::from(distlock::Error::Redis(err))
    }
}

/// A handshake the server answered with a refusal of the user (a wrong password, an
/// unknown user, no permission for the first commands).
fn is_refused_auth(err: &redis::RedisError) -> bool {
    matches!(
        err.kind(),
        redis::ErrorKind::AuthenticationFailed
            | redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm)
    ) || {
        let text = err.to_string().to_ascii_uppercase();
        text.contains("WRONGPASS") || text.contains("NOPERM") || text.contains("NOAUTH")
    }
}
