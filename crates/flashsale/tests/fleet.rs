//! Two instances of the service share one Redis and one PostgreSQL, as a fleet behind a
//! load balancer does: exactly one of them loads the stock at start, and buyers spread over
//! both never get more than the stock or a second coupon.

mod common;

use std::time::Duration;

use common::{assert_clean, bounded, heavy_plan};
use distlock_testkit::{PostgresServer, RedisServer};
use flashsale::db::Db;
use flashsale::load::{http_client, run_on_coupon};
use flashsale::model::NewCoupon;
use flashsale::{Service, ServiceConfig, Strategy};
use time::OffsetDateTime;

async fn fleet(strategy: Strategy) {
    let redis = RedisServer::start().await.expect("redis");
    let postgres = PostgresServer::start().await.expect("postgres");
    // Coupons exist in SQL only, as after a deploy onto an empty Redis.
    let db = Db::connect(&postgres.url()).await.expect("db");
    let plan = heavy_plan(300);
    let now = OffsetDateTime::now_utc();
    let mut coupons = Vec::new();
    for title in ["first", "second", "third"] {
        let new = NewCoupon {
            title: title.into(),
            stock: plan.stock,
            price: 100,
            starts_at: now - time::Duration::minutes(1),
            ends_at: now + time::Duration::hours(1),
        };
        coupons.push(db.create_coupon(&new, 0).await.expect("coupon").id);
    }
    let config = || {
        let mut config = ServiceConfig::new(strategy);
        config.redis_url = Some(redis.url());
        config.database_url = Some(postgres.url());
        config
    };
    let (a, b) = tokio::join!(Service::start(config()), Service::start(config()));
    let (a, b) = (a.expect("instance a"), b.expect("instance b"));

    // The loader lock makes them take turns: one loads all three, the other finds them live.
    let (loaded_a, loaded_b) = (&a.load_report().loaded, &b.load_report().loaded);
    assert!(
        (loaded_a == &coupons && b.load_report().skipped == coupons)
            || (loaded_b == &coupons && a.load_report().skipped == coupons),
        "a: {:?}, b: {:?}",
        a.load_report(),
        b.load_report()
    );

    let client = http_client(&plan).expect("client");
    let report = run_on_coupon(
        &client,
        &[a.base_url(), b.base_url()],
        strategy,
        coupons[0],
        &plan,
    )
    .await
    .expect("load run");
    assert_clean(&report);
    assert_eq!(db.order_count(coupons[0]).await.expect("count"), plan.stock);
    assert_eq!(
        db.users_with_several_orders(coupons[0])
            .await
            .expect("query"),
        0
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_with_the_script_share_one_stock() {
    bounded(Duration::from_secs(120), fleet(Strategy::Lua)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_with_the_lock_share_one_stock() {
    bounded(Duration::from_secs(120), fleet(Strategy::Lock)).await;
}
