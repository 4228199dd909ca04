//! Issue 30, section 2: what the third review of the `distlock` command found. Each test
//! failed on the build the review tried.

mod common;

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use common::{assert_one_line, distlock, finish, run_to_end, stderr, until_exists, LIMIT};
use distlock_testkit::{FaultProxy, RedisServer};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::process::Command;

/// Runs `command` to its end within `limit`: a run that waits forever fails the test
/// instead of holding it up for the common limit.
async fn within(limit: Duration, mut command: Command) -> Output {
    let child = command.spawn().unwrap();
    tokio::time::timeout(limit, child.wait_with_output())
        .await
        .expect("distlock finished in time")
        .unwrap()
}

fn pid_of(child: &tokio::process::Child) -> Pid {
    Pid::from_raw(child.id().unwrap() as i32)
}

/// The number of lines distlock wrote to stderr.
fn lines(output: &Output) -> usize {
    stderr(output).lines().count()
}

async fn exists(raw: &mut redis::aio::MultiplexedConnection, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<i64>(raw)
        .await
        .unwrap()
        == 1
}

/// Whether the process whose pid is in `pid_file` is alive (not a zombie).
fn alive(pid_file: &Path) -> bool {
    let pid = std::fs::read_to_string(pid_file).unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())).unwrap_or_default();
    !stat.is_empty()
        && stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// 2.1: an ACL user that may not publish on the lock's channel is refused (77) before
/// the command starts, and the lock is not left held.
#[tokio::test]
async fn an_acl_user_without_channel_permission_is_refused_before_the_command() {
    let server = RedisServer::start().await.unwrap();
    let mut admin = server.connection().await.unwrap();
    let _: () = redis::cmd("ACL")
        .arg(
            &[
                "SETUSER",
                "nochan",
                "on",
                ">pw",
                "~*",
                "resetchannels",
                "+@all",
            ][..],
        )
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!("redis://nochan:pw@127.0.0.1:{}", server.port());
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    for flags in [vec![], vec!["--fair"], vec!["-n", "2"]] {
        let mut run = distlock(&url);
        run.args(["run", "chan"])
            .args(&flags)
            .args(["--", "touch"])
            .arg(&ran);
        let run = within(Duration::from_secs(10), run).await;
        assert_eq!(run.status.code(), Some(77), "{flags:?}: {}", stderr(&run));
        assert!(stderr(&run).contains("channel"), "{}", stderr(&run));
        assert!(!ran.exists(), "{flags:?}: the command ran");
        assert!(!exists(&mut admin, "chan").await, "{flags:?}: left held");
    }
}

/// 2.2: a name that is another application's hash: run, run --wait and elect exit 2 at
/// once with a line that says so, as status says "not a lock".
#[tokio::test]
async fn another_applications_hash_is_refused_by_run_and_elect() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let _: () = redis::cmd("HSET")
        .arg(&["stats", "views", "5"][..])
        .query_async(&mut raw)
        .await
        .unwrap();
    let _: () = redis::cmd("RPUSH")
        .arg(&["queue", "a"][..])
        .query_async(&mut raw)
        .await
        .unwrap();
    for (name, args) in [
        ("stats", vec!["run"]),
        ("stats", vec!["run", "--wait", "2s"]),
        ("stats", vec!["run", "--fair"]),
        ("stats", vec!["run", "-n", "2"]),
        ("stats", vec!["elect"]),
        ("queue", vec!["run"]),
    ] {
        let mut command = distlock(&server.url());
        command
            .arg(args[0])
            .arg(name)
            .args(&args[1..])
            .args(["--", "true"]);
        let output = within(Duration::from_secs(10), command).await;
        assert_one_line(&output, 2, "not a lock", &format!("{args:?}"));
    }
}

/// 2.3: `run -n` does not take another application's number for a semaphore; it uses
/// one it created itself, or one named as a semaphore with --adopt-semaphore, and status
/// says which.
#[tokio::test]
async fn a_number_distlock_did_not_create_is_not_taken_for_a_semaphore() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let _: () = redis::cmd("SET")
        .arg(&["stock", "3"][..])
        .query_async(&mut raw)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let mut run = distlock(&server.url());
    run.args(["run", "stock", "-n", "3", "--", "touch"])
        .arg(&ran);
    let run = within(Duration::from_secs(10), run).await;
    assert_eq!(run.status.code(), Some(2), "{}", stderr(&run));
    assert!(
        stderr(&run).contains("--adopt-semaphore"),
        "{}",
        stderr(&run)
    );
    assert!(!ran.exists());
    let value: String = redis::cmd("GET")
        .arg("stock")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(value, "3");
    let mut status = distlock(&server.url());
    status.args(["status", "stock", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&run_to_end(status).await.stdout).unwrap();
    assert_eq!(json["kind"], "number", "{json}");

    // Named as a semaphore: taken.
    let mut adopted = distlock(&server.url());
    adopted
        .args([
            "run",
            "stock",
            "-n",
            "3",
            "--adopt-semaphore",
            "--",
            "sh",
            "-c",
        ])
        .arg(format!(
            "redis-cli -p {} GET stock > {}",
            server.port(),
            ran.display()
        ));
    let adopted = within(Duration::from_secs(10), adopted).await;
    assert_eq!(adopted.status.code(), Some(0), "{}", stderr(&adopted));
    assert_eq!(std::fs::read_to_string(&ran).unwrap().trim(), "2");

    // Created by distlock: status says so, and later runs need no flag.
    let mut own = distlock(&server.url());
    own.args(["run", "own", "-n", "2", "--", "true"]);
    assert_eq!(run_to_end(own).await.status.code(), Some(0));
    let mut again = distlock(&server.url());
    again.args(["run", "own", "-n", "2", "--", "true"]);
    assert_eq!(run_to_end(again).await.status.code(), Some(0));
    let mut status = distlock(&server.url());
    status.args(["status", "own", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&run_to_end(status).await.stdout).unwrap();
    assert_eq!(json["kind"], "semaphore", "{json}");
    assert_eq!(json["created_by_distlock"], true, "{json}");
}

/// 2.4: a missing password and a wrong one are both refusals (77), and elect gives up
/// on them at once.
#[tokio::test]
async fn a_missing_or_wrong_password_is_a_refusal() {
    let server = RedisServer::start().await.unwrap();
    let mut admin = server.connection().await.unwrap();
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "default", "resetpass", ">secret"][..])
        .query_async(&mut admin)
        .await
        .unwrap();
    let port = server.port();
    for url in [
        format!("redis://127.0.0.1:{port}"),
        format!("redis://:wrong@127.0.0.1:{port}"),
    ] {
        for args in [vec!["status", "x"], vec!["elect", "x", "--", "true"]] {
            let mut command = distlock(&url);
            command.args(&args);
            let output = within(Duration::from_secs(10), command).await;
            assert_eq!(
                output.status.code(),
                Some(77),
                "{args:?}: {}",
                stderr(&output)
            );
            assert_eq!(lines(&output), 1, "{}", stderr(&output));
            assert!(stderr(&output).contains("password"), "{}", stderr(&output));
        }
    }
}

/// 2.5: with Redis unreachable and a short --kill-grace, the command is killed no later
/// than the server's end of the lease (a 3 s and a 6 s ttl, as the review measured).
#[tokio::test]
async fn a_short_kill_grace_kills_before_the_lease_ends_when_redis_is_unreachable() {
    let server = RedisServer::start().await.unwrap();
    let proxy = FaultProxy::in_front_of(&server).await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut runs = Vec::new();
    for ttl in ["3s", "6s"] {
        let name = format!("grace{ttl}");
        let pid = dir.path().join(&name);
        let mut run = distlock(&proxy.url());
        run.args([
            "run",
            &name,
            "--ttl",
            ttl,
            "--kill-grace",
            "100ms",
            "--",
            "sh",
            "-c",
        ])
        .arg(format!(
            "trap '' TERM; echo $$ > {pid}.tmp; mv {pid}.tmp {pid}; while :; do sleep 0.01; done",
            pid = pid.display()
        ));
        let run = run.spawn().unwrap();
        until_exists(&pid).await;
        runs.push((name, pid, run));
    }
    proxy.blackhole();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut lease_ends = Vec::new();
    for (name, _, _) in &runs {
        let lease_end: i64 = redis::cmd("PEXPIRETIME")
            .arg(name)
            .query_async(&mut raw)
            .await
            .unwrap();
        assert!(lease_end > 0, "{name}");
        lease_ends.push(lease_end);
    }
    let started = Instant::now();
    let mut died = vec![None; runs.len()];
    while died.iter().any(Option::is_none) {
        assert!(started.elapsed() < LIMIT);
        for (index, (_, pid, _)) in runs.iter().enumerate() {
            if died[index].is_none() && !alive(pid) {
                died[index] = Some(unix_ms());
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    for (index, (name, _, run)) in runs.into_iter().enumerate() {
        let died_at = died[index].unwrap();
        assert!(
            died_at <= lease_ends[index],
            "{name}: the command died {} ms after the lease's end",
            died_at - lease_ends[index]
        );
        let run = finish(run).await;
        assert_eq!(run.status.code(), Some(79), "{name}: {}", stderr(&run));
    }
}

/// 2.6: elect says "leading" only once its command starts (after the previous holder's
/// command is gone), and a candidate that was stopped past its lease says the lease
/// ended, not that Redis is unreachable.
#[tokio::test]
async fn elects_words_are_true() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let _: () = redis::cmd("SET")
        .arg("distlock_running:{lead}")
        .arg("someone-else:1")
        .arg("PX")
        .arg(1000)
        .query_async(&mut raw)
        .await
        .unwrap();
    let mut elect = distlock(&server.url());
    elect.args(["elect", "lead", "--", "true"]);
    let elect = run_to_end(elect).await;
    assert_eq!(elect.status.code(), Some(0), "{}", stderr(&elect));
    let text = stderr(&elect);
    let waiting = text.find("waiting for the previous holder").expect(&text);
    let leading = text.find("leading").expect(&text);
    assert!(waiting < leading, "{text}");

    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let mut elect = distlock(&server.url());
    elect
        .args(["elect", "paused", "--ttl", "2s", "--", "sh", "-c"])
        .arg(format!(
            "trap 'exit 0' TERM; touch {}; while :; do sleep 0.05; done",
            started.display()
        ));
    let elect = elect.spawn().unwrap();
    until_exists(&started).await;
    std::fs::remove_file(&started).unwrap();
    kill(pid_of(&elect), Signal::SIGSTOP).unwrap();
    tokio::time::sleep(Duration::from_millis(3500)).await;
    kill(pid_of(&elect), Signal::SIGCONT).unwrap();
    // It stops the command and leads again.
    until_exists(&started).await;
    kill(pid_of(&elect), Signal::SIGTERM).unwrap();
    let elect = finish(elect).await;
    let text = stderr(&elect);
    assert!(!text.contains("unreachable"), "{text}");
    assert!(text.contains("ended"), "{text}");
}

/// 2.7: a peer that is not Redis is reported in one line.
#[tokio::test]
async fn a_peer_that_is_not_redis_is_one_line() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut buffer = [0; 256];
            let _ = socket.read(&mut buffer).await;
            let _ = socket
                .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                .await;
        }
    });
    let mut status = distlock(&format!("redis://127.0.0.1:{port}"));
    status.args(["status", "x"]);
    let status = within(Duration::from_secs(10), status).await;
    assert_eq!(status.status.code(), Some(69), "{}", stderr(&status));
    assert_eq!(lines(&status), 1, "{}", stderr(&status));
    assert!(
        stderr(&status).contains("not answer like Redis"),
        "{}",
        stderr(&status)
    );
}

/// 2.7: a name with a newline or other control characters cannot add rows to list's or
/// status's text.
#[tokio::test]
async fn control_characters_in_names_are_escaped_in_text() {
    let server = RedisServer::start().await.unwrap();
    let name = "evil\nfake-row   lock   9.9s  1  owner\r\x1b[2J";
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let mut holder = distlock(&server.url());
    holder
        .args(["run", name, "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 30", started.display()));
    let holder = holder.spawn().unwrap();
    until_exists(&started).await;
    let mut list = distlock(&server.url());
    list.arg("list");
    let list = run_to_end(list).await;
    let text = String::from_utf8_lossy(&list.stdout).into_owned();
    assert_eq!(text.lines().count(), 2, "{text}");
    assert!(!text.contains('\r') && !text.contains('\x1b'), "{text:?}");
    assert!(text.contains("evil\\nfake-row"), "{text}");
    let mut status = distlock(&server.url());
    status.args(["status", name]);
    let status = run_to_end(status).await;
    let text = String::from_utf8_lossy(&status.stdout).into_owned();
    assert!(
        text.lines().all(|line| line.contains(':')),
        "a row was injected: {text}"
    );
    assert!(!text.contains('\r') && !text.contains('\x1b'), "{text:?}");
    // JSON carries the name as it is.
    let mut json = distlock(&server.url());
    json.args(["status", name, "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&run_to_end(json).await.stdout).unwrap();
    assert_eq!(json["name"], name);
    drop(holder);
}

/// 2.7: a redis+cluster:// URL at a server that is not a cluster node is a clear usage
/// error, and elect does not retry it.
#[tokio::test]
async fn a_cluster_url_at_a_plain_server_is_a_usage_error() {
    let server = RedisServer::start().await.unwrap();
    let url = format!("redis+cluster://127.0.0.1:{}", server.port());
    for args in [vec!["status", "x"], vec!["elect", "x", "--", "true"]] {
        let mut command = distlock(&url);
        command.args(&args);
        let output = within(Duration::from_secs(10), command).await;
        assert_one_line(&output, 2, "not a Redis Cluster", &format!("{args:?}"));
    }
}

/// 2.7: a running mark that is another application's key: one line, no script SHA or
/// script line, and no word about clearing a mark that was never set.
#[tokio::test]
async fn a_wrong_type_is_one_plain_line() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let _: () = redis::cmd("RPUSH")
        .arg(&["distlock_running:{w}", "x"][..])
        .query_async(&mut raw)
        .await
        .unwrap();
    let mut run = distlock(&server.url());
    run.args(["run", "w", "--", "true"]);
    let run = within(Duration::from_secs(10), run).await;
    let text = stderr(&run);
    assert_eq!(run.status.code(), Some(2), "{text}");
    assert_eq!(lines(&run), 1, "{text}");
    assert!(!text.contains("could not clear"), "{text}");
    assert!(!text.contains("user_script"), "{text}");
    assert!(!text.contains("script:"), "{text}");
    assert!(text.contains("distlock_running:{w}"), "{text}");
    assert!(!exists(&mut raw, "w").await, "the lock was left held");
}

/// 2.7: a lease too short to run a command under is refused as a usage error.
#[tokio::test]
async fn a_lease_too_short_is_a_usage_error() {
    let server = RedisServer::start().await.unwrap();
    for flag in ["--lease", "--ttl"] {
        let mut run = distlock(&server.url());
        run.args(["run", "short", flag, "1ms", "--", "true"]);
        let run = run_to_end(run).await;
        assert_eq!(run.status.code(), Some(2), "{}", stderr(&run));
        assert!(stderr(&run).contains("at least"), "{}", stderr(&run));
    }
}
