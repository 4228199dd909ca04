//! Issue 30: what a hostile review of the distlock command's issue-30 changes found. Each
//! test failed on the reviewed build (the branch review30cli, on top of 1f83c13).

mod common;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::process::Output;
use std::time::Duration;

use common::{distlock, stderr, until_exists};
use distlock_testkit::RedisServer;
use tokio::process::Command;

/// Runs `command` to its end within `limit`.
async fn within(limit: Duration, mut command: Command) -> Output {
    let child = command.spawn().unwrap();
    tokio::time::timeout(limit, child.wait_with_output())
        .await
        .expect("distlock finished in time")
        .unwrap()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

async fn query<T: redis::FromRedisValue>(
    raw: &mut redis::aio::MultiplexedConnection,
    args: &[&str],
) -> T {
    redis::cmd(args[0])
        .arg(&args[1..])
        .query_async(raw)
        .await
        .unwrap()
}

/// `-v` masks the password of the URL's user info, but not a `sentinel_password=`
/// query parameter, which the library reads as the sentinels' password: `distlock -v`
/// with that URL in DISTLOCK_URL prints the password on stderr.
#[tokio::test]
async fn verbose_never_prints_a_sentinel_password() {
    let mut status = distlock("redis://127.0.0.1:1");
    status
        .env(
            "DISTLOCK_URL",
            "redis+sentinel://127.0.0.1:1/mymaster?sentinel_password=hunter2",
        )
        .args(["-v", "status", "x"]);
    let output = within(Duration::from_secs(15), status).await;
    assert!(!stderr(&output).contains("hunter2"), "{}", stderr(&output));
}

/// Names are shown escaped "in the text of status, list and the messages": force-unlock
/// writes the name as it is, so a name with a newline or an escape sequence adds lines
/// and moves the cursor.
#[tokio::test]
async fn force_unlock_escapes_control_characters_in_names() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let _: () = query(&mut raw, &["SET", "app\nkey", "hello"]).await;
    for name in ["free\nname\x1b[2J", "app\nkey"] {
        let mut unlock = distlock(&server.url());
        unlock.args(["force-unlock", name, "--yes"]);
        let output = within(Duration::from_secs(10), unlock).await;
        let text = stdout(&output) + &stderr(&output);
        assert!(
            !text.contains('\x1b') && text.lines().count() == 1,
            "{name:?}: {text:?}"
        );
    }
}

/// `run -n` uses a count without its mark only with --adopt-semaphore. But the mark of
/// a semaphore `q` and the mark of a semaphore `{q}` are one key, `{q}:distlock_semaphore`:
/// once `run -n` has made `q`, another application's counter at `{q}` is taken for a
/// semaphore distlock created, and status says distlock created it.
#[tokio::test]
async fn a_tagged_names_number_is_not_taken_for_a_semaphore_of_another_name() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let mut first = distlock(&server.url());
    first.args(["run", "q", "-n", "1", "--", "true"]);
    let first = within(Duration::from_secs(10), first).await;
    assert_eq!(first.status.code(), Some(0), "{}", stderr(&first));
    // Another application's counter.
    let _: () = query(&mut raw, &["SET", "{q}", "5"]).await;
    let mut status = distlock(&server.url());
    status.args(["status", "{q}", "--json"]);
    let status = within(Duration::from_secs(10), status).await;
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(json["created_by_distlock"], false, "{json}");
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let mut run = distlock(&server.url());
    run.args(["run", "{q}", "-n", "5", "--", "touch"]).arg(&ran);
    let run = within(Duration::from_secs(10), run).await;
    assert_eq!(run.status.code(), Some(2), "{}", stderr(&run));
    assert!(
        !ran.exists(),
        "the command ran on another application's number"
    );
}

/// DISTLOCK_URL comes before REDIS_URL; one that is not UTF-8 is skipped without a word,
/// and distlock takes the lock on REDIS_URL's server (or the default 127.0.0.1:6379)
/// instead: a lock on another Redis than the operator named.
#[tokio::test]
async fn a_distlock_url_that_is_not_utf8_is_refused_not_skipped() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let mut run = distlock(&server.url());
    run.env(
        "DISTLOCK_URL",
        OsStr::from_bytes(b"redis://127.0.0.1:1/0\xff"),
    )
    .args(["run", "u", "--", "touch"])
    .arg(&ran);
    let output = within(Duration::from_secs(10), run).await;
    assert!(
        !ran.exists(),
        "the command ran under a lock on REDIS_URL's server (exit {:?})",
        output.status.code()
    );
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
}

/// "The command line wins" over DISTLOCK_* for the flags that pick a kind: but elect
/// refuses DISTLOCK_SHARED=1 before the command line's --exclusive (or --fair) is
/// weighed, and exits 2.
#[tokio::test]
async fn elects_command_line_kind_wins_over_distlock_shared() {
    let server = RedisServer::start().await.unwrap();
    for flag in ["--exclusive", "--fair"] {
        let mut elect = distlock(&server.url());
        elect.env("DISTLOCK_SHARED", "1").args([
            "elect",
            &format!("leader{flag}"),
            flag,
            "--",
            "sh",
            "-c",
            "exit 3",
        ]);
        let output = within(Duration::from_secs(10), elect).await;
        assert_eq!(output.status.code(), Some(3), "{flag}: {}", stderr(&output));
    }
}

/// --exclusive: "writers are preferred (no new reader while one waits)". A reader that
/// comes while a writer waits for the first reader is let in at once.
#[tokio::test]
async fn no_new_shared_holder_while_an_exclusive_one_waits() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first");
    let mut reader = distlock(&server.url());
    reader
        .args(["run", "books", "--shared", "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 30", first.display()));
    let reader = reader.spawn().unwrap();
    until_exists(&first).await;
    let mut writer = distlock(&server.url());
    writer.args(["run", "books", "--exclusive", "--", "true"]);
    let writer = writer.spawn().unwrap();
    // The writer is waiting once it has listed itself.
    let started = std::time::Instant::now();
    loop {
        let keys: Vec<String> = query(&mut raw, &["KEYS", "*writers*"]).await;
        if !keys.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the writer never waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut late = distlock(&server.url());
    late.args(["run", "books", "--shared", "--no-wait", "--", "true"]);
    let late = within(Duration::from_secs(10), late).await;
    assert_eq!(
        late.status.code(),
        Some(75),
        "a new reader ran while a writer waited: {}",
        stderr(&late)
    );
    drop((reader, writer));
}

/// A fencing counter the lock scripts refuse (not a number, or one spent up to
/// i64::MAX, which `fence --at-least 9223372036854775806` allows) makes every run exit
/// 69, "Redis could not be reached", on a Redis that answers; elect takes it for an
/// unreachable Redis and tries again forever.
#[tokio::test]
async fn a_refused_fencing_counter_is_not_an_unreachable_redis() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let mut first = distlock(&server.url());
    first.args(["run", "f", "--", "true"]);
    assert_eq!(
        within(Duration::from_secs(10), first).await.status.code(),
        Some(0)
    );
    let counters: Vec<String> = query(&mut raw, &["KEYS", "distlock_fence:*"]).await;
    assert_eq!(counters.len(), 1, "{counters:?}");
    let counter = &counters[0];

    let _: () = query(&mut raw, &["SET", counter, "abc"]).await;
    let mut run = distlock(&server.url());
    run.args(["run", "f", "--", "true"]);
    let output = within(Duration::from_secs(10), run).await;
    assert_ne!(output.status.code(), Some(69), "{}", stderr(&output));
    assert_ne!(output.status.code(), Some(0), "{}", stderr(&output));
    let mut elect = distlock(&server.url());
    elect.args(["elect", "f", "--", "true"]);
    let elect = within(Duration::from_secs(5), elect).await;
    assert_ne!(elect.status.code(), Some(0), "{}", stderr(&elect));

    // Spent: the highest floor fence accepts leaves one token.
    let mut fence = distlock(&server.url());
    fence.args(["fence", "f", "--at-least", "9223372036854775806"]);
    let fence = within(Duration::from_secs(10), fence).await;
    assert_eq!(fence.status.code(), Some(0), "{}", stderr(&fence));
    let mut last = distlock(&server.url());
    last.args(["run", "f", "--", "true"]);
    assert_eq!(
        within(Duration::from_secs(10), last).await.status.code(),
        Some(0)
    );
    let mut spent = distlock(&server.url());
    spent.args(["run", "f", "--", "true"]);
    let spent = within(Duration::from_secs(10), spent).await;
    assert_ne!(spent.status.code(), Some(69), "{}", stderr(&spent));
}

/// `fence NAME --at-least N` is the operator's repair of a counter ("a counter that is
/// not a canonical non-negative integer ... is replaced"), but a counter of digits beyond
/// u64 (99999999999999999999) is kept as it is, the reply does not parse, and fence exits
/// 69; `fence NAME` shows it as 0, and every run is refused until the key is deleted by
/// hand.
#[tokio::test]
async fn fence_repairs_a_counter_too_large_for_a_token() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let mut first = distlock(&server.url());
    first.args(["run", "g", "--", "true"]);
    assert_eq!(
        within(Duration::from_secs(10), first).await.status.code(),
        Some(0)
    );
    let counters: Vec<String> = query(&mut raw, &["KEYS", "distlock_fence:*"]).await;
    let counter = &counters[0];
    let _: () = query(&mut raw, &["SET", counter, "99999999999999999999"]).await;
    let mut fence = distlock(&server.url());
    fence.args(["fence", "g", "--at-least", "5"]);
    let fence = within(Duration::from_secs(10), fence).await;
    assert_eq!(fence.status.code(), Some(0), "{}", stderr(&fence));
    let mut run = distlock(&server.url());
    run.args(["run", "g", "--", "sh", "-c", "echo $DISTLOCK_FENCING_TOKEN"]);
    let run = within(Duration::from_secs(10), run).await;
    assert_eq!(run.status.code(), Some(0), "{}", stderr(&run));
}

/// "'lost NAME' when the server says the lock is another's": a force-unlock is told as
/// "the lease on NAME ended before it was renewed" (the guard's lease reads zero once it
/// is lost, and that is taken for a lease that ran out), by run, elect and hold; and
/// `hold`, which has no command, says "the command was stopped".
#[tokio::test]
async fn a_force_unlock_is_told_as_a_lost_lock() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    for (name, args) in [
        ("h", vec!["hold", "h"]),
        ("r", vec!["run", "r", "--", "sleep", "30"]),
        ("e", vec!["elect", "e", "--", "sleep", "30"]),
    ] {
        let mut holder = distlock(&server.url());
        holder.args(&args);
        let holder = holder.spawn().unwrap();
        let record = format!("distlock_holders:{{{name}}}");
        let started = std::time::Instant::now();
        loop {
            let held: i64 = query(&mut raw, &["EXISTS", &record]).await;
            if held == 1 {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(10));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut unlock = distlock(&server.url());
        unlock.args(["force-unlock", name, "--yes"]);
        assert_eq!(
            within(Duration::from_secs(10), unlock).await.status.code(),
            Some(0)
        );
        if args[0] == "elect" {
            // It leads again; what it said of the loss is on stderr by then.
            tokio::time::sleep(Duration::from_secs(2)).await;
            let pid = nix::unistd::Pid::from_raw(holder.id().unwrap() as i32);
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        }
        let output = tokio::time::timeout(Duration::from_secs(10), holder.wait_with_output())
            .await
            .unwrap()
            .unwrap();
        if args[0] != "elect" {
            assert_eq!(output.status.code(), Some(79), "{}", stderr(&output));
        }
        let said = stderr(&output);
        assert!(said.contains(&format!("lost {name}")), "{args:?}: {said}");
        assert!(!said.contains("lease on"), "{args:?}: {said}");
        if args[0] == "hold" {
            assert!(!said.contains("command"), "{said}");
        }
    }
}

/// "`status` shows a record only for an owner that holds now": a `--shared` holder killed
/// with `kill -9` keeps its field in the read-write lock's hash after its own lease (its
/// `{NAME}:<owner>:rwlock_timeout:1`) has run out, while another reader keeps the hash
/// alive; status lists the dead reader as a holder, with the dead pid from its record
/// (which the living reader's renewals keep too).
#[tokio::test]
async fn status_does_not_show_a_dead_reader_as_a_holder() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let spawn = || {
        let mut hold = distlock(&server.url());
        hold.args(["hold", "books", "--shared", "--ttl", "2s"]);
        hold.spawn().unwrap()
    };
    let dead = spawn();
    let living = spawn();
    let started = std::time::Instant::now();
    loop {
        let records: i64 = query(&mut raw, &["HLEN", "distlock_holders:{books}"]).await;
        if records == 2 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "never held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dead_pid = dead.id().unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(dead_pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // Twice its lease.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let timeouts: Vec<String> = query(&mut raw, &["KEYS", "{books}:*:rwlock_timeout:*"]).await;
    assert_eq!(timeouts.len(), 1, "{timeouts:?}");
    let mut status = distlock(&server.url());
    status.args(["status", "books", "--json"]);
    let status = within(Duration::from_secs(10), status).await;
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let holders = json["holders"].as_array().unwrap();
    assert!(
        holders.iter().all(|holder| holder["pid"] != dead_pid),
        "a reader killed 4 s ago, with a 2 s lease, shown as a holder: {json}"
    );
    assert_eq!(holders.len(), 1, "{json}");
    drop((dead, living));
}

/// A permit whose holder died (kill -9, a lost host) is free once its lease runs out:
/// "the next acquisition reclaims" it. But the -n check before the acquisition counts
/// free permits plus permits whose lease has not run out, so the dead holder's permit is
/// in neither: every `run -n 2` after it is refused, exit 2 "has 1 permits, not 2", and
/// no acquisition ever reclaims it.
#[tokio::test]
async fn a_dead_holders_permit_does_not_change_the_semaphores_size() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let mut hold = distlock(&server.url());
    hold.args(["hold", "workers", "-n", "2", "--ttl", "1s"]);
    let hold = hold.spawn().unwrap();
    let started = std::time::Instant::now();
    loop {
        let records: i64 = query(&mut raw, &["HLEN", "distlock_holders:{workers}"]).await;
        if records == 1 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "never held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(hold.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // Past its lease.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for _ in 0..2 {
        let mut run = distlock(&server.url());
        run.args(["run", "workers", "-n", "2", "--no-wait", "--", "true"]);
        let run = within(Duration::from_secs(10), run).await;
        assert_eq!(run.status.code(), Some(0), "{}", stderr(&run));
    }
    drop(hold);
}

/// "Names are shown escaped ... in the messages": the message of a different -n quotes
/// the semaphore's keys (NAME, {NAME}:timeout, {NAME}:distlock_semaphore) raw, and the
/// channel refusal quotes the channel (which holds the name) raw: a name with a newline
/// and an escape sequence adds lines to stderr and colours the terminal.
#[tokio::test]
async fn messages_that_quote_keys_escape_the_name_in_them() {
    let server = RedisServer::start().await.unwrap();
    let name = "q\n\x1b[31mX";
    let mut first = distlock(&server.url());
    first.args(["run", name, "-n", "2", "--", "true"]);
    let first = within(Duration::from_secs(10), first).await;
    assert_eq!(first.status.code(), Some(0), "{}", stderr(&first));
    let mut other = distlock(&server.url());
    other.args(["run", name, "-n", "3", "--", "true"]);
    let other = within(Duration::from_secs(10), other).await;
    assert_eq!(other.status.code(), Some(2), "{}", stderr(&other));
    assert!(
        !stderr(&other).contains('\x1b') && stderr(&other).lines().count() == 1,
        "{:?}",
        stderr(&other)
    );

    let mut admin = server.connection().await.unwrap();
    let _: () = query(
        &mut admin,
        &[
            "ACL",
            "SETUSER",
            "nochan",
            "on",
            ">pw",
            "~*",
            "resetchannels",
            "+@all",
        ],
    )
    .await;
    let url = format!("redis://nochan:pw@127.0.0.1:{}", server.port());
    let mut refused = distlock(&url);
    refused.args(["run", "c\nd\x1b[2J", "--", "true"]);
    let refused = within(Duration::from_secs(10), refused).await;
    assert_eq!(refused.status.code(), Some(77), "{}", stderr(&refused));
    assert!(
        !stderr(&refused).contains('\x1b') && stderr(&refused).lines().count() == 1,
        "{:?}",
        stderr(&refused)
    );
}

/// force-unlock of a lock wakes its waiters (the next run starts once the old command is
/// gone). Of a read-write lock it does not: force-unlock deletes it as a plain lock and
/// publishes on the plain lock's channel, where nobody waiting for a read-write lock
/// listens, so a `--shared` waiter starts only when the old writer's lease would have
/// ended (about 30 s later).
#[tokio::test]
async fn force_unlock_of_a_read_write_lock_wakes_its_waiters() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (writing, reading) = (dir.path().join("writing"), dir.path().join("reading"));
    let mut writer = distlock(&server.url());
    writer
        .args(["run", "rw", "--exclusive", "--", "sh", "-c"])
        .arg(format!("touch {}; exec sleep 60", writing.display()));
    let writer = writer.spawn().unwrap();
    until_exists(&writing).await;
    let mut reader = distlock(&server.url());
    reader
        .args(["run", "rw", "--shared", "--", "touch"])
        .arg(&reading);
    let reader = reader.spawn().unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut unlock = distlock(&server.url());
    unlock.args(["force-unlock", "rw", "--yes"]);
    let unlock = within(Duration::from_secs(10), unlock).await;
    assert_eq!(unlock.status.code(), Some(0), "{}", stderr(&unlock));
    let writer = tokio::time::timeout(Duration::from_secs(10), writer.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(writer.status.code(), Some(79), "{}", stderr(&writer));
    let unlocked = std::time::Instant::now();
    while !reading.exists() && unlocked.elapsed() < Duration::from_secs(8) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        reading.exists(),
        "the waiting reader had not started 8 s after the writer was gone"
    );
    drop(reader);
}

/// `q` and `{q}` are two locks, but the fair lock's queue and timeouts
/// (`redisson_lock_queue:{q}`, `redisson_lock_timeout:{q}`), like every helper key of
/// Redisson's layout, are one key for both names: while `x` has a fair waiter,
/// `run --fair {x} --no-wait` on the free `{x}` exited 75 saying "held by someone else",
/// while status said `{x}` is not held. The layout stays Redisson's (docs/layout.md); the
/// refusal now says what holds it back.
#[tokio::test]
async fn a_fair_lock_behind_the_shared_queue_of_another_spelling_says_so() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let mut holder = distlock(&server.url());
    holder
        .args(["run", "x", "--fair", "--", "sh", "-c"])
        .arg(format!("touch {}; exec sleep 30", started.display()));
    let holder = holder.spawn().unwrap();
    until_exists(&started).await;
    let mut waiter = distlock(&server.url());
    waiter.args(["run", "x", "--fair", "--", "true"]);
    let waiter = waiter.spawn().unwrap();
    let asked = std::time::Instant::now();
    loop {
        let queued: i64 = query(&mut raw, &["LLEN", "redisson_lock_queue:{x}"]).await;
        if queued == 1 {
            break;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(10),
            "the waiter never queued"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut status = distlock(&server.url());
    status.args(["status", "{x}", "--json"]);
    let status = within(Duration::from_secs(10), status).await;
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(json["held"], false, "{json}");
    // x and {x} share the fair queue (Redisson's layout, docs/layout.md): {x} is free but
    // x's waiter is ahead, and the refusal says so instead of "held by someone else".
    let mut braced = distlock(&server.url());
    braced.args(["run", "{x}", "--fair", "--no-wait", "--", "true"]);
    let braced = within(Duration::from_secs(10), braced).await;
    assert_eq!(braced.status.code(), Some(75), "{}", stderr(&braced));
    assert!(
        stderr(&braced).contains("is free, but 1 waiter(s) are queued ahead"),
        "{}",
        stderr(&braced)
    );
    drop((holder, waiter));
}
