//! A worker killed between reading order events and acknowledging them loses no order: a
//! restarted worker reclaims the pending entries (XAUTOCLAIM) and stores each one once.
//! Runs on a real PostgreSQL.

mod common;

use std::collections::BTreeSet;
use std::process::Stdio;
use std::time::Duration;

use common::{bounded, buy, open_coupon};
use distlock_testkit::{PostgresServer, RedisServer};
use flashsale::db::Db;
use flashsale::keys::{CouponKeys, ORDER_GROUP};
use flashsale::metrics::Metrics;
use flashsale::worker::{Watched, Worker, WorkerSettings};
use flashsale::{Service, ServiceConfig, Strategy};
use tokio::io::{AsyncBufReadExt, BufReader};

const CHILD_ENV: &str = "FLASHSALE_TEST_DOOMED_WORKER";

/// The consumer group's pending entries: read by a worker, not yet acknowledged.
async fn pending(
    conn: &mut redis::aio::MultiplexedConnection,
    keys: &CouponKeys,
) -> redis::streams::StreamPendingReply {
    redis::cmd("XPENDING")
        .arg(&keys.orders)
        .arg(ORDER_GROUP)
        .query_async(conn)
        .await
        .expect("xpending")
}

/// Run in a child process: reads a batch as consumer "doomed", says so, then hangs until
/// killed, never acknowledging.
#[tokio::test]
#[ignore = "child process of worker_killed_before_ack_loses_no_order"]
async fn doomed_worker() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.splitn(3, ' ');
    let (Some(redis_url), Some(db_url), Some(coupon)) = (parts.next(), parts.next(), parts.next())
    else {
        panic!("bad {CHILD_ENV}: {spec}");
    };
    let db = Db::connect(db_url).await.expect("db");
    let watched = Watched::default();
    watched.add(coupon.parse().expect("coupon id"));
    let settings = WorkerSettings {
        consumer: "doomed".into(),
        ..WorkerSettings::new()
    };
    let locks = distlock::Client::connect(redis_url)
        .await
        .expect("redis url");
    // It only reads: an admission that the store would refuse is never used.
    let tenure = flashsale::authority::Tenure::new(
        flashsale::db::Admission::unrecorded("doomed"),
        std::time::Instant::now(),
    );
    let mut worker = Worker::connect(&locks, db, tenure, settings, watched, Metrics::new())
        .await
        .expect("worker");
    loop {
        let read = worker
            .read_new(Some(Duration::from_millis(250)))
            .await
            .expect("read");
        if !read.is_empty() {
            println!("READ {}", read.len());
            break;
        }
    }
    tokio::time::sleep(Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_killed_before_ack_loses_no_order() {
    bounded(Duration::from_secs(90), async {
        let redis = RedisServer::start().await.expect("redis");
        let postgres = PostgresServer::start().await.expect("postgres");
        let mut config = ServiceConfig::new(Strategy::Lua);
        config.redis_url = Some(redis.url());
        config.database_url = Some(postgres.url());
        config.worker = None; // orders stay in the stream until a worker is started
        let service = Service::start(config).await.expect("service");
        let base = service.base_url();
        let http = reqwest::Client::new();
        let coupon = open_coupon(&http, &base, 40).await;
        let mut order_ids = BTreeSet::new();
        for user in 1..=40 {
            let answer = buy(&http, &base, coupon, user).await;
            assert_eq!(answer.status, 201, "{}", answer.body);
            order_ids.insert(
                answer.body["order_id"]
                    .as_str()
                    .expect("order id")
                    .to_owned(),
            );
        }

        // The doomed worker reads every event, then is SIGKILLed before it acknowledges.
        let mut child = tokio::process::Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "--exact",
                "doomed_worker",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(
                CHILD_ENV,
                format!("{} {} {coupon}", redis.url(), postgres.url()),
            )
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn child");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut read = 0;
        while let Some(line) = lines.next_line().await.expect("child output") {
            // libtest may print "test doomed_worker ... " on the same line first.
            if let Some((_, n)) = line.split_once("READ ") {
                read = n.trim().parse().expect("count");
                break;
            }
        }
        assert_eq!(read, 40, "the doomed worker should have read every event");
        child.kill().await.expect("SIGKILL the worker");

        let keys = Db::connect(&postgres.url())
            .await
            .expect("db")
            .keyspace()
            .coupon(coupon);
        let mut conn = redis.connection().await.expect("redis");
        let stuck = pending(&mut conn, &keys).await;
        assert_eq!(
            stuck.count(),
            40,
            "the killed worker's entries stay pending"
        );
        assert_eq!(service.db().order_count(coupon).await.expect("count"), 0);

        // A new worker, with a short reclaim idle, takes them over.
        let db = Db::connect(&postgres.url()).await.expect("db");
        let watched = Watched::default();
        watched.add(coupon);
        let metrics = Metrics::new();
        let settings = WorkerSettings {
            reclaim_idle: Duration::from_millis(300),
            ..WorkerSettings::new()
        };
        let locks = distlock::Client::connect(&redis.url())
            .await
            .expect("connect");
        let tenure = flashsale::authority::Tenure::new(
            service.admission().clone(),
            std::time::Instant::now(),
        );
        let worker = Worker::connect(
            &locks,
            db.clone(),
            tenure,
            settings,
            watched,
            metrics.clone(),
        )
        .await
        .expect("worker");
        let stop = tokio_util::sync::CancellationToken::new();
        let running = tokio::spawn(worker.run(stop.clone()));
        while db.order_count(coupon).await.expect("count") < 40 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.cancel();
        running.await.expect("worker task");

        assert_eq!(metrics.orders_reclaimed.get(), 40);
        let stored: BTreeSet<String> = db
            .buyers(coupon)
            .await
            .expect("buyers")
            .into_iter()
            .map(|(user, _order)| user.to_string())
            .collect();
        assert_eq!(stored.len(), 40);
        let mut stored_orders = BTreeSet::new();
        for user in 1..=40 {
            for order in db.user_orders(user).await.expect("orders") {
                stored_orders.insert(order.order_id);
            }
        }
        assert_eq!(
            stored_orders, order_ids,
            "exactly the sold orders are stored"
        );
        assert_eq!(pending(&mut conn, &keys).await.count(), 0);
        service.shutdown().await;
    })
    .await;
}

/// A read whose reply is lost still delivers: Redis puts the entries in this consumer's
/// pending list. The shutdown drain must store them too, not stop at the first round
/// that finds nothing new (found by review: 8 of 400 orders told 201 were not in SQL
/// after a clean SIGTERM, until the next start reclaimed them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_of_a_read_whose_reply_was_lost_are_stored_before_exit() {
    bounded(Duration::from_secs(60), async {
        let redis = RedisServer::start().await.expect("redis");
        let dir = tempfile::tempdir().expect("dir");
        let mut config = common::sqlite_config(Strategy::Lua, &dir, Some(redis.url()));
        config.worker = None;
        let service = Service::start(config).await.expect("service");
        let (client, base) = (reqwest::Client::new(), service.base_url());
        let coupon = open_coupon(&client, &base, 10).await;
        for user in 1..=5 {
            assert_eq!(buy(&client, &base, coupon, user).await.status, 201);
        }
        let watched = Watched::default();
        watched.add(coupon);
        let locks = distlock::Client::connect(&redis.url())
            .await
            .expect("connect");
        let tenure = flashsale::authority::Tenure::new(
            service.admission().clone(),
            std::time::Instant::now(),
        );
        let mut worker = Worker::connect(
            &locks,
            service.db().clone(),
            tenure,
            WorkerSettings::new(),
            watched,
            Metrics::new(),
        )
        .await
        .expect("worker");
        // Delivered, and the reply never reaches the worker's loop.
        let lost = worker.read_new(None).await.expect("read");
        assert_eq!(lost.len(), 5);
        let stop = tokio_util::sync::CancellationToken::new();
        stop.cancel();
        worker.run(stop).await;
        assert_eq!(service.db().order_count(coupon).await.expect("count"), 5);
        service.shutdown().await;
    })
    .await;
}
