//! The command on the deployments the library takes: a Redis Cluster (by its
//! `redis+cluster://` URL and by one node's URL) and a Sentinel group.

mod common;

use common::{distlock, run_to_end, stderr};
use distlock_testkit::{RedisCluster, SentinelGroup};

/// `run`, a conflict, `status` and `force-unlock` on a cluster; `list` says plainly that
/// it does not scan one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_works_on_a_cluster() {
    let cluster = RedisCluster::start().await.expect("start cluster");
    for url in [cluster.url(), cluster.seed_urls()[1].clone()] {
        let mut run = distlock(&url);
        run.args([
            "run",
            "cluster-job",
            "--",
            "sh",
            "-c",
            "echo $DISTLOCK_FENCING_TOKEN",
        ]);
        let run = run_to_end(run).await;
        assert_eq!(run.status.code(), Some(0), "{url}: {}", stderr(&run));
        assert!(String::from_utf8_lossy(&run.stdout)
            .trim()
            .parse::<u64>()
            .is_ok());
        let mut fair = distlock(&url);
        fair.args(["run", "cluster-fair", "--fair", "--", "true"]);
        assert_eq!(run_to_end(fair).await.status.code(), Some(0), "{url}");
        let mut permits = distlock(&url);
        permits.args(["run", "cluster-pool", "-n", "2", "--", "true"]);
        assert_eq!(run_to_end(permits).await.status.code(), Some(0), "{url}");
    }
    let url = cluster.url();
    let mut holder = distlock(&url);
    holder.args(["run", "cluster-held", "--", "sleep", "30"]);
    let holder = holder.spawn().unwrap();
    let asked = std::time::Instant::now();
    loop {
        let mut status = distlock(&url);
        status.args(["status", "cluster-held", "--json"]);
        let status = run_to_end(status).await;
        let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap_or_default();
        if json["held"] == true {
            break;
        }
        assert!(asked.elapsed() < common::LIMIT, "{}", stderr(&status));
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let mut conflict = distlock(&url);
    conflict.args(["run", "cluster-held", "--no-wait", "--", "true"]);
    assert_eq!(run_to_end(conflict).await.status.code(), Some(75));
    let mut unlock = distlock(&url);
    unlock.args(["force-unlock", "cluster-held", "--yes"]);
    assert_eq!(run_to_end(unlock).await.status.code(), Some(0));
    let holder = common::finish(holder).await;
    assert_eq!(holder.status.code(), Some(79), "{}", stderr(&holder));
    let mut list = distlock(&url);
    list.arg("list");
    let list = run_to_end(list).await;
    assert_eq!(list.status.code(), Some(2));
    assert!(stderr(&list).contains("Cluster"), "{}", stderr(&list));
}

/// `run` and `status` through a Sentinel group's URL (replica sync on by default: the
/// master has replicas).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_works_through_sentinel() {
    let group = SentinelGroup::start().await.expect("start sentinel group");
    let url = group.sentinel_url();
    let mut run = distlock(&url);
    run.args([
        "run",
        "sentinel-job",
        "--",
        "sh",
        "-c",
        "echo $DISTLOCK_FENCING_TOKEN",
    ]);
    let run = run_to_end(run).await;
    assert_eq!(run.status.code(), Some(0), "{}", stderr(&run));
    assert_eq!(String::from_utf8_lossy(&run.stdout).trim(), "1");
    let mut status = distlock(&url);
    status.args(["status", "sentinel-job", "--json"]);
    let status = run_to_end(status).await;
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(json["held"], false, "{json}");
    assert_eq!(json["last_fencing_token"], 1, "{json}");
}
