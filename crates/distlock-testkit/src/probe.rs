//! Shared helpers of the multi-process topologies: bounded one-shot queries to a node, and
//! bounded polling of observable state.
//!
//! Topologies change state asynchronously (gossip, elections, replication), so every wait
//! polls what the servers report, with a deadline; nothing sleeps for a fixed time hoping
//! the change has happened.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::TestkitError;

/// How often a wait re-checks: short against the second-scale events it waits for, long
/// enough not to load a two-core machine.
pub(crate) const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// Upper bound for one query. A healthy loopback server answers in microseconds; the bound
/// exists because a frozen (SIGSTOP) server accepts connections but never answers.
pub(crate) const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

/// `redis://127.0.0.1:{port}/`.
pub(crate) fn url(port: u16) -> String {
    format!("redis://127.0.0.1:{port}/")
}

/// Runs `cmd` on the server at `port` over a fresh connection, bounded by
/// [`QUERY_TIMEOUT`]. A fresh connection per query keeps the helpers free of connection
/// state that a kill or restart of the node would invalidate.
pub(crate) async fn query<T: redis::FromRedisValue>(
    port: u16,
    cmd: &redis::Cmd,
) -> Result<T, TestkitError> {
    let client = redis::Client::open(url(port))?;
    let run = async {
        let mut conn = client.get_multiplexed_async_connection().await?;
        cmd.query_async::<T>(&mut conn).await
    };
    match tokio::time::timeout(QUERY_TIMEOUT, run).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(TestkitError::Timeout {
            what: format!("an answer from port {port}"),
            waited: QUERY_TIMEOUT,
            last: "no reply (is the server paused?)".to_owned(),
        }),
    }
}

/// `INFO <section>` of the server at `port`.
pub(crate) async fn info(port: u16, section: &str) -> Result<String, TestkitError> {
    query(port, redis::cmd("INFO").arg(section)).await
}

/// The value of `field` in an `INFO`/`CLUSTER INFO` reply (`field:value` lines).
pub(crate) fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines().find_map(|line| {
        line.trim_end()
            .strip_prefix(field)
            .and_then(|rest| rest.strip_prefix(':'))
    })
}

/// Has the master at `port` drop its replica connections (`CLIENT KILL TYPE replica`) and
/// checks that it has none left. Freeze the replicas first, or they reconnect at once.
pub(crate) async fn drop_replica_links(port: u16) -> Result<(), TestkitError> {
    let _killed: i64 = query(
        port,
        redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("replica"),
    )
    .await?;
    // CLIENT KILL frees the connections synchronously; checking makes a surprise (say, a
    // replica that was not frozen and reconnected) fail here, not later.
    let replication = info(port, "replication").await?;
    match info_field(&replication, "connected_slaves") {
        Some("0") => Ok(()),
        other => Err(TestkitError::Topology(format!(
            "master {port} still has replicas after CLIENT KILL: connected_slaves {other:?}"
        ))),
    }
}

/// The replication role the server at `port` reports (`master` or `slave`).
pub(crate) async fn role(port: u16) -> Result<String, TestkitError> {
    let info = info(port, "replication").await?;
    info_field(&info, "role").map(str::to_owned).ok_or_else(|| {
        TestkitError::UnexpectedReply(format!("INFO replication without role: {info}"))
    })
}

/// Calls `probe` every [`POLL_INTERVAL`] until it returns `Ok`, for at most `limit`.
///
/// `probe` returns `Err(state)` while the awaited condition does not hold yet, describing
/// what it saw; the last such description ends up in the [`TestkitError::Timeout`] so a
/// failed wait explains itself. Each call is itself bounded by the time left.
pub(crate) async fn poll<T, F, Fut>(
    what: &str,
    limit: Duration,
    mut probe: F,
) -> Result<T, TestkitError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let started = Instant::now();
    let deadline = started + limit;
    let mut last = "nothing observed yet".to_owned();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, probe()).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(state)) => last = state,
            Err(_) => {}
        }
        if Instant::now() + POLL_INTERVAL >= deadline {
            return Err(TestkitError::Timeout {
                what: what.to_owned(),
                waited: started.elapsed(),
                last,
            });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_info_fields() {
        let info = "# Cluster\r\ncluster_state:ok\r\ncluster_slots_ok:16384\r\n";
        assert_eq!(info_field(info, "cluster_state"), Some("ok"));
        assert_eq!(info_field(info, "cluster_slots_ok"), Some("16384"));
        assert_eq!(info_field(info, "cluster_slots"), None);
    }

    #[tokio::test]
    async fn poll_reports_the_last_state_on_timeout() {
        let mut calls = 0;
        let result: Result<(), _> = poll("nothing", Duration::from_millis(200), || {
            calls += 1;
            let state = format!("call {calls}");
            async move { Err(state) }
        })
        .await;
        match result {
            Err(TestkitError::Timeout { what, last, .. }) => {
                assert_eq!(what, "nothing");
                assert!(last.starts_with("call "), "{last}");
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
}
