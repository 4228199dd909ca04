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
