//! The `flashsale` binary: clear errors for bad configuration, and a SIGTERM that stores
//! every sold order before the process exits.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{bounded, buy, open_coupon};
use distlock_testkit::RedisServer;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_flashsale");

/// Runs the binary to completion and returns its exit code and stderr.
async fn run(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env_remove("REDIS_URL")
        .env_remove("DATABASE_URL");
    for (key, value) in env {
        command.env(key, value);
    }
    let output = bounded(Duration::from_secs(30), command.output())
        .await
        .expect("run flashsale");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A name, the arguments, the environment, and what stderr must say.
type Case<'a> = (&'a str, Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);

#[tokio::test]
async fn bad_configuration_is_reported_plainly() {
    let dir = tempfile::tempdir().expect("dir");
    let sqlite = format!("sqlite://{}", dir.path().join("x.db").display());
    let cases: Vec<Case> = vec![
        (
            "unreachable redis",
            vec!["serve", "--listen", "127.0.0.1:0"],
            vec![
                ("REDIS_URL", "redis://127.0.0.1:1/"),
                ("DATABASE_URL", &sqlite),
            ],
            "cannot connect",
        ),
        (
            "malformed redis url",
            vec!["serve", "--listen", "127.0.0.1:0"],
            vec![("REDIS_URL", "http//nope"), ("DATABASE_URL", &sqlite)],
            "redis",
        ),
        (
            "unsupported database",
            vec!["serve", "--listen", "127.0.0.1:0"],
            vec![("DATABASE_URL", "mysql://root:hunter2@db/shop")],
            "unsupported database URL \"mysql://root:***@db/shop\"",
        ),
        (
            "unreachable postgres",
            vec!["serve", "--listen", "127.0.0.1:0"],
            vec![("DATABASE_URL", "postgres://app:secret@127.0.0.1:1/shop")],
            "cannot connect to the database at postgres://app:***@127.0.0.1:1/shop",
        ),
        (
            "zero segments",
            vec!["serve", "--segments", "0"],
            vec![],
            "invalid --segments",
        ),
        (
            "bad listen address",
            vec!["serve", "--listen", "nowhere"],
            vec![],
            "invalid value 'nowhere'",
        ),
        (
            "unknown strategy",
            vec!["serve", "--strategy", "yolo"],
            vec![],
            "invalid value 'yolo'",
        ),
        (
            "the unsafe strategy without opting in",
            vec!["serve", "--strategy", "unsafe"],
            vec![],
            "--allow-unsafe",
        ),
        (
            "zero concurrency",
            vec!["load", "--concurrency", "0"],
            vec![],
            "--concurrency must be between",
        ),
        (
            "nothing at --url",
            vec!["load", "--url", "http://127.0.0.1:1"],
            vec![],
            "cannot reach the service at http://127.0.0.1:1",
        ),
    ];
    for (name, args, env, expected) in cases {
        let (code, stderr) = run(&args, &env).await;
        assert_eq!(code, 2, "{name}: exit code {code}, stderr:\n{stderr}");
        assert!(
            stderr.contains(expected),
            "{name}: expected {expected:?} in:\n{stderr}"
        );
        assert!(
            !stderr.contains("hunter2") && !stderr.contains("secret"),
            "{name}: password leaked:\n{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{name}: panicked:\n{stderr}");
    }
}

/// A `flashsale serve` child on a SQLite file in `dir`, up and announced.
struct Served {
    child: tokio::process::Child,
    /// `http://ADDR`, from the startup line.
    base: String,
    /// Every stderr line up to and including the startup line.
    startup: String,
}

/// Starts `flashsale serve --listen 127.0.0.1:0 EXTRA…` with `redis_url`, and waits for its
/// startup line. The rest of its stderr is drained in the background.
async fn serve(dir: &tempfile::TempDir, redis_url: &str, extra: &[&str]) -> Served {
    let database = format!("sqlite://{}", dir.path().join("shop.db").display());
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(extra)
        .env("REDIS_URL", redis_url)
        .env("DATABASE_URL", &database)
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
    let base = base.unwrap_or_else(|| panic!("no startup line:\n{startup}"));
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Served {
        child,
        base,
        startup,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_line_masks_the_redis_password() {
    bounded(Duration::from_secs(60), async {
        let redis = RedisServer::start().await.expect("redis");
        let mut admin = redis.connection().await.expect("admin");
        let _: () = redis::cmd("ACL")
            .arg(&["SETUSER", "shop", "on", ">hunter2", "~*", "&*", "+@all"])
            .query_async(&mut admin)
            .await
            .expect("ACL SETUSER");
        let dir = tempfile::tempdir().expect("dir");
        let url = format!("redis://shop:hunter2@127.0.0.1:{}/", redis.port());
        let mut served = serve(&dir, &url, &[]).await;
        assert!(
            !served.startup.contains("hunter2"),
            "password printed:\n{}",
            served.startup
        );
        assert!(
            served.startup.contains("redis://shop:***@"),
            "{}",
            served.startup
        );
        let _ = served.child.kill().await;
    })
    .await;
}

/// A client that sends half a request body and then nothing must not keep the service
/// alive after SIGTERM: the shutdown deadline cuts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_does_not_hold_shutdown_past_its_deadline() {
    use tokio::io::AsyncWriteExt;
    bounded(Duration::from_secs(60), async {
        let redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let Served {
            mut child, base, ..
        } = serve(&dir, &redis.url(), &["--shutdown-timeout", "1"]).await;
        let addr = base.trim_start_matches("http://").to_owned();
        let mut slow = tokio::net::TcpStream::connect(&addr).await.expect("connect");
        slow.write_all(
            b"POST /api/coupons HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"title\"",
        )
        .await
        .expect("write");
        // The request has reached its handler, which now waits for the rest of the body.
        let http = reqwest::Client::new();
        let _ = open_coupon(&http, &base, 1).await;
        let pid = Pid::from_raw(child.id().expect("pid") as i32);
        let terminated = std::time::Instant::now();
        kill(pid, Signal::SIGTERM).expect("SIGTERM");
        let status = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
        let took = terminated.elapsed();
        assert!(
            matches!(status, Ok(Ok(_))) && took < Duration::from_secs(5),
            "the service was still up {took:?} after SIGTERM with a slow client connected"
        );
        drop(slow);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stores_every_sold_order_before_exit() {
    bounded(Duration::from_secs(60), async {
        let redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let database = format!("sqlite://{}", dir.path().join("shop.db").display());
        let Served {
            mut child, base, ..
        } = serve(&dir, &redis.url(), &[]).await;

        let http = reqwest::Client::new();
        let coupon = open_coupon(&http, &base, 300).await;
        let sales =
            futures_util::future::join_all((1..=300).map(|user| buy(&http, &base, coupon, user)))
                .await;
        assert!(sales.iter().all(|sale| sale.status == 201));
        // Terminate at once: whatever the worker has not stored yet, it must store now.
        let pid = Pid::from_raw(child.id().expect("pid") as i32);
        kill(pid, Signal::SIGTERM).expect("SIGTERM");
        let status = child.wait().await.expect("exit");
        assert!(status.success(), "{status}");

        let db = flashsale::db::Db::connect(&database).await.expect("db");
        assert_eq!(db.order_count(coupon).await.expect("count"), 300);
    })
    .await;
}
