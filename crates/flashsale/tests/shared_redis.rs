//! One Redis shared by stores that have nothing to do with each other: two services with
//! their own databases, or a `load` run beside a `serve`. Their coupon ids collide (each
//! database counts from 1), so only the namespace in every key keeps them apart.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{bounded, buy, drain, open_coupon, sqlite_config};
use distlock_testkit::RedisServer;
use flashsale::{Service, Strategy};

async fn order_ids(service: &Service, coupon: i64) -> BTreeSet<String> {
    service
        .db()
        .coupon_orders(coupon)
        .await
        .expect("orders")
        .into_iter()
        .map(|order| order.order_id)
        .collect()
}

async fn two_services_on_one_redis(strategy: Strategy) {
    bounded(Duration::from_secs(60), async {
        let redis = RedisServer::start().await.expect("redis");
        let (dir_a, dir_b) = (
            tempfile::tempdir().expect("a"),
            tempfile::tempdir().expect("b"),
        );
        let a = Service::start(sqlite_config(strategy, &dir_a, Some(redis.url())))
            .await
            .expect("service a");
        let b = Service::start(sqlite_config(strategy, &dir_b, Some(redis.url())))
            .await
            .expect("service b");
        let http = reqwest::Client::new();
        let coupon_a = open_coupon(&http, &a.base_url(), 10).await;
        let coupon_b = open_coupon(&http, &b.base_url(), 10).await;
        assert_eq!(coupon_a, coupon_b, "the premise: both stores number from 1");
        let coupon = coupon_a;

        for service in [&a, &b] {
            for user in 1..=10 {
                let answer = buy(&http, &service.base_url(), coupon, user).await;
                assert_eq!(answer.status, 201, "user {user}: {}", answer.body);
            }
            let answer = buy(&http, &service.base_url(), coupon, 11).await;
            assert_eq!(answer.body["error"], "sold_out", "{}", answer.body);
        }
        let stats_a = drain(&http, &a.base_url(), coupon).await;
        let stats_b = drain(&http, &b.base_url(), coupon).await;
        for stats in [&stats_a, &stats_b] {
            assert_eq!(stats["sold"], 10, "{stats}");
            assert_eq!(stats["orders_stored"], 10, "{stats}");
        }
        let (orders_a, orders_b) = (order_ids(&a, coupon).await, order_ids(&b, coupon).await);
        assert_eq!((orders_a.len(), orders_b.len()), (10, 10));
        assert!(
            orders_a.is_disjoint(&orders_b),
            "one store's orders were written into the other's SQL"
        );
        assert_ne!(a.db().keyspace(), b.db().keyspace());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_databases_on_one_redis_never_share_a_counter_buyers_or_stream_lua() {
    two_services_on_one_redis(Strategy::Lua).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_databases_on_one_redis_never_share_a_counter_buyers_or_stream_lock() {
    two_services_on_one_redis(Strategy::Lock).await;
}

/// The namespace is created with the schema and kept in SQL: a restart on the same
/// database finds its own keys again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_namespace_is_stored_with_the_database_and_kept_across_restarts() {
    bounded(Duration::from_secs(60), async {
        let redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let first = Service::start(sqlite_config(Strategy::Lua, &dir, Some(redis.url())))
            .await
            .expect("start");
        let keyspace = first.db().keyspace().clone();
        assert!(keyspace.namespace().len() >= 16, "{keyspace:?}");
        first.shutdown().await;
        let second = Service::start(sqlite_config(Strategy::Lua, &dir, Some(redis.url())))
            .await
            .expect("restart");
        assert_eq!(second.db().keyspace(), &keyspace);
    })
    .await;
}
