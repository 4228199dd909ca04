//! One SQL store has exactly one stock authority: the Redis (and logical database) whose
//! counters sell its stock. A review started an embedded `serve` and a fleet-mode one on
//! one SQLite file and sold 100 orders for a stock of 50 (99 on PostgreSQL): each sold the
//! whole stock from its own counter. Every pairing of two authorities on one store is
//! refused here, whichever starts first, on SQLite and on PostgreSQL; a take-over on
//! purpose moves the store and sells only what is left.

mod common;

use std::time::Duration;

use common::{bounded, buy, drain, open_coupon, stats};
use distlock_testkit::{PostgresServer, RedisServer};
use flashsale::authority::AuthorityError;
use flashsale::{ConfigError, Service, ServiceConfig, Strategy};
use tempfile::TempDir;

/// One side of a pairing: where its stock would be sold from.
#[derive(Clone, Copy, Debug)]
enum Side<'a> {
    /// `serve` with REDIS_URL unset, its data directory in `dir`.
    Embedded(&'a TempDir),
    /// `serve` with REDIS_URL set.
    Fleet(&'a str),
}

/// The store every side of a test shares.
#[derive(Clone, Copy)]
enum Store<'a> {
    Sqlite(&'a TempDir),
    Postgres(&'a str),
}

fn config(side: Side, store: Store) -> ServiceConfig {
    let mut config = ServiceConfig::new(Strategy::Lua);
    match side {
        Side::Embedded(dir) => config.data_dir = dir.path().to_owned(),
        Side::Fleet(url) => config.redis_url = Some(url.to_owned()),
    }
    match store {
        Store::Sqlite(dir) => {
            let file = dir.path().join("shop.db");
            config.sqlite_path = Some(file.clone());
            config.database_url = Some(format!("sqlite://{}", file.display()));
        }
        Store::Postgres(url) => config.database_url = Some(url.to_owned()),
    }
    config
}

/// Starts `first` and sells on it, then starts `second` on the same store and expects it
/// refused as another authority, with a message naming the owner and the way to move it;
/// then again with `first` stopped: the rule is about the store, not who runs now.
async fn second_authority_is_refused(first: Side<'_>, second: Side<'_>, store: Store<'_>) {
    let service = Service::start(config(first, store))
        .await
        .expect("the first authority starts");
    let http = reqwest::Client::new();
    let coupon = open_coupon(&http, &service.base_url(), 50).await;
    for user in 1..=5 {
        assert_eq!(
            buy(&http, &service.base_url(), coupon, user).await.status,
            201
        );
    }
    expect_refused(first, second, store, "running").await;
    drain(&http, &service.base_url(), coupon).await;
    service.shutdown().await;
    expect_refused(first, second, store, "stopped").await;
}

async fn expect_refused(first: Side<'_>, second: Side<'_>, store: Store<'_>, first_is: &str) {
    let Err(err) = Service::start(config(second, store)).await else {
        panic!("{second:?} started beside {first:?} ({first_is})");
    };
    assert!(
        matches!(&err, ConfigError::Authority(e) if matches!(**e, AuthorityError::Foreign { .. })),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("--take-over-store") && message.contains("SIGTERM"),
        "{message}"
    );
}

/// Four pairings on one store kind, each on a store of its own.
async fn every_pairing(store_for: impl Fn(usize) -> (Option<TempDir>, String)) {
    let redis_a = RedisServer::start().await.expect("redis");
    let redis_b = RedisServer::start().await.expect("redis");
    let logical_1 = format!("{}/1", redis_a.url().trim_end_matches('/'));
    let (a_url, b_url) = (redis_a.url(), redis_b.url());
    for pairing in 0..4 {
        let embedded_dir = tempfile::tempdir().expect("dir");
        let (sqlite_dir, postgres_url) = store_for(pairing);
        let store = match &sqlite_dir {
            Some(dir) => Store::Sqlite(dir),
            None => Store::Postgres(&postgres_url),
        };
        let (first, second) = match pairing {
            0 => (Side::Embedded(&embedded_dir), Side::Fleet(&a_url)),
            1 => (Side::Fleet(&a_url), Side::Embedded(&embedded_dir)),
            2 => (Side::Fleet(&a_url), Side::Fleet(&b_url)),
            _ => (Side::Fleet(&a_url), Side::Fleet(&logical_1)),
        };
        second_authority_is_refused(first, second, store).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pairing_of_two_authorities_on_one_sqlite_file_is_refused() {
    bounded(Duration::from_secs(120), async {
        every_pairing(|_| (Some(tempfile::tempdir().expect("dir")), String::new())).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pairing_of_two_authorities_on_one_postgres_database_is_refused() {
    bounded(Duration::from_secs(180), async {
        let postgres = PostgresServer::start().await.expect("postgres");
        let mut urls = Vec::new();
        {
            use sqlx::Connection;
            let mut connection = sqlx::PgConnection::connect(&postgres.url())
                .await
                .expect("connect");
            for pairing in 0..4 {
                sqlx::query(&format!("CREATE DATABASE shop{pairing}"))
                    .execute(&mut connection)
                    .await
                    .expect("create database");
                let server = postgres.url();
                let server = server.trim_end_matches("/postgres");
                urls.push(format!("{server}/shop{pairing}"));
            }
        }
        every_pairing(|pairing| (None, urls[pairing].clone())).await;
    })
    .await;
}

/// The same Redis reached again, by another URL spelling, is the same authority.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_authority_is_its_redis_however_it_is_reached() {
    bounded(Duration::from_secs(60), async {
        let redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let first = Service::start(config(Side::Fleet(&redis.url()), Store::Sqlite(&dir)))
            .await
            .expect("first");
        let other_spelling = redis.url().replace("127.0.0.1", "localhost");
        let second = Service::start(config(Side::Fleet(&other_spelling), Store::Sqlite(&dir)))
            .await
            .expect("the same Redis under another name");
        second.shutdown().await;
        first.shutdown().await;
    })
    .await;
}

/// Moving a store on purpose: a take-over is refused until the old authority is released
/// (a review took over a running lua fleet: 21,012 orders for a stock of 20,000, and 207
/// buyers told 201 with no order). Once its last instance stopped gracefully with every
/// order stored, the take-over is accepted at once, rebuilds its counters from SQL (a stale
/// counter of its own from an earlier tenure included) and sells exactly what is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_over_waits_for_the_old_authority_to_stop_and_sells_only_what_is_left() {
    bounded(Duration::from_secs(90), async {
        let (redis_a, redis_b) = (
            RedisServer::start().await.expect("redis"),
            RedisServer::start().await.expect("redis"),
        );
        let dir = tempfile::tempdir().expect("dir");
        let http = reqwest::Client::new();
        let on_a = Service::start(config(Side::Fleet(&redis_a.url()), Store::Sqlite(&dir)))
            .await
            .expect("a");
        let coupon = open_coupon(&http, &on_a.base_url(), 30).await;
        for user in 1..=10 {
            assert_eq!(buy(&http, &on_a.base_url(), coupon, user).await.status, 201);
        }
        drain(&http, &on_a.base_url(), coupon).await;

        let take_over = |url: &str| {
            let mut config = config(Side::Fleet(url), Store::Sqlite(&dir));
            config.take_over_store = true;
            config
        };
        let refused = Service::start(take_over(&redis_b.url()))
            .await
            .err()
            .expect("a take-over while A sells");
        assert!(
            matches!(&refused, ConfigError::Authority(e) if matches!(**e, AuthorityError::NotReleased { .. })),
            "{refused:?}"
        );
        assert!(refused.to_string().contains("SIGTERM"), "{refused}");
        // A take-over that cannot even listen fails before it touches the store (a review
        // took a store over with a start that then failed to bind: nothing served it).
        let mut cannot_listen = take_over(&redis_b.url());
        cannot_listen.listen = on_a.addr();
        let refused = Service::start(cannot_listen).await.err().expect("address in use");
        assert!(matches!(refused, ConfigError::Listen { .. }), "{refused:?}");
        assert_eq!(buy(&http, &on_a.base_url(), coupon, 11).await.status, 201);
        on_a.shutdown().await;

        let on_b = Service::start(take_over(&redis_b.url())).await.expect("take over");
        assert_eq!(stats(&http, &on_b.base_url(), coupon).await["remaining"], 19);
        assert_eq!(
            buy(&http, &on_b.base_url(), coupon, 3).await.body["error"],
            "already_purchased"
        );
        for user in 12..=25 {
            assert_eq!(buy(&http, &on_b.base_url(), coupon, user).await.status, 201);
        }
        drain(&http, &on_b.base_url(), coupon).await;
        on_b.shutdown().await;

        // Back to A, whose counter still says 19 left from its tenure: a plain start is
        // refused (its counters are stale), a take-over rebuilds them: 5 left.
        let refused = Service::start(config(Side::Fleet(&redis_a.url()), Store::Sqlite(&dir)))
            .await
            .err()
            .expect("stale Redis refused");
        assert!(
            matches!(&refused, ConfigError::Authority(e) if matches!(**e, AuthorityError::StaleRedis { .. })),
            "{refused:?}"
        );
        let on_a = Service::start(take_over(&redis_a.url())).await.expect("take back");
        assert_eq!(stats(&http, &on_a.base_url(), coupon).await["remaining"], 5);
        let base = on_a.base_url();
        let wins = futures_util::future::join_all(
            (100..120).map(|user| buy(&http, &base, coupon, user)),
        )
        .await
        .iter()
        .filter(|answer| answer.status == 201)
        .count();
        assert_eq!(wins, 5);
        let after = drain(&http, &on_a.base_url(), coupon).await;
        assert_eq!(after["orders_stored"], 30, "{after}");
        on_a.shutdown().await;
    })
    .await;
}

/// A take-over of an authority that was not released is refused; only
/// `--abandon-old-authority` takes it, and only once every instance of it has been silent.
/// An instance frozen (SIGSTOP) past such a take-over sells nothing when it wakes, neither
/// new purchases nor ones it had queued (a review had 56 queued purchases sold after the
/// take-over), does not store its own backlog (its units were put back on sale), and exits
/// 1. The timings are shortened by the test hook (beat 100 ms, sales lease 1 s, silence
/// 3 s); the defaults are 0.5 s, 10 s and 15 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_frozen_past_an_abandoning_take_over_sells_nothing_when_it_wakes() {
    use common::child::{start_serve, BIN};
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    bounded(Duration::from_secs(60), async {
        const TIMING: &str = "100,1000,3000";
        let (redis_a, redis_b) = (
            RedisServer::start().await.expect("redis"),
            RedisServer::start().await.expect("redis"),
        );
        let dir = tempfile::tempdir().expect("dir");
        let database = format!("sqlite://{}", dir.path().join("shop.db").display());
        let command = |redis: &RedisServer| {
            let mut command = tokio::process::Command::new(BIN);
            command
                .env("REDIS_URL", redis.url())
                .env("DATABASE_URL", &database)
                .env("FLASHSALE_TEST_AUTHORITY_TIMING", TIMING);
            command
        };
        let serve = |redis: &RedisServer, extra: &'static [&'static str]| {
            let command = command(redis);
            async move { start_serve(command, extra).await }
        };
        let mut a = serve(&redis_a, &[]).await;
        let http = reqwest::Client::new();
        let coupon = open_coupon(&http, &a.base, 10).await;
        for user in 1..=4 {
            assert_eq!(buy(&http, &a.base, coupon, user).await.status, 201);
        }
        drain(&http, &a.base, coupon).await;

        // Purchases reach A while its Redis is frozen: one batch waits on Redis, the
        // rest queue in A. Then A itself freezes.
        let redis_a_pid = Pid::from_raw(redis_a.pid().expect("pid") as i32);
        kill(redis_a_pid, Signal::SIGSTOP).expect("SIGSTOP redis");
        let queued: Vec<_> = (60..70)
            .map(|user| {
                let (http, base) = (http.clone(), a.base.clone());
                tokio::spawn(async move {
                    http.post(format!("{base}/api/coupons/{coupon}/seckill"))
                        .header("x-user-id", user)
                        .send()
                        .await
                })
            })
            .collect();
        // Let A admit them (its admission check passes) before it freezes: the check
        // that matters is the one made again when their batch is formed, after the wake.
        // A exposes no queue depth to wait on, hence the pause.
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Frozen inside a write (its beat's transaction), A would hold SQLite's one write
        // lock and no take-over could start (store_epoch.rs's
        // `a_take_over_names_the_process_holding_sqlites_lock` covers that case). Here A
        // must freeze between writes: it is continued and frozen again until it holds no
        // write lock.
        let db_path = dir.path().join("shop.db");
        loop {
            kill(a.pid(), Signal::SIGSTOP).expect("SIGSTOP");
            common::child::stopped(a.pid()).await;
            let holders = flashsale::db::sqlite_lock::write_lock_holders(&db_path);
            if holders.iter().all(|holder| holder.pid != a.pid().as_raw()) {
                break;
            }
            kill(a.pid(), Signal::SIGCONT).expect("SIGCONT");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        let env = |extra: &[(&'static str, String)]| {
            let mut env = vec![
                ("REDIS_URL", redis_b.url()),
                ("DATABASE_URL", database.clone()),
                ("FLASHSALE_TEST_AUTHORITY_TIMING", TIMING.to_owned()),
            ];
            env.extend(extra.iter().cloned());
            env
        };
        let run = |args: &'static [&'static str]| {
            let env = env(&[]);
            async move {
                let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
                common::child::run(args, &env).await
            }
        };
        let (code, stderr) = run(&["serve", "--listen", "127.0.0.1:0", "--take-over-store"]).await;
        assert_eq!(code, 4, "{stderr}");
        assert!(stderr.contains("which was not released"), "{stderr}");
        let (code, stderr) = run(&[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--take-over-store",
            "--abandon-old-authority",
        ])
        .await;
        assert_eq!(code, 4, "{stderr}");
        assert!(stderr.contains("is still being sold"), "{stderr}");
        let db = flashsale::db::Db::connect(&database).await.expect("db");
        // Accepted once A has been silent for the 3 s, by the database's clock.
        let b = common::child::abandoning_take_over(|| command(&redis_b)).await;
        let sold_on_b = buy(&http, &b.base, coupon, 50).await;
        assert_eq!(sold_on_b.status, 201, "{}", sold_on_b.body);

        kill(a.pid(), Signal::SIGCONT).expect("SIGCONT");
        kill(redis_a_pid, Signal::SIGCONT).expect("SIGCONT redis");
        for purchase in queued {
            let response = purchase.await.expect("join").expect("A answers");
            let status = response.status().as_u16();
            let body: serde_json::Value =
                serde_json::from_str(&response.text().await.expect("body")).expect("json");
            assert_eq!(
                (status, body["outcome"].as_str()),
                (503, Some("not_sold")),
                "{body}"
            );
        }
        let exited = common::child::exits_within(&mut a, Duration::from_secs(10)).await;
        assert_eq!(exited.code(), Some(1));
        drain(&http, &b.base, coupon).await;
        assert_eq!(db.order_count(coupon).await.expect("count"), 5);
        drop(b);
    })
    .await;
}

/// A store slower to answer a beat than two beats, but well within the sales lease, keeps
/// an instance selling, and a take-over still reaches it: woken from a freeze into that
/// slow store, it hears that it was taken over and exits 1. (Beats used to be cut at two
/// beats: behind a database 80 ms away every beat was thrown away, sales stopped a lease
/// after the start, and a taken-over instance never heard of it and stayed up, the
/// likely cause of a CI run where a woken instance stayed up on a busy SQLite file.)
/// Timings shortened: beat 100 ms, lease 3 s, silence 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_store_keeps_sales_going_and_still_evicts_a_taken_over_instance() {
    use common::child::{abandoning_take_over, start_serve, BIN};
    use distlock_testkit::FaultProxy;
    use nix::sys::signal::{kill, Signal};
    bounded(Duration::from_secs(90), async {
        const TIMING: &str = "100,3000,5000";
        // A beat is five to nine round trips (pool check, begin, admission, beat, commit,
        // and the statements' preparation on a new connection), 0.4 to 0.75 s, about 1 s
        // on a connection the pool opens meanwhile: against the 0.2 s beats were cut at,
        // and well inside the lease, even with two such beats between confirmations.
        const ONE_WAY: Duration = Duration::from_millis(40);
        let (redis_a, redis_b) = (
            RedisServer::start().await.expect("redis"),
            RedisServer::start().await.expect("redis"),
        );
        let postgres = PostgresServer::start().await.expect("postgres");
        let direct = postgres.url();
        let proxy = FaultProxy::start(std::net::SocketAddr::from((
            std::net::Ipv4Addr::LOCALHOST,
            postgres.port(),
        )))
        .await
        .expect("proxy");
        let slow = direct.replace(
            &format!(":{}/", postgres.port()),
            &format!(":{}/", proxy.port()),
        );
        let command = |redis: &RedisServer, database: &str| {
            let mut command = tokio::process::Command::new(BIN);
            command
                .env("REDIS_URL", redis.url())
                .env("DATABASE_URL", database)
                .env("FLASHSALE_TEST_AUTHORITY_TIMING", TIMING);
            command
        };
        let mut a = start_serve(command(&redis_a, &slow), &[]).await;
        proxy.set_delay(ONE_WAY);
        let http = reqwest::Client::new();
        let coupon = open_coupon(&http, &a.base, 100).await;
        // Sales go on past the lease behind the slow store.
        let selling_until = tokio::time::Instant::now() + Duration::from_secs(4);
        let mut user = 0;
        while tokio::time::Instant::now() < selling_until {
            user += 1;
            let bought = buy(&http, &a.base, coupon, user).await;
            assert_eq!(
                bought.status,
                201,
                "purchase {user}: {}; A's stderr:\n{}",
                bought.body,
                a.later.lock().expect("lines").join("\n")
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        drain(&http, &a.base, coupon).await;

        // Frozen with a beat in flight, its transaction holds the store row (FOR SHARE)
        // until PostgreSQL ends it as idle (`idle_in_transaction_session_timeout`, 10 s;
        // 10 s more for a second beat, out beside a slow one, queued behind it on the
        // instance's row); the take-over waits for the row meanwhile.
        kill(a.pid(), Signal::SIGSTOP).expect("SIGSTOP");
        common::child::stopped(a.pid()).await;
        let b = abandoning_take_over(|| command(&redis_b, &direct)).await;
        let sold_on_b = buy(&http, &b.base, coupon, 100_000).await;
        assert_eq!(sold_on_b.status, 201, "{}", sold_on_b.body);

        kill(a.pid(), Signal::SIGCONT).expect("SIGCONT");
        let exited = common::child::exits_within(&mut a, Duration::from_secs(10)).await;
        assert_eq!(exited.code(), Some(1));
        drain(&http, &b.base, coupon).await;
        let db = flashsale::db::Db::connect(&direct).await.expect("db");
        assert_eq!(db.order_count(coupon).await.expect("count"), user + 1);
        drop(b);
    })
    .await;
}

/// An instance that stops gracefully with order events still unstored (it ran no worker,
/// and no other instance stored them) does not release the store: a take-over is refused,
/// since the old Redis holds sales SQL lacks (a review took over after such a stop: 300
/// buyers told 201 never reached SQL). Once an instance with a worker stored them and
/// stopped, the store is released, and two take-overs at once settle one authority (a
/// review saw both win and sell 4,000 for 2,000).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_is_released_only_with_every_order_stored_and_taken_over_once() {
    bounded(Duration::from_secs(90), async {
        let (redis_a, redis_b, redis_c) = (
            RedisServer::start().await.expect("redis"),
            RedisServer::start().await.expect("redis"),
            RedisServer::start().await.expect("redis"),
        );
        let dir = tempfile::tempdir().expect("dir");
        let http = reqwest::Client::new();
        let mut no_worker = config(Side::Fleet(&redis_a.url()), Store::Sqlite(&dir));
        no_worker.worker = None;
        let on_a = Service::start(no_worker).await.expect("a");
        let coupon = open_coupon(&http, &on_a.base_url(), 20).await;
        for user in 1..=6 {
            assert_eq!(buy(&http, &on_a.base_url(), coupon, user).await.status, 201);
        }
        on_a.shutdown().await;
        let take_over = |url: &str| {
            let mut config = config(Side::Fleet(url), Store::Sqlite(&dir));
            config.take_over_store = true;
            config
        };
        let refused = Service::start(take_over(&redis_b.url())).await.err().expect("refused");
        assert!(
            matches!(&refused, ConfigError::Authority(e) if matches!(**e, AuthorityError::NotReleased { .. })),
            "{refused:?}"
        );

        // An instance with a worker stores the 6 and, stopping last, releases the store.
        let on_a = Service::start(config(Side::Fleet(&redis_a.url()), Store::Sqlite(&dir)))
            .await
            .expect("a with a worker");
        drain(&http, &on_a.base_url(), coupon).await;
        on_a.shutdown().await;

        let (b, c) = tokio::join!(
            Service::start(take_over(&redis_b.url())),
            Service::start(take_over(&redis_c.url()))
        );
        let winner = match (b, c) {
            (Ok(winner), Err(_)) | (Err(_), Ok(winner)) => winner,
            (b, c) => panic!("not one take-over: {:?} {:?}", b.err(), c.err()),
        };
        assert_eq!(stats(&http, &winner.base_url(), coupon).await["remaining"], 14);
        let after = drain(&http, &winner.base_url(), coupon).await;
        assert_eq!(after["orders_stored"], 6, "{after}");
        winner.shutdown().await;
    })
    .await;
}

/// The binary says so too: `serve`, `load` and `reconcile` on a store an embedded `serve`
/// owns, pointed at another Redis, each exit with the code for a foreign store (4) and say
/// which authority owns it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_refuses_a_store_of_another_authority_with_its_own_exit_code() {
    bounded(Duration::from_secs(90), async {
        let dir = tempfile::tempdir().expect("dir");
        let mut embedded = common::child::serve_on_defaults(dir.path(), &[]).await;
        let database = format!(
            "sqlite://{}",
            dir.path().join("flashsale-data/flashsale.db").display()
        );
        let redis = RedisServer::start().await.expect("redis");
        let env = [("REDIS_URL", redis.url()), ("DATABASE_URL", database)];
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        for args in [
            vec!["serve", "--listen", "127.0.0.1:0"],
            vec!["load", "--stock", "10", "--requests", "20", "--users", "20"],
            vec!["reconcile"],
        ] {
            let (code, stderr) = common::child::run(&args, &env).await;
            assert_eq!(code, 4, "{args:?}: {stderr}");
            assert!(
                stderr.contains("the embedded Redis of data directory")
                    && stderr.contains("--take-over-store"),
                "{args:?}: {stderr}"
            );
        }
        embedded.child.kill().await.expect("kill");
    })
    .await;
}

/// Two logical databases of one server reached through its unix socket are two
/// authorities too (a review sold 100 orders for 50 this way: the socket URLs' `?db=` was
/// dropped when they were compared).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_logical_databases_behind_one_unix_socket_are_two_authorities() {
    bounded(Duration::from_secs(60), async {
        let sockets = tempfile::tempdir().expect("dir");
        let socket = sockets.path().join("redis.sock");
        let socket = socket.to_str().expect("path");
        let _redis =
            RedisServer::start_with_args(&["--unixsocket", socket, "--unixsocketperm", "700"])
                .await
                .expect("redis");
        let db0 = format!("redis+unix://{socket}?db=0");
        let db1 = format!("redis+unix://{socket}?db=1");
        let dir = tempfile::tempdir().expect("dir");
        second_authority_is_refused(Side::Fleet(&db0), Side::Fleet(&db1), Store::Sqlite(&dir))
            .await;
    })
    .await;
}

/// A Redis that holds the authority's id but counters from an earlier state (restored from
/// a backup, or a data directory copied and started on the same SQL store) is repaired at
/// start: it gets the buyers SQL holds and its units left are lowered to match. A review
/// sold 70 orders for a stock of 50 both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_behind_sql_is_repaired_before_it_sells() {
    bounded(Duration::from_secs(90), async {
        // A copied data directory: B is A's data directory from when 10 were sold.
        let root = tempfile::tempdir().expect("dir");
        let (dir_a, dir_b) = (root.path().join("a"), root.path().join("b"));
        let sqlite = dir_a.join("flashsale.db");
        let embedded = |data_dir: &std::path::Path| {
            let mut config = ServiceConfig::new(Strategy::Lua);
            config.data_dir = data_dir.to_owned();
            config.sqlite_path = Some(sqlite.clone());
            config
        };
        let http = reqwest::Client::new();
        let a = Service::start(embedded(&dir_a)).await.expect("a");
        let coupon = open_coupon(&http, &a.base_url(), 50).await;
        for user in 1..=10 {
            assert_eq!(buy(&http, &a.base_url(), coupon, user).await.status, 201);
        }
        drain(&http, &a.base_url(), coupon).await;
        a.shutdown().await;
        let copied = std::process::Command::new("cp")
            .arg("-a")
            .arg(&dir_a)
            .arg(&dir_b)
            .status()
            .expect("cp");
        assert!(copied.success());
        let a = Service::start(embedded(&dir_a)).await.expect("a again");
        for user in 11..=30 {
            assert_eq!(buy(&http, &a.base_url(), coupon, user).await.status, 201);
        }
        drain(&http, &a.base_url(), coupon).await;
        a.shutdown().await;

        let b = Service::start(embedded(&dir_b)).await.expect("b");
        assert_eq!(stats(&http, &b.base_url(), coupon).await["remaining"], 20);
        assert_eq!(
            buy(&http, &b.base_url(), coupon, 25).await.body["error"],
            "already_purchased"
        );
        let base = b.base_url();
        let wins =
            futures_util::future::join_all((100..140).map(|user| buy(&http, &base, coupon, user)))
                .await
                .iter()
                .filter(|answer| answer.status == 201)
                .count();
        assert_eq!(wins, 20);
        let after = drain(&http, &base, coupon).await;
        assert_eq!(after["orders_stored"], 50, "{after}");
        b.shutdown().await;
    })
    .await;
}

/// Two fleets started at the same moment on a new SQLite file: one becomes the authority,
/// the other is refused as another authority. A review saw the loser fail on the schema
/// instead (1 run in 5: both created the tables at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_fleets_starting_at_once_on_a_new_store_settle_one_authority() {
    bounded(Duration::from_secs(90), async {
        let (redis_a, redis_b) = (
            RedisServer::start().await.expect("redis"),
            RedisServer::start().await.expect("redis"),
        );
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("dir");
            let (a, b) = tokio::join!(
                Service::start(config(Side::Fleet(&redis_a.url()), Store::Sqlite(&dir))),
                Service::start(config(Side::Fleet(&redis_b.url()), Store::Sqlite(&dir))),
            );
            let (winner, loser) = match (a, b) {
                (Ok(winner), Err(loser)) | (Err(loser), Ok(winner)) => (winner, loser),
                (a, b) => panic!("not one authority: {:?}, {:?}", a.err(), b.err()),
            };
            assert!(
                matches!(&loser, ConfigError::Authority(e) if matches!(**e, AuthorityError::Foreign { .. })),
                "{loser:?}"
            );
            winner.shutdown().await;
        }
    })
    .await;
}

/// A Redis restored from a backup taken mid-sale holds the claim of a segmented sale that
/// completed later: the buyer holds an order in SQL, the claim holds no unit. The repair
/// at start replaces the claim with the order and counts its unit (a review's restored
/// backup held 168 such claims: 168 units sold twice, and those buyers told `sold_out`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_claim_of_a_completed_sale_is_settled_at_start() {
    use redis::AsyncCommands;
    bounded(Duration::from_secs(60), async {
        let redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let segmented = || {
            let mut config = config(Side::Fleet(&redis.url()), Store::Sqlite(&dir));
            config.strategy = flashsale::strategy::StrategySettings::new(Strategy::Segmented);
            config
        };
        let http = reqwest::Client::new();
        let first = Service::start(segmented()).await.expect("first");
        let coupon = open_coupon(&http, &first.base_url(), 20).await;
        for user in 1..=10 {
            assert_eq!(
                buy(&http, &first.base_url(), coupon, user).await.status,
                201
            );
        }
        drain(&http, &first.base_url(), coupon).await;
        let keys = first.db().keyspace().coupon(coupon);
        first.shutdown().await;

        // As the backup saw user 3: claimed, its unit not yet taken.
        let mut conn = redis.connection().await.expect("redis");
        let settle_by = flashsale::model::now_millis() + 600_000;
        let () = redis::pipe()
            .atomic()
            .hset(
                &keys.buyers,
                3,
                format!("~{settle_by}:host-1:c{coupon}-u3-abc"),
            )
            .zadd(&keys.claims, 3, settle_by)
            .hincr(&keys.stock, 0, 1)
            .query_async(&mut conn)
            .await
            .expect("restore");

        let again = Service::start(segmented()).await.expect("again");
        assert_eq!(
            stats(&http, &again.base_url(), coupon).await["remaining"],
            10
        );
        let retry = buy(&http, &again.base_url(), coupon, 3).await;
        assert_eq!(retry.body["error"], "already_purchased", "{}", retry.body);
        assert!(retry.body["order_id"].is_string(), "{}", retry.body);
        let claims: i64 = conn.zcard(&keys.claims).await.expect("claims");
        assert_eq!(claims, 0);
        again.shutdown().await;
    })
    .await;
}
