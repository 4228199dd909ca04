//! Per-request lock names must not grow Redis forever: after any number of names are
//! acquired and released, the keys left are bounded (one fencing counter per hash slot at
//! most, no unlock latches), while each name's tokens still strictly increase.

mod common;

use std::time::Duration;

use common::{bounded, client, eventually, raw, server};
use distlock::FencingCounter;

const LIMIT: Duration = Duration::from_secs(60);

async fn dbsize(conn: &mut redis::aio::MultiplexedConnection) -> i64 {
    redis::cmd("DBSIZE").query_async(conn).await.unwrap()
}

#[tokio::test]
async fn two_thousand_names_leave_one_counter_per_slot_and_no_latches() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        // Names of one tenant share a hash tag, hence a slot: they share one counter.
        let mut last_token = 0;
        for n in 0..2_000 {
            let lock = client.lock(format!("{{tenant-a}}:request:{n}")).unwrap();
            let guard = lock.lock().await.unwrap();
            assert!(
                guard.fencing_token() > last_token,
                "tokens go up within a slot"
            );
            last_token = guard.fencing_token();
            guard.release().await.unwrap();
        }
        let watched = conn.clone();
        eventually(Duration::from_secs(5), "unlock latches are deleted", || {
            let mut conn = watched.clone();
            async move { dbsize(&mut conn).await == 1 }
        })
        .await;
        assert_eq!(common::fencing_counters(&mut conn).await, vec![2_000]);

        // Names spread over slots: at most one counter per slot, whatever the count.
        for n in 0..2_000 {
            let guard = client
                .lock(format!("request:{n}"))
                .unwrap()
                .lock()
                .await
                .unwrap();
            guard.release().await.unwrap();
        }
        let watched = conn.clone();
        eventually(Duration::from_secs(5), "unlock latches are deleted", || {
            let mut conn = watched.clone();
            async move {
                let latches: Vec<String> = redis::cmd("KEYS")
                    .arg("redisson_unlock_latch:*")
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                latches.is_empty()
            }
        })
        .await;
        let counters = common::fencing_counters(&mut conn).await.len() as i64;
        assert!(counters <= 16_384);
        assert_eq!(dbsize(&mut conn).await, counters, "only counters are left");
    })
    .await;
}

#[tokio::test]
async fn tokens_of_one_name_strictly_increase_while_its_slot_is_shared() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let names = ["{shared}:a", "{shared}:b", "{shared}:c"];
        let mut last = [0u64; 3];
        for round in 0..60 {
            let which = round % 3;
            let guard = client.lock(names[which]).unwrap().lock().await.unwrap();
            assert!(
                guard.fencing_token() > last[which],
                "{} went backwards",
                names[which]
            );
            last[which] = guard.fencing_token();
            guard.release().await.unwrap();
        }
    })
    .await;
}

#[tokio::test]
async fn per_name_counters_remain_available_for_redisson_fenced_locks() {
    let server = server().await;
    let client = distlock::Client::builder()
        .fencing_counter(FencingCounter::PerName)
        .connect(&server.url())
        .await
        .unwrap();
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        for _ in 0..3 {
            let guard = client.lock("fenced-order").unwrap().lock().await.unwrap();
            guard.release().await.unwrap();
        }
        let counter: u64 = redis::cmd("GET")
            .arg("redisson_lock_token:{fenced-order}")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(counter, 3);
    })
    .await;
}
