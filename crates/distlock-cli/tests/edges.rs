//! Breaks a hostile review found in the first `distlock` command, each a test that failed
//! on that build: overlaps at the edges of a stop, keys of other applications, mixed
//! kinds on one name, output nobody reads, and a leader started before its Redis.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{distlock, finish, run_to_end, stderr, until_exists, LIMIT};
use distlock_testkit::RedisServer;
use tokio::process::Child;

/// Whether the process whose pid is in `pid_file` is alive (a zombie is not: only its
/// parent has not read its status).
fn alive(pid_file: &Path) -> bool {
    let pid = std::fs::read_to_string(pid_file).unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())).unwrap_or_default();
    !stat.is_empty()
        && stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
}
/// Review B1 and B2: a grace longer than the lease, and a process of the command that
/// ignores SIGTERM after the command itself exits on it. Both used to run on after the
/// mark was gone, beside the next holder's command.
#[tokio::test]
async fn what_the_command_started_is_stopped_before_the_next_holder_starts() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (pid, overlap, ran) = (
        dir.path().join("gpid"),
        dir.path().join("overlap"),
        dir.path().join("ran"),
    );
    // The command exits on SIGTERM; the process it started ignores it.
    let first_command = format!(
        "(trap '' TERM; while :; do sleep 0.05; done) & echo $! > {pid}.tmp; mv {pid}.tmp {pid}; wait",
        pid = pid.display()
    );
    let mut first = distlock(&server.url());
    first.args([
        "run",
        "grand",
        "--ttl",
        "2s",
        "--kill-grace",
        "4s",
        "--",
        "sh",
        "-c",
        &first_command,
    ]);
    let first = first.spawn().unwrap();
    until_exists(&pid).await;
    let mut second = distlock(&server.url());
    second.args(["run", "grand", "--", "sh", "-c"]).arg(format!(
        "if [ -e /proc/$(cat {pid}) ] && ! grep -q ') Z' /proc/$(cat {pid})/stat; then echo overlap > {overlap}; fi; touch {ran}",
        pid = pid.display(),
        overlap = overlap.display(),
        ran = ran.display()
    ));
    let second = second.spawn().unwrap();
    let mut unlock = distlock(&server.url());
    unlock.args(["force-unlock", "grand", "--yes"]);
    assert_eq!(run_to_end(unlock).await.status.code(), Some(0));
    let first = finish(first).await;
    assert_eq!(first.status.code(), Some(79), "{}", stderr(&first));
    assert!(
        !alive(&pid),
        "the process the command started outlived the stop"
    );
    let second = finish(second).await;
    assert_eq!(second.status.code(), Some(0), "{}", stderr(&second));
    assert!(ran.exists());
    assert!(
        !overlap.exists(),
        "the next holder's command ran beside the first one's process"
    );
}

/// Review B5: another application's hash of integers is neither shown as a lock nor
/// deleted by force-unlock.
#[tokio::test]
async fn another_applications_hash_is_not_a_lock() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let _: () = redis::cmd("HSET")
        .arg("stats:page")
        .arg("views")
        .arg(5)
        .arg("clicks")
        .arg(7)
        .query_async(&mut raw)
        .await
        .unwrap();
    let mut unlock = distlock(&server.url());
    unlock.args(["force-unlock", "stats:page", "--yes"]);
    let unlock = run_to_end(unlock).await;
    assert_eq!(unlock.status.code(), Some(2), "{}", stderr(&unlock));
    let exists: i64 = redis::cmd("EXISTS")
        .arg("stats:page")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(exists, 1, "force-unlock deleted another application's data");
    let mut status = distlock(&server.url());
    status.args(["status", "stats:page", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&run_to_end(status).await.stdout).unwrap();
    assert_eq!(json["held"], false);
    assert_eq!(json["kind"], "not a lock");
    // Keys list cannot take as lock names, or that are not UTF-8, do not stop a listing.
    let _: () = redis::cmd("HSET")
        .arg("sess}42")
        .arg("u")
        .arg(1)
        .query_async(&mut raw)
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(b"bin\xffname".as_slice())
        .arg("f")
        .arg(1)
        .query_async(&mut raw)
        .await
        .unwrap();
    let holder = {
        let mut run = distlock(&server.url());
        run.args(["run", "real", "--", "sleep", "30"]);
        run.spawn().unwrap()
    };
    let mut listed = String::new();
    let asked = Instant::now();
    while !listed.contains("\"real\"") {
        assert!(asked.elapsed() < LIMIT, "{listed}");
        let mut list = distlock(&server.url());
        list.args(["list", "--json"]);
        let list = run_to_end(list).await;
        assert_eq!(list.status.code(), Some(0), "{}", stderr(&list));
        listed = String::from_utf8_lossy(&list.stdout).into_owned();
    }
    assert_eq!(listed.lines().count(), 1, "{listed}");
    drop(holder);
}

/// Review B11: output nobody reads (`distlock list | head -1`) is not a panic.
#[tokio::test]
async fn a_closed_output_is_not_a_panic() {
    let server = RedisServer::start().await.unwrap();
    let holders: Vec<Child> = (0..3)
        .map(|index| {
            let mut run = distlock(&server.url());
            run.args(["run", &format!("job{index}"), "--", "sleep", "30"]);
            run.spawn().unwrap()
        })
        .collect();
    let asked = Instant::now();
    loop {
        let mut list = distlock(&server.url());
        list.args(["list"]);
        let text = String::from_utf8_lossy(&run_to_end(list).await.stdout).into_owned();
        if text.lines().count() == 4 {
            break;
        }
        assert!(asked.elapsed() < LIMIT, "{text}");
    }
    for args in [vec!["list"], vec!["status", "job0"]] {
        let mut closed = distlock(&server.url());
        closed.args(&args).stdout(Stdio::piped());
        let mut child = closed.spawn().unwrap();
        drop(child.stdout.take());
        let output = finish(child).await;
        assert!(
            !stderr(&output).contains("panicked"),
            "{args:?}: {}",
            stderr(&output)
        );
        assert_ne!(output.status.code(), Some(101), "{args:?}");
    }
    drop(holders);
}

/// Review B7: a refusal on the running mark (an ACL that does not cover it) after the lock
/// was taken gives the lock back, and names the mark.
#[tokio::test]
async fn a_refused_mark_gives_the_lock_back() {
    let server = RedisServer::start().await.unwrap();
    let mut admin = server.connection().await.unwrap();
    let rules = [
        "on",
        ">apppw",
        "~jobs*",
        "~redisson_lock__channel:*",
        "~redisson_lock_token:*",
        "~distlock_fence:*",
        "~redisson_unlock_latch:*",
        "&*",
        "+@all",
    ];
    let mut setuser = redis::cmd("ACL");
    setuser.arg("SETUSER").arg("app");
    for rule in rules {
        setuser.arg(rule);
    }
    let _: () = setuser.query_async(&mut admin).await.unwrap();
    let url = format!("redis://app:apppw@127.0.0.1:{}", server.port());
    let mut run = distlock(&url);
    run.args(["run", "jobs1", "--", "true"]);
    let run = run_to_end(run).await;
    assert_eq!(run.status.code(), Some(77), "{}", stderr(&run));
    assert!(
        stderr(&run).contains("distlock_running:{jobs1}"),
        "{}",
        stderr(&run)
    );
    let held: i64 = redis::cmd("EXISTS")
        .arg("jobs1")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(held, 0, "the lock was left held");
}

/// Review B9 and B10: a lock and a semaphore on one name, and permits asked with a
/// different -n: clear refusals (exit 2), never "Redis unreachable"; a semaphore's status
/// shows its holders.
#[tokio::test]
async fn kinds_and_permit_counts_do_not_mix() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let mut pool = distlock(&server.url());
    pool.args(["run", "pool", "-n", "2", "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 30", started.display()));
    let pool = pool.spawn().unwrap();
    until_exists(&started).await;
    for args in [
        vec!["run", "pool", "--", "true"],
        vec!["run", "pool", "-n", "3", "--", "true"],
        vec!["run", "pool", "-n", "1", "--", "true"],
    ] {
        let mut other = distlock(&server.url());
        other.args(&args);
        let other = run_to_end(other).await;
        assert_eq!(other.status.code(), Some(2), "{args:?}: {}", stderr(&other));
    }
    let mut status = distlock(&server.url());
    status.args(["status", "pool", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&run_to_end(status).await.stdout).unwrap();
    assert_eq!(json["held"], true, "{json}");
    assert_eq!(json["kind"], "semaphore");
    assert_eq!(json["free_permits"], 1);
    assert_eq!(json["holders"].as_array().unwrap().len(), 1);
    let mut unlock = distlock(&server.url());
    unlock.args(["force-unlock", "pool", "--yes"]);
    assert_eq!(run_to_end(unlock).await.status.code(), Some(2));
    drop(pool);
}

/// Review B13a: a leader started while its Redis is down waits for it.
#[tokio::test]
async fn a_leader_started_before_its_redis_waits_for_it() {
    let mut server = RedisServer::start().await.unwrap();
    server.kill().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let mut elect = distlock(&server.url());
    elect.args(["elect", "boot", "--", "sh", "-c"]).arg(format!(
        "trap 'exit 0' TERM; touch {}; while :; do sleep 0.05; done",
        started.display()
    ));
    let elect = elect.spawn().unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    server.restart().await.unwrap();
    until_exists(&started).await;
    let pid = nix::unistd::Pid::from_raw(elect.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let elect = finish(elect).await;
    assert_eq!(elect.status.code(), Some(0), "{}", stderr(&elect));
}

/// Review B13b: a signal while waiting for the previous holder's command ends the wait;
/// the command never runs and the lock is given back.
#[tokio::test]
async fn a_signal_during_the_wait_for_the_previous_command_ends_it() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    // A previous holder's command still marked as running.
    let _: () = redis::cmd("SET")
        .arg("distlock_running:{marked}")
        .arg("someone-else:1")
        .arg("PX")
        .arg(20_000)
        .query_async(&mut raw)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let mut run = distlock(&server.url());
    run.args(["run", "marked", "--", "touch"]).arg(&ran);
    let run = run.spawn().unwrap();
    let asked = Instant::now();
    loop {
        let held: i64 = redis::cmd("EXISTS")
            .arg("marked")
            .query_async(&mut raw)
            .await
            .unwrap();
        if held == 1 {
            break;
        }
        assert!(asked.elapsed() < LIMIT);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let pid = nix::unistd::Pid::from_raw(run.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let run = finish(run).await;
    assert_eq!(run.status.code(), Some(128 + 15), "{}", stderr(&run));
    assert!(!ran.exists(), "the command ran after the signal");
    let held: i64 = redis::cmd("EXISTS")
        .arg("marked")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(held, 0, "the lock was left held");
}

/// Second review B1: a holder that loses the lock while it waits for the previous
/// command to stop never starts its command; the holder after it does, once.
#[tokio::test]
async fn a_holder_that_loses_the_lock_while_waiting_never_starts() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (a_pid, b_ran, c_ran) = (
        dir.path().join("a"),
        dir.path().join("b-ran"),
        dir.path().join("c-ran"),
    );
    let mut a = distlock(&server.url());
    a.args(["run", "chain", "--kill-grace", "3s", "--", "sh", "-c"])
        .arg(format!(
            "trap '' TERM; echo $$ > {pid}.tmp; mv {pid}.tmp {pid}; while :; do sleep 0.05; done",
            pid = a_pid.display()
        ));
    let a = a.spawn().unwrap();
    until_exists(&a_pid).await;
    let force = |url: String| async move {
        let mut unlock = distlock(&url);
        unlock.args(["force-unlock", "chain", "--yes"]);
        run_to_end(unlock).await
    };
    let held_by = |url: String| async move {
        let mut status = distlock(&url);
        status.args(["status", "chain", "--json"]);
        let json: serde_json::Value =
            serde_json::from_slice(&run_to_end(status).await.stdout).unwrap();
        json["holders"][0]["owner"].as_str().map(str::to_owned)
    };
    let first_owner = held_by(server.url()).await;
    force(server.url()).await;
    // B takes the lock and waits for A's command to stop.
    let mut b = distlock(&server.url());
    b.args(["run", "chain", "--", "touch"]).arg(&b_ran);
    let b = b.spawn().unwrap();
    let asked = Instant::now();
    while held_by(server.url()).await == first_owner || held_by(server.url()).await.is_none() {
        assert!(asked.elapsed() < LIMIT, "B never took the lock");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // B loses it while it waits; C takes it.
    force(server.url()).await;
    let mut c = distlock(&server.url());
    c.args(["run", "chain", "--", "touch"]).arg(&c_ran);
    let c = c.spawn().unwrap();
    let (a, b, c) = (finish(a).await, finish(b).await, finish(c).await);
    assert_eq!(a.status.code(), Some(79), "{}", stderr(&a));
    assert_eq!(b.status.code(), Some(79), "{}", stderr(&b));
    assert!(!b_ran.exists(), "B ran its command after losing the lock");
    assert_eq!(c.status.code(), Some(0), "{}", stderr(&c));
    assert!(c_ran.exists());
}

/// Second review B2: jobs a command leaves in the background keep its lock until they
/// end; the next holder starts after them.
#[tokio::test]
async fn background_jobs_of_the_command_keep_the_lock() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (done, overlap) = (dir.path().join("bg-done"), dir.path().join("overlap"));
    let mut first = distlock(&server.url());
    first.args(["run", "bg", "--", "sh", "-c"]).arg(format!(
        "(sleep 0.5; touch {}) & echo started",
        done.display()
    ));
    let first = run_to_end(first).await;
    assert_eq!(first.status.code(), Some(0), "{}", stderr(&first));
    assert!(
        done.exists(),
        "distlock returned before the background job ended"
    );
    let mut second = distlock(&server.url());
    second.args(["run", "bg", "--", "sh", "-c"]).arg(format!(
        "test -e {} || touch {}",
        done.display(),
        overlap.display()
    ));
    assert_eq!(run_to_end(second).await.status.code(), Some(0));
    assert!(!overlap.exists());
}

/// Second review B4: `q` and `{q}` are different locks with different marks; and
/// `--no-wait` does not wait for a previous command that is still stopping.
#[tokio::test]
async fn marks_of_different_locks_never_meet_and_no_wait_never_waits() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let mut q = distlock(&server.url());
    q.args(["run", "q", "--kill-grace", "3s", "--", "sh", "-c"])
        .arg(format!(
            "trap '' TERM; touch {}; while :; do sleep 0.05; done",
            started.display()
        ));
    let q = q.spawn().unwrap();
    until_exists(&started).await;
    let asked = Instant::now();
    let mut braced = distlock(&server.url());
    braced.args(["run", "{q}", "--no-wait", "--", "true"]);
    assert_eq!(run_to_end(braced).await.status.code(), Some(0));
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "{:?}",
        asked.elapsed()
    );
    // q is force-unlocked while its command ignores SIGTERM: a --no-wait run takes the
    // lock but finds the command still stopping, and reports the conflict at once.
    let mut unlock = distlock(&server.url());
    unlock.args(["force-unlock", "q", "--yes"]);
    run_to_end(unlock).await;
    let asked = Instant::now();
    let mut skipped = distlock(&server.url());
    skipped.args(["run", "q", "--no-wait", "--", "true"]);
    let skipped = run_to_end(skipped).await;
    assert_eq!(skipped.status.code(), Some(75), "{}", stderr(&skipped));
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "{:?}",
        asked.elapsed()
    );
    assert_eq!(finish(q).await.status.code(), Some(79));
}

/// Second review B5, B6, B8, B9: a hash of `user:<n>` counters is not a lock; a plain
/// string is not a semaphore; semaphores with braces in their names are listed; a
/// password in the query string is refused on the command line; a URL that does not
/// parse is not quoted; arguments that are not UTF-8 reach the command.
#[tokio::test]
async fn odd_keys_urls_and_arguments() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let _: () = redis::cmd("HSET")
        .arg("pageviews")
        .arg("user:42")
        .arg(7)
        .query_async(&mut raw)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg("plain")
        .arg("hello")
        .query_async(&mut raw)
        .await
        .unwrap();
    for (name, kind) in [("pageviews", "not a lock"), ("plain", "not a lock")] {
        let mut status = distlock(&server.url());
        status.args(["status", name, "--json"]);
        let json: serde_json::Value =
            serde_json::from_slice(&run_to_end(status).await.stdout).unwrap();
        assert_eq!(json["kind"], kind, "{name}: {json}");
        let mut unlock = distlock(&server.url());
        unlock.args(["force-unlock", name, "--yes"]);
        assert_eq!(run_to_end(unlock).await.status.code(), Some(2), "{name}");
    }
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let mut pool = distlock(&server.url());
    pool.args(["run", "a{s}", "-n", "2", "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 30", started.display()));
    let pool = pool.spawn().unwrap();
    until_exists(&started).await;
    let mut list = distlock(&server.url());
    list.args(["list", "--json"]);
    let listed = String::from_utf8_lossy(&run_to_end(list).await.stdout).into_owned();
    assert!(listed.contains("\"name\":\"a{s}\""), "{listed}");
    assert!(!listed.contains("pageviews"), "{listed}");
    drop(pool);

    let mut query = distlock(&server.url());
    query
        .args([
            "--url",
            "redis+sentinel://127.0.0.1:1/m?sentinel_password=hunter2",
        ])
        .args(["status", "x"]);
    assert_eq!(run_to_end(query).await.status.code(), Some(2));
    let bad = distlock("redis://:p@ss:w%rd/#?x@127.0.0.1:1");
    let mut bad = bad;
    bad.args(["status", "x"]);
    let bad = run_to_end(bad).await;
    assert!(!stderr(&bad).contains("ss:w"), "{}", stderr(&bad));

    use std::os::unix::ffi::OsStrExt;
    let mut bytes = distlock(&server.url());
    bytes
        .args(["run", "bytes", "--", "printf", "%s"])
        .arg(std::ffi::OsStr::from_bytes(b"\xffname"));
    let bytes = run_to_end(bytes).await;
    assert_eq!(bytes.status.code(), Some(0), "{}", stderr(&bytes));
    assert_eq!(bytes.stdout, b"\xffname");
}
