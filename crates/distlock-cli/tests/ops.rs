//! Issue 30, section 3: what ops teams use in flock, etcdctl lock and consul lock, each
//! against a real server.

mod common;

use std::time::{Duration, Instant};

use common::{distlock, run_to_end, stderr, until_exists};
use distlock_testkit::RedisServer;

/// Decimal and compound durations, as flock (`-w 0.5`, with a unit here) and Go write
/// them.
#[tokio::test]
async fn decimal_and_compound_durations_are_read() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let mut holder = distlock(&server.url());
    holder
        .args(["run", "dec", "--ttl", "1m30s", "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 30", started.display()));
    let holder = holder.spawn().unwrap();
    until_exists(&started).await;
    let mut status = distlock(&server.url());
    status.args(["status", "dec", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&run_to_end(status).await.stdout).unwrap();
    let left = json["lease_remaining_ms"].as_u64().unwrap();
    assert!(left > 60_000 && left <= 90_000, "{json}");
    let asked = Instant::now();
    let mut waiter = distlock(&server.url());
    waiter.args(["run", "dec", "--wait", "0.5s", "--", "true"]);
    let waiter = run_to_end(waiter).await;
    assert_eq!(waiter.status.code(), Some(75), "{}", stderr(&waiter));
    let waited = asked.elapsed();
    assert!(
        waited >= Duration::from_millis(500) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    let mut fine = distlock(&server.url());
    fine.args(["run", "dec", "--wait", "1.0005s", "--", "true"]);
    let fine = run_to_end(fine).await;
    assert_eq!(fine.status.code(), Some(2), "{}", stderr(&fine));
    drop(holder);
}
