//! Slow clients and a slow store: headers, bodies and requests each have a deadline, and
//! every request is timed by route and status.

mod common;

use std::time::{Duration, Instant};

use common::{bounded, send, sqlite_config};
use distlock_testkit::RedisServer;
use flashsale::{Service, Strategy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A service whose clients get 500 ms for headers and bodies, and requests 1 s.
async fn impatient() -> (Service, RedisServer, tempfile::TempDir) {
    let redis = RedisServer::start().await.expect("redis");
    let dir = tempfile::tempdir().expect("dir");
    let mut config = sqlite_config(Strategy::Lua, &dir, Some(redis.url()));
    config.read_timeout = Duration::from_millis(500);
    config.strategy.request_timeout = Duration::from_secs(1);
    let service = Service::start(config).await.expect("service");
    (service, redis, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_trickles_its_headers_is_cut_off() {
    bounded(Duration::from_secs(30), async {
        let (service, _redis, _dir) = impatient().await;
        let mut slow = tokio::net::TcpStream::connect(service.addr())
            .await
            .expect("connect");
        slow.write_all(b"GET /ping HTTP/1.1\r\nhost: x\r\n")
            .await
            .expect("write");
        let started = Instant::now();
        let mut rest = Vec::new();
        // The server closes the connection (perhaps after a 408) instead of waiting.
        let _ = tokio::time::timeout(Duration::from_secs(10), slow.read_to_end(&mut rest))
            .await
            .expect("the connection is still open 10 s later");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        service.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_trickles_its_body_gets_408() {
    bounded(Duration::from_secs(30), async {
        let (service, _redis, _dir) = impatient().await;
        let mut slow = tokio::net::TcpStream::connect(service.addr())
            .await
            .expect("connect");
        slow.write_all(
            b"POST /api/coupons HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"title\"",
        )
        .await
        .expect("write");
        let started = Instant::now();
        let mut answer = vec![0; 4096];
        let read = tokio::time::timeout(Duration::from_secs(10), slow.read(&mut answer))
            .await
            .expect("no answer 10 s later")
            .expect("read");
        let answer = String::from_utf8_lossy(&answer[..read]);
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("request_timeout"), "{answer}");
        assert!(started.elapsed() < Duration::from_secs(3));
        service.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_stuck_on_the_database_is_answered_at_its_deadline_and_timed() {
    bounded(Duration::from_secs(30), async {
        let (service, _redis, dir) = impatient().await;
        let (client, base) = (reqwest::Client::new(), service.base_url());
        // Another process holds the SQLite file's write lock; a write waits for it (5 s).
        let mut other = common::lock_sqlite_file(&dir.path().join("flashsale.db")).await;
        let started = Instant::now();
        let stuck = send(
            client
                .post(format!("{base}/api/coupons"))
                .header("content-type", "application/json")
                .body(
                    serde_json::json!({
                        "title": "stuck", "stock": 1, "price": 1,
                        "starts_at": "2026-01-01T00:00:00Z", "ends_at": "2036-01-01T00:00:00Z"
                    })
                    .to_string(),
                ),
        )
        .await;
        let took = started.elapsed();
        assert_eq!(stuck.status, 503, "{}", stuck.body);
        assert_eq!(stuck.body["error"], "request_timeout", "{}", stuck.body);
        assert!(took < Duration::from_secs(3), "{took:?}");
        sqlx::query("ROLLBACK")
            .execute(&mut other)
            .await
            .expect("unlock");

        let metrics = common::metrics(&client, &base).await;
        assert!(
            metrics.contains(
                "flashsale_http_request_duration_seconds_count{route=\"/api/coupons\",status=\"503\"} 1"
            ),
            "{metrics}"
        );
        service.shutdown().await;
    })
    .await;
}

/// A body declared larger than the limit is refused at once with 413, not waited for until
/// the read timeout (second review: 408 after 10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_declared_too_large_gets_413_at_once() {
    bounded(Duration::from_secs(30), async {
        let (service, _redis, _dir) = impatient().await;
        let mut client = tokio::net::TcpStream::connect(service.addr())
            .await
            .expect("connect");
        client
            .write_all(
                b"POST /api/coupons HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 99999999999\r\n\r\n",
            )
            .await
            .expect("write");
        let started = Instant::now();
        let mut answer = vec![0; 4096];
        let read = client.read(&mut answer).await.expect("read");
        let answer = String::from_utf8_lossy(&answer[..read]);
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        assert!(answer.contains("body_too_large"), "{answer}");
        assert!(started.elapsed() < Duration::from_millis(400), "{:?}", started.elapsed());
        service.shutdown().await;
    })
    .await;
}

/// Review: a purchase that found its coupon's stock missing from Redis waited up to a
/// minute for the loader lock, ignoring its own deadline. It now waits until its deadline
/// at most, and is answered then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purchase_waiting_for_a_stock_load_is_answered_at_its_deadline() {
    bounded(Duration::from_secs(30), async {
        let (service, redis, _dir) = impatient().await;
        let (client, base) = (reqwest::Client::new(), service.base_url());
        let coupon = common::open_coupon(&client, &base, 5).await;
        let keyspace = service.db().keyspace().clone();
        // Another instance is loading stock (it holds the loader lock), and Redis lost
        // this coupon's counter.
        let rival = distlock::Client::connect(&redis.url()).await.unwrap();
        let loading = rival
            .lock(keyspace.stock_loader_lock())
            .unwrap()
            .lock()
            .await
            .unwrap();
        let mut conn = redis.connection().await.unwrap();
        let _: () = redis::cmd("DEL")
            .arg(&keyspace.coupon(coupon).stock)
            .query_async(&mut conn)
            .await
            .unwrap();
        let started = Instant::now();
        let answer = common::buy(&client, &base, coupon, 1).await;
        let took = started.elapsed();
        assert!(took < Duration::from_secs(3), "answered after {took:?}");
        assert_eq!(answer.status, 503, "{}", answer.body);
        loading.release().await.unwrap();
        // Once the load can run, the purchase goes through.
        let answer = common::buy(&client, &base, coupon, 1).await;
        assert!(answer.status < 300, "{}", answer.body);
        rival.shutdown().await;
        service.shutdown().await;
    })
    .await;
}
