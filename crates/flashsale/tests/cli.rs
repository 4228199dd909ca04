//! The `flashsale` binary: clear errors for bad configuration, and a SIGTERM that stores
//! every sold order before the process exits.

mod common;

use std::time::Duration;

use common::child::{run, serve, serve_on_defaults, Served, BIN};
use common::{bounded, buy, drain, open_coupon};
use distlock_testkit::RedisServer;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use sqlx::Connection;
use tokio::process::Command;

/// A name, the arguments, the environment, and what stderr must say.
type Case<'a> = (&'a str, Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);

#[tokio::test]
async fn bad_configuration_is_reported_plainly() {
    let dir = tempfile::tempdir().expect("dir");
    let sqlite = format!("sqlite://{}", dir.path().join("x.db").display());
    let text_file = dir.path().join("notes.txt");
    std::fs::write(&text_file, b"not a database\n".repeat(300)).expect("text file");
    let text_url = format!("sqlite://{}", text_file.display());
    let cases: Vec<Case> = vec![
        (
            // A review saw 4 s of repeated errors, then "pool timed out".
            "a database file that is not a database",
            vec!["serve", "--listen", "127.0.0.1:0"],
            vec![("DATABASE_URL", &text_url)],
            "file is not a database",
        ),
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
            // Two instances with a 1 ms lease oversold on the earlier build.
            "a lease far too short for any critical section",
            vec!["serve", "--strategy", "lock", "--lock-lease", "1ms"],
            vec![],
            "invalid --lock-lease: 1ms is out of range: must be between 100ms and 10m",
        ),
        (
            "a duration without its unit",
            vec!["serve", "--lock-lease", "30000"],
            vec![],
            "\"30000\" has no unit: expected a number and a unit, or several from the largest unit down: 500ms, 10s, 1.5s, 2m, 1m30s or 1h",
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
        } = serve(&dir, &redis.url(), &["--shutdown-timeout", "1s"]).await;
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

/// The default mode's promise: a buyer told 201 has an order, even when the service is
/// killed with -9 in the middle of a rush and started again on the same directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_burst_on_the_defaults_then_a_restart_keeps_every_order_a_buyer_was_told_about()
{
    use std::collections::{BTreeMap, BTreeSet};

    const STOCK: i64 = 3_000;
    const KILL_AFTER: usize = 1_000;
    bounded(Duration::from_secs(240), async {
        let dir = tempfile::tempdir().expect("dir");
        let data = dir.path().join("flashsale-data");
        let mut first = serve_on_defaults(dir.path(), &[]).await;
        let redis_dir = std::fs::canonicalize(&data)
            .expect("data dir")
            .join("redis");
        assert!(
            first
                .startup
                .contains(&format!("keeps its data in {}", redis_dir.display()))
                && first.startup.contains("ONE instance"),
            "the startup lines do not say where the data lives:\n{}",
            first.startup
        );
        let redis_pid: i32 = std::fs::read_to_string(data.join("redis/redis-server.pid"))
            .expect("the private redis-server's pid file")
            .trim()
            .parse()
            .expect("pid");
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .build()
            .expect("client");
        let coupon = open_coupon(&http, &first.base, STOCK).await;

        let told = Told::default();
        let reached = std::sync::Arc::new(tokio::sync::Notify::new());
        let rush = Rush {
            http: http.clone(),
            coupon,
            told: told.clone(),
            sold: Default::default(),
            reached: reached.clone(),
        };
        let clients = rush.start(&first.base, KILL_AFTER);
        reached.notified().await;
        first.child.start_kill().expect("kill -9");
        first.child.wait().await.expect("reaped");
        for client in clients {
            client.await.expect("client task");
        }

        // The private Redis dies with the service instead of living on as an orphan.
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        while kill(Pid::from_raw(redis_pid), None).is_ok()
            && !std::fs::read_to_string(format!("/proc/{redis_pid}/stat"))
                .unwrap_or_default()
                .contains(") Z")
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the private redis-server outlived its killed service"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        let second = serve_on_defaults(dir.path(), &[]).await;
        let more = rush.start(&second.base, usize::MAX);
        for client in more {
            client.await.expect("client task");
        }
        drain(&http, &second.base, coupon).await;

        let db = flashsale::db::Db::connect(&format!(
            "sqlite://{}",
            data.join("flashsale.db").display()
        ))
        .await
        .expect("db");
        let stored: BTreeMap<String, i64> = db
            .coupon_orders(coupon)
            .await
            .expect("orders")
            .into_iter()
            .map(|order| (order.order_id, order.user_id))
            .collect();
        let told = told.lock().expect("told").clone();
        let mut told_201: BTreeMap<i64, BTreeSet<String>> = BTreeMap::new();
        for (user, status, order) in &told {
            if *status == 201 {
                let order = order.clone().expect("a 201 carries its order id");
                told_201.entry(*user).or_default().insert(order);
            }
        }
        let missing: Vec<&String> = told_201
            .values()
            .flatten()
            .filter(|order| !stored.contains_key(*order))
            .collect();
        let told_twice = told_201.values().filter(|orders| orders.len() > 1).count();
        let sold_told: usize = told_201.values().map(BTreeSet::len).sum();
        assert!(
            missing.is_empty(),
            "{} of {sold_told} order ids told to buyers are not in SQL (e.g. {:?})",
            missing.len(),
            missing.first()
        );
        assert_eq!(told_twice, 0, "users told 201 twice");
        assert!(
            stored.len() as i64 <= STOCK,
            "{} orders for {STOCK} units",
            stored.len()
        );
        assert_eq!(
            db.users_with_several_orders(coupon).await.expect("count"),
            0
        );
        assert!(sold_told >= KILL_AFTER);
    })
    .await;
}

/// Every answer a buyer got: (user, status, order id).
type Told = std::sync::Arc<std::sync::Mutex<Vec<(i64, u16, Option<String>)>>>;

/// 200 clients buying as users 1 to 6,000, each once, recording every answer.
struct Rush {
    http: reqwest::Client,
    coupon: i64,
    told: Told,
    /// 201s so far, across every start.
    sold: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Notified when `sold` reaches the threshold given to `start`.
    reached: std::sync::Arc<tokio::sync::Notify>,
}

impl Rush {
    const USERS: i64 = 6_000;
    const CLIENTS: i64 = 200;

    /// Starts the clients against `base`. A client stops at its first request without an
    /// answer (the service is gone): no answer, no promise.
    fn start(&self, base: &str, threshold: usize) -> Vec<tokio::task::JoinHandle<()>> {
        use std::sync::atomic::Ordering;
        (0..Self::CLIENTS)
            .map(|client| {
                let (http, told, sold, reached) = (
                    self.http.clone(),
                    self.told.clone(),
                    self.sold.clone(),
                    self.reached.clone(),
                );
                let url = format!("{base}/api/coupons/{}/seckill", self.coupon);
                tokio::spawn(async move {
                    for user in (1 + client..=Self::USERS).step_by(Self::CLIENTS as usize) {
                        let Ok(response) = http.post(&url).header("x-user-id", user).send().await
                        else {
                            return;
                        };
                        let status = response.status().as_u16();
                        let Ok(text) = response.text().await else {
                            return;
                        };
                        let body: serde_json::Value =
                            serde_json::from_str(&text).unwrap_or_default();
                        let order = body["order_id"].as_str().map(str::to_owned);
                        told.lock().expect("told").push((user, status, order));
                        if status == 201 && sold.fetch_add(1, Ordering::SeqCst) + 1 == threshold {
                            reached.notify_one();
                        }
                    }
                })
            })
            .collect()
    }
}

/// The embedded mode's private Redis cannot be shared, so a second instance on the same
/// data directory would sell the stock again: it must refuse, and say how to run a fleet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_serve_on_the_same_data_directory_is_refused_and_told_how_to_run_a_fleet() {
    bounded(Duration::from_secs(60), async {
        let dir = tempfile::tempdir().expect("dir");
        let first = serve_on_defaults(dir.path(), &[]).await;
        let data_dir = dir.path().join("flashsale-data");
        let data_dir = data_dir.to_str().expect("utf-8 path");
        let (code, stderr) = run(
            &["serve", "--listen", "127.0.0.1:0", "--data-dir", data_dir],
            &[],
        )
        .await;
        assert_eq!(code, 2, "{stderr}");
        for expected in [
            "in use by another flashsale serve",
            &format!("(pid {})", first.child.id().expect("pid")),
            "REDIS_URL",
            "DATABASE_URL",
        ] {
            assert!(
                stderr.contains(expected),
                "expected {expected:?} in:\n{stderr}"
            );
        }
        // The refused instance left the first one serving.
        let http = reqwest::Client::new();
        let coupon = open_coupon(&http, &first.base, 1).await;
        assert_eq!(buy(&http, &first.base, coupon, 1).await.status, 201);
    })
    .await;
}

/// Two embedded instances with their own data directories but one SQLite file given with
/// --sqlite-path would each sell the whole stock from their own Redis: the second refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_embedded_serve_on_the_same_sqlite_file_is_refused() {
    bounded(Duration::from_secs(60), async {
        let dir = tempfile::tempdir().expect("dir");
        let sqlite = dir.path().join("shared.db");
        let sqlite = sqlite.to_str().expect("utf-8 path");
        let _first = serve_on_defaults(
            dir.path(),
            &["--data-dir", "first", "--sqlite-path", sqlite],
        )
        .await;
        let second_dir = dir.path().join("second");
        let (code, stderr) = run(
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--data-dir",
                second_dir.to_str().expect("utf-8 path"),
                "--sqlite-path",
                sqlite,
            ],
            &[],
        )
        .await;
        assert_eq!(code, 2, "{stderr}");
        assert!(stderr.contains("shared.db is in use"), "{stderr}");
        assert!(stderr.contains("DATABASE_URL"), "{stderr}");
    })
    .await;
}

/// The first instance uses the default SQLite file inside its data directory; others
/// name that file from their own data directories, by --sqlite-path or DATABASE_URL.
/// Each would sell the whole stock again from its own private Redis (found by review:
/// 99 orders for 50 units).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_serve_on_another_instances_default_sqlite_file_is_refused() {
    bounded(Duration::from_secs(60), async {
        let dir = tempfile::tempdir().expect("dir");
        let _first = serve_on_defaults(dir.path(), &["--data-dir", "first"]).await;
        let taken = dir.path().join("first").join("flashsale.db");
        let taken = taken.to_str().expect("utf-8 path");
        let second_dir = dir.path().join("second");
        let second_dir = second_dir.to_str().expect("utf-8 path");
        let by_url = format!("sqlite://{taken}");
        // Other names of the same file: a lock on a name would miss them (second review:
        // a symlink sold 95 orders for 50 units).
        let symlink = dir.path().join("link.db");
        std::os::unix::fs::symlink(taken, &symlink).expect("symlink");
        let hard_link = dir.path().join("hard.db");
        std::fs::hard_link(taken, &hard_link).expect("hard link");
        let (symlink, hard_link) = (
            symlink.to_str().expect("utf-8 path"),
            hard_link.to_str().expect("utf-8 path"),
        );
        for (how, args, env) in [
            ("--sqlite-path", vec!["--sqlite-path", taken], vec![]),
            (
                "DATABASE_URL",
                vec![],
                vec![("DATABASE_URL", by_url.as_str())],
            ),
            ("a symlink", vec!["--sqlite-path", symlink], vec![]),
            ("a hard link", vec!["--sqlite-path", hard_link], vec![]),
        ] {
            let mut argv = vec!["serve", "--listen", "127.0.0.1:0", "--data-dir", second_dir];
            argv.extend(args);
            let (code, stderr) = run(&argv, &env).await;
            assert_eq!(code, 2, "{how}: {stderr}");
            assert!(stderr.contains("is in use"), "{how}: {stderr}");
        }
    })
    .await;
}

/// An embedded instance holds a PostgreSQL store too (an advisory lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_embedded_serve_on_the_same_postgres_database_is_refused_and_the_first_stops_without_its_lock(
) {
    bounded(Duration::from_secs(60), async {
        let postgres = distlock_testkit::PostgresServer::start()
            .await
            .expect("postgres");
        let dir = tempfile::tempdir().expect("dir");
        let mut first = Command::new(BIN);
        first
            .env_remove("REDIS_URL")
            .env("DATABASE_URL", postgres.url())
            .current_dir(dir.path());
        let mut first = common::child::start_serve(first, &["--data-dir", "first"]).await;
        let (code, stderr) = run(
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--data-dir",
                dir.path().join("second").to_str().expect("utf-8 path"),
            ],
            &[("DATABASE_URL", &postgres.url())],
        )
        .await;
        assert_eq!(code, 2, "{stderr}");
        assert!(stderr.contains("is in use"), "{stderr}");

        // The lock's session ends under the first instance (second review: it sold on,
        // and a second instance then started and sold the stock again). It must stop.
        let mut admin = sqlx::PgConnection::connect(&postgres.url())
            .await
            .expect("admin");
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory'")
            .execute(&mut admin)
            .await
            .expect("terminate");
        let exited = tokio::time::timeout(Duration::from_secs(10), first.child.wait())
            .await
            .expect("the first serve sold on without its lock")
            .expect("wait");
        assert_eq!(exited.code(), Some(1));
    })
    .await;
}

/// The private Redis dies under a running embedded serve (found by review: the service
/// stayed up holding the data directory, answering every purchase `outcome_unknown`
/// after 5.5 s). It must exit, so a supervisor restarts it on its data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_serve_whose_redis_dies_exits_and_restarts_on_its_data() {
    bounded(Duration::from_secs(60), async {
        let dir = tempfile::tempdir().expect("dir");
        let Served {
            mut child, base, ..
        } = serve_on_defaults(dir.path(), &[]).await;
        let http = reqwest::Client::new();
        let coupon = open_coupon(&http, &base, 5).await;
        assert_eq!(buy(&http, &base, coupon, 1).await.status, 201);
        let pid_file = dir.path().join("flashsale-data/redis/redis-server.pid");
        let redis_pid: i32 = std::fs::read_to_string(&pid_file)
            .expect("pid file")
            .trim()
            .parse()
            .expect("pid");
        kill(Pid::from_raw(redis_pid), Signal::SIGKILL).expect("kill redis");
        let exited = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .expect("serve still up 10 s after its Redis died")
            .expect("wait");
        assert_eq!(exited.code(), Some(1));

        let restarted = serve_on_defaults(dir.path(), &[]).await;
        let base = &restarted.base;
        let again = buy(&http, base, coupon, 1).await;
        assert_eq!(again.body["error"], "already_purchased", "{}", again.body);
        assert_eq!(buy(&http, base, coupon, 2).await.status, 201);
    })
    .await;
}

/// The private Redis keeps a lock in its append-only file when its holder dies with it. A
/// review killed the private Redis during a lock-strategy burst: after the restart, buyers
/// got 503 `busy` for about 20 s, until the dead run's lease ran out. Here a serve stops
/// itself while holding the coupon's lock, its Redis is killed and then the serve: the next
/// start releases the dead run's lock, and its first sale does not wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_held_by_a_dead_embedded_run_is_released_before_the_next_run_takes_traffic() {
    bounded(Duration::from_secs(60), async {
        let dir = tempfile::tempdir().expect("dir");
        let mut command = Command::new(BIN);
        command
            .env_remove("REDIS_URL")
            .env_remove("DATABASE_URL")
            .env("FLASHSALE_FAULT_STOP_HOLDER_OF_USER", "7")
            .current_dir(dir.path());
        let mut first = common::child::start_serve(command, &["--strategy", "lock"]).await;
        let http = reqwest::Client::new();
        let coupon = open_coupon(&http, &first.base, 5).await;
        let stalled = tokio::spawn({
            let (http, base) = (http.clone(), first.base.clone());
            async move {
                let _ = http
                    .post(format!("{base}/api/coupons/{coupon}/seckill"))
                    .header("x-user-id", 7)
                    .send()
                    .await;
            }
        });
        common::child::stopped(first.pid()).await;
        // It holds the coupon's lock (a 30 s lease). Its Redis dies, then it does.
        let pid_file = dir.path().join("flashsale-data/redis/redis-server.pid");
        let redis_pid: i32 = std::fs::read_to_string(&pid_file)
            .expect("pid file")
            .trim()
            .parse()
            .expect("pid");
        kill(Pid::from_raw(redis_pid), Signal::SIGKILL).expect("kill redis");
        first.child.kill().await.expect("kill serve");
        stalled.abort();

        let restarted = serve_on_defaults(dir.path(), &["--strategy", "lock"]).await;
        let started = std::time::Instant::now();
        let sale = buy(&http, &restarted.base, coupon, 8).await;
        assert_eq!(sale.status, 201, "{}", sale.body);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the first sale waited {:?} for a dead run's lock",
            started.elapsed()
        );
    })
    .await;
}

/// Every request that reached the server before SIGTERM gets its answer. A review saw 128
/// keep-alive connections (all of its client's) closed without an answer during a lua
/// drain. Here 64 clients buy in a loop over keep-alive connections until the server
/// refuses a new connection; none may see a connection cut with its request unanswered,
/// and every sale told 201 is in SQL after the exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_sent_before_sigterm_gets_its_answer() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    bounded(Duration::from_secs(60), async {
        let redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let database = format!("sqlite://{}", dir.path().join("shop.db").display());
        let Served {
            mut child, base, ..
        } = serve(&dir, &redis.url(), &[]).await;
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(256)
            .build()
            .expect("client");
        let coupon = open_coupon(&http, &base, 1_000_000).await;
        let answered = Arc::new(AtomicUsize::new(0));
        let clients: Vec<_> = (0..64_i64)
            .map(|lane| {
                let (http, base, answered) = (http.clone(), base.clone(), answered.clone());
                tokio::spawn(async move {
                    let mut sold = Vec::new();
                    for round in 0.. {
                        let user = lane * 1_000_000 + round + 1;
                        let sent = http
                            .post(format!("{base}/api/coupons/{coupon}/seckill"))
                            .header("x-user-id", user)
                            .send()
                            .await;
                        match sent {
                            Ok(response) => {
                                let status = response.status().as_u16();
                                let body = response.text().await;
                                let Ok(body) = body else {
                                    return Err(format!("user {user}: the answer was cut"));
                                };
                                if status == 201 {
                                    sold.push(user);
                                } else {
                                    return Err(format!("user {user}: {status} {body}"));
                                }
                                answered.fetch_add(1, Ordering::Relaxed);
                            }
                            // Refused: the server stopped accepting; nothing reached it.
                            Err(err) if err.is_connect() => return Ok(sold),
                            Err(err) => return Err(format!("user {user}: no answer: {err:?}")),
                        }
                    }
                    Ok(sold)
                })
            })
            .collect();
        while answered.load(Ordering::Relaxed) < 2_000 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        kill(
            Pid::from_raw(child.id().expect("pid") as i32),
            Signal::SIGTERM,
        )
        .expect("SIGTERM");
        let mut sold = 0;
        let mut lost = Vec::new();
        for client in clients {
            match client.await.expect("join") {
                Ok(users) => sold += users.len(),
                Err(why) => lost.push(why),
            }
        }
        let status = child.wait().await.expect("exit");
        assert!(
            lost.is_empty(),
            "{} of 64 clients: {:?}",
            lost.len(),
            &lost[..lost.len().min(3)]
        );
        assert!(status.success(), "{status}");
        let db = flashsale::db::Db::connect(&database).await.expect("db");
        assert_eq!(db.order_count(coupon).await.expect("count"), sold as i64);
    })
    .await;
}

/// A fleet-mode serve whose Redis died: a review saw it still running 40 s after SIGTERM,
/// retrying its drain every ~10 s. The drain is bounded by --shutdown-timeout, and the exit
/// code (6) and the last line say the queue was not drained and what that leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_redis_gone_exits_by_the_shutdown_timeout_and_says_the_drain_failed() {
    bounded(Duration::from_secs(60), async {
        let mut redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let mut served = serve(&dir, &redis.url(), &["--shutdown-timeout", "2s"]).await;
        let http = reqwest::Client::new();
        let coupon = open_coupon(&http, &served.base, 50).await;
        for user in 1..=20 {
            assert_eq!(buy(&http, &served.base, coupon, user).await.status, 201);
        }
        drain(&http, &served.base, coupon).await;
        redis.kill().await.expect("kill redis");

        let terminated = std::time::Instant::now();
        kill(served.pid(), Signal::SIGTERM).expect("SIGTERM");
        let status = tokio::time::timeout(Duration::from_secs(15), served.child.wait())
            .await
            .expect("serve still up 15 s after SIGTERM with its Redis gone")
            .expect("wait");
        let took = terminated.elapsed();
        assert!(
            took < Duration::from_secs(7),
            "took {took:?}: {}",
            served.later.lock().expect("lines").join("\n")
        );
        assert_eq!(status.code(), Some(6), "{status}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let said = served.later.lock().expect("lines").join("\n");
        assert!(said.contains("NOT drained"), "{said}");
        // Logs to a pipe carry no colour codes (a review found them in log files).
        assert!(
            said.contains("WARN") && !said.contains('\u{1b}'),
            "{said:?}"
        );

        // Every order it sold is stored all the same.
        let database = format!("sqlite://{}", dir.path().join("shop.db").display());
        let db = flashsale::db::Db::connect(&database).await.expect("db");
        assert_eq!(db.order_count(coupon).await.expect("count"), 20);
    })
    .await;
}

/// Only `serve` creates a store. A review ran `reconcile --data-dir /missing`: it created
/// the directory with a Redis and an empty database, printed an empty table and exited 0,
/// so a cron probe with a typo would always pass. Every such typo now exits 5, says what is
/// missing, and creates nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typo_in_a_store_path_is_an_error_not_a_new_empty_store() {
    bounded(Duration::from_secs(60), async {
        let redis = RedisServer::start().await.expect("redis");
        let empty = tempfile::tempdir().expect("dir");
        let missing_dir = empty.path().join("missing");
        let missing_db = empty.path().join("missing.db");
        let blank_db = empty.path().join("blank.db");
        std::fs::write(&blank_db, b"").expect("blank file");
        let text_db = empty.path().join("notes.db");
        std::fs::write(
            &text_db,
            b"these are not the tables you are looking for\n".repeat(100),
        )
        .expect("text file");
        let text_url = format!("sqlite://{}", text_db.display());
        let missing_url = format!("sqlite://{}", missing_db.display());
        let blank_url = format!("sqlite://{}", blank_db.display());
        let redis_url = redis.url();
        let cases: Vec<Case> = vec![
            (
                "reconcile --data-dir of a missing directory",
                vec![
                    "reconcile",
                    "--data-dir",
                    missing_dir.to_str().expect("path"),
                ],
                vec![],
                "no flashsale data directory",
            ),
            (
                "reconcile with no arguments in an empty directory",
                vec!["reconcile"],
                vec![],
                "no flashsale data directory at flashsale-data",
            ),
            (
                "reconcile --sqlite-path of a missing file",
                vec![
                    "reconcile",
                    "--sqlite-path",
                    missing_db.to_str().expect("path"),
                ],
                vec![("REDIS_URL", &redis_url)],
                "is not a file",
            ),
            (
                "reconcile on a file with no schema",
                vec!["reconcile"],
                vec![("REDIS_URL", &redis_url), ("DATABASE_URL", &blank_url)],
                "holds no flashsale schema",
            ),
            (
                "reconcile on a file that is not a database",
                vec!["reconcile"],
                vec![("REDIS_URL", &redis_url), ("DATABASE_URL", &text_url)],
                "file is not a database",
            ),
            (
                "load on a DATABASE_URL of a missing file",
                vec!["load", "--stock", "5", "--requests", "10", "--users", "10"],
                vec![("REDIS_URL", &redis_url), ("DATABASE_URL", &missing_url)],
                "`flashsale serve` creates one",
            ),
        ];
        for (name, args, env, expected) in cases {
            let (code, stderr) = common::child::run_in(empty.path(), &args, &env).await;
            assert_eq!(code, 5, "{name}: {stderr}");
            assert!(
                stderr.contains(expected),
                "{name}: expected {expected:?} in {stderr}"
            );
            assert!(!stderr.contains("invalid the"), "{name}: {stderr}");
        }
        let mut left: Vec<String> = std::fs::read_dir(empty.path())
            .expect("list")
            .map(|entry| {
                entry
                    .expect("entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        left.sort();
        assert_eq!(
            left,
            vec!["blank.db", "notes.db"],
            "a command created a store"
        );
        // A refused command leaves the files it was pointed at as they were (a review found
        // an empty file turned into a 4 KB database in WAL mode).
        assert_eq!(std::fs::metadata(&blank_db).expect("blank").len(), 0);
        assert_eq!(std::fs::metadata(&text_db).expect("text").len(), 4_500);

        // A real store, asked about a coupon it does not have.
        let dir = tempfile::tempdir().expect("dir");
        let served = serve(&dir, &redis.url(), &[]).await;
        let database = format!("sqlite://{}", dir.path().join("shop.db").display());
        let env = [
            ("REDIS_URL", redis_url.as_str()),
            ("DATABASE_URL", &database),
        ];
        let (code, stderr) = run(&["reconcile", "--coupon", "999"], &env).await;
        assert_eq!(code, 5, "{stderr}");
        assert!(stderr.contains("the store holds no coupon 999"), "{stderr}");
        let (code, stderr) = run(&["reconcile"], &env).await;
        assert_eq!(code, 0, "{stderr}");
        drop(served);
    })
    .await;
}

/// A Redis that may evict keys is refused, and the operator is told what to change on the
/// server, not which library function to call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_may_evict_is_refused_with_what_to_change_on_the_server() {
    bounded(Duration::from_secs(30), async {
        let redis = RedisServer::start_with_args(&["--maxmemory-policy", "allkeys-lru"])
            .await
            .expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let database = format!("sqlite://{}", dir.path().join("shop.db").display());
        let (code, stderr) = run(
            &["serve", "--listen", "127.0.0.1:0"],
            &[("REDIS_URL", &redis.url()), ("DATABASE_URL", &database)],
        )
        .await;
        assert_eq!(code, 2, "{stderr}");
        assert!(
            stderr.contains("maxmemory-policy allkeys-lru")
                && stderr.contains("CONFIG SET maxmemory-policy noeviction")
                && !stderr.contains("ClientBuilder"),
            "{stderr}"
        );
    })
    .await;
}
