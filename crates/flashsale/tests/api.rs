//! The happy paths of the HTTP API, and the metrics they leave behind.

mod common;

use std::time::Duration;

use common::{bounded, buy, drain, send, sqlite_service};
use flashsale::Strategy;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purchase_from_coupon_to_stored_order() {
    bounded(Duration::from_secs(60), async {
        let (service, _dir) = sqlite_service(Strategy::Lua).await;
        let base = service.base_url();
        let http = reqwest::Client::new();

        let created = send(
            http.post(format!("{base}/api/coupons"))
                .header("content-type", "application/json")
                .body(
                    r#"{"title":"Double 11","stock":2,"price":1999,
                        "starts_at":"2020-11-11T00:00:00+08:00","ends_at":"2999-11-11T00:00:00+08:00"}"#,
                ),
        )
        .await;
        assert_eq!(created.status, 201, "{}", created.body);
        let coupon = created.body["id"].as_i64().expect("id");
        assert_eq!(created.body["starts_at"], "2020-11-10T16:00:00Z");

        let first = buy(&http, &base, coupon, 7).await;
        assert_eq!(first.status, 201);
        let order_id = first.body["order_id"].as_str().expect("order id").to_owned();
        assert_eq!(buy(&http, &base, coupon, 7).await.body["error"], "already_purchased");
        assert_eq!(buy(&http, &base, coupon, 8).await.status, 201);
        let sold_out = buy(&http, &base, coupon, 9).await;
        assert_eq!((sold_out.status, sold_out.body["error"].as_str()), (409, Some("sold_out")));

        let view = send(http.get(format!("{base}/api/coupons/{coupon}"))).await;
        assert_eq!(view.status, 200);
        assert_eq!((view.body["remaining"].as_i64(), view.body["sale"].as_str()), (Some(0), Some("open")));
        assert_eq!(view.body["price"], 1999);

        let stats = drain(&http, &base, coupon).await;
        assert_eq!(
            (&stats["sold"], &stats["sales_recorded"], &stats["orders_stored"], &stats["orders_queued"]),
            (&2.into(), &2.into(), &2.into(), &0.into())
        );
        let orders = send(http.get(format!("{base}/api/users/7/orders"))).await;
        assert_eq!(orders.status, 200);
        assert_eq!(orders.body["orders"].as_array().map(Vec::len), Some(1));
        assert_eq!(orders.body["orders"][0]["order_id"], order_id.as_str());
        assert_eq!(orders.body["orders"][0]["coupon_id"], coupon);
        let nobody = send(http.get(format!("{base}/api/users/12345/orders"))).await;
        assert_eq!(nobody.body["orders"].as_array().map(Vec::len), Some(0));

        let health = send(http.get(format!("{base}/healthz"))).await;
        assert_eq!((health.status, health.body["strategy"].as_str()), (200, Some("lua")));
        assert_eq!(send(http.get(format!("{base}/ping"))).await.body["pong"], true);

        let metrics = common::metrics(&http, &base).await;
        for line in [
            r#"flashsale_purchases_total{outcome="reserved"} 2"#,
            r#"flashsale_purchases_total{outcome="already_purchased"} 1"#,
            r#"flashsale_purchases_total{outcome="sold_out"} 1"#,
            "flashsale_reservation_duration_seconds_count 4",
            "flashsale_orders_stored_total 2",
            "flashsale_stream_lag 0",
            "flashsale_stream_pending 0",
            "flashsale_worker_errors_total 0",
            r#"flashsale_stock_loads_total{kind="new"} 1"#,
            r#"flashsale_http_request_duration_seconds_count{route="/api/coupons/{id}/seckill",status="201"} 2"#,
            // Series present before their first event, for increase() alerts.
            r#"flashsale_purchases_total{outcome="outcome_unknown"} 0"#,
            r#"flashsale_lock_writes_refused_total{reason="fenced"} 0"#,
            r#"flashsale_stock_loads_total{kind="reload"} 0"#,
        ] {
            assert!(metrics.lines().any(|l| l == line), "missing {line:?} in:\n{metrics}");
        }
        let commits = metrics
            .lines()
            .find_map(|l| l.strip_prefix("flashsale_worker_commit_duration_seconds_count "))
            .and_then(|n| n.parse::<u64>().ok());
        assert!(commits.is_some_and(|n| n >= 1), "{metrics}");
        // A timestamp in seconds, by the convention's name: within a minute of now.
        let last_success = metrics
            .lines()
            .find_map(|l| l.strip_prefix("flashsale_worker_last_success_timestamp_seconds "))
            .and_then(|n| n.parse::<f64>().ok())
            .expect("last success timestamp");
        let now = flashsale::model::now_millis() as f64 / 1000.0;
        assert!((now - last_success).abs() < 60.0, "{last_success} vs {now}");
        assert!(!metrics.contains("unix_ms"), "{metrics}");
        service.shutdown().await;
    })
    .await;
}

/// `/healthz` answers 200 only when Redis answers, the database takes a write, and the
/// order worker has finished a round recently; a locked SQLite file is a 503 that names
/// the database, within a bounded time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_reports_a_database_that_cannot_write() {
    bounded(Duration::from_secs(60), async {
        let (service, dir) = sqlite_service(Strategy::Lua).await;
        let http = reqwest::Client::new();
        let healthz = || send(http.get(format!("{}/healthz", service.base_url())));
        let healthy = healthz().await;
        assert_eq!(healthy.status, 200, "{}", healthy.body);
        assert_eq!(healthy.body["database"], "ok", "{}", healthy.body);
        assert_eq!(healthy.body["redis"], "ok", "{}", healthy.body);
        let worker = healthy.body["worker"]["status"]
            .as_str()
            .unwrap_or_default();
        assert!(matches!(worker, "ok" | "starting"), "{}", healthy.body);
        assert_eq!(healthy.body["worker"]["pending"], 0, "{}", healthy.body);
        assert!(
            healthy.body["worker"]["queued"].is_i64(),
            "{}",
            healthy.body
        );

        // Another process holds the SQLite file's write lock: reads still work.
        let mut other = common::lock_sqlite_file(&dir.path().join("flashsale.db")).await;
        let asked = std::time::Instant::now();
        let locked = healthz().await;
        let took = asked.elapsed();
        assert_eq!(locked.status, 503, "{}", locked.body);
        assert_ne!(locked.body["database"], "ok", "{}", locked.body);
        assert!(took < Duration::from_secs(3), "/healthz took {took:?}");
        sqlx::query("ROLLBACK")
            .execute(&mut other)
            .await
            .expect("unlock");
        drop(other);
        assert_eq!(healthz().await.status, 200);
        service.shutdown().await;
    })
    .await;
}
