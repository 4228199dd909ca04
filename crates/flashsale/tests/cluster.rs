//! flashsale on a Redis Cluster (3 masters, 3 replicas): with REDIS_URL pointing at the
//! cluster, every guarded strategy keeps every rule under the heavy load, the worker reads
//! each coupon's stream on its own node, and a loss of Redis's data is repaired from SQL.

mod common;

use std::time::Duration;

use common::{assert_clean, bounded, buy, drain, heavy_plan, open_coupon, sqlite_config, stats};
use distlock_testkit::{ClusterRole, RedisCluster};
use flashsale::load::run_against;
use flashsale::{Service, Strategy};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_guarded_strategy_keeps_the_rules_on_a_cluster() {
    let cluster = RedisCluster::start().await.expect("start cluster");
    for strategy in [Strategy::Lua, Strategy::Lock, Strategy::Segmented] {
        let dir = tempfile::tempdir().expect("dir");
        let service = Service::start(sqlite_config(strategy, &dir, Some(cluster.url())))
            .await
            .expect("start service on the cluster");
        let report = bounded(
            Duration::from_secs(120),
            run_against(&service.base_url(), strategy, &heavy_plan(150)),
        )
        .await
        .expect("load run");
        assert_clean(&report);
        service.shutdown().await;
    }
}

/// Two coupons (on different slots, so the worker reads them with one command each) sell
/// out and every order reaches SQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_stores_the_orders_of_coupons_on_different_nodes() {
    let cluster = RedisCluster::start().await.expect("start cluster");
    let dir = tempfile::tempdir().expect("dir");
    let service = Service::start(sqlite_config(Strategy::Lua, &dir, Some(cluster.url())))
        .await
        .expect("start service on the cluster");
    let (http, base) = (reqwest::Client::new(), service.base_url());
    let mut coupons = Vec::new();
    for _ in 0..4 {
        coupons.push(open_coupon(&http, &base, 10).await);
    }
    for &coupon in &coupons {
        for user in 1..=10 {
            assert_eq!(buy(&http, &base, coupon, user).await.status, 201);
        }
    }
    for &coupon in &coupons {
        let drained = bounded(Duration::from_secs(30), drain(&http, &base, coupon)).await;
        assert_eq!(drained["orders_stored"], 10, "coupon {coupon}: {drained}");
    }
    service.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_that_lost_its_data_is_reloaded_from_sql() {
    let cluster = RedisCluster::start().await.expect("start cluster");
    let dir = tempfile::tempdir().expect("dir");
    let service = Service::start(sqlite_config(Strategy::Lua, &dir, Some(cluster.url())))
        .await
        .expect("start service on the cluster");
    let (http, base) = (reqwest::Client::new(), service.base_url());
    let coupon = open_coupon(&http, &base, 50).await;
    for user in 1..=20 {
        assert_eq!(buy(&http, &base, coupon, user).await.status, 201);
    }
    let before = bounded(Duration::from_secs(30), drain(&http, &base, coupon)).await;
    assert_eq!(before["orders_stored"], 20);

    // Every master loses its data (its replicas follow).
    for node in cluster.nodes().await.expect("nodes") {
        if node.role == ClusterRole::Master {
            let mut conn = cluster.node_connection(node.index).await.expect("node");
            let _: () = redis::cmd("FLUSHALL")
                .query_async(&mut conn)
                .await
                .expect("FLUSHALL");
        }
    }

    // An earlier buyer is still refused, and exactly the rest of the stock sells.
    let again = buy(&http, &base, coupon, 1).await;
    assert_eq!(again.status, 409, "{}", again.body);
    let mut sold = 0;
    for user in 21..=80 {
        if buy(&http, &base, coupon, user).await.status == 201 {
            sold += 1;
        }
    }
    assert_eq!(sold, 30, "the reload lost or invented stock");
    let after = bounded(Duration::from_secs(30), drain(&http, &base, coupon)).await;
    assert_eq!(after["orders_stored"], 50, "{after}");
    let coupon_stats = stats(&http, &base, coupon).await;
    assert_eq!(coupon_stats["remaining"], 0, "{coupon_stats}");
    service.shutdown().await;
}
