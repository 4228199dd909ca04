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
  2                    bad arguments; a name that holds another kind of key (another
                       application's, or a lock where a semaphore was asked); a
                       fencing counter that holds no token count (raise it with
                       distlock fence NAME --at-least N) or has none left
  69                   Redis could not be reached, or did not answer in time
  70                   an internal error
  75                   the lock is held by someone else (--no-wait, or --wait ran out);
                       change it with --conflict-exit-code
  77                   Redis refused: a missing or wrong password, an ACL user that may
                       not do this, a server that may evict keys (maxmemory-policy),
                       or a read-only replica named by a redis:// URL
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

/// Whether the URL names one server (`redis://`, `rediss://`, a socket), not a sentinel
/// deployment or a cluster, which follow a failover: set once connected. A READONLY reply
/// from one server means the URL names a replica, which no retry changes.
static SINGLE_SERVER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub fn set_single_server(single: bool) {
    SINGLE_SERVER.store(single, std::sync::atomic::Ordering::Relaxed);
}

/// A failure of taking the lock `name`. A fencing counter the lock scripts refuse (it
/// holds something that is not a token count, or has handed out its last token) is
/// Redis answering, not an unreachable Redis: exit 2, never retried by `elect`, with the
/// operator's repair.
pub fn lock_failure(err: distlock::Error, name: &str) -> Failure {
    if let distlock::Error::Redis(redis) = &err {
        if !err.is_connection_error() {
            let text = redis.to_string();
            let shown = crate::out::shown(name);
            if text.contains("fencing counter") && text.contains("is not a positive integer") {
                return Failure::new(
                    USAGE,
                    format!(
                        "the fencing counter of {shown} holds no token count (another program \
                         wrote it?): no fencing token can be handed out, and {shown} was not \
                         taken. Raise it with `distlock fence {shown} --at-least N`, N the \
                         highest token your store accepted"
                    ),
                );
            }
            if text.contains("has handed out its last token")
                || text.contains("increment or decrement would overflow")
            {
                return Failure::new(
                    USAGE,
                    format!(
                        "the fencing counter of {shown} has handed out its last token \
                         ({}): no later holder can have a larger one, and {shown} was not \
                         taken; lock under another name",
                        i64::MAX
                    ),
                );
            }
        }
    }
    Failure::from(err)
}

/// A READONLY reply (a write sent to a replica).
fn is_read_only(err: &redis::RedisError) -> bool {
    err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
        || err.to_string().contains("READONLY")
}

impl From<distlock::Error> for Failure {
    fn from(err: distlock::Error) -> Self {
        use distlock::Error;
        if let Error::Redis(redis) = &err {
            if is_read_only(redis) && SINGLE_SERVER.load(std::sync::atomic::Ordering::Relaxed) {
                return Failure::new(
                    REFUSED,
                    "the Redis the URL names is a read-only replica (READONLY): it cannot \
                     hold a lock; give the master's address (or redis+sentinel://, which \
                     follows a failover)",
                );
            }
        }
        let code = match &err {
            Error::InvalidName { .. }
            | Error::InvalidDuration { .. }
            | Error::InvalidArgument { .. }
            | Error::InvalidConfig { .. }
            | Error::InvalidUrl { .. } => USAGE,
            Error::NoPermission { .. } | Error::EvictionPolicy { .. } => REFUSED,
            Error::Unsupported { .. } => USAGE,
            Error::Store {
                failure: distlock::StoreFailure::PermissionDenied,
                ..
            } => REFUSED,
            Error::Store { .. } => UNAVAILABLE,
            Error::Redis(redis)
                if redis.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm) =>
            {
                REFUSED
            }
            Error::Connect { source, .. }
                if matches!(
                    source.kind(),
                    redis::ErrorKind::AuthenticationFailed
                        | redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm)
                ) || is_refused_auth(&source.to_string()) =>
            {
                REFUSED
            }
            Error::NotRedis { detail, .. } if is_refused_auth(detail) => REFUSED,
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
            Error::Connect { source, .. } | Error::Redis(source)
                if source.to_string().contains("cluster support disabled") =>
            {
                let at = match &err {
                    Error::Connect { target, .. } => format!(" at {target}"),
                    _ => String::new(),
                };
                return Failure::new(
                    USAGE,
                    format!(
                        "the server{at} is not a Redis Cluster node (cluster support disabled): \
                         give redis+cluster:// only for a cluster, redis:// for one server"
                    ),
                );
            }
            _ => {
                let text = err.to_string();
                if let Some(refusal) = auth_refusal(&text) {
                    let target = match &err {
                        Error::Connect { target, .. } | Error::NotRedis { target, .. } => {
                            format!(" at {target}")
                        }
                        _ => String::new(),
                    };
                    format!("the Redis{target} {refusal}")
                } else if let Error::NotRedis { target, detail } = &err {
                    format!(
                        "the server at {target} does not answer like Redis (is it a Redis port?): {}",
                        first_line(detail)
                    )
                } else {
                    plain(&text)
                }
            }
        };
        // A lock, a semaphore and another application's key cannot share a name.
        if message.contains("WRONGTYPE") {
            return Failure::new(
                USAGE,
                "a key distlock needs holds another kind of value (WRONGTYPE): a lock and a \
                 semaphore, or another application's key, cannot share a name",
            );
        }
        Failure::new(code, message)
    }
}

/// The first line of a message (a parser's error can run over several), without
/// trailing blanks.
fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or("").trim_end()
}

/// A server error as an operator reads it: one line, without the SHA and the line of the
/// script that raised it (`script: 0f3a…, on @user_script:122.`, `(call to f_0f3a…)`,
/// `@user_script:12:`).
fn plain(text: &str) -> String {
    let mut text = first_line(text).to_owned();
    if let Some(at) = text.find(" script: ") {
        let rest = &text[at + " script: ".len()..];
        if rest.len() >= 40 && rest[..40].bytes().all(|byte| byte.is_ascii_hexdigit()) {
            text.truncate(at);
        }
    }
    if let Some(at) = text.find(" (call to f_") {
        if let Some(end) = text[at..].find(')') {
            text.replace_range(at..at + end + 1, "");
        }
    }
    while let Some(at) = text.find("@user_script:") {
        let digits = text[at + "@user_script:".len()..]
            .bytes()
            .take_while(u8::is_ascii_digit)
            .count();
        let mut end = at + "@user_script:".len() + digits;
        if text[end..].starts_with(": ") {
            end += 2;
        } else if text[end..].starts_with(':') {
            end += 1;
        }
        text.replace_range(at..end, "");
    }
    text.trim_end().to_owned()
}

/// What an authentication refusal means, in the words an operator acts on; `None` when
/// `text` is not one.
fn auth_refusal(text: &str) -> Option<&'static str> {
    let upper = text.to_ascii_uppercase();
    if upper.contains("NOAUTH") {
        Some(
            "requires a password (NOAUTH): give it in REDIS_URL (redis://user:password@host) \
             or in --password-file",
        )
    } else if upper.contains("WRONGPASS") || text.contains("Password authentication failed") {
        Some(
            "refused the user or password (WRONGPASS): check the password in REDIS_URL or \
             --password-file, and the user",
        )
    } else {
        None
    }
}

impl From<redis::RedisError> for Failure {
    fn from(err: redis::RedisError) -> Self {
        Failure::from(distlock::Error::Redis(err))
    }
}

/// A handshake the server answered with a refusal of the user (a wrong password, a
/// missing one, an unknown user, no permission for the first commands).
fn is_refused_auth(text: &str) -> bool {
    let text = text.to_ascii_uppercase();
    text.contains("WRONGPASS")
        || text.contains("NOPERM")
        || text.contains("NOAUTH")
        || text.contains("PASSWORD AUTHENTICATION FAILED")
        || text.contains("AUTHENTICATIONFAILED")
}

#[cfg(test)]
mod tests {
    use super::plain;

    #[test]
    fn script_internals_are_left_out_of_a_message() {
        let sha = "cd3132e1d70e96c82e977024374a8f4250ffcaf0";
        assert_eq!(
            plain(&format!(
                "Redis command failed: \"ERR\": boom script: {sha}, on @user_script:122."
            )),
            "Redis command failed: \"ERR\": boom"
        );
        assert_eq!(
            plain(&format!(
                "ERR Error running script (call to f_{sha}): @user_script:12: bad thing"
            )),
            "ERR Error running script: bad thing"
        );
        assert_eq!(plain("first\nsecond"), "first");
    }
}
