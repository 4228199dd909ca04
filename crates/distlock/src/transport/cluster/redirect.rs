//! Reading what a cluster node answers about where a command belongs: the slot a command
//! can go straight to, MOVED / ASK / TRYAGAIN replies, and the pause between retries.

use std::sync::Arc;
use std::time::Duration;

use redis::cluster_routing::Slot;
use redis::{Arg, Cmd, RedisResult, Value};

use super::topology::Node;
use super::{CLUSTER_MAX_RETRY_WAIT_MS, CLUSTER_MIN_RETRY_WAIT_MS};

/// The pause before attempt `attempt + 1` of a command the cluster could not take yet:
/// doubling from [`CLUSTER_MIN_RETRY_WAIT_MS`] up to [`CLUSTER_MAX_RETRY_WAIT_MS`].
pub(crate) async fn retry_pause(attempt: u32) {
    let pause = CLUSTER_MIN_RETRY_WAIT_MS
        .saturating_mul(1 << attempt.min(10))
        .min(CLUSTER_MAX_RETRY_WAIT_MS);
    tokio::time::sleep(Duration::from_millis(pause)).await;
}

/// `work`, cut off at `timeout`: a pipeline and every redirection it follows are bounded
/// as redis-rs's response timeout bounds a command.
pub(crate) async fn within<T>(
    timeout: Duration,
    work: impl std::future::Future<Output = RedisResult<T>>,
) -> RedisResult<T> {
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or_else(|_| {
            Err(redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "a cluster pipeline and its redirections outlasted the response timeout",
            )))
        })
}

/// The slot and node of a MOVED or ASK reply's detail: `<slot> <host>:<port>`.
pub(crate) fn redirection(detail: &str) -> Option<(Slot, Node)> {
    let mut parts = detail.split_whitespace();
    let (slot, address) = (parts.next()?, parts.next()?);
    let slot = slot.parse::<u16>().ok().and_then(Slot::new)?;
    let (host, port) = address.rsplit_once(':')?;
    let port = port.parse::<u16>().ok()?;
    Some((slot, Arc::new((host.to_owned(), port))))
}

/// The slot a command can go straight to, if it is one the direct path takes: a script
/// call (`EVALSHA sha numkeys key …` or `EVAL`), routed by its first key, or an `UNLINK`
/// whose keys all share one slot (the deletion of unlock latches, grouped by slot).
pub(crate) fn direct_slot(cmd: &Cmd) -> Option<Slot> {
    let mut args = cmd.args_iter();
    let name = match args.next()? {
        Arg::Simple(name) => name,
        _ => return None,
    };
    if name.eq_ignore_ascii_case(b"UNLINK") {
        let mut slot = None;
        for key in args {
            let Arg::Simple(key) = key else {
                return None;
            };
            let this = Slot::for_key(key);
            if *slot.get_or_insert(this) != this {
                // Keys of several slots: redis-rs's cluster connection splits them.
                return None;
            }
        }
        return slot;
    }
    if !name.eq_ignore_ascii_case(b"EVALSHA") && !name.eq_ignore_ascii_case(b"EVAL") {
        return None;
    }
    args.next()?;
    let keys = match args.next()? {
        Arg::Simple(count) => std::str::from_utf8(count).ok()?.parse::<usize>().ok()?,
        _ => return None,
    };
    if keys == 0 {
        return None;
    }
    match args.next()? {
        Arg::Simple(key) => Some(Slot::for_key(key)),
        _ => None,
    }
}

/// What a direct reply says about where the script should have gone, if anything.
pub(crate) enum Misrouted {
    /// MOVED: the slot has a new master, given in the detail.
    Moved(String),
    /// ASK: this key has moved to the importing master named in the detail.
    Ask(String),
    /// TRYAGAIN, CLUSTERDOWN: the slot is in transition.
    InTransition,
}

pub(crate) fn misrouted(reply: &Value) -> Option<Misrouted> {
    let Value::ServerError(err) = reply else {
        return None;
    };
    use redis::ServerErrorKind as Kind;
    match err.kind()? {
        Kind::Moved => Some(Misrouted::Moved(
            err.details().unwrap_or_default().to_owned(),
        )),
        Kind::Ask => Some(Misrouted::Ask(err.details().unwrap_or_default().to_owned())),
        Kind::TryAgain | Kind::ClusterDown => Some(Misrouted::InTransition),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_scripts_by_first_key_and_unlinks_of_one_slot() {
        let script = redis::cmd("EVALSHA")
            .arg("sha")
            .arg(2)
            .arg("{a}:lock")
            .arg("other")
            .clone();
        assert_eq!(direct_slot(&script), Some(Slot::for_key("a")));
        let keyless = redis::cmd("EVALSHA").arg("sha").arg(0).clone();
        assert_eq!(direct_slot(&keyless), None);
        let one_slot = redis::cmd("UNLINK").arg("{a}:x").arg("{a}:y").clone();
        assert_eq!(direct_slot(&one_slot), Some(Slot::for_key("a")));
        // Keys of two slots are split by the cluster connection, never sent to one node.
        let two_slots = redis::cmd("UNLINK").arg("{a}:x").arg("{b}:y").clone();
        assert_eq!(direct_slot(&two_slots), None);
        assert_eq!(direct_slot(&redis::cmd("UNLINK")), None);
        assert_eq!(direct_slot(redis::cmd("GET").arg("{a}:x")), None);
    }

    #[test]
    fn reads_redirections() {
        let (slot, node) = redirection("3999 127.0.0.1:6381").expect("parses");
        assert_eq!(slot, Slot::new(3999).expect("a slot"));
        assert_eq!(*node, ("127.0.0.1".to_owned(), 6381));
        assert!(redirection("3999").is_none());
        assert!(redirection("99999 h:1").is_none());
        assert!(redirection("1 h:port").is_none());
    }
}
