//! Shared fixtures: services on private Redis, SQLite and PostgreSQL, and HTTP helpers.
#![allow(dead_code)]

pub mod child;

use std::future::Future;
use std::time::Duration;

use flashsale::load::{LoadPlan, StrategyReport};
use flashsale::{Service, ServiceConfig, Strategy};
use serde_json::Value;
use tempfile::TempDir;

/// Fails the test, instead of hanging it, when `future` does not finish in `limit`.
pub async fn bounded<T>(limit: Duration, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, future).await {
        Ok(value) => value,
        Err(_) => panic!("test step did not finish within {limit:?}"),
    }
}

/// A service configuration on a private SQLite file in `dir` (and the embedded mode's
/// private Redis, with its data in `dir`, unless `redis_url` is set).
pub fn sqlite_config(
    strategy: Strategy,
    dir: &TempDir,
    redis_url: Option<String>,
) -> ServiceConfig {
    let mut config = ServiceConfig::new(strategy);
    config.data_dir = dir.path().to_owned();
    config.sqlite_path = Some(dir.path().join("flashsale.db"));
    config.redis_url = redis_url;
    config
}

/// A service with its own Redis and SQLite file.
pub async fn sqlite_service(strategy: Strategy) -> (Service, TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let service = Service::start(sqlite_config(strategy, &dir, None))
        .await
        .expect("start service");
    (service, dir)
}

/// The load the correctness tests use: at least 200 concurrent clients and 5,000
/// requests, with 1,500 of them retries of users who already tried.
pub fn heavy_plan(stock: i64) -> LoadPlan {
    LoadPlan {
        stock,
        requests: 5_000,
        users: 3_500,
        concurrency: 200,
        seed: 7,
        drain_timeout: Duration::from_secs(60),
        progress: false,
    }
}

/// Asserts that a guarded strategy kept every rule, with the whole report on failure.
pub fn assert_clean(report: &StrategyReport) {
    assert!(report.is_clean(), "rules broken: {report:#?}");
    assert_eq!(report.oversold, 0);
    assert_eq!(report.users_with_several_orders, 0);
    assert_eq!(
        report.sold, report.stock,
        "every unit should sell: {report:#?}"
    );
    assert_eq!(report.stock_left, 0);
    assert_eq!(report.orders_stored, report.sales_recorded);
    assert_eq!(report.orders_stored, report.sold);
}

/// True if `err` says the connection was cut while the request was still being written.
fn is_cut_while_writing(err: &reqwest::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            );
        }
        source = error.source();
    }
    false
}

/// A response's status and JSON body (`Value::Null` when the body is not JSON).
pub struct Answer {
    pub status: u16,
    pub body: Value,
}

/// Sends a request and reads the answer.
///
/// A server that refuses a large body answers before it has read it all and closes the
/// connection; the client, still writing, can then see its write cut (EPIPE) and lose the
/// answer, depending on timing. Such a request is sent again, a few times, until its
/// answer is read: the answer is what the caller checks.
pub async fn send(request: reqwest::RequestBuilder) -> Answer {
    let mut tries_left = 5;
    let response = loop {
        let attempt = request
            .try_clone()
            .expect("a request that can be sent again");
        match attempt.send().await {
            Ok(response) => break response,
            Err(err) if tries_left > 1 && is_cut_while_writing(&err) => tries_left -= 1,
            Err(err) => panic!("HTTP request: {err:?}"),
        }
    };
    let status = response.status().as_u16();
    let text = response.text().await.expect("HTTP body");
    Answer {
        status,
        body: serde_json::from_str(&text).unwrap_or(Value::Null),
    }
}

/// `POST /api/coupons/{id}/seckill` as `user`.
pub async fn buy(client: &reqwest::Client, base: &str, coupon: i64, user: i64) -> Answer {
    send(
        client
            .post(format!("{base}/api/coupons/{coupon}/seckill"))
            .header("x-user-id", user),
    )
    .await
}

/// The text of `GET /metrics`.
pub async fn metrics(client: &reqwest::Client, base: &str) -> String {
    client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics body")
}

/// Takes the write lock of the SQLite file at `path` from a connection of its own, as
/// another process would; writers then wait until the connection is dropped or rolls back.
pub async fn lock_sqlite_file(path: &std::path::Path) -> sqlx::SqliteConnection {
    use sqlx::Connection;
    let mut other = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("second connection");
    sqlx::query("BEGIN EXCLUSIVE")
        .execute(&mut other)
        .await
        .expect("lock the file");
    other
}

/// `GET /api/coupons/{id}/stats`.
pub async fn stats(client: &reqwest::Client, base: &str, coupon: i64) -> Value {
    let answer = send(client.get(format!("{base}/api/coupons/{coupon}/stats"))).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body
}

/// Creates a coupon whose sale is open for the next hour.
pub async fn open_coupon(client: &reqwest::Client, base: &str, stock: i64) -> i64 {
    flashsale::load::create_coupon(client, base, Strategy::Lua, stock)
        .await
        .expect("create coupon")
}

/// Waits, bounded, until the worker has stored every queued order of `coupon`.
pub async fn drain(client: &reqwest::Client, base: &str, coupon: i64) -> Value {
    let (_, drained) =
        flashsale::load::wait_for_drain(client, base, coupon, Duration::from_secs(30))
            .await
            .expect("stats");
    assert!(drained, "the order worker did not drain within 30 s");
    stats(client, base, coupon).await
}
