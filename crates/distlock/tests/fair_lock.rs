//! The fair lock: first come, first served across clients, a release that hands the lock
//! straight to the head of the queue, waiters that give up or die leaving nothing behind,
//! and a queue shared with Redisson's waiters (keys, channels and messages as Redisson's
//! scripts read and write them; ../shared/reference/redisson-layout.md).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{bounded, client, client_with_watchdog, eventually, raw, server};
use distlock_testkit::ExclusionChecker;
use futures_util::StreamExt;
use tokio::sync::Mutex;

const LIMIT: Duration = Duration::from_secs(30);

fn queue(name: &str) -> String {
    format!("redisson_lock_queue:{{{name}}}")
}

fn timeouts(name: &str) -> String {
    format!("redisson_lock_timeout:{{{name}}}")
}

fn waiters(name: &str) -> String {
    format!("distlock_fair_waiters:{{{name}}}")
}

async fn queue_length(conn: &mut redis::aio::MultiplexedConnection, name: &str) -> usize {
    redis::cmd("LLEN")
        .arg(queue(name))
        .query_async(conn)
        .await
        .expect("LLEN")
}

/// Waits until `count` waiters are queued for `name`.
async fn until_queued(conn: &redis::aio::MultiplexedConnection, name: &str, count: usize) {
    let what = format!("{count} waiter(s) queued for {name}");
    eventually(Duration::from_secs(10), &what, || {
        let mut conn = conn.clone();
        let name = name.to_owned();
        async move { queue_length(&mut conn, &name).await == count }
    })
    .await;
}

/// Whether any of the queue's keys is still in Redis.
async fn queue_keys_left(conn: &mut redis::aio::MultiplexedConnection, name: &str) -> i64 {
    redis::cmd("EXISTS")
        .arg(queue(name))
        .arg(timeouts(name))
        .arg(waiters(name))
        .query_async(conn)
        .await
        .expect("EXISTS")
}

async fn server_time_ms(conn: &mut redis::aio::MultiplexedConnection) -> i64 {
    let (seconds, micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await.expect("TIME");
    seconds * 1000 + micros / 1000
}

/// Waiters that queued one after another, on several clients, get the lock in that order.
#[tokio::test]
async fn waiters_get_the_lock_in_the_order_they_queued() {
    let server = server().await;
    let clients = [
        client(&server).await,
        client(&server).await,
        client(&server).await,
    ];
    let conn = raw(&server).await;
    bounded(LIMIT, async {
        let holder = clients[0].fair_lock("fifo").unwrap().lock().await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for n in 0..6 {
            let lock = clients[n % clients.len()].fair_lock("fifo").unwrap();
            let order = Arc::clone(&order);
            tasks.push(tokio::spawn(async move {
                let guard = lock.lock().await.unwrap();
                order.lock().await.push(n);
                guard.release().await.unwrap();
            }));
            // The next one asks only once this one is in the queue.
            until_queued(&conn, "fifo", n + 1).await;
        }
        holder.release().await.unwrap();
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(*order.lock().await, [0, 1, 2, 3, 4, 5]);
    })
    .await;
}

/// The release script itself gives the lock to the waiter at the head: when the release
/// returns, the waiter's owner already holds it and the queue is empty, before the waiter
/// has sent anything.
#[tokio::test]
async fn a_release_hands_the_lock_to_the_head_of_the_queue() {
    let server = server().await;
    let (a, b) = (client(&server).await, client(&server).await);
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let held = a.fair_lock("handoff").unwrap().lock().await.unwrap();
        let lock = b.fair_lock("handoff").unwrap();
        let waiting = tokio::spawn(async move { lock.lock().await });
        until_queued(&conn, "handoff", 1).await;
        let token = held.fencing_token();
        let owner = held.owner().to_owned();
        // Stall the waiter's client so that it cannot send anything after the release.
        b.stall_background_for_tests(Duration::from_millis(300));
        held.release().await.unwrap();
        let fields: Vec<String> = redis::cmd("HKEYS")
            .arg("handoff")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(fields.len(), 1, "{fields:?}");
        assert_ne!(fields[0], owner, "the releaser still holds it");
        assert_eq!(queue_length(&mut conn, "handoff").await, 0);
        let granted = waiting.await.unwrap().unwrap();
        assert_eq!(granted.owner(), fields[0]);
        assert!(granted.fencing_token() > token);
        assert!(!granted.is_lost());
        assert!(granted.verify().await.unwrap());
        granted.release().await.unwrap();
        assert_eq!(queue_keys_left(&mut conn, "handoff").await, 0);
    })
    .await;
}

/// A waiter that times out leaves the queue before its call returns, and the keys of an
/// empty queue are gone (Redisson's leave queue entries behind after a `tryLock` timeout).
#[tokio::test]
async fn a_timed_out_waiter_leaves_no_queue_entry_behind() {
    let server = server().await;
    let (a, b) = (client(&server).await, client(&server).await);
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let held = a.fair_lock("timeout").unwrap().lock().await.unwrap();
        let lock = b.fair_lock("timeout").unwrap();
        let missed = lock.try_lock_for(Duration::from_millis(150)).await.unwrap();
        assert!(missed.is_none());
        assert_eq!(queue_keys_left(&mut conn, "timeout").await, 0);
        // try_lock never queues.
        assert!(lock.try_lock().await.unwrap().is_none());
        assert_eq!(queue_keys_left(&mut conn, "timeout").await, 0);
        held.release().await.unwrap();
        let free = lock
            .try_lock()
            .await
            .unwrap()
            .expect("free and nobody queued");
        free.release().await.unwrap();
    })
    .await;
}

/// A waiter whose future is dropped leaves the queue, and the next waiter moves up.
#[tokio::test]
async fn a_cancelled_waiter_leaves_the_queue() {
    let server = server().await;
    let (a, b) = (client(&server).await, client(&server).await);
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let held = a.fair_lock("cancel").unwrap().lock().await.unwrap();
        let lock = b.fair_lock("cancel").unwrap();
        let first = tokio::spawn({
            let lock = lock.clone();
            async move { lock.lock().await }
        });
        until_queued(&conn, "cancel", 1).await;
        let second = tokio::spawn({
            let lock = lock.clone();
            async move { lock.lock().await }
        });
        until_queued(&conn, "cancel", 2).await;
        first.abort();
        until_queued(&conn, "cancel", 1).await;
        held.release().await.unwrap();
        let guard = second.await.unwrap().unwrap();
        guard.release().await.unwrap();
        assert_eq!(queue_keys_left(&mut conn, "cancel").await, 0);
    })
    .await;
}

/// A waiter that gives up after the lock was granted to it, before it read the grant,
/// gives the lock on to the next waiter instead of stranding it until its lease ends.
#[tokio::test]
async fn a_grant_to_a_waiter_that_gave_up_goes_to_the_next_one() {
    let server = server().await;
    let holder = client(&server).await;
    let quitter = client(&server).await;
    let patient = client(&server).await;
    let conn = raw(&server).await;
    bounded(LIMIT, async {
        let held = holder.fair_lock("regrant").unwrap().lock().await.unwrap();
        let giving_up = tokio::spawn({
            let lock = quitter.fair_lock("regrant").unwrap();
            async move { lock.lock().await }
        });
        until_queued(&conn, "regrant", 1).await;
        let next = tokio::spawn({
            let lock = patient.fair_lock("regrant").unwrap();
            async move { lock.lock().await }
        });
        until_queued(&conn, "regrant", 2).await;
        // The quitter's client cannot read its grant, nor leave, until the stall ends.
        quitter.stall_background_for_tests(Duration::from_millis(500));
        held.release().await.unwrap();
        giving_up.abort();
        let guard = next.await.unwrap().unwrap();
        assert!(guard.verify().await.unwrap());
        guard.release().await.unwrap();
    })
    .await;
}

/// A killed waiter (its entry no longer refreshed) is dropped from the queue by its
/// deadline, and one whose entry has no deadline at all does not break the scripts
/// (Redisson's compare it with nil and fail). Neither holds up the waiter behind.
#[tokio::test]
async fn dead_and_broken_queue_entries_do_not_hold_up_the_queue() {
    let server = server().await;
    let (a, b) = (client(&server).await, client(&server).await);
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let held = a.fair_lock("stale").unwrap().lock().await.unwrap();
        let now = server_time_ms(&mut conn).await;
        // A distlock waiter that died 300 ms from now, and an entry without a score.
        let _: () = redis::pipe()
            .cmd("RPUSH")
            .arg(queue("stale"))
            .arg("dead:1")
            .arg("broken:1")
            .cmd("ZADD")
            .arg(timeouts("stale"))
            .arg(now + 300)
            .arg("dead:1")
            .cmd("HSET")
            .arg(waiters("stale"))
            .arg("dead:1")
            .arg(60_000)
            .query_async(&mut conn)
            .await
            .unwrap();
        let lock = b.fair_lock("stale").unwrap();
        let waiting = tokio::spawn(async move { lock.lock().await });
        until_queued(&conn, "stale", 3).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        let released_at = std::time::Instant::now();
        held.release().await.unwrap();
        let guard = waiting.await.unwrap().unwrap();
        assert!(
            released_at.elapsed() < Duration::from_secs(2),
            "waited {:?} behind dead entries",
            released_at.elapsed()
        );
        guard.release().await.unwrap();
        assert_eq!(queue_keys_left(&mut conn, "stale").await, 0);
    })
    .await;
}

/// A grant to a waiter that died right after it last refreshed its place frees itself at
/// the end of the lease the waiter registered, and the next waiter gets the lock then.
#[tokio::test]
async fn a_grant_to_a_dead_waiter_is_bounded_by_its_lease() {
    let server = server().await;
    let (a, b) = (client(&server).await, client(&server).await);
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let held = a.fair_lock("dead-grant").unwrap().lock().await.unwrap();
        let now = server_time_ms(&mut conn).await;
        // Alive for another 5 s by its score, with a 300 ms lease: it will be granted.
        let _: () = redis::pipe()
            .cmd("RPUSH")
            .arg(queue("dead-grant"))
            .arg("dead:1")
            .cmd("ZADD")
            .arg(timeouts("dead-grant"))
            .arg(now + 5000)
            .arg("dead:1")
            .cmd("HSET")
            .arg(waiters("dead-grant"))
            .arg("dead:1")
            .arg(300)
            .query_async(&mut conn)
            .await
            .unwrap();
        let lock = b.fair_lock("dead-grant").unwrap();
        let waiting = tokio::spawn(async move { lock.lock().await });
        until_queued(&conn, "dead-grant", 2).await;
        held.release().await.unwrap();
        let owner: Vec<String> = redis::cmd("HKEYS")
            .arg("dead-grant")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(owner, ["dead:1"], "granted to the head");
        let guard = waiting.await.unwrap().unwrap();
        guard.release().await.unwrap();
    })
    .await;
}

/// The queue is Redisson's: a Redisson waiter at the head (in the list and the sorted
/// set, not in distlock's waiters) is told `0` on its own channel and not given the lock;
/// its acquisition then takes it as Redisson's script does, and a distlock waiter behind
/// it is woken by Redisson's release (`0` on the distlock waiter's channel).
#[tokio::test]
async fn a_mixed_queue_follows_redissons_protocol() {
    let server = server().await;
    let (a, b) = (client(&server).await, client(&server).await);
    let mut conn = raw(&server).await;
    let redisson = "11111111-2222-3333-4444-555555555555:77";
    bounded(LIMIT, async {
        let held = a.fair_lock("mixed").unwrap().lock().await.unwrap();
        // A Redisson waiter queues as its acquire script does: at the back, scored with
        // the previous deadline (here the lock's) plus its 300 s wait.
        let now = server_time_ms(&mut conn).await;
        let _: () = redis::pipe()
            .cmd("RPUSH")
            .arg(queue("mixed"))
            .arg(redisson)
            .cmd("ZADD")
            .arg(timeouts("mixed"))
            .arg(now + 330_000)
            .arg(redisson)
            .query_async(&mut conn)
            .await
            .unwrap();
        let lock = b.fair_lock("mixed").unwrap();
        let waiting = tokio::spawn(async move { lock.lock().await });
        until_queued(&conn, "mixed", 2).await;
        let redisson_channel = format!("redisson_lock__channel:{{mixed}}:{redisson}");
        let mut listener = server.client().unwrap().get_async_pubsub().await.unwrap();
        listener.subscribe(&redisson_channel).await.unwrap();
        held.release().await.unwrap();
        let told = listener.on_message().next().await.unwrap();
        assert_eq!(told.get_payload::<String>().unwrap(), "0");
        let exists: i64 = redis::cmd("EXISTS")
            .arg("mixed")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(exists, 0, "a Redisson waiter is not granted the lock");
        // Redisson's acquisition at the head: pop itself, take the hold and the lease,
        // and lower the scores of those behind by its wait.
        let behind: Vec<String> = redis::cmd("LRANGE")
            .arg(queue("mixed"))
            .arg(1)
            .arg(-1)
            .query_async(&mut conn)
            .await
            .unwrap();
        let mut take = redis::pipe();
        take.cmd("LPOP").arg(queue("mixed"));
        take.cmd("ZREM").arg(timeouts("mixed")).arg(redisson);
        for waiter in &behind {
            take.cmd("ZINCRBY")
                .arg(timeouts("mixed"))
                .arg(-300_000)
                .arg(waiter);
        }
        take.cmd("HSET").arg("mixed").arg(redisson).arg(1);
        take.cmd("PEXPIRE").arg("mixed").arg(30_000);
        let _: () = take.query_async(&mut conn).await.unwrap();
        // The distlock waiter stays queued behind the Redisson holder (its refreshes put
        // its own score back), and does not take the lock.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(queue_length(&mut conn, "mixed").await, 1);
        assert!(!waiting.is_finished());
        // Redisson's release: DEL, then `0` to the head waiter's channel.
        let head: String = redis::cmd("LINDEX")
            .arg(queue("mixed"))
            .arg(0)
            .query_async(&mut conn)
            .await
            .unwrap();
        let released_at = std::time::Instant::now();
        let _: () = redis::pipe()
            .cmd("DEL")
            .arg("mixed")
            .cmd("PUBLISH")
            .arg(format!("redisson_lock__channel:{{mixed}}:{head}"))
            .arg("0")
            .query_async(&mut conn)
            .await
            .unwrap();
        let guard = waiting.await.unwrap().unwrap();
        assert!(
            released_at.elapsed() < Duration::from_millis(200),
            "woken by the message, not by its next refresh: {:?}",
            released_at.elapsed()
        );
        guard.release().await.unwrap();
    })
    .await;
}

/// Contenders on several clients never overlap, tokens strictly increase, and every
/// contender gets its turn: nobody is overtaken by a waiter that queued after it.
#[tokio::test]
async fn contenders_never_overlap_and_take_turns() {
    let server = server().await;
    let clients = [
        client_with_watchdog(&server, Duration::from_secs(2)).await,
        client_with_watchdog(&server, Duration::from_secs(2)).await,
    ];
    let checker = Arc::new(ExclusionChecker::new());
    let rounds = 15;
    bounded(LIMIT, async {
        let mut tasks = Vec::new();
        for n in 0..8 {
            let lock = clients[n % 2].fair_lock("turns").unwrap();
            let checker = Arc::clone(&checker);
            tasks.push(tokio::spawn(async move {
                let mut count = 0;
                for _ in 0..rounds {
                    let guard = lock.lock().await.unwrap();
                    let hold = checker.enter(guard.fencing_token(), format!("task {n}"));
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    hold.finish();
                    guard.release().await.unwrap();
                    count += 1;
                }
                count
            }));
        }
        for task in tasks {
            assert_eq!(task.await.unwrap(), rounds);
        }
    })
    .await;
    let report = checker.report();
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.holds, 8 * rounds);
}
