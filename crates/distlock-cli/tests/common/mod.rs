//! What the command's tests share: the real binary pointed at a Redis, and waiting for
//! it and for the files its commands write.

#![allow(dead_code)] // each test file uses its own part

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

/// The bound on any one wait of a test.
pub const LIMIT: Duration = Duration::from_secs(40);

/// The `distlock` binary with `REDIS_URL` set to `url`: stdin empty, stdout and stderr
/// captured, killed if the test drops it.
pub fn distlock(url: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_distlock"));
    command
        .env("REDIS_URL", url)
        .kill_on_drop(true)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Waits (bounded) for a started distlock to exit.
pub async fn finish(child: Child) -> Output {
    tokio::time::timeout(LIMIT, child.wait_with_output())
        .await
        .expect("distlock finished in time")
        .expect("distlock ran")
}

/// Runs `command` to its end.
pub async fn run_to_end(mut command: Command) -> Output {
    finish(command.spawn().expect("distlock started")).await
}

/// The exit code (the process exited, it was not killed).
pub fn code(output: &Output) -> i32 {
    output.status.code().expect("exited, not killed")
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Waits until `path` exists (a command under the lock writes it when it starts).
pub async fn until_exists(path: &Path) {
    let started = Instant::now();
    while !path.exists() {
        assert!(
            started.elapsed() < LIMIT,
            "{} never appeared",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Asserts that distlock exited with `code` and wrote one line to stderr, saying `says`.
/// `context` names the case in the failure message.
pub fn assert_one_line(output: &Output, code: i32, says: &str, context: &str) {
    let text = stderr(output);
    assert_eq!(output.status.code(), Some(code), "{context}: {text}");
    assert!(
        text.contains(says),
        "{context}: expected {says:?} in: {text}"
    );
    assert_eq!(text.lines().count(), 1, "{context}: one line, not: {text}");
}

/// Runs `distlock run job <extra> -- sh -c 'echo $DISTLOCK_FENCING_TOKEN'` on `url` to
/// its end, asserting it exits 0; answers the token it printed.
pub async fn token_of_a_run(url: &str, extra: &[&str]) -> u64 {
    let mut run = distlock(url);
    run.args(["run", "job"])
        .args(extra)
        .args(["--", "sh", "-c", "echo $DISTLOCK_FENCING_TOKEN"]);
    let run = run_to_end(run).await;
    assert_eq!(code(&run), 0, "{}", stderr(&run));
    String::from_utf8_lossy(&run.stdout)
        .trim()
        .parse()
        .expect("the command printed its fencing token")
}

/// The command's core on a store other than Redis, as on Redis: a running holder of
/// `job` makes `--no-wait` a conflict (75); `status --json` shows it held by one holder;
/// a force-unlock stops its command with the lost code (79); the next run's token is
/// larger than the holder's. Answers that last token.
pub async fn run_conflicts_and_passes_growing_tokens(url: &str) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let mut holder = distlock(url);
    holder.args(["run", "job", "--", "sh", "-c"]).arg(format!(
        "echo $DISTLOCK_FENCING_TOKEN; touch {}; sleep 30",
        started.display()
    ));
    let holder = holder.spawn().unwrap();
    until_exists(&started).await;

    let mut skipped = distlock(url);
    skipped.args(["run", "job", "--no-wait", "--", "true"]);
    let skipped = run_to_end(skipped).await;
    assert_eq!(code(&skipped), 75, "{}", stderr(&skipped));

    let mut status = distlock(url);
    status.args(["status", "job", "--json"]);
    let status = run_to_end(status).await;
    assert_eq!(code(&status), 0, "{}", stderr(&status));
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(json["held"], true, "{json}");
    assert_eq!(json["holders"].as_array().map(Vec::len), Some(1), "{json}");

    let mut unlock = distlock(url);
    unlock.args(["force-unlock", "job", "--yes"]);
    let unlock = run_to_end(unlock).await;
    assert_eq!(code(&unlock), 0, "{}", stderr(&unlock));
    let stopped = finish(holder).await;
    assert_eq!(code(&stopped), 79, "{}", stderr(&stopped));
    let first_token: u64 = String::from_utf8_lossy(&stopped.stdout)
        .trim()
        .parse()
        .unwrap();

    let token = token_of_a_run(url, &[]).await;
    assert!(token > first_token, "{token} after {first_token}");
    token
}

/// `--shared` and `--exclusive` on a store other than Redis, as on Redis: two shared runs
/// of `books` run their commands together, an `--exclusive --no-wait` run meanwhile is a
/// conflict (75), and once they ended it runs (0).
pub async fn shared_runs_go_together_and_an_exclusive_one_waits(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let readers: Vec<_> = (0..2)
        .map(|index| {
            let started = dir.path().join(format!("reader{index}"));
            let mut reader = distlock(url);
            reader
                .args(["run", "books", "--shared", "--", "sh", "-c"])
                .arg(format!("touch {}; sleep 30", started.display()));
            (reader.spawn().unwrap(), started)
        })
        .collect();
    for (_, started) in &readers {
        until_exists(started).await;
    }
    let exclusive = || {
        let mut run = distlock(url);
        run.args(["run", "books", "--exclusive", "--no-wait", "--", "true"]);
        run_to_end(run)
    };
    let writer = exclusive().await;
    assert_eq!(code(&writer), 75, "{}", stderr(&writer));
    for (reader, _) in readers {
        let pid = nix::unistd::Pid::from_raw(reader.id().unwrap() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        finish(reader).await;
    }
    let writer = exclusive().await;
    assert_eq!(code(&writer), 0, "{}", stderr(&writer));
}
