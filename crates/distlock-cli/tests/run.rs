//! The real `distlock` binary against a real Redis: exit codes, conflicts, what the
//! command gets, signals, and the stop when the lock is lost.

mod common;

use std::time::{Duration, Instant};

use common::{code, distlock, finish, run_to_end, stderr, until_exists, LIMIT};
use distlock_testkit::RedisServer;
use tokio::process::Child;

#[tokio::test]
async fn the_commands_exit_status_and_environment_pass_through() {
    let server = RedisServer::start().await.unwrap();
    let mut first = distlock(&server.url());
    first.args([
        "run",
        "job",
        "--",
        "sh",
        "-c",
        "echo \"$DISTLOCK_NAME $DISTLOCK_FENCING_TOKEN $DISTLOCK_OWNER\"; exit 7",
    ]);
    let first = run_to_end(first).await;
    assert_eq!(code(&first), 7, "{}", stderr(&first));
    let printed = String::from_utf8_lossy(&first.stdout).into_owned();
    let fields: Vec<&str> = printed.split_whitespace().collect();
    assert_eq!(fields[0], "job");
    assert_eq!(fields[1], "1");
    assert!(fields[2].contains(':'), "owner {}", fields[2]);

    let mut second = distlock(&server.url());
    second.args([
        "run",
        "job",
        "--",
        "sh",
        "-c",
        "echo $DISTLOCK_FENCING_TOKEN",
    ]);
    let second = run_to_end(second).await;
    assert_eq!(code(&second), 0);
    assert_eq!(String::from_utf8_lossy(&second.stdout).trim(), "2");

    // Killed by a signal: 128 + N, as a shell reports it.
    let mut killed = distlock(&server.url());
    killed.args(["run", "job", "--", "sh", "-c", "kill -KILL $$"]);
    assert_eq!(code(&run_to_end(killed).await), 128 + 9);
    // Not found, not executable.
    let mut missing = distlock(&server.url());
    missing.args(["run", "job", "--", "/no/such/command"]);
    assert_eq!(code(&run_to_end(missing).await), 127);
    let dir = tempfile::tempdir().unwrap();
    let plain_file = dir.path().join("not-executable");
    std::fs::write(&plain_file, "echo hi\n").unwrap();
    let mut not_executable = distlock(&server.url());
    not_executable.args(["run", "job", "--"]).arg(&plain_file);
    assert_eq!(code(&run_to_end(not_executable).await), 126);
    // Every run released the lock.
    let mut status = distlock(&server.url());
    status.args(["status", "job", "--json"]);
    let status = run_to_end(status).await;
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(json["held"], false);
}

#[tokio::test]
async fn a_held_lock_is_a_conflict_with_its_own_exit_code() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let mut holder = distlock(&server.url());
    holder
        .args(["run", "cron", "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 30", started.display()));
    let holder = holder.spawn().expect("distlock started");
    until_exists(&started).await;

    let mut skipped = distlock(&server.url());
    skipped.args([
        "run",
        "cron",
        "--no-wait",
        "--",
        "touch",
        "/nonexistent/ran",
    ]);
    let skipped = run_to_end(skipped).await;
    assert_eq!(code(&skipped), 75, "{}", stderr(&skipped));
    assert_eq!(stderr(&skipped).lines().count(), 1, "{}", stderr(&skipped));

    let mut custom = distlock(&server.url());
    custom.args([
        "run",
        "cron",
        "--no-wait",
        "--conflict-exit-code",
        "9",
        "--",
        "true",
    ]);
    assert_eq!(code(&run_to_end(custom).await), 9);

    let asked = Instant::now();
    let mut waited = distlock(&server.url());
    waited.args(["run", "cron", "--wait", "300ms", "--", "true"]);
    assert_eq!(code(&run_to_end(waited).await), 75);
    assert!(asked.elapsed() >= Duration::from_millis(300));

    // The status an operator sees while it is held.
    let mut status = distlock(&server.url());
    status.args(["status", "cron", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&run_to_end(status).await.stdout).unwrap();
    assert_eq!(json["held"], true);
    assert_eq!(json["kind"], "lock");
    assert_eq!(json["last_fencing_token"], 1);
    assert!(json["lease_remaining_ms"].as_u64().unwrap() > 20_000);
    let mut list = distlock(&server.url());
    list.args(["list", "--json"]);
    let listed = String::from_utf8_lossy(&run_to_end(list).await.stdout).into_owned();
    assert_eq!(listed.lines().count(), 1, "{listed}");
    assert!(listed.contains("\"name\":\"cron\""), "{listed}");
    drop(holder);
}

/// Bad arguments: exit code 2 and a clear line, never a panic, and nothing run.
#[tokio::test]
async fn bad_arguments_exit_2_without_running_anything() {
    let server = RedisServer::start().await.unwrap();
    let cases: &[&[&str]] = &[
        &["run", "job", "--"],
        &["run", "job"],
        &["run", "", "--", "true"],
        &["run", "job", "--lease", "0s", "--", "true"],
        &["run", "job", "--wait", "-1s", "--", "true"],
        &["run", "job", "--wait", "10", "--", "true"],
        &["run", "job", "--no-such-flag", "--", "true"],
        &["run", "job", "-n", "0", "--", "true"],
        &["run", "job", "--fair", "-n", "2", "--", "true"],
        &["run", "job", "--no-wait", "--wait", "1s", "--", "true"],
        &["run", "a}b", "--", "true"],
        &["status"],
        &["frobnicate"],
    ];
    for args in cases {
        let mut command = distlock(&server.url());
        command.args(*args);
        let outcome = run_to_end(command).await;
        assert_eq!(code(&outcome), 2, "{args:?}: {}", stderr(&outcome));
        assert!(!stderr(&outcome).contains("panicked"), "{args:?}");
        assert!(!stderr(&outcome).is_empty(), "{args:?}");
    }
}

/// A Redis that is down, or refuses the user: one line, its own exit code, and the
/// password nowhere in the output.
#[tokio::test]
async fn an_unreachable_or_refusing_redis_has_its_own_code_and_never_shows_the_password() {
    let server = RedisServer::start().await.unwrap();
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let mut down = distlock("redis://127.0.0.1:1");
    down.env(
        "REDIS_URL",
        format!("redis://app:hunter2secret@127.0.0.1:{port}/0"),
    )
    .args(["run", "job", "--", "true"]);
    let down = run_to_end(down).await;
    assert_eq!(code(&down), 69, "{}", stderr(&down));
    assert_eq!(stderr(&down).lines().count(), 1, "{}", stderr(&down));
    assert!(
        !stderr(&down).contains("hunter2secret"),
        "{}",
        stderr(&down)
    );

    // A user that may not touch locks.
    let mut admin = server.connection().await.unwrap();
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("reader")
        .arg("on")
        .arg(">readerpass")
        .arg("~*")
        .arg("+@connection")
        .arg("+info")
        .arg("+get")
        .query_async(&mut admin)
        .await
        .unwrap();
    let mut refused = distlock("redis://127.0.0.1:1");
    refused
        .env(
            "REDIS_URL",
            format!("redis://reader:readerpass@127.0.0.1:{}/0", server.port()),
        )
        .args(["run", "job", "--", "true"]);
    let refused = run_to_end(refused).await;
    assert_eq!(code(&refused), 77, "{}", stderr(&refused));
    assert!(
        !stderr(&refused).contains("readerpass"),
        "{}",
        stderr(&refused)
    );

    // On the command line a password is refused; from a file it is used.
    let mut on_the_line = distlock(&server.url());
    on_the_line
        .args([
            "--url",
            &format!("redis://reader:readerpass@127.0.0.1:{}", server.port()),
        ])
        .args(["status", "job"]);
    assert_eq!(code(&run_to_end(on_the_line).await), 2);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("password");
    std::fs::write(&file, "readerpass\n").unwrap();
    let mut from_file = distlock("redis://127.0.0.1:1");
    from_file
        .args([
            "--url",
            &format!("redis://reader@127.0.0.1:{}", server.port()),
        ])
        .arg("--password-file")
        .arg(&file)
        .args(["run", "job", "--", "true"]);
    let from_file = run_to_end(from_file).await;
    // Authenticated (not 69), then refused by the ACL.
    assert_eq!(code(&from_file), 77, "{}", stderr(&from_file));
    let help = run_to_end({
        let mut help = distlock(&server.url());
        help.env("REDIS_URL", "redis://u:helpsecret@127.0.0.1:1")
            .args(["run", "--help"]);
        help
    })
    .await;
    assert_eq!(code(&help), 0);
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(!text.contains("helpsecret"), "{text}");
    assert!(text.contains("79"), "the exit codes are listed: {text}");
}

/// SIGINT, SIGTERM and SIGHUP sent to distlock reach the command's process group; the
/// command's own exit status is then passed through.
#[tokio::test]
async fn signals_are_passed_on_to_the_command() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let started = dir.path().join("started");
    let script = format!(
        "trap 'echo HUP >> {log}' HUP; trap 'echo INT >> {log}' INT; \
         trap 'echo TERM >> {log}; exit 42' TERM; touch {started}; \
         while :; do sleep 0.05; done",
        log = log.display(),
        started = started.display()
    );
    let mut run = distlock(&server.url());
    run.args(["run", "signals", "--", "sh", "-c", &script]);
    let run = run.spawn().expect("distlock started");
    until_exists(&started).await;
    let pid = nix::unistd::Pid::from_raw(run.id().unwrap() as i32);
    for (signal, line) in [
        (nix::sys::signal::Signal::SIGHUP, "HUP"),
        (nix::sys::signal::Signal::SIGINT, "INT"),
    ] {
        nix::sys::signal::kill(pid, signal).unwrap();
        let asked = Instant::now();
        while !std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains(line)
        {
            assert!(asked.elapsed() < LIMIT, "{line} never reached the command");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let run = finish(run).await;
    assert_eq!(code(&run), 42, "{}", stderr(&run));
    assert!(std::fs::read_to_string(&log).unwrap().contains("TERM"));
}

/// Two cron hosts firing the same job every tick: runs with --no-wait never overlap, and
/// every tick either runs the job or reports the conflict.
#[tokio::test]
async fn cron_style_runs_never_overlap() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let inside = dir.path().join("inside");
    let overlaps = dir.path().join("overlaps");
    // mkdir is atomic: it fails if another run's command is inside.
    let job = format!(
        "mkdir {inside} 2>/dev/null || echo overlap >> {overlaps}; sleep 0.02; rmdir {inside}",
        inside = inside.display(),
        overlaps = overlaps.display()
    );
    let (mut ran, mut skipped) = (0, 0);
    for _ in 0..15 {
        let ticks: Vec<Child> = (0..2)
            .map(|_| {
                let mut run = distlock(&server.url());
                run.args(["run", "nightly", "--no-wait", "--", "sh", "-c", &job]);
                run.spawn().expect("distlock started")
            })
            .collect();
        for tick in ticks {
            match code(&finish(tick).await) {
                0 => ran += 1,
                75 => skipped += 1,
                other => panic!("exit {other}"),
            }
        }
    }
    assert!(!overlaps.exists(), "two runs overlapped");
    assert!(ran >= 15, "ran {ran}, skipped {skipped}");
    assert_eq!(ran + skipped, 30);
}
