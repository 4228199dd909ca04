//! Claims left by a crash are repaired, and `flashsale reconcile` reports where Redis and
//! SQL disagree.

mod common;

use std::time::Duration;

use common::child::{start_serve, stopped, BIN};
use common::{bounded, buy, open_coupon, sqlite_config};
use distlock_testkit::RedisServer;
use flashsale::db::Db;
use flashsale::{Service, Strategy};
use redis::AsyncCommands;
use tokio::process::Command;

/// A segmented instance is killed between claiming a buyer and selling: the buyer is
/// refused (`already_purchased`, no order) until the claim's settle-by time passes, and
/// then the other instance's repair removes the claim and the buyer can buy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_left_by_a_killed_instance_is_repaired_and_the_user_can_buy() {
    bounded(Duration::from_secs(60), async {
        let redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let database = format!("sqlite://{}", dir.path().join("shop.db").display());
        let mut command = Command::new(BIN);
        command
            .env("REDIS_URL", redis.url())
            .env("DATABASE_URL", &database)
            .env("FLASHSALE_FAULT_STOP_HOLDER_OF_USER", "7");
        let mut doomed = start_serve(
            command,
            &[
                "--strategy",
                "segmented",
                "--request-timeout",
                "1s",
                "--lock-lease",
                "1s",
            ],
        )
        .await;
        let mut config = sqlite_config(Strategy::Segmented, &dir, Some(redis.url()));
        config.sqlite_path = None;
        config.database_url = Some(database.clone());
        let survivor = Service::start(config).await.expect("survivor");
        let (client, base) = (reqwest::Client::new(), survivor.base_url());
        let coupon = open_coupon(&client, &base, 10).await;

        // The doomed instance claims user 7, takes a segment's lock and stops; then dies.
        let doomed_base = doomed.base.clone();
        let (doomed_client, in_flight) = (client.clone(), coupon);
        let _abandoned = tokio::spawn(async move {
            let _ = doomed_client
                .post(format!("{doomed_base}/api/coupons/{in_flight}/seckill"))
                .header("x-user-id", 7)
                .send()
                .await;
        });
        stopped(doomed.pid()).await;
        doomed.child.kill().await.expect("kill -9");

        let blocked = buy(&client, &base, coupon, 7).await;
        assert_eq!(
            blocked.body["error"], "already_purchased",
            "{}",
            blocked.body
        );
        assert!(blocked.body["order_id"].is_null(), "{}", blocked.body);

        // Once the claim's sale is settled (1 s deadline + 2.5 s), the repair removes it.
        let buyers = survivor.db().keyspace().coupon(coupon).buyers;
        let mut conn = redis.connection().await.expect("redis");
        while conn
            .hexists::<_, _, bool>(&buyers, 7)
            .await
            .expect("hexists")
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let bought = buy(&client, &base, coupon, 7).await;
        assert_eq!(bought.status, 201, "{}", bought.body);
        let metrics = common::metrics(&client, &base).await;
        assert!(
            metrics.contains("flashsale_claims_repaired_total 1"),
            "{metrics}"
        );
        survivor.shutdown().await;
    })
    .await;
}

/// Runs `flashsale reconcile --json EXTRA…` on `redis_url` and `database`, and returns its
/// exit code and report.
async fn reconcile(redis_url: &str, database: &str, extra: &[&str]) -> (i32, serde_json::Value) {
    let output = Command::new(BIN)
        .args(["reconcile", "--json"])
        .args(extra)
        .env("REDIS_URL", redis_url)
        .env("DATABASE_URL", database)
        .output()
        .await
        .expect("run reconcile");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report = serde_json::from_str(&stdout).unwrap_or_else(|err| {
        panic!(
            "not JSON ({err}): {stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code().unwrap_or(-1), report)
}

/// A lua service on a Redis and a SQLite file that `flashsale reconcile` can also reach,
/// with the database's URL.
async fn lua_service_on_a_shared_redis() -> (RedisServer, tempfile::TempDir, Service, String) {
    let redis = RedisServer::start().await.expect("redis");
    let dir = tempfile::tempdir().expect("dir");
    let service = Service::start(sqlite_config(Strategy::Lua, &dir, Some(redis.url())))
        .await
        .expect("service");
    let database = format!("sqlite://{}", dir.path().join("flashsale.db").display());
    (redis, dir, service, database)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_removes_only_stale_claims_and_reports_each_kind_of_drift() {
    bounded(Duration::from_secs(60), async {
        let (redis, _dir, service, database) = lua_service_on_a_shared_redis().await;
        let (client, base) = (reqwest::Client::new(), service.base_url());
        let clean = open_coupon(&client, &base, 5).await;
        let drifted = open_coupon(&client, &base, 10).await;
        for user in 1..=4 {
            assert_eq!(buy(&client, &base, clean, user).await.status, 201);
            assert_eq!(buy(&client, &base, drifted, user).await.status, 201);
        }
        common::drain(&client, &base, drifted).await;
        common::drain(&client, &base, clean).await;
        service.shutdown().await;

        let (code, report) = reconcile(&redis.url(), &database, &[]).await;
        assert_eq!(code, 0, "{report:#}");

        // Break the drifted coupon in each way reconcile must see.
        let db = Db::connect(&database).await.expect("db");
        let keys = db.keyspace().coupon(drifted);
        let mut conn = redis.connection().await.expect("redis");
        let now_ms = flashsale::model::now_millis();
        let stale = format!("~{}:gone-1:c{drifted}-u50-dead", now_ms - 1_000);
        let fresh = format!("~{}:alive-2:c{drifted}-u51-busy", now_ms + 600_000);
        let () = redis::pipe()
            .hset(&keys.buyers, 50, &stale)
            .zadd(&keys.claims, 50, now_ms - 1_000)
            .hset(&keys.buyers, 51, &fresh)
            .zadd(&keys.claims, 51, now_ms + 600_000)
            // A sale Redis told a buyer about that nothing will store.
            .hset(&keys.buyers, 60, format!("c{drifted}-u60-lost"))
            .hincr(&keys.stock, 0, -1)
            // A stored order whose buyer Redis forgot, and one it remembers differently.
            .hdel(&keys.buyers, 1)
            .hset(&keys.buyers, 2, format!("c{drifted}-u2-other"))
            // A counter that counts three units too many.
            .hincr(&keys.stock, 0, 3)
            .query_async(&mut conn)
            .await
            .expect("break");

        let (code, report) = reconcile(&redis.url(), &database, &[]).await;
        assert_eq!(code, 3, "{report:#}");
        let find = |id: i64| {
            report
                .as_array()
                .expect("array")
                .iter()
                .find(|coupon| coupon["coupon_id"] == id)
                .expect("coupon in report")
                .clone()
        };
        let ok = find(clean);
        assert_eq!(
            (
                ok["counter_drift"].as_i64(),
                ok["missing_in_sql_count"].as_i64()
            ),
            (Some(0), Some(0)),
            "{ok:#}"
        );
        let bad = find(drifted);
        assert_eq!(bad["stale_claims_removed"], 1, "{bad:#}");
        assert_eq!(bad["claims_in_progress"], 1, "{bad:#}");
        assert_eq!(
            bad["missing_in_sql"],
            serde_json::json!([format!("c{drifted}-u60-lost")])
        );
        assert_eq!(bad["missing_in_redis_count"], 1, "{bad:#}");
        assert_eq!(bad["different_order_count"], 1, "{bad:#}");
        // Left: 10 − 4 sold − 1 (user 60) + 3 = 8; buyers: 2, 3, 4, 60 in Redis and 1 in
        // SQL only. The counter's +3 shows, and the buyer Redis forgot is a unit sold, not
        // a unit sold twice (the earlier build reported 3 − 1).
        assert_eq!(bad["counter_drift"], 3, "{bad:#}");
        assert_eq!(bad["oversold"], 0, "{bad:#}");
        assert_eq!(bad["missing_in_redis_repaired"], 1, "{bad:#}");
        // The counter could have sold those 3 units again: lowered to the 5 truly left.
        assert_eq!(bad["counter_lowered"], 3, "{bad:#}");
        let left: i64 = conn.hget(&keys.stock, 0).await.expect("stock");
        assert_eq!(left, 5);
        let entries: std::collections::HashMap<i64, String> =
            conn.hgetall(&keys.buyers).await.expect("buyers");
        let stored_1 = db.buyers(drifted).await.expect("buyers");
        let stored_1 = stored_1
            .iter()
            .find(|(user, _)| *user == 1)
            .expect("user 1");
        assert_eq!(
            entries.get(&1),
            Some(&stored_1.1),
            "the forgotten buyer is back"
        );
        assert!(!entries.contains_key(&50), "the stale claim is gone");
        assert_eq!(
            entries.get(&51),
            Some(&fresh),
            "a claim in progress is kept"
        );

        let (code, _) = reconcile(&redis.url(), &database, &["--coupon", &clean.to_string()]).await;
        assert_eq!(code, 0);
    })
    .await;
}

/// Reconcile while a coupon sells (second review: three runs during load all reported
/// drift, exit 3, on a healthy coupon): a healthy coupon stays healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_during_a_rush_reports_no_drift_on_a_healthy_coupon() {
    bounded(Duration::from_secs(90), async {
        let (redis, _dir, service, database) = lua_service_on_a_shared_redis().await;
        let (client, base) = (reqwest::Client::new(), service.base_url());
        let coupon = open_coupon(&client, &base, 100_000).await;
        let stop = tokio_util::sync::CancellationToken::new();
        let rush: Vec<_> = (0..16)
            .map(|lane| {
                let (client, base, stop) = (client.clone(), base.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut user = 1 + lane * 1_000_000;
                    while !stop.is_cancelled() {
                        assert_eq!(buy(&client, &base, coupon, user).await.status, 201);
                        user += 1;
                    }
                })
            })
            .collect();
        for _ in 0..3 {
            let (code, report) =
                reconcile(&redis.url(), &database, &["--coupon", &coupon.to_string()]).await;
            assert_eq!(code, 0, "{report:#}");
        }
        stop.cancel();
        for lane in rush {
            lane.await.expect("lane");
        }
        service.shutdown().await;
    })
    .await;
}

/// A store that was oversold (SQL holds more orders than the stock: two authorities sold
/// it before the store recorded one) is reported as oversold, exit 3. A review found the
/// earlier build calling 50 units sold twice "units counted that are not for sale".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversold_coupon_is_reported_as_oversold() {
    bounded(Duration::from_secs(60), async {
        let (redis, _dir, service, database) = lua_service_on_a_shared_redis().await;
        let (client, base) = (reqwest::Client::new(), service.base_url());
        let coupon = open_coupon(&client, &base, 5).await;
        for user in 1..=5 {
            assert_eq!(buy(&client, &base, coupon, user).await.status, 201);
        }
        common::drain(&client, &base, coupon).await;
        service.shutdown().await;
        // Three more orders in SQL, sold from some other counter (written straight into
        // the database: no instance of this store would write them).
        {
            use sqlx::Connection;
            sqlx::any::install_default_drivers();
            let mut other = sqlx::AnyConnection::connect(&database).await.expect("db");
            for user in 101..=103 {
                sqlx::query(
                    "INSERT INTO orders (id, coupon_id, user_id, created_at, stored_at) \
                     VALUES ($1, $2, $3, 0, 0)",
                )
                .bind(format!("c{coupon}-u{user}-0ff"))
                .bind(coupon)
                .bind(user)
                .execute(&mut other)
                .await
                .expect("insert");
            }
        }

        let (code, report) = reconcile(&redis.url(), &database, &[]).await;
        assert_eq!(code, 3, "{report:#}");
        let coupon_report = &report[0];
        assert_eq!(coupon_report["oversold"], 3, "{coupon_report:#}");
        assert_eq!(coupon_report["counter_drift"], 0, "{coupon_report:#}");
        let output = Command::new(BIN)
            .arg("reconcile")
            .env("REDIS_URL", redis.url())
            .env("DATABASE_URL", &database)
            .output()
            .await
            .expect("run reconcile");
        let table = String::from_utf8_lossy(&output.stdout);
        assert!(
            table.contains("OVERSOLD by 3: buyers hold 8 units of a stock of 5"),
            "{table}"
        );
        assert!(!table.contains("could have sold"), "{table}");
    })
    .await;
}
