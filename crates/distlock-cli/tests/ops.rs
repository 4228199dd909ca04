//! Issue 30, section 3: what ops teams use in flock, etcdctl lock and consul lock, each
//! against a real server.

mod common;

use std::time::{Duration, Instant};

use common::{distlock, run_to_end, stderr, until_exists};
use distlock_testkit::RedisServer;

/// Decimal and compound durations, as flock (`-w 0.5`, with a unit here) and Go write
/// them.
#[tokio::test]
async fn decimal_and_compound_durations_are_read() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let mut holder = distlock(&server.url());
    holder
        .args(["run", "dec", "--ttl", "1m30s", "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 30", started.display()));
    let holder = holder.spawn().unwrap();
    until_exists(&started).await;
    let mut status = distlock(&server.url());
    status.args(["status", "dec", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&run_to_end(status).await.stdout).unwrap();
    let left = json["lease_remaining_ms"].as_u64().unwrap();
    assert!(left > 60_000 && left <= 90_000, "{json}");
    let asked = Instant::now();
    let mut waiter = distlock(&server.url());
    waiter.args(["run", "dec", "--wait", "0.5s", "--", "true"]);
    let waiter = run_to_end(waiter).await;
    assert_eq!(waiter.status.code(), Some(75), "{}", stderr(&waiter));
    let waited = asked.elapsed();
    assert!(
        waited >= Duration::from_millis(500) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    let mut fine = distlock(&server.url());
    fine.args(["run", "dec", "--wait", "1.0005s", "--", "true"]);
    let fine = run_to_end(fine).await;
    assert_eq!(fine.status.code(), Some(2), "{}", stderr(&fine));
    drop(holder);
}

/// `-c 'shell string'`, as flock -c and consul lock -shell run it.
#[tokio::test]
async fn a_shell_string_runs_under_the_lock() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    let mut run = distlock(&server.url());
    run.args(["run", "shell", "-c"]).arg(format!(
        "echo \"$DISTLOCK_FENCING_TOKEN\" > {} && exit 3",
        token.display()
    ));
    let run = run_to_end(run).await;
    assert_eq!(run.status.code(), Some(3), "{}", stderr(&run));
    assert_eq!(std::fs::read_to_string(&token).unwrap().trim(), "1");
    let mut elect = distlock(&server.url());
    elect.args(["elect", "shell", "-c", "exit 4"]);
    assert_eq!(run_to_end(elect).await.status.code(), Some(4));
    for args in [
        vec!["run", "shell", "-c", "true", "--", "true"],
        vec!["run", "shell", "-c"],
    ] {
        let mut both = distlock(&server.url());
        both.args(&args);
        let both = run_to_end(both).await;
        assert_eq!(both.status.code(), Some(2), "{args:?}: {}", stderr(&both));
    }
}

/// `distlock hold NAME`: the lock with no command, as `etcdctl lock NAME` holds it,
/// until SIGTERM; what a command would be told is on stdout.
#[tokio::test]
async fn hold_keeps_the_lock_until_a_signal() {
    use tokio::io::AsyncBufReadExt;
    let server = RedisServer::start().await.unwrap();
    let mut hold = distlock(&server.url());
    hold.args(["hold", "held"]);
    let mut hold = hold.spawn().unwrap();
    let mut lines = tokio::io::BufReader::new(hold.stdout.take().unwrap()).lines();
    let mut told = Vec::new();
    while told.len() < 3 {
        let line = tokio::time::timeout(common::LIMIT, lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .expect("hold printed what it holds");
        told.push(line);
    }
    assert_eq!(told[0], "DISTLOCK_NAME=held", "{told:?}");
    assert!(told[1].starts_with("DISTLOCK_OWNER="), "{told:?}");
    assert_eq!(told[2], "DISTLOCK_FENCING_TOKEN=1", "{told:?}");
    let mut other = distlock(&server.url());
    other.args(["run", "held", "--no-wait", "--", "true"]);
    assert_eq!(run_to_end(other).await.status.code(), Some(75));
    let pid = nix::unistd::Pid::from_raw(hold.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(common::LIMIT, hold.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    let mut after = distlock(&server.url());
    after.args(["run", "held", "--no-wait", "--", "true"]);
    assert_eq!(run_to_end(after).await.status.code(), Some(0));
    // Lost: exit 79.
    let mut hold = distlock(&server.url());
    hold.args(["hold", "held"]);
    let mut hold = hold.spawn().unwrap();
    let mut lines = tokio::io::BufReader::new(hold.stdout.take().unwrap()).lines();
    tokio::time::timeout(common::LIMIT, lines.next_line())
        .await
        .unwrap()
        .unwrap();
    let mut unlock = distlock(&server.url());
    unlock.args(["force-unlock", "held", "--yes"]);
    assert_eq!(run_to_end(unlock).await.status.code(), Some(0));
    let status = tokio::time::timeout(common::LIMIT, hold.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(79));
    // Without a command, run is still a usage error: a forgotten command never holds.
    let mut forgot = distlock(&server.url());
    forgot.args(["run", "held"]);
    assert_eq!(run_to_end(forgot).await.status.code(), Some(2));
}

/// `distlock fence NAME --at-least N`: after Redis lost its data, the counter is raised
/// past the highest token a store accepted; it is never lowered.
#[tokio::test]
async fn fence_raises_the_counter_and_never_lowers_it() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    let token_of_a_run = |url: String, token: std::path::PathBuf| async move {
        let mut run = distlock(&url);
        run.args(["run", "fenced", "-c"]).arg(format!(
            "echo $DISTLOCK_FENCING_TOKEN > {}",
            token.display()
        ));
        assert_eq!(run_to_end(run).await.status.code(), Some(0));
        std::fs::read_to_string(&token).unwrap().trim().to_owned()
    };
    assert_eq!(token_of_a_run(server.url(), token.clone()).await, "1");
    let fence = |args: &[&str]| {
        let mut fence = distlock(&server.url());
        fence.arg("fence").args(args);
        run_to_end(fence)
    };
    let raised = fence(&["fenced", "--at-least", "100", "--json"]).await;
    assert_eq!(raised.status.code(), Some(0), "{}", stderr(&raised));
    let json: serde_json::Value = serde_json::from_slice(&raised.stdout).unwrap();
    assert_eq!(json["counter"], 100, "{json}");
    assert_eq!(json["raised"], true, "{json}");
    assert_eq!(token_of_a_run(server.url(), token.clone()).await, "101");
    let lower = fence(&["fenced", "--at-least", "5"]).await;
    assert_eq!(lower.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&lower.stdout).contains("not changed"),
        "{}",
        String::from_utf8_lossy(&lower.stdout)
    );
    let shown = fence(&["fenced"]).await;
    assert!(
        String::from_utf8_lossy(&shown.stdout).contains("at 101"),
        "{}",
        String::from_utf8_lossy(&shown.stdout)
    );
    let mut raw = server.connection().await.unwrap();
    let _: () = redis::cmd("HSET")
        .arg(&["stats", "views", "5"][..])
        .query_async(&mut raw)
        .await
        .unwrap();
    for args in [
        vec!["stats", "--at-least", "10"],
        vec!["fenced", "--at-least", "9223372036854775807"],
    ] {
        let refused = fence(&args).await;
        assert_eq!(
            refused.status.code(),
            Some(2),
            "{args:?}: {}",
            stderr(&refused)
        );
    }
}

/// `--verbose` says what distlock does, with the password masked; without it, a run
/// that goes well says nothing.
#[tokio::test]
async fn verbose_says_what_distlock_does() {
    let server = RedisServer::start().await.unwrap();
    let mut quiet = distlock(&server.url());
    quiet.args(["run", "talk", "--", "true"]);
    let quiet = run_to_end(quiet).await;
    assert_eq!(quiet.status.code(), Some(0));
    assert_eq!(stderr(&quiet), "");
    let mut admin = server.connection().await.unwrap();
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "app", "on", ">hunter2", "~*", "&*", "+@all"][..])
        .query_async(&mut admin)
        .await
        .unwrap();
    let mut loud = distlock(&format!("redis://app:hunter2@127.0.0.1:{}", server.port()));
    loud.args([
        "run",
        "--verbose",
        "talk",
        "--wait",
        "2s",
        "--",
        "sh",
        "-c",
        "exit 3",
    ]);
    let loud = run_to_end(loud).await;
    assert_eq!(loud.status.code(), Some(3));
    let text = stderr(&loud);
    for said in [
        "connecting to redis://app:***@127.0.0.1",
        "taking talk, waiting at most 2s",
        "with fencing token 2",
        "started the command",
        "exit status: 3",
        "released",
    ] {
        assert!(text.contains(said), "{said}: {text}");
    }
    assert!(!text.contains("hunter2"), "{text}");
}

/// Every flag also reads a DISTLOCK_* variable; the command line wins over it.
#[tokio::test]
async fn distlock_variables_set_flags_and_the_command_line_wins() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    // DISTLOCK_URL comes before REDIS_URL; DISTLOCK_TTL sets --ttl.
    let mut holder = distlock("redis://127.0.0.1:1");
    holder
        .env("DISTLOCK_URL", server.url())
        .env("DISTLOCK_TTL", "1m30s")
        .args(["run", "envy", "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 30", started.display()));
    let holder = holder.spawn().unwrap();
    until_exists(&started).await;
    let mut status = distlock(&server.url());
    status.env("DISTLOCK_JSON", "1").args(["status", "envy"]);
    let json: serde_json::Value = serde_json::from_slice(&run_to_end(status).await.stdout).unwrap();
    assert!(
        json["lease_remaining_ms"].as_u64().unwrap() > 60_000,
        "{json}"
    );
    let mut skipped = distlock(&server.url());
    skipped
        .env("DISTLOCK_NO_WAIT", "true")
        .env("DISTLOCK_CONFLICT_EXIT_CODE", "9")
        .args(["run", "envy", "--", "true"]);
    assert_eq!(run_to_end(skipped).await.status.code(), Some(9));
    // --wait on the command line wins over DISTLOCK_NO_WAIT.
    let asked = Instant::now();
    let mut waited = distlock(&server.url());
    waited
        .env("DISTLOCK_NO_WAIT", "1")
        .args(["run", "envy", "--wait", "1s", "--", "true"]);
    let waited = run_to_end(waited).await;
    assert_eq!(waited.status.code(), Some(75), "{}", stderr(&waited));
    assert!(asked.elapsed() >= Duration::from_secs(1));
    let mut help = distlock(&server.url());
    help.args(["run", "--help"]);
    let help = String::from_utf8_lossy(&run_to_end(help).await.stdout).into_owned();
    assert!(help.contains("[env: DISTLOCK_KILL_GRACE="), "{help}");
    let mut bad = distlock(&server.url());
    bad.env("DISTLOCK_VERBOSE", "maybe")
        .args(["status", "envy"]);
    assert_eq!(run_to_end(bad).await.status.code(), Some(2));
    drop(holder);
}

/// --cacert, --cert and --key: a rediss:// server with a private CA that asks for a
/// client certificate.
#[tokio::test]
async fn tls_flags_reach_a_server_that_asks_for_a_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let certificates =
        distlock_testkit::write_test_certificates(dir.path()).expect("test certificates");
    let (_server, tls_port) = certificates
        .start_server(true)
        .await
        .expect("redis-server with TLS");
    let path = |file: &std::path::Path| file.display().to_string();
    let (cert, key, ca) = (
        path(&certificates.cert),
        path(&certificates.key),
        path(&certificates.ca),
    );
    let url = format!("rediss://127.0.0.1:{tls_port}");
    let mut run = distlock(&url);
    run.args(["--cacert", &ca, "--cert", &cert, "--key", &key])
        .args(["run", "secure", "--", "true"]);
    let run = run_to_end(run).await;
    assert_eq!(run.status.code(), Some(0), "{}", stderr(&run));
    // From the environment too.
    let mut status = distlock(&url);
    status
        .env("DISTLOCK_CACERT", &ca)
        .env("DISTLOCK_CERT", &cert)
        .env("DISTLOCK_KEY", &key)
        .args(["status", "secure"]);
    let status = run_to_end(status).await;
    assert_eq!(status.status.code(), Some(0), "{}", stderr(&status));
    // Without the client certificate the server refuses; without the CA the server's
    // certificate is not trusted: neither is a success.
    for flags in [vec!["--cacert", &ca], vec!["--cert", &cert, "--key", &key]] {
        let mut refused = distlock(&url);
        refused.args(&flags).args(["status", "secure"]);
        let refused = run_to_end(refused).await;
        assert_ne!(refused.status.code(), Some(0), "{flags:?}");
        assert_eq!(stderr(&refused).lines().count(), 1, "{}", stderr(&refused));
    }
    // Certificates for a URL without TLS, or a --cert without its --key: exit 2.
    for args in [
        vec![
            "--url",
            "redis://127.0.0.1:1",
            "--cacert",
            &ca,
            "status",
            "x",
        ],
        vec!["--cert", &cert, "status", "x"],
    ] {
        let mut wrong = distlock(&url);
        wrong.args(&args);
        let wrong = run_to_end(wrong).await;
        assert_eq!(wrong.status.code(), Some(2), "{args:?}: {}", stderr(&wrong));
    }
}

/// --connect-timeout and --response-timeout bound the waits on a slow or silent server.
#[tokio::test]
async fn connect_and_response_timeouts_are_kept() {
    let server = RedisServer::start().await.unwrap();
    let proxy = distlock_testkit::FaultProxy::in_front_of(&server)
        .await
        .unwrap();
    proxy.blackhole();
    let asked = Instant::now();
    let mut silent = distlock(&proxy.url());
    silent.args(["--connect-timeout", "300ms", "status", "x"]);
    let silent = run_to_end(silent).await;
    assert_eq!(silent.status.code(), Some(69), "{}", stderr(&silent));
    assert!(
        asked.elapsed() < Duration::from_millis(1500),
        "{:?}",
        asked.elapsed()
    );
    proxy.heal();
    // 300 ms each way: a round trip takes 600 ms.
    proxy.set_delay(Duration::from_millis(300));
    let mut patient = distlock(&proxy.url());
    patient.args([
        "--connect-timeout",
        "10s",
        "--response-timeout",
        "3s",
        "status",
        "x",
    ]);
    let patient = run_to_end(patient).await;
    assert_eq!(patient.status.code(), Some(0), "{}", stderr(&patient));
    let mut hasty = distlock(&proxy.url());
    hasty.args([
        "--connect-timeout",
        "10s",
        "--response-timeout",
        "200ms",
        "status",
        "x",
    ]);
    let hasty = run_to_end(hasty).await;
    assert_eq!(hasty.status.code(), Some(69), "{}", stderr(&hasty));
}

/// --shared (flock -s) takes the read side of a read-write lock: shared holders run
/// together, an --exclusive one (flock -x) waits for them, and a plain run of the name
/// is told what it is.
#[tokio::test]
async fn shared_holders_run_together_and_exclude_an_exclusive_one() {
    let server = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let readers: Vec<_> = (0..2)
        .map(|index| {
            let started = dir.path().join(format!("reader{index}"));
            let mut reader = distlock(&server.url());
            reader
                .args(["run", "books", "--shared", "--", "sh", "-c"])
                .arg(format!("touch {}; sleep 30", started.display()));
            (reader.spawn().unwrap(), started)
        })
        .collect();
    for (_, started) in &readers {
        until_exists(started).await;
    }
    let attempt = |args: &[&str]| {
        let mut run = distlock(&server.url());
        run.args(["run", "books"]).args(args).args(["--", "true"]);
        run_to_end(run)
    };
    let writer = attempt(&["--exclusive", "--no-wait"]).await;
    assert_eq!(writer.status.code(), Some(75), "{}", stderr(&writer));
    let plain = attempt(&["--no-wait"]).await;
    assert_eq!(plain.status.code(), Some(2), "{}", stderr(&plain));
    assert!(stderr(&plain).contains("--shared"), "{}", stderr(&plain));
    let mut status = distlock(&server.url());
    status.args(["status", "books", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&run_to_end(status).await.stdout).unwrap();
    assert_eq!(json["kind"], "read-write lock", "{json}");
    assert_eq!(json["mode"], "read", "{json}");
    assert_eq!(json["holders"].as_array().unwrap().len(), 2, "{json}");
    for (reader, _) in readers {
        let pid = nix::unistd::Pid::from_raw(reader.id().unwrap() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        common::finish(reader).await;
    }
    let writer = attempt(&["--exclusive", "--no-wait"]).await;
    assert_eq!(writer.status.code(), Some(0), "{}", stderr(&writer));
    // A writer excludes readers.
    let started = dir.path().join("writer");
    let mut writer = distlock(&server.url());
    writer
        .args(["run", "books", "--exclusive", "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 30", started.display()));
    let writer = writer.spawn().unwrap();
    until_exists(&started).await;
    let reader = attempt(&["--shared", "--no-wait"]).await;
    assert_eq!(reader.status.code(), Some(75), "{}", stderr(&reader));
    let mut elect = distlock(&server.url());
    elect.args(["elect", "books", "--shared", "--", "true"]);
    assert_eq!(run_to_end(elect).await.status.code(), Some(2));
    drop(writer);
}

/// status and list say who holds a lock (host, pid, command, start), from a record
/// beside the lock, never in the lock's own (Redisson's) hash; --json carries it.
#[tokio::test]
async fn status_and_list_say_who_holds_it() {
    let server = RedisServer::start().await.unwrap();
    let mut raw = server.connection().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let host = nix::unistd::gethostname().unwrap().into_string().unwrap();
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut holders = Vec::new();
    for (name, flags) in [("who", vec![]), ("pool", vec!["-n", "2"])] {
        let started = dir.path().join(name);
        let mut run = distlock(&server.url());
        run.args(["run", name])
            .args(&flags)
            .args(["--", "sh", "-c"])
            .arg(format!("touch {}; sleep 30", started.display()));
        let run = run.spawn().unwrap();
        until_exists(&started).await;
        holders.push((name, run, started));
    }
    // The record is written just after the command starts.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for (name, run, started) in &holders {
        let mut status = distlock(&server.url());
        status.args(["status", name, "--json"]);
        let json: serde_json::Value =
            serde_json::from_slice(&run_to_end(status).await.stdout).unwrap();
        let holder = &json["holders"][0];
        assert_eq!(holder["host"], host.as_str(), "{json}");
        assert_eq!(holder["pid"], run.id().unwrap(), "{json}");
        assert!(holder["command_pid"].as_u64().unwrap() > 0, "{json}");
        assert_eq!(
            holder["command"],
            format!("sh -c 'touch {}; sleep 30'", started.display()),
            "{json}"
        );
        let at = holder["started_at_ms"].as_u64().unwrap();
        assert!(at >= before && at < before + 60_000, "{json}");
        assert!(
            holder["started_at"].as_str().unwrap().ends_with("UTC"),
            "{json}"
        );
        let mut text = distlock(&server.url());
        text.args(["status", name]);
        let text = String::from_utf8_lossy(&run_to_end(text).await.stdout).into_owned();
        assert!(text.contains(&format!("host:      {host}, pid")), "{text}");
        assert!(text.contains("command:   sh -c"), "{text}");
        assert!(text.contains("since:"), "{text}");
    }
    // Redisson's hash holds the owner and nothing else.
    let fields: i64 = redis::cmd("HLEN")
        .arg("who")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(fields, 1);
    let mut list = distlock(&server.url());
    list.arg("list");
    let listed = String::from_utf8_lossy(&run_to_end(list).await.stdout).into_owned();
    assert_eq!(listed.lines().count(), 3, "{listed}");
    assert!(listed.lines().next().unwrap().contains("HOST"), "{listed}");
    assert!(
        listed
            .lines()
            .skip(1)
            .all(|line| line.contains(&host) && line.contains("sleep 30")),
        "{listed}"
    );
    let mut json = distlock(&server.url());
    json.args(["list", "--json"]);
    let json = String::from_utf8_lossy(&run_to_end(json).await.stdout).into_owned();
    assert_eq!(json.matches("\"host\"").count(), 2, "{json}");
    // A holder that lets go removes its record.
    for (name, run, _) in holders {
        let pid = nix::unistd::Pid::from_raw(run.id().unwrap() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        common::finish(run).await;
        let left: i64 = redis::cmd("EXISTS")
            .arg(format!("distlock_holders:{{{name}}}"))
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(left, 0, "{name}");
    }
}
