//! The semaphore: never more holders than permits, across clients; waiters woken by the
//! free count a release publishes; local waiters served in arrival order with their
//! permit counts; cancellation leaves no permit taken; Redisson's layout and messages.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bounded, client, raw, server};
use distlock::{Error, PermitsSet};
use futures_util::StreamExt;

const LIMIT: Duration = Duration::from_secs(30);

/// N+1 contenders on two clients never hold more than N permits at once, counted by a
/// checker of their own, and every contender gets its turns.
#[tokio::test]
async fn contenders_never_hold_more_permits_than_there_are() {
    let server = server().await;
    let clients = [client(&server).await, client(&server).await];
    assert!(clients[0]
        .semaphore("pool")
        .unwrap()
        .try_set_permits(3)
        .await
        .unwrap()
        .is_set());
    let holding = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    bounded(LIMIT, async {
        let mut tasks = Vec::new();
        for n in 0..4 {
            let semaphore = clients[n % 2].semaphore("pool").unwrap();
            let (holding, most) = (Arc::clone(&holding), Arc::clone(&most));
            tasks.push(tokio::spawn(async move {
                for _ in 0..20 {
                    let permits = semaphore.acquire(1).await.unwrap();
                    let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    holding.fetch_sub(1, Ordering::SeqCst);
                    permits.release().await.unwrap();
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
    })
    .await;
    assert!(
        most.load(Ordering::SeqCst) <= 3,
        "{} held at once",
        most.load(Ordering::SeqCst)
    );
    assert_eq!(
        most.load(Ordering::SeqCst),
        3,
        "the permits were never all in use"
    );
    let semaphore = clients[0].semaphore("pool").unwrap();
    assert_eq!(semaphore.available_permits().await.unwrap(), 3);
}

/// A waiter asking for 3 permits is not passed by waiters of the same client asking for
/// 1 that came after it, when permits come back one at a time.
#[tokio::test]
async fn a_waiter_asking_for_several_permits_is_not_starved() {
    let server = server().await;
    let client = client(&server).await;
    let semaphore = client.semaphore("batch").unwrap();
    assert!(semaphore.try_set_permits(3).await.unwrap().is_set());
    bounded(LIMIT, async {
        let all = semaphore.acquire(3).await.unwrap();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let big = tokio::spawn({
            let (semaphore, order) = (semaphore.clone(), Arc::clone(&order));
            async move {
                let permits = semaphore.acquire(3).await.unwrap();
                order.lock().unwrap().push("three");
                permits.release().await.unwrap();
            }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut small = Vec::new();
        for _ in 0..3 {
            let (semaphore, order) = (semaphore.clone(), Arc::clone(&order));
            small.push(tokio::spawn(async move {
                let permits = semaphore.acquire(1).await.unwrap();
                order.lock().unwrap().push("one");
                permits.release().await.unwrap();
            }));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        all.forget();
        for _ in 0..3 {
            semaphore.release(1).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        big.await.unwrap();
        for task in small {
            task.await.unwrap();
        }
        assert_eq!(
            order.lock().unwrap()[0],
            "three",
            "{:?}",
            order.lock().unwrap()
        );
    })
    .await;
}

/// Acquisitions cancelled while waiting, and ones whose future is dropped mid-attempt,
/// leave no permit taken; a dropped guard gives its permits back; a forgotten one keeps
/// them.
#[tokio::test]
async fn cancellation_leaves_no_permit_taken() {
    let server = server().await;
    let client = client(&server).await;
    let semaphore = client.semaphore("cancel").unwrap();
    assert!(semaphore.try_set_permits(2).await.unwrap().is_set());
    bounded(LIMIT, async {
        let held = semaphore.acquire(2).await.unwrap();
        // Waiting, then cancelled.
        assert!(
            tokio::time::timeout(Duration::from_millis(50), semaphore.acquire(1))
                .await
                .is_err()
        );
        held.release().await.unwrap();
        // Dropped at every point of an acquisition that would succeed.
        for micros in [0u64, 50, 100, 200, 400, 800, 1600] {
            let attempt = tokio::time::timeout(Duration::from_micros(micros), semaphore.acquire(2));
            drop(attempt.await);
            common::eventually(Duration::from_secs(5), "the permits are back", || {
                let semaphore = semaphore.clone();
                async move { semaphore.available_permits().await.unwrap() == 2 }
            })
            .await;
        }
        drop(semaphore.acquire(1).await.unwrap());
        common::eventually(Duration::from_secs(5), "a dropped guard gave back", || {
            let semaphore = semaphore.clone();
            async move { semaphore.available_permits().await.unwrap() == 2 }
        })
        .await;
        semaphore.acquire(1).await.unwrap().forget();
        assert_eq!(semaphore.available_permits().await.unwrap(), 1);
        assert_eq!(semaphore.drain_permits().await.unwrap(), 1);
        assert_eq!(semaphore.available_permits().await.unwrap(), 0);
    })
    .await;
}

/// The layout is Redisson's: the free count at the name; a release publishes the new
/// count on `redisson_sc:{name}`; Redisson's release (INCRBY, then the count published)
/// wakes a distlock waiter at once.
#[tokio::test]
async fn follows_redissons_layout_and_messages() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let semaphore = client.semaphore("shared").unwrap();
        assert!(semaphore.try_set_permits(1).await.unwrap().is_set());
        assert_eq!(
            semaphore.try_set_permits(5).await.unwrap(),
            PermitsSet::Kept { found: 1 }
        );
        let stored: String = redis::cmd("GET")
            .arg("shared")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(stored, "1");
        let mut listener = server.client().unwrap().get_async_pubsub().await.unwrap();
        listener.subscribe("redisson_sc:{shared}").await.unwrap();
        let permits = semaphore.acquire(1).await.unwrap();
        permits.release().await.unwrap();
        let message = listener.on_message().next().await.unwrap();
        assert_eq!(message.get_payload::<String>().unwrap(), "1");
        // Redisson takes the permit, then gives it back its own way.
        let _: i64 = redis::cmd("DECRBY")
            .arg("shared")
            .arg(1)
            .query_async(&mut conn)
            .await
            .unwrap();
        let waiting = tokio::spawn({
            let semaphore = semaphore.clone();
            async move { semaphore.acquire(1).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let released_at = Instant::now();
        let _: () = redis::pipe()
            .cmd("INCRBY")
            .arg("shared")
            .arg(1)
            .ignore()
            .cmd("PUBLISH")
            .arg("redisson_sc:{shared}")
            .arg("1")
            .ignore()
            .query_async(&mut conn)
            .await
            .unwrap();
        let permits = waiting.await.unwrap().unwrap();
        assert!(
            released_at.elapsed() < Duration::from_millis(300),
            "woken by the message: {:?}",
            released_at.elapsed()
        );
        permits.release().await.unwrap();
    })
    .await;
}

/// Bad input gets a typed error and writes nothing.
#[tokio::test]
async fn bad_input_is_a_typed_error() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    let semaphore = client.semaphore("bad").unwrap();
    assert!(matches!(
        semaphore.acquire(0).await,
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        semaphore.try_acquire(0).await,
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        semaphore.release(0).await,
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        semaphore.try_set_permits(-1).await,
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        client.semaphore(""),
        Err(Error::InvalidName { .. })
    ));
    let exists: i64 = redis::cmd("EXISTS")
        .arg("bad")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(exists, 0);
    // A key that is not a permit count.
    let _: () = redis::cmd("SET")
        .arg("bad")
        .arg("many")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(semaphore.try_acquire(1).await.is_err());
    assert!(semaphore.available_permits().await.is_err());
    assert!(semaphore.release(1).await.is_err());
    let stored: String = redis::cmd("GET")
        .arg("bad")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(stored, "many");
}

/// Review: permits given back on a connection the server just dropped (a failover, a
/// proxy, CLIENT KILL) are sent again, once, under a latch that keeps the first answer:
/// they come back, and only once.
#[tokio::test]
async fn permits_given_back_on_a_dropped_connection_come_back_once() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let semaphore = client.semaphore("dropped").unwrap();
        assert!(semaphore.try_set_permits(2).await.unwrap().is_set());
        let released = semaphore.acquire(1).await.unwrap();
        let dropped = semaphore.acquire(1).await.unwrap();
        let kill = || {
            redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("normal")
                .arg("SKIPME")
                .arg("yes")
                .clone()
        };
        let _: i64 = kill().query_async(&mut conn).await.unwrap();
        released.release().await.unwrap();
        let _: i64 = kill().query_async(&mut conn).await.unwrap();
        drop(dropped);
        common::eventually(Duration::from_secs(5), "both permits back", || {
            let semaphore = semaphore.clone();
            async move { semaphore.available_permits().await.unwrap() == 2 }
        })
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            semaphore.available_permits().await.unwrap(),
            2,
            "a permit came back twice"
        );
    })
    .await;
}

/// Review: draining a key that holds something else than a whole count is refused, and
/// the key is left as it was.
#[tokio::test]
async fn draining_garbage_is_refused() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    let semaphore = client.semaphore("junk").unwrap();
    for junk in ["1e3", "0x10", " 7", "1.5", "nan", "inf"] {
        let _: () = redis::cmd("SET")
            .arg("junk")
            .arg(junk)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(semaphore.drain_permits().await.is_err(), "{junk}");
        assert!(semaphore.try_acquire(1).await.is_err(), "{junk}");
        let stored: String = redis::cmd("GET")
            .arg("junk")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(stored, junk);
    }
}

/// Review: a waiter behind a head that asks for more than is free does not pass it on
/// its fallback timer either: arrival order within a client is strict, as tokio's
/// semaphore's is. The head still looks by itself, and gets its permits once they come.
#[tokio::test]
async fn a_waiter_behind_the_head_never_passes_it_on_a_timer() {
    let server = server().await;
    let (a, b) = (client(&server).await, client(&server).await);
    bounded(LIMIT, async {
        let semaphore = a.semaphore("strict").unwrap();
        assert!(semaphore.try_set_permits(0).await.unwrap().is_set());
        let big = tokio::spawn({
            let semaphore = semaphore.clone();
            async move { semaphore.acquire(3).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let small = tokio::spawn({
            let semaphore = semaphore.clone();
            async move { semaphore.acquire(1).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        b.semaphore("strict").unwrap().release(2).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert!(
            !small.is_finished(),
            "a later, smaller waiter passed the head"
        );
        assert_eq!(semaphore.available_permits().await.unwrap(), 2);
        b.semaphore("strict").unwrap().release(1).await.unwrap();
        let permits = big.await.unwrap().unwrap();
        assert_eq!(permits.permits(), 3);
        permits.release().await.unwrap();
        small.await.unwrap().unwrap().release().await.unwrap();
    })
    .await;
}

/// Issue 30, 4.3: `try_set_permits(3)` on a semaphore that already had a count kept the
/// earlier count, and said only `false`, which compiled unread. It now says what it kept:
/// the free count it found (a plain semaphore keeps no other), and the result must be
/// used. Every count is an `i64`, so what is asked, held and read compare directly.
#[tokio::test]
async fn try_set_permits_says_which_count_it_kept() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let semaphore = client.semaphore("kept").unwrap();
        assert_eq!(semaphore.try_set_permits(2).await.unwrap(), PermitsSet::Set);
        assert_eq!(
            semaphore.try_set_permits(3).await.unwrap(),
            PermitsSet::Kept { found: 2 }
        );
        let asked: i64 = 2;
        let permits = semaphore.acquire(asked).await.unwrap();
        assert_eq!(permits.permits(), asked);
        // Taken permits are not in a plain semaphore's count: it finds 0 free.
        let kept = semaphore.try_set_permits(3).await.unwrap();
        assert_eq!(kept, PermitsSet::Kept { found: 0 });
        assert!(!kept.is_set());
        // Below zero, as Redisson's reducePermits can leave it, and read back as such.
        assert_eq!(semaphore.add_permits(-1).await.unwrap(), -1);
        assert_eq!(
            semaphore.try_set_permits(3).await.unwrap(),
            PermitsSet::Kept { found: -1 }
        );
        assert_eq!(semaphore.available_permits().await.unwrap(), -1);
        permits.release().await.unwrap();
        assert_eq!(semaphore.available_permits().await.unwrap(), 1);
        // Asks below 1 and negative counts are typed errors.
        for bad in [0, -1] {
            assert!(matches!(
                semaphore.acquire(bad).await,
                Err(Error::InvalidArgument { .. })
            ));
        }
        assert!(matches!(
            client.semaphore("fresh").unwrap().try_set_permits(-2).await,
            Err(Error::InvalidArgument { .. })
        ));
    })
    .await;
}
