//! The real `distlock` binary with a `postgres://` URL, against a private PostgreSQL each
//! test starts: the same commands and exit codes as on Redis, the token in
//! `DISTLOCK_FENCING_TOKEN`, and clear refusals for what only Redis has so far.

mod common;

use std::time::Duration;

use common::{
    assert_one_line, code, distlock, run_to_end,
    shared_runs_go_together_and_an_exclusive_one_waits, stderr, until_exists,
};
use distlock_testkit::PostgresServer;

async fn database() -> PostgresServer {
    PostgresServer::start().await.expect("start postgres")
}

#[tokio::test]
async fn run_holds_the_lock_passes_the_token_and_conflicts_like_on_redis() {
    let server = database().await;
    let url = server.url();
    let mut first = distlock(&url);
    first.args([
        "run",
        "job",
        "--",
        "sh",
        "-c",
        "echo \"$DISTLOCK_NAME $DISTLOCK_FENCING_TOKEN\"; exit 7",
    ]);
    let first = run_to_end(first).await;
    assert_eq!(code(&first), 7, "{}", stderr(&first));
    let printed = String::from_utf8_lossy(&first.stdout).into_owned();
    let fields: Vec<&str> = printed.split_whitespace().collect();
    assert_eq!(fields.first(), Some(&"job"), "{printed}");
    let first_token: u64 = fields[1].parse().unwrap();

    // Held by a running command: a second run is a conflict (75), and waits as long as
    // it is told.
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let mut holder = distlock(&url);
    holder.args(["run", "job", "--", "sh", "-c"]).arg(format!(
        "touch {}; echo $DISTLOCK_FENCING_TOKEN; sleep 30",
        started.display()
    ));
    let holder = holder.spawn().unwrap();
    until_exists(&started).await;
    let mut skipped = distlock(&url);
    skipped.args(["run", "job", "--no-wait", "--", "true"]);
    let skipped = run_to_end(skipped).await;
    assert_eq!(code(&skipped), 75, "{}", stderr(&skipped));
    let mut waited = distlock(&url);
    waited.args(["run", "job", "--wait", "300ms", "--", "true"]);
    assert_eq!(code(&run_to_end(waited).await), 75);

    // What an operator sees.
    let mut status = distlock(&url);
    status.args(["status", "job", "--json"]);
    let status = run_to_end(status).await;
    assert_eq!(code(&status), 0, "{}", stderr(&status));
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(json["held"], true, "{json}");
    assert_eq!(json["kind"], "lock", "{json}");
    assert!(json["last_fencing_token"].as_u64().unwrap() > first_token);
    assert!(json["lease_remaining_ms"].as_u64().unwrap() > 0, "{json}");
    assert_eq!(json["holders"].as_array().map(Vec::len), Some(1), "{json}");

    // A force-unlock stops the holder's command, which exits with the lost code (79).
    let mut unlock = distlock(&url);
    unlock.args(["force-unlock", "job", "--yes"]);
    let unlock = run_to_end(unlock).await;
    assert_eq!(code(&unlock), 0, "{}", stderr(&unlock));
    let stopped = common::finish(holder).await;
    assert_eq!(code(&stopped), 79, "{}", stderr(&stopped));

    // The next holder's token is above every earlier one.
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
    assert!(token > first_token);
}

#[tokio::test]
async fn fence_and_elect_work_on_postgres() {
    let server = database().await;
    let url = server.url();
    let mut fence = distlock(&url);
    fence.args(["fence", "deploy", "--at-least", "5000"]);
    let fence = run_to_end(fence).await;
    assert_eq!(code(&fence), 0, "{}", stderr(&fence));
    let mut run = distlock(&url);
    run.args([
        "run",
        "deploy",
        "--",
        "sh",
        "-c",
        "echo $DISTLOCK_FENCING_TOKEN",
    ]);
    let run = run_to_end(run).await;
    let token: u64 = String::from_utf8_lossy(&run.stdout).trim().parse().unwrap();
    assert!(token > 5000, "{token}");

    // elect: the leader runs its command; it ends, and so does the election.
    let mut elect = distlock(&url);
    elect.args(["elect", "leader", "--", "sh", "-c", "exit 3"]);
    let elect = run_to_end(elect).await;
    assert_eq!(code(&elect), 3, "{}", stderr(&elect));
}

/// --shared and --exclusive take the read-write lock, as on Redis.
#[tokio::test]
async fn shared_and_exclusive_take_the_read_write_lock() {
    let server = database().await;
    shared_runs_go_together_and_an_exclusive_one_waits(&server.url()).await;
}

#[tokio::test]
async fn what_only_redis_has_is_refused_with_the_usage_code() {
    let server = database().await;
    let url = server.url();
    let cases: &[(&[&str], &str)] = &[
        (&["run", "x", "--fair", "--", "true"], "--fair"),
        (&["run", "x", "-n", "2", "--", "true"], "-n"),
        (&["list"], "list"),
    ];
    for (args, says) in cases {
        let mut command = distlock(&url);
        command.args(*args);
        let output = run_to_end(command).await;
        assert_one_line(&output, 2, says, &format!("{args:?}"));
    }
}

#[tokio::test]
async fn an_unreachable_or_refusing_database_has_the_redis_codes() {
    let server = database().await;
    // Nothing listens there: unavailable (69).
    let closed = format!("postgres://postgres@127.0.0.1:{}/postgres", free_port());
    let mut unreachable = distlock(&closed);
    unreachable.args(["run", "x", "--", "true"]);
    let unreachable = run_to_end(unreachable).await;
    assert_eq!(code(&unreachable), 69, "{}", stderr(&unreachable));
    // A role the database does not know: refused (77), and the password never shown.
    let nobody = format!(
        "postgres://nobody:hunter2@127.0.0.1:{}/postgres",
        server.port()
    );
    let mut refused = distlock("redis://unused");
    refused
        .env("DISTLOCK_URL", &nobody)
        .args(["run", "x", "--", "true"]);
    let refused = run_to_end(refused).await;
    assert_eq!(code(&refused), 77, "{}", stderr(&refused));
    assert!(
        !stderr(&refused).contains("hunter2"),
        "{}",
        stderr(&refused)
    );
}

/// A loopback port nothing listens on.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    listener.local_addr().unwrap().port()
}

/// The lease is renewed while the command runs past it.
#[tokio::test]
async fn a_command_that_runs_past_the_ttl_keeps_the_lock() {
    let server = database().await;
    let url = server.url();
    let mut long = distlock(&url);
    long.args(["run", "long", "--ttl", "1s", "--", "sleep", "2.5"]);
    let long = long.spawn().unwrap();
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let mut skipped = distlock(&url);
    skipped.args(["run", "long", "--no-wait", "--", "true"]);
    assert_eq!(code(&run_to_end(skipped).await), 75);
    let long = common::finish(long).await;
    assert_eq!(code(&long), 0, "{}", stderr(&long));
}
