//! The count-down latch: waiters wake on the message that opens it, not by polling;
//! Redisson's layout and messages; bad input gets a typed error.

mod common;

use std::time::{Duration, Instant};

use common::{bounded, client, raw, server};
use distlock::Error;
use futures_util::StreamExt;

const LIMIT: Duration = Duration::from_secs(30);

/// Waiters on several clients wake when the last count-down opens the latch, at once
/// (the message), and `0` is published on Redisson's channel.
#[tokio::test]
async fn waiters_wake_when_the_latch_opens() {
    let server = server().await;
    let (a, b) = (client(&server).await, client(&server).await);
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let latch = a.count_down_latch("warm").unwrap();
        assert!(latch.try_set_count(2).await.unwrap());
        assert!(!latch.try_set_count(5).await.unwrap());
        assert_eq!(latch.count().await.unwrap(), 2);
        let mut waiters = Vec::new();
        for client in [&a, &b, &b] {
            let latch = client.count_down_latch("warm").unwrap();
            waiters.push(tokio::spawn(async move {
                latch.wait().await.unwrap();
                Instant::now()
            }));
        }
        let mut listener = server.client().unwrap().get_async_pubsub().await.unwrap();
        listener
            .subscribe("redisson_countdownlatch__channel__{warm}")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(latch.count_down().await.unwrap(), 1);
        assert!(waiters.iter().all(|waiter| !waiter.is_finished()));
        let opened_at = Instant::now();
        assert_eq!(latch.count_down().await.unwrap(), 0);
        for waiter in waiters {
            let woke = waiter.await.unwrap();
            assert!(
                woke.duration_since(opened_at) < Duration::from_millis(300),
                "woken by the message: {:?}",
                woke.duration_since(opened_at)
            );
        }
        let message = listener.on_message().next().await.unwrap();
        assert_eq!(message.get_payload::<String>().unwrap(), "0");
        let exists: i64 = redis::cmd("EXISTS")
            .arg("warm")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(exists, 0, "an open latch leaves no key");
        // Counting down an open latch changes nothing.
        assert_eq!(latch.count_down().await.unwrap(), 0);
        let exists: i64 = redis::cmd("EXISTS")
            .arg("warm")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(exists, 0);
        latch.wait().await.unwrap();
    })
    .await;
}

/// A distlock waiter wakes on Redisson's countDown (DECR, then at zero DEL and `0`), and
/// `wait_for` says when the latch did not open in time.
#[tokio::test]
async fn a_redisson_count_down_opens_it_and_a_wait_can_time_out() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let latch = client.count_down_latch("jobs").unwrap();
        assert!(
            latch.wait_for(Duration::ZERO).await.unwrap(),
            "an open latch"
        );
        latch.try_set_count(1).await.unwrap();
        assert!(!latch.wait_for(Duration::from_millis(100)).await.unwrap());
        let waiter = tokio::spawn({
            let latch = latch.clone();
            async move { latch.wait_for(Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let opened_at = Instant::now();
        let _: () = redis::pipe()
            .cmd("DECR")
            .arg("jobs")
            .ignore()
            .cmd("DEL")
            .arg("jobs")
            .ignore()
            .cmd("PUBLISH")
            .arg("redisson_countdownlatch__channel__{jobs}")
            .arg("0")
            .ignore()
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(waiter.await.unwrap().unwrap());
        assert!(
            opened_at.elapsed() < Duration::from_millis(300),
            "{:?}",
            opened_at.elapsed()
        );
    })
    .await;
}

/// Bad input gets a typed error and writes nothing.
#[tokio::test]
async fn bad_input_is_a_typed_error() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    let latch = client.count_down_latch("bad").unwrap();
    assert!(matches!(
        latch.try_set_count(0).await,
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        latch.try_set_count(u64::MAX).await,
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        client.count_down_latch(""),
        Err(Error::InvalidName { .. })
    ));
    assert!(matches!(
        latch.wait_for(Duration::MAX).await,
        Err(Error::InvalidDuration { .. })
    ));
    let exists: i64 = redis::cmd("EXISTS")
        .arg("bad")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(exists, 0);
    let _: () = redis::cmd("SET")
        .arg("bad")
        .arg("lots")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(latch.count().await.is_err());
    assert!(latch.count_down().await.is_err());
    assert!(latch.wait_for(Duration::from_millis(10)).await.is_err());
}

/// Review: waiters that arrive just after the latch opened, while the woken ones are still
/// leaving, return at once: they do not queue behind them for a message already gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_arriving_at_an_open_latch_returns_at_once() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let latch = client.count_down_latch("late").unwrap();
        let mut worst = Duration::ZERO;
        for _ in 0..5 {
            latch.try_set_count(1).await.unwrap();
            let early: Vec<_> = (0..30)
                .map(|_| {
                    let latch = latch.clone();
                    tokio::spawn(async move { latch.wait_for(Duration::from_secs(5)).await })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(100)).await;
            latch.count_down().await.unwrap();
            let mut late = Vec::new();
            for _ in 0..10 {
                let latch = latch.clone();
                late.push(tokio::spawn(async move {
                    let started = Instant::now();
                    assert!(latch.wait_for(Duration::from_secs(5)).await.unwrap());
                    started.elapsed()
                }));
                tokio::task::yield_now().await;
            }
            for waiter in early {
                assert!(waiter.await.unwrap().unwrap());
            }
            for waiter in late {
                worst = worst.max(waiter.await.unwrap());
            }
        }
        assert!(
            worst < Duration::from_millis(500),
            "a late waiter took {worst:?}"
        );
    })
    .await;
}
