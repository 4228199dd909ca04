//! `flashsale serve` as a child process: started, announced, and its output drained.

use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_flashsale");

/// A `flashsale serve` child on a SQLite file in `dir`, up and announced.
pub struct Served {
    pub child: tokio::process::Child,
    /// `http://ADDR`, from the startup line.
    pub base: String,
    /// Every stderr line up to and including the startup line.
    pub startup: String,
    /// The stderr lines after the startup line, as they come.
    pub later: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

/// Starts `flashsale serve --listen 127.0.0.1:0 EXTRA…` with `redis_url` and a SQLite file
/// in `dir`, and waits for its startup line. The rest of its stderr is drained in the
/// background.
pub async fn serve(dir: &tempfile::TempDir, redis_url: &str, extra: &[&str]) -> Served {
    let database = format!("sqlite://{}", dir.path().join("shop.db").display());
    let mut command = Command::new(BIN);
    command
        .env("REDIS_URL", redis_url)
        .env("DATABASE_URL", &database);
    start_serve(command, extra).await
}

/// Starts `flashsale serve` on its defaults (no REDIS_URL, no DATABASE_URL), in `dir` as
/// its working directory, as a new user would.
pub async fn serve_on_defaults(dir: &std::path::Path, extra: &[&str]) -> Served {
    let mut command = Command::new(BIN);
    command
        .env_remove("REDIS_URL")
        .env_remove("DATABASE_URL")
        .current_dir(dir);
    start_serve(command, extra).await
}

/// Starts `flashsale serve --listen 127.0.0.1:0 EXTRA…` with `command`'s environment and
/// waits for its startup line; panics if it exits first.
pub async fn start_serve(command: Command, extra: &[&str]) -> Served {
    match start_or_exit(command, extra).await {
        Ok(served) => served,
        Err((code, stderr)) => panic!("serve exited {code} before its startup line:\n{stderr}"),
    }
}

impl Served {
    /// The child's pid.
    pub fn pid(&self) -> nix::unistd::Pid {
        let pid = self.child.id().expect("the child is running");
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid"))
    }
}

/// `serve --take-over-store --abandon-old-authority` with `command()`'s environment,
/// started again every 250 ms while the old authority is still selling (silent for less
/// than the take-over silence); panics on any other refusal.
pub async fn abandoning_take_over(mut command: impl FnMut() -> Command) -> Served {
    let abandon = ["--take-over-store", "--abandon-old-authority"];
    loop {
        match start_or_exit(command(), &abandon).await {
            Ok(served) => return served,
            Err((4, stderr)) if stderr.contains("is still being sold") => {
                tokio::time::sleep(std::time::Duration::from_millis(250)).await
            }
            Err((code, stderr)) => panic!("take-over exited {code}: {stderr}"),
        }
    }
}

/// The exit status of `served` within `limit`; panics with its stderr if it is still up.
pub async fn exits_within(
    served: &mut Served,
    limit: std::time::Duration,
) -> std::process::ExitStatus {
    match tokio::time::timeout(limit, served.child.wait()).await {
        Ok(exited) => exited.expect("wait"),
        Err(_) => panic!(
            "still up {limit:?} later; its stderr since the start:\n{}",
            served.later.lock().expect("lines").join("\n")
        ),
    }
}

/// Waits until process `pid` is stopped (state `T` in /proc): a SIGSTOP took effect.
pub async fn stopped(pid: nix::unistd::Pid) {
    let stat = format!("/proc/{pid}/stat");
    loop {
        let text = tokio::fs::read_to_string(&stat).await.expect("read stat");
        // The state follows the command name, which is in parentheses.
        let state = text.rsplit_once(") ").map(|(_, rest)| rest.chars().next());
        if state == Some(Some('T')) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Runs the binary to completion, in a scratch working directory (the defaults write
/// there), and returns its exit code and stderr.
pub async fn run(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let scratch = tempfile::tempdir().expect("scratch dir");
    run_in(scratch.path(), args, env).await
}

/// Runs the binary to completion in working directory `dir`, and returns its exit code
/// and stderr.
pub async fn run_in(dir: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let (code, _stdout, stderr) = output_in(dir, args, env).await;
    (code, stderr)
}

/// `flashsale serve` started with `command` (its env set, `serve --listen 127.0.0.1:0`
/// and `extra` added here): `Ok` once it announced itself, or `Err((exit code, stderr))`
/// when it exited first, refused.
pub async fn start_or_exit(mut command: Command, extra: &[&str]) -> Result<Served, (i32, String)> {
    let mut child = command
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(extra)
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let mut startup = Vec::new();
    let mut base = None;
    while let Some(line) = lines.next_line().await.expect("stderr") {
        let announced = line
            .strip_prefix("flashsale: http://")
            .and_then(|rest| rest.split_whitespace().next())
            .map(|addr| format!("http://{addr}"));
        startup.push(line);
        if announced.is_some() {
            base = announced;
            break;
        }
    }
    let startup = startup.join("\n");
    let Some(base) = base else {
        let status = child.wait().await.expect("wait");
        return Err((status.code().unwrap_or(-1), startup));
    };
    let later = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    tokio::spawn({
        let later = later.clone();
        async move {
            while let Ok(Some(line)) = lines.next_line().await {
                later.lock().expect("stderr lines").push(line);
            }
        }
    });
    Ok(Served {
        child,
        base,
        startup,
        later,
    })
}

/// Runs the binary to completion, in a scratch working directory, and returns its exit
/// code, stdout and stderr.
pub async fn output(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let scratch = tempfile::tempdir().expect("scratch dir");
    output_in(scratch.path(), args, env).await
}

/// Runs the binary to completion in working directory `dir`, and returns its exit code,
/// stdout and stderr.
pub async fn output_in(
    dir: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> (i32, String, String) {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .current_dir(dir)
        .env_remove("REDIS_URL")
        .env_remove("DATABASE_URL")
        // A serve that should have been refused and was not must not outlive the test.
        .kill_on_drop(true);
    for (key, value) in env {
        command.env(key, value);
    }
    let output = super::bounded(std::time::Duration::from_secs(30), command.output())
        .await
        .expect("run flashsale");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}
