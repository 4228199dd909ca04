//! The real `distlock` binary (built with the `zk` feature) with a `zk://` URL, against
//! a ZooKeeper ensemble (one server) each test starts: the same commands and exit codes
//! as on Redis, PostgreSQL and etcd.

mod common;

use common::{code, distlock, run_to_end, stderr, until_exists};
use distlock_testkit::ZkEnsemble;

#[tokio::test]
async fn run_holds_the_lock_passes_the_token_and_conflicts_like_on_redis() {
    let zk = ZkEnsemble::start(1).await.expect("start ZooKeeper");
    let url = zk.url();
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let mut holder = distlock(&url);
    holder.args(["run", "job", "--", "sh", "-c"]).arg(format!(
        "echo $DISTLOCK_FENCING_TOKEN; touch {}; sleep 30",
        started.display()
    ));
    let holder = holder.spawn().unwrap();
    until_exists(&started).await;

    let mut skipped = distlock(&url);
    skipped.args(["run", "job", "--no-wait", "--", "true"]);
    let skipped = run_to_end(skipped).await;
    assert_eq!(code(&skipped), 75, "{}", stderr(&skipped));

    let mut status = distlock(&url);
    status.args(["status", "job", "--json"]);
    let status = run_to_end(status).await;
    assert_eq!(code(&status), 0, "{}", stderr(&status));
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(json["held"], true, "{json}");
    assert_eq!(json["holders"].as_array().map(Vec::len), Some(1), "{json}");

    let mut unlock = distlock(&url);
    unlock.args(["force-unlock", "job", "--yes"]);
    let unlock = run_to_end(unlock).await;
    assert_eq!(code(&unlock), 0, "{}", stderr(&unlock));
    let stopped = common::finish(holder).await;
    assert_eq!(code(&stopped), 79, "{}", stderr(&stopped));
    let first_token: u64 = String::from_utf8_lossy(&stopped.stdout)
        .trim()
        .parse()
        .unwrap();

    let mut next = distlock(&url);
    next.args([
        "run",
        "job",
        "--",
        "sh",
        "-c",
        "echo $DISTLOCK_FENCING_TOKEN",
    ]);
    let next = run_to_end(next).await;
    assert_eq!(code(&next), 0, "{}", stderr(&next));
    let token: u64 = String::from_utf8_lossy(&next.stdout)
        .trim()
        .parse()
        .unwrap();
    assert!(token > first_token, "{token} after {first_token}");

    // A fixed lease works as on the other stores: held, with a larger token, and freed.
    let mut fixed = distlock(&url);
    fixed.args([
        "run",
        "job",
        "--lease",
        "5s",
        "--",
        "sh",
        "-c",
        "echo $DISTLOCK_FENCING_TOKEN",
    ]);
    let fixed = run_to_end(fixed).await;
    assert_eq!(code(&fixed), 0, "{}", stderr(&fixed));
    let fixed_token: u64 = String::from_utf8_lossy(&fixed.stdout)
        .trim()
        .parse()
        .unwrap();
    assert!(fixed_token > token, "{fixed_token} after {token}");
    let mut after = distlock(&url);
    after.args(["run", "job", "--no-wait", "--lease", "5s", "--", "true"]);
    let after = run_to_end(after).await;
    assert_eq!(code(&after), 0, "{}", stderr(&after));
}
