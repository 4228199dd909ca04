//! The `lock` strategy under a holder paused past its lease: two `flashsale serve`
//! processes share one Redis and one SQLite file; one of them is stopped (SIGSTOP, from a
//! test hook, at the worst moment: holding the coupon's lock, its check done, its SQL write
//! not yet sent) and continued after its lease ran out.

mod common;

use std::time::Duration;

use common::child::{start_serve, stopped, Served, BIN};
use common::{bounded, buy, open_coupon, stats};
use distlock_testkit::RedisServer;
use flashsale::db::Db;
use nix::sys::signal::{kill, Signal};
use redis::AsyncCommands;
use tokio::process::Command;

/// The stopped holder's lease. Short, so the tests are quick; long enough for the lease
/// check at start.
const LEASE: &str = "1s";

/// The user whose purchase makes instance A stop itself while holding the lock.
const STOPPED_USER: i64 = 7;

/// Two lock-strategy instances on one Redis and one SQLite file; the first stops itself
/// while it holds the lock for [`STOPPED_USER`].
async fn two_instances(redis: &RedisServer, dir: &tempfile::TempDir) -> (Served, Served) {
    two_instances_with(redis, dir, &["--strategy", "lock"]).await
}

/// Two instances as [`two_instances`], with `strategy_args` instead of the lock strategy.
async fn two_instances_with(
    redis: &RedisServer,
    dir: &tempfile::TempDir,
    strategy_args: &[&str],
) -> (Served, Served) {
    let start = |fault: bool| {
        let mut command = Command::new(BIN);
        command
            .env("REDIS_URL", redis.url())
            .env(
                "DATABASE_URL",
                format!("sqlite://{}", dir.path().join("shop.db").display()),
            )
            .env_remove("FLASHSALE_FAULT_STOP_HOLDER_OF_USER");
        if fault {
            command.env(
                "FLASHSALE_FAULT_STOP_HOLDER_OF_USER",
                STOPPED_USER.to_string(),
            );
        }
        let mut args = strategy_args.to_vec();
        args.extend(["--lock-lease", LEASE]);
        async move { start_serve(command, &args).await }
    };
    let a = start(true).await;
    let b = start(false).await;
    (a, b)
}

/// A takes the lock for [`STOPPED_USER`], sees a unit left, and stops before writing; B
/// waits out A's lease, takes the lock with a newer token and sells to user 8 (201); then
/// A is continued. Returns A's answer.
async fn newer_holder_sells_while_a_is_stopped(
    client: &reqwest::Client,
    a: &Served,
    b: &Served,
    coupon: i64,
) -> common::Answer {
    let stalled = tokio::spawn({
        let (client, base) = (client.clone(), a.base.clone());
        async move { buy(&client, &base, coupon, STOPPED_USER).await }
    });
    stopped(a.pid()).await;
    let newer = buy(client, &b.base, coupon, 8).await;
    assert_eq!(newer.status, 201, "{}", newer.body);
    kill(a.pid(), Signal::SIGCONT).expect("SIGCONT");
    stalled.await.expect("join")
}

/// The value of a counter line in the text of `/metrics`, 0 if absent.
async fn metric(client: &reqwest::Client, base: &str, line_prefix: &str) -> u64 {
    let text = common::metrics(client, base).await;
    text.lines()
        .find_map(|line| line.strip_prefix(line_prefix))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_stopped_past_its_lease_cannot_write_once_a_newer_holder_has() {
    bounded(Duration::from_secs(90), async {
        let redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let (a, b) = two_instances(&redis, &dir).await;
        let client = reqwest::Client::new();
        let coupon = open_coupon(&client, &a.base, 2).await;

        // A unit is still left in SQL when A wakes up and writes.
        let late = newer_holder_sells_while_a_is_stopped(&client, &a, &b, coupon).await;
        assert_eq!(
            late.status, 503,
            "the stale holder's write landed: {}",
            late.body
        );
        assert_eq!(late.body["error"], "lock_lost", "{}", late.body);
        assert_eq!(late.body["outcome"], "not_sold", "{}", late.body);
        assert_eq!(
            metric(
                &client,
                &a.base,
                "flashsale_lock_writes_refused_total{reason=\"fenced\"} "
            )
            .await,
            1
        );

        // Nothing is stuck: A sells the last unit, and then no more.
        let last = buy(&client, &a.base, coupon, 9).await;
        assert_eq!(last.status, 201, "{}", last.body);
        let none_left = buy(&client, &b.base, coupon, 10).await;
        assert_eq!(none_left.body["error"], "sold_out", "{}", none_left.body);

        let db = Db::connect(&format!(
            "sqlite://{}",
            dir.path().join("shop.db").display()
        ))
        .await
        .expect("db");
        let mut buyers: Vec<i64> = db
            .buyers(coupon)
            .await
            .expect("buyers")
            .into_iter()
            .map(|(user, _)| user)
            .collect();
        buyers.sort();
        assert_eq!(
            buyers,
            vec![8, 9],
            "SQL holds the stock's two orders, no more"
        );
        let figures = stats(&client, &b.base, coupon).await;
        assert_eq!(figures["remaining"], 0, "{figures}");
        assert_eq!(figures["orders_stored"], 2, "{figures}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_stopped_past_its_lease_rolls_back_when_it_wakes() {
    bounded(Duration::from_secs(90), async {
        let redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let (a, _b) = two_instances(&redis, &dir).await;
        let client = reqwest::Client::new();
        let coupon = open_coupon(&client, &a.base, 1).await;
        let db = Db::connect(&format!(
            "sqlite://{}",
            dir.path().join("shop.db").display()
        ))
        .await
        .expect("db");
        let lock_key = db.keyspace().coupon(coupon).lock();

        let stalled = tokio::spawn({
            let (client, base) = (client.clone(), a.base.clone());
            async move { buy(&client, &base, coupon, STOPPED_USER).await }
        });
        stopped(a.pid()).await;
        // Nobody else buys, so no newer token fences A out; but its lease expires.
        let mut redis_conn = redis.connection().await.expect("redis");
        while redis_conn
            .exists::<_, bool>(&lock_key)
            .await
            .expect("exists")
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        kill(a.pid(), Signal::SIGCONT).expect("SIGCONT");
        let late = stalled.await.expect("join");
        assert_eq!(
            late.status, 503,
            "a write past the lease landed: {}",
            late.body
        );
        assert_eq!(late.body["error"], "lock_lost", "{}", late.body);
        assert_eq!(
            metric(
                &client,
                &a.base,
                "flashsale_lock_writes_refused_total{reason=\"lease_lost\"} "
            )
            .await,
            1
        );
        assert_eq!(db.order_count(coupon).await.expect("count"), 0);
        // The unit is still for sale.
        let retry = buy(&client, &a.base, coupon, 11).await;
        assert_eq!(retry.status, 201, "{}", retry.body);
    })
    .await;
}

/// The token counter goes back while the stock survives (deleted here; a failover to a
/// replica that lagged does the same): the first sale is fenced out, and puts the counter
/// past SQL's fence, so the next one is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fencing_counter_that_went_back_costs_one_refused_sale() {
    bounded(Duration::from_secs(60), async {
        let redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let service = flashsale::Service::start(common::sqlite_config(
            flashsale::Strategy::Lock,
            &dir,
            Some(redis.url()),
        ))
        .await
        .expect("service");
        let (client, base) = (reqwest::Client::new(), service.base_url());
        let coupon = open_coupon(&client, &base, 10).await;
        for user in 1..=5 {
            assert_eq!(buy(&client, &base, coupon, user).await.status, 201);
        }
        let mut conn = redis.connection().await.expect("redis");
        let counters: Vec<String> = conn.keys("distlock_fence:*").await.expect("keys");
        assert!(!counters.is_empty());
        let () = conn.del(&counters).await.expect("del");

        let refused = buy(&client, &base, coupon, 6).await;
        assert_eq!(refused.body["error"], "lock_lost", "{}", refused.body);
        let sold = buy(&client, &base, coupon, 7).await;
        assert_eq!(sold.status, 201, "{}", sold.body);
        assert_eq!(service.db().order_count(coupon).await.expect("count"), 6);
        service.shutdown().await;
    })
    .await;
}

/// Segmented, with one segment: a holder stops after it saw the last unit and before its
/// write; another instance waits out the lease and sells that unit; the stopped one is
/// continued. Its write checks the segment again in the script and sells nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_segmented_holder_stopped_past_its_lease_cannot_sell_a_unit_sold_meanwhile() {
    bounded(Duration::from_secs(90), async {
        let redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let (a, b) = two_instances_with(
            &redis,
            &dir,
            &["--strategy", "segmented", "--segments", "1"],
        )
        .await;
        let client = reqwest::Client::new();
        let coupon = open_coupon(&client, &a.base, 1).await;
        let late = newer_holder_sells_while_a_is_stopped(&client, &a, &b, coupon).await;
        assert_eq!(
            late.body["error"], "sold_out",
            "the stale holder sold: {}",
            late.body
        );
        let figures = common::drain(&client, &b.base, coupon).await;
        assert_eq!(figures["remaining"], 0, "{figures}");
        assert_eq!(figures["orders_stored"], 1, "{figures}");
    })
    .await;
}
