//! The programs in examples/ run as a user would run them: against a real Redis named by
//! REDIS_URL, with nothing from the testkit inside them. `cargo test` builds them first.

use std::path::PathBuf;
use std::process::Command;

use distlock_testkit::RedisServer;

/// Runs `examples/<name>` with `REDIS_URL` set; returns its stdout, failing the test with
/// its output if it did not exit 0.
fn run(name: &str, url: &str) -> String {
    // This test runs from target/<profile>/deps; cargo puts examples beside it.
    let mut path: PathBuf = std::env::current_exe().expect("test executable");
    path.pop();
    path.pop();
    path.push("examples");
    path.push(name);
    assert!(
        path.exists(),
        "{} is not built: run the whole suite (`cargo test -p distlock`), which builds \
         the examples, or `cargo build -p distlock --examples` first",
        path.display()
    );
    let output = Command::new(&path)
        .env("REDIS_URL", url)
        .output()
        .unwrap_or_else(|err| panic!("run {}: {err}", path.display()));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{name} failed: {}\n{stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test]
async fn the_cron_job_runs_once_per_period() {
    let server = RedisServer::start().await.unwrap();
    let first = run("cron_once", &server.url());
    assert!(first.contains("report done"), "{first}");
    let second = run("cron_once", &server.url());
    assert!(second.contains("skipped"), "{second}");
}

#[tokio::test]
async fn the_fenced_write_refuses_the_stale_writer() {
    let server = RedisServer::start().await.unwrap();
    let out = run("fenced_write", &server.url());
    assert!(out.contains("B adds 10: written"), "{out}");
    assert!(out.contains("A wakes and takes 100: refused"), "{out}");
    assert!(out.contains("A releases: AlreadyLost"), "{out}");
    assert!(out.contains("balance: 110"), "{out}");
}

#[tokio::test]
async fn the_worker_pool_does_every_job() {
    let server = RedisServer::start().await.unwrap();
    let out = run("worker_pool", &server.url());
    assert!(out.contains("12 jobs: 12 done, others: []"), "{out}");
}
