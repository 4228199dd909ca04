//! Redis loses its data. The stock is rebuilt under the loader lock from what survives
//! (SQL orders, and order events still in the stream), so the remaining stock is right and
//! nobody buys twice.

mod common;

use std::time::Duration;

use common::{bounded, buy, drain, open_coupon, sqlite_config, stats};
use distlock_testkit::RedisServer;
use flashsale::{Service, Strategy};
use redis::AsyncCommands;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_without_persistence_reloads_the_right_stock_lua() {
    restart_without_persistence_reloads_the_right_stock(Strategy::Lua).await;
}

/// The lock strategy also needs its fencing counter back above the highest token SQL
/// accepted: on a counter that restarted from 1, every sale would be fenced out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_without_persistence_reloads_the_right_stock_lock() {
    restart_without_persistence_reloads_the_right_stock(Strategy::Lock).await;
}

async fn restart_without_persistence_reloads_the_right_stock(strategy: Strategy) {
    bounded(Duration::from_secs(90), async {
        let mut redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let service = Service::start(sqlite_config(strategy, &dir, Some(redis.url())))
            .await
            .expect("service");
        let base = service.base_url();
        let http = reqwest::Client::new();
        let coupon = open_coupon(&http, &base, 100).await;
        for user in 1..=40 {
            assert_eq!(buy(&http, &base, coupon, user).await.status, 201);
        }
        let before = drain(&http, &base, coupon).await;
        assert_eq!(before["orders_stored"], 40);

        // No persistence: the restarted server is empty.
        redis.restart().await.expect("restart redis");
        let mut conn = redis.connection().await.expect("redis");
        let keys: Vec<String> = conn.keys("flashsale:*").await.expect("keys");
        assert!(keys.is_empty(), "Redis kept {keys:?}");

        // An earlier buyer is still refused: the reload restored the buyers from SQL. The
        // first requests may get 503 while the service's connection re-establishes itself,
        // as a client retrying a 503 would see.
        let mut again = buy(&http, &base, coupon, 1).await;
        for _ in 0..100 {
            if again.status != 503 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            again = buy(&http, &base, coupon, 1).await;
        }
        assert_eq!(
            (again.status, again.body["error"].as_str()),
            (409, Some("already_purchased"))
        );
        let reloaded = stats(&http, &base, coupon).await;
        assert_eq!(reloaded["remaining"], 60, "{reloaded}");
        // The data loss shows in the metrics, not only in a log line.
        let metrics = common::metrics(&http, &base).await;
        assert!(
            metrics.contains("flashsale_stock_loads_total{kind=\"reload\"} 1")
                && metrics.contains("flashsale_stock_loads_total{kind=\"new\"} 1"),
            "{metrics}"
        );

        // 160 new buyers race for the 60 units left; exactly 60 win.
        let attempts =
            futures_util::future::join_all((41..=200).map(|user| buy(&http, &base, coupon, user)))
                .await;
        let wins = attempts
            .iter()
            .filter(|answer| answer.status == 201)
            .count();
        let refusals: Vec<&serde_json::Value> = attempts
            .iter()
            .filter(|a| a.status != 201 && a.body["error"] != "sold_out")
            .map(|a| &a.body)
            .collect();
        assert!(
            refusals.is_empty(),
            "{} refused: {:?}",
            refusals.len(),
            refusals.first()
        );
        assert_eq!(wins, 60);

        // The worker recreated its consumer group and stored every sale once.
        let after = drain(&http, &base, coupon).await;
        assert_eq!(after["orders_stored"], 100, "{after}");
        assert_eq!(after["remaining"], 0);
        assert_eq!(
            service
                .db()
                .users_with_several_orders(coupon)
                .await
                .expect("query"),
            0
        );
        service.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_counter_is_rebuilt_from_orders_still_in_the_stream() {
    bounded(Duration::from_secs(60), async {
        let redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let mut config = sqlite_config(Strategy::Lua, &dir, Some(redis.url()));
        config.worker = None; // the sales stay in the stream, not yet in SQL
        let first = Service::start(config.clone()).await.expect("service");
        let http = reqwest::Client::new();
        let coupon = open_coupon(&http, &first.base_url(), 50).await;
        for user in 1..=20 {
            assert_eq!(
                buy(&http, &first.base_url(), coupon, user).await.status,
                201
            );
        }
        first.shutdown().await;
        assert_eq!(
            flashsale::db::Db::connect(&config.database_url())
                .await
                .expect("db")
                .order_count(coupon)
                .await
                .expect("count"),
            0
        );

        // Only the counter and the buyers are lost (an eviction, a bad FLUSH by pattern).
        let mut conn = redis.connection().await.expect("redis");
        let keys = flashsale::db::Db::connect(&config.database_url())
            .await
            .expect("db")
            .keyspace()
            .coupon(coupon);
        let _: i64 = conn.del(&[&keys.stock, &keys.buyers]).await.expect("del");

        // The next instance's start-up load counts the 20 sales still in the stream.
        config.worker = Some(flashsale::worker::WorkerSettings::new());
        let second = Service::start(config).await.expect("service");
        assert_eq!(second.load_report().loaded, vec![coupon]);
        let base = second.base_url();
        assert_eq!(stats(&http, &base, coupon).await["remaining"], 30);
        assert_eq!(
            buy(&http, &base, coupon, 7).await.body["error"],
            "already_purchased"
        );
        let after = drain(&http, &base, coupon).await;
        assert_eq!(after["orders_stored"], 20);
        second.shutdown().await;
    })
    .await;
}
