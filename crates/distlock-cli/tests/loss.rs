//! When the lock is lost while the command runs: force-unlocked by an operator, the Redis
//! server stopped (SIGSTOP) past the lease, or killed. In each case the command is
//! stopped, distlock exits with the "lost" code, and the next holder's command never
//! overlaps it: the next command checks, when it starts, whether the first one's process
//! still exists.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{distlock, finish, stderr, until_exists, LIMIT};
use distlock_testkit::RedisServer;
use tokio::process::Child;

/// A first holder's command, and the second holder's overlap check.
struct Commands {
    _dir: tempfile::TempDir,
    pid: PathBuf,
    overlap: PathBuf,
    second_ran: PathBuf,
}

impl Commands {
    fn new() -> Commands {
        let dir = tempfile::tempdir().unwrap();
        Commands {
            pid: dir.path().join("first.pid"),
            overlap: dir.path().join("overlap"),
            second_ran: dir.path().join("second-ran"),
            _dir: dir,
        }
    }

    /// Writes its pid, then runs until stopped; with `stubborn`, it ignores SIGTERM, so
    /// only SIGKILL stops it.
    fn first(&self, stubborn: bool) -> String {
        let trap = if stubborn { "trap '' TERM; " } else { "" };
        format!(
            "{trap}echo $$ > {pid}.tmp; mv {pid}.tmp {pid}; while :; do sleep 0.05; done",
            pid = self.pid.display()
        )
    }

    /// Starts the first holder's command (see [`Commands::first`]) on lock `name`, with
    /// `flags`, and waits until it runs.
    async fn start_first(
        &self,
        server: &RedisServer,
        name: &str,
        flags: &[&str],
        stubborn: bool,
    ) -> Child {
        let mut first = distlock(&server.url());
        first
            .args(["run", name])
            .args(flags)
            .args(["--", "sh", "-c", &self.first(stubborn)]);
        let first = first.spawn().unwrap();
        until_exists(&self.pid).await;
        first
    }

    /// Runs the second holder's command on lock `name` to its end, and checks that it ran
    /// and never beside the first.
    async fn run_second_without_overlap(&self, server: &RedisServer, name: &str, flags: &[&str]) {
        let mut second = distlock(&server.url());
        second
            .args(["run", name])
            .args(flags)
            .args(["--", "sh", "-c", &self.second()]);
        let second = finish(second.spawn().unwrap()).await;
        assert_eq!(second.status.code(), Some(0), "{}", stderr(&second));
        self.assert_no_overlap();
    }

    /// Records an overlap if the first command's process still exists.
    fn second(&self) -> String {
        format!(
            "if [ -e /proc/$(cat {pid}) ]; then echo overlap > {overlap}; fi; touch {ran}",
            pid = self.pid.display(),
            overlap = self.overlap.display(),
            ran = self.second_ran.display()
        )
    }

    /// Waits until the first command's process is gone; how long that took from `since`.
    async fn first_gone_after(&self, since: Instant) -> Duration {
        while !self.first_is_gone() {
            assert!(since.elapsed() < LIMIT, "the first command never stopped");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        since.elapsed()
    }

    fn first_is_gone(&self) -> bool {
        let pid = std::fs::read_to_string(&self.pid).unwrap();
        !Path::new(&format!("/proc/{}", pid.trim())).exists()
    }

    fn assert_no_overlap(&self) {
        assert!(self.second_ran.exists(), "the second command never ran");
        assert!(
            !self.overlap.exists(),
            "the second command started while the first ran"
        );
    }
}

/// An operator force-unlocks the lock while a command that ignores SIGTERM runs: it gets
/// SIGKILL after the grace, and a second run waiting for the lock starts its command only
/// once the first is gone.
#[tokio::test]
async fn a_force_unlock_stops_the_command_and_the_next_never_overlaps() {
    let server = RedisServer::start().await.unwrap();
    let commands = Commands::new();
    let first = commands
        .start_first(&server, "deploy", &["--kill-grace", "1s"], true)
        .await;
    let mut second = distlock(&server.url());
    second.args(["run", "deploy", "--", "sh", "-c", &commands.second()]);
    let second = second.spawn().unwrap();

    let mut unlock = distlock(&server.url());
    unlock.args(["force-unlock", "deploy", "--yes"]);
    let unlocked = finish(unlock.spawn().unwrap()).await;
    assert_eq!(unlocked.status.code(), Some(0), "{}", stderr(&unlocked));

    let first = finish(first).await;
    assert_eq!(first.status.code(), Some(79), "{}", stderr(&first));
    assert!(commands.first_is_gone());
    let second = finish(second).await;
    assert_eq!(second.status.code(), Some(0), "{}", stderr(&second));
    commands.assert_no_overlap();
}

/// The Redis server is stopped (SIGSTOP) while a command runs under a 3 s watchdog lease:
/// no renewal gets through, and the command is stopped before the lease can have ended.
/// Once Redis runs again, the next run's command never overlaps it.
#[tokio::test]
async fn a_stopped_redis_stops_the_command_within_the_lease() {
    let server = RedisServer::start().await.unwrap();
    let commands = Commands::new();
    let first = commands
        .start_first(&server, "report", &["--ttl", "3s"], false)
        .await;
    server.pause().unwrap();
    // The last renewal was sent before this instant: the lease ends within 3 s of it.
    let stopped_at = Instant::now();
    let (first, stopped_within) =
        tokio::join!(finish(first), commands.first_gone_after(stopped_at));
    let exited_within = stopped_at.elapsed();
    server.resume().unwrap();
    assert_eq!(first.status.code(), Some(79), "{}", stderr(&first));
    assert!(
        stopped_within < Duration::from_secs(3),
        "the command ran {stopped_within:?} past the pause; the lease is 3 s"
    );
    assert!(
        exited_within < Duration::from_secs(6),
        "distlock took {exited_within:?} to exit"
    );
    commands
        .run_second_without_overlap(&server, "report", &["--wait", "10s"])
        .await;
}

/// The Redis server is killed while a command runs: the command is stopped within the
/// lease, and once Redis is back, the next run's command never overlaps it.
#[tokio::test]
async fn a_killed_redis_stops_the_command_within_the_lease() {
    let mut server = RedisServer::start().await.unwrap();
    let commands = Commands::new();
    let first = commands
        .start_first(&server, "backup", &["--ttl", "3s"], false)
        .await;
    server.kill().await.unwrap();
    let killed_at = Instant::now();
    let (first, stopped_within) = tokio::join!(finish(first), commands.first_gone_after(killed_at));
    let exited_within = killed_at.elapsed();
    assert!(
        stopped_within < Duration::from_secs(3),
        "{stopped_within:?}"
    );
    assert!(
        exited_within < Duration::from_secs(6),
        "distlock took {exited_within:?} to exit"
    );
    assert_eq!(first.status.code(), Some(79), "{}", stderr(&first));
    server.restart().await.unwrap();
    commands
        .run_second_without_overlap(&server, "backup", &["--wait", "10s"])
        .await;
}

/// kill -9 of distlock takes its command with it (the parent-death signal): a command
/// never runs on without its lock.
#[tokio::test]
async fn a_killed_distlock_takes_its_command_with_it() {
    let server = RedisServer::start().await.unwrap();
    let commands = Commands::new();
    let mut first = commands
        .start_first(&server, "sync", &["--ttl", "2s"], true)
        .await;
    first.start_kill().unwrap();
    first.wait().await.unwrap();
    let killed = Instant::now();
    while !commands.first_is_gone() {
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "the command outlived distlock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    commands
        .run_second_without_overlap(&server, "sync", &["--wait", "10s"])
        .await;
}

/// `elect` restarts its command after the lock is lost and taken again, with a larger
/// fencing token; SIGTERM to it reaches the command, whose status is passed through.
#[tokio::test]
async fn elect_runs_the_command_again_after_a_loss() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("starts");
    let script = format!(
        "trap 'exit 5' TERM; echo $DISTLOCK_FENCING_TOKEN >> {log}; while :; do sleep 0.05; done",
        log = log.display()
    );
    let mut elect = distlock(&server.url());
    elect.args(["elect", "leader", "--", "sh", "-c", &script]);
    let elect = elect.spawn().unwrap();
    let starts = |count: usize| {
        let log = log.clone();
        async move {
            let asked = Instant::now();
            loop {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                if text.lines().count() >= count {
                    return text;
                }
                assert!(
                    asked.elapsed() < LIMIT,
                    "never started {count} times: {text:?}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    starts(1).await;
    let mut unlock = distlock(&server.url());
    unlock.args(["force-unlock", "leader", "--yes"]);
    finish(unlock.spawn().unwrap()).await;
    let text = starts(2).await;
    let tokens: Vec<u64> = text
        .lines()
        .map(|line| line.trim().parse().unwrap())
        .collect();
    assert!(tokens[1] > tokens[0], "{tokens:?}");
    let pid = nix::unistd::Pid::from_raw(elect.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let elect = finish(elect).await;
    assert_eq!(elect.status.code(), Some(5), "{}", stderr(&elect));
}

/// `-n 2`: two commands run at once, a third is a conflict.
#[tokio::test]
async fn permits_let_n_commands_run_at_once() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let release = dir.path().join("release");
    let holders: Vec<Child> = (0..2)
        .map(|index| {
            let started = dir.path().join(format!("started-{index}"));
            let mut run = distlock(&server.url());
            run.args(["run", "pool", "-n", "2", "--", "sh", "-c"])
                .arg(format!(
                    "touch {}; while [ ! -e {} ]; do sleep 0.02; done",
                    started.display(),
                    release.display()
                ));
            run.spawn().unwrap()
        })
        .collect();
    for index in 0..2 {
        until_exists(&dir.path().join(format!("started-{index}"))).await;
    }
    let mut third = distlock(&server.url());
    third.args(["run", "pool", "-n", "2", "--no-wait", "--", "true"]);
    let third = finish(third.spawn().unwrap()).await;
    assert_eq!(third.status.code(), Some(75), "{}", stderr(&third));
    std::fs::write(&release, "").unwrap();
    for holder in holders {
        let holder = finish(holder).await;
        assert_eq!(holder.status.code(), Some(0), "{}", stderr(&holder));
    }
    let mut again = distlock(&server.url());
    again.args(["run", "pool", "-n", "2", "--no-wait", "--", "true"]);
    assert_eq!(finish(again.spawn().unwrap()).await.status.code(), Some(0));
}
