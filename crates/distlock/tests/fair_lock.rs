//! The fair lock: first come, first served across clients, a release that hands the lock
//! straight to the head of the queue, waiters that give up or die leaving nothing behind,
//! and a queue shared with Redisson's waiters (keys, channels and messages as Redisson's
//! scripts read and write them; ../shared/reference/redisson-layout.md).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::redisson_fair::{
    assert_entry_outlasted, queue, queued, redisson_acquire, score_left_ms, server_time_ms,
    timeouts, waiters, REDISSON_FAIR_GIVE_UP,
};
use common::{bounded, client, client_with_watchdog, eventually, raw, server};
use distlock_testkit::ExclusionChecker;
use futures_util::StreamExt;
use tokio::sync::Mutex;

const LIMIT: Duration = Duration::from_secs(30);

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

/// A task that waits for the fair lock `name` on `client`.
fn wait_for(
    client: &distlock::Client,
    name: &str,
) -> tokio::task::JoinHandle<distlock::Result<distlock::LockGuard>> {
    let lock = client.fair_lock(name).expect("a fair lock handle");
    tokio::spawn(async move { lock.lock().await })
}

/// A task that waits for the fair lock through `lock` (a handle the caller keeps).
fn waiting_on(
    lock: &distlock::FairLock,
) -> tokio::task::JoinHandle<distlock::Result<distlock::LockGuard>> {
    let lock = lock.clone();
    tokio::spawn(async move { lock.lock().await })
}

/// A fault proxy in front of `server`, and a client `builder` connects through it.
async fn behind_a_proxy(
    server: &distlock_testkit::RedisServer,
    builder: distlock::ClientBuilder,
) -> (distlock_testkit::FaultProxy, distlock::Client) {
    let proxy = distlock_testkit::FaultProxy::in_front_of(server)
        .await
        .expect("start proxy");
    let client = builder
        .connect(&proxy.url())
        .await
        .expect("connect through the proxy");
    (proxy, client)
}

/// Waits at most `limit` for the Redisson waiter listening on `listener` to be told its
/// turn (`0` on its own channel).
async fn told_its_turn(listener: &mut redis::aio::PubSub, limit: Duration) {
    let told = tokio::time::timeout(limit, listener.on_message().next())
        .await
        .expect("the Redisson waiter was told its turn")
        .expect("a message");
    assert_eq!(told.get_payload::<String>().unwrap(), "0");
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
        let giving_up = wait_for(&quitter, "regrant");
        until_queued(&conn, "regrant", 1).await;
        let next = wait_for(&patient, "regrant");
        until_queued(&conn, "regrant", 2).await;
        // The quitter's client cannot read its grant, nor leave, until the stall ends.
        quitter.stall_background_for_tests(Duration::from_millis(500));
        held.release().await.unwrap();
        giving_up.abort();
        // Its own refresh, on this runtime, may still have taken the grant just before
        // the abort: the guard is then the task's output, given back with the handle.
        drop(giving_up);
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
            .arg(format!("60000:{}", now + 300))
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

/// Review (issue 32): a release whose queue lists its head twice (a list out of step)
/// does not take the plain handoff, which would see a live distlock waiter behind the
/// head. It takes the general path: once the head's entry is gone, that path counts the
/// second listing as a Redisson waiter and keeps the queue's keys from expiring, as it
/// did before the plain handoff existed.
#[tokio::test]
async fn a_head_listed_twice_takes_the_general_release() {
    let server = server().await;
    let holder = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let held = holder.fair_lock("twice").unwrap().lock().await.unwrap();
        let now = server_time_ms(&mut conn).await;
        let _: () = redis::pipe()
            .cmd("RPUSH")
            .arg(queue("twice"))
            .arg("twin:1")
            .arg("twin:1")
            .cmd("ZADD")
            .arg(timeouts("twice"))
            .arg(now + 30_000)
            .arg("twin:1")
            .cmd("HSET")
            .arg(waiters("twice"))
            .arg("twin:1")
            .arg(format!("30000:{}", now + 5_000))
            .cmd("PEXPIRE")
            .arg(queue("twice"))
            .arg(60_000)
            .cmd("PEXPIRE")
            .arg(timeouts("twice"))
            .arg(60_000)
            .cmd("PEXPIRE")
            .arg(waiters("twice"))
            .arg(60_000)
            .query_async(&mut conn)
            .await
            .unwrap();
        held.release().await.unwrap();
        let holders: Vec<String> = redis::cmd("HKEYS")
            .arg("twice")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(holders, ["twin:1"], "the head was not granted the lock");
        let ttl: i64 = redis::cmd("PTTL")
            .arg(queue("twice"))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            ttl, -1,
            "the queue's keys were not kept as the general path keeps them"
        );
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
            .arg(format!("300:{}", now + 5000))
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
            // A refresh comes every second; 500 ms leaves room for a busy machine (200 ms
            // failed once while the workspace built beside the tests).
            released_at.elapsed() < Duration::from_millis(500),
            "woken by the message, not by its next refresh: {:?}",
            released_at.elapsed()
        );
        guard.release().await.unwrap();
    })
    .await;
}

/// Eight tasks, on two clients with a 2 s watchdog, each take `rounds` turns on the fair
/// lock `name`, holding it 1 ms under an exclusion checker. `shared_handles`: the tasks
/// of a client clone one handle (sharing its kept owner ids) instead of making their
/// own. `give_up_every`: every so many rounds a task only waits 300 µs, so waits also
/// end by leaving the queue. Returns the checker's report and the turns held.
async fn take_turns(
    name: &str,
    rounds: usize,
    shared_handles: bool,
    give_up_every: Option<usize>,
) -> (distlock_testkit::ExclusionReport, usize) {
    let server = server().await;
    let clients = [
        client_with_watchdog(&server, Duration::from_secs(2)).await,
        client_with_watchdog(&server, Duration::from_secs(2)).await,
    ];
    let handles = [
        clients[0].fair_lock(name).unwrap(),
        clients[1].fair_lock(name).unwrap(),
    ];
    let checker = Arc::new(ExclusionChecker::new());
    let held = bounded(LIMIT, async {
        let mut tasks = Vec::new();
        for n in 0..8 {
            let lock = if shared_handles {
                handles[n % 2].clone()
            } else {
                clients[n % 2].fair_lock(name).unwrap()
            };
            let checker = Arc::clone(&checker);
            tasks.push(tokio::spawn(async move {
                let mut held = 0;
                for round in 1..=rounds {
                    if give_up_every.is_some_and(|every| round % every == 0) {
                        let _ = lock.try_lock_for(Duration::from_micros(300)).await.unwrap();
                        continue;
                    }
                    let guard = lock.lock().await.unwrap();
                    let hold = checker.enter(guard.fencing_token(), format!("task {n}"));
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    hold.finish();
                    guard.release().await.unwrap();
                    held += 1;
                }
                held
            }));
        }
        let mut held = 0;
        for task in tasks {
            held += task.await.unwrap();
        }
        held
    })
    .await;
    (checker.report(), held)
}

/// Contenders on several clients never overlap, tokens strictly increase, and every
/// contender gets its turn: nobody is overtaken by a waiter that queued after it.
#[tokio::test]
async fn contenders_never_overlap_and_take_turns() {
    let rounds = 15;
    let (report, held) = take_turns("turns", rounds, false, None).await;
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.holds, 8 * rounds);
    assert_eq!(held, 8 * rounds);
}

/// Review: a waiter stalled past the lease of a grant it never read (its process paused)
/// must not take that stale grant when it resumes: by then the grant ran out and another
/// waiter holds the lock. Here the waiter's runtime resumes before its client's thread,
/// so its next look at the lock (busy, queued again) reaches the server before the old
/// grant message is read; the message is then recognised as older than that look.
#[test]
fn a_grant_read_after_it_ran_out_is_not_taken() {
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // In a task of the main runtime, so that the test's own calls go over that runtime's
    // connections: every client of a process shares one background thread, which the
    // test stalls.
    let body = main.spawn(async {
        let server = server().await;
        let holder = client(&server).await;
        // Its lease outlasts the stall of the background thread every client of the
        // process shares (nothing renews it meanwhile).
        let rival = client_with_watchdog(&server, Duration::from_secs(6)).await;
        let mut conn = raw(&server).await;
        let url = server.url();
        // The waiter runs on a runtime of its own, with a client of its own.
        let stalled = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let waiter_client = stalled
            .spawn(async move { distlock::Client::connect(&url).await.unwrap() })
            .await
            .unwrap();
        bounded(LIMIT, async {
            let held = holder
                .fair_lock("stale-grant")
                .unwrap()
                .lock()
                .await
                .unwrap();
            let lock = waiter_client
                .fair_lock("stale-grant")
                .unwrap()
                .with_lease(Duration::from_millis(1500));
            let waiting = stalled.spawn(async move {
                let guard = lock.try_lock_for(Duration::from_secs(20)).await.unwrap();
                guard.map(|guard| (guard.owner().to_owned(), guard.is_lost(), guard))
            });
            until_queued(&conn, "stale-grant", 1).await;
            let next = wait_for(&rival, "stale-grant");
            until_queued(&conn, "stale-grant", 2).await;
            // Pause the waiter: its client's thread for 4 s, its runtime for 3.5 s.
            waiter_client.stall_background_for_tests(Duration::from_secs(4));
            for _ in 0..2 {
                stalled.spawn(async { std::thread::sleep(Duration::from_millis(3500)) });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            let stale_token = held.fencing_token() + 1;
            held.release().await.unwrap();
            // The grant runs out after 1.5 s; the rival, next in line, takes the lock.
            let rivals = next.await.unwrap().unwrap();
            assert!(
                rivals.fencing_token() > stale_token,
                "{} vs {stale_token}",
                rivals.fencing_token()
            );
            tokio::time::sleep(Duration::from_secs(3)).await;
            let holders: Vec<String> = redis::cmd("HKEYS")
                .arg("stale-grant")
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(holders, [rivals.owner()]);
            assert!(!waiting.is_finished(), "the waiter took a stale grant");
            let rivals_token = rivals.fencing_token();
            rivals.release().await.unwrap();
            let (owner, lost, guard) = waiting.await.unwrap().expect("its turn came");
            assert!(!lost);
            assert!(guard.fencing_token() > rivals_token);
            let holders: Vec<String> = redis::cmd("HKEYS")
                .arg("stale-grant")
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(holders, [owner]);
            guard.release().await.unwrap();
        })
        .await;
        stalled.shutdown_background();
    });
    main.block_on(body).unwrap();
}

/// Review: when a Redisson waiter takes the lock (a wait off every score, as Redisson
/// does), a distlock waiter behind it keeps its place: it is not dropped as gone and sent
/// behind a Redisson waiter that queued after it.
#[tokio::test]
async fn a_redisson_acquisition_does_not_send_a_distlock_waiter_back() {
    let server = server().await;
    let a = client(&server).await;
    let b = client_with_watchdog(&server, Duration::from_secs(2)).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let held = a.fair_lock("order").unwrap().lock().await.unwrap();
        assert!(!redisson_acquire(&mut conn, "order", "r1:1").await);
        let waiting = wait_for(&b, "order");
        until_queued(&conn, "order", 2).await;
        let distlock_waiter = queued(&mut conn, "order").await[1].clone();
        assert!(!redisson_acquire(&mut conn, "order", "r2:1").await);
        held.release().await.unwrap();
        assert!(redisson_acquire(&mut conn, "order", "r1:1").await);
        // Several of the distlock waiter's refreshes.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            queued(&mut conn, "order").await,
            [distlock_waiter, "r2:1".to_owned()]
        );
        waiting.abort();
    })
    .await;
}

/// Review: a Redisson waiter behind a distlock waiter that takes the lock keeps a score
/// that outlasts that waiter's hold, and is told its turn (`0` on its channel) when the
/// lock is released, ahead of the distlock waiter that queued after it.
#[tokio::test]
async fn a_redisson_waiter_keeps_its_turn_behind_a_distlock_holder() {
    let server = server().await;
    let a = client(&server).await;
    let b = client_with_watchdog(&server, Duration::from_secs(2)).await;
    let c = client_with_watchdog(&server, Duration::from_secs(2)).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let held = a.fair_lock("turn").unwrap().lock().await.unwrap();
        let first = wait_for(&b, "turn");
        until_queued(&conn, "turn", 1).await;
        assert!(!redisson_acquire(&mut conn, "turn", "r:1").await);
        let last = wait_for(&c, "turn");
        until_queued(&conn, "turn", 3).await;
        let mut listener = server.client().unwrap().get_async_pubsub().await.unwrap();
        listener
            .subscribe("redisson_lock__channel:{turn}:r:1")
            .await
            .unwrap();
        held.release().await.unwrap();
        let first = first.await.unwrap().unwrap();
        // The distlock holder works for 4 s (renewed), well past its waiters' alive time.
        tokio::time::sleep(Duration::from_secs(4)).await;
        first.release().await.unwrap();
        told_its_turn(&mut listener, Duration::from_secs(2)).await;
        assert!(redisson_acquire(&mut conn, "turn", "r:1").await);
        assert!(!last.is_finished());
        // The last waiter's owner, read while the Redisson holder keeps it queued: once
        // the lock is deleted, its own next refresh may take the lock and leave the queue
        // before the queue is read (CI read an empty queue here).
        until_queued(&conn, "turn", 1).await;
        let last_owner = queued(&mut conn, "turn").await[0].clone();
        let _: () = redis::cmd("DEL")
            .arg("turn")
            .query_async(&mut conn)
            .await
            .unwrap();
        let _: () = redis::cmd("PUBLISH")
            .arg(format!("redisson_lock__channel:{{turn}}:{last_owner}"))
            .arg("0")
            .query_async(&mut conn)
            .await
            .unwrap();
        let guard = last.await.unwrap().unwrap();
        guard.release().await.unwrap();
    })
    .await;
}

/// Issue 30 (1.1): a Redisson waiter that queued behind a distlock waiter keeps its entry
/// when that waiter leaves the queue, handed the lock or giving up. The distlock waiter's
/// refreshes had set an expiry of a few seconds on the queue's keys, which Redisson never
/// extends: the Redisson waiter's entry vanished while the lock was held, and a later
/// arrival was served first.
#[tokio::test]
async fn a_redisson_waiter_keeps_its_entry_when_the_distlock_waiter_ahead_leaves() {
    let server = server().await;
    let a = client(&server).await;
    let b = client_with_watchdog(&server, Duration::from_secs(2)).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        // Handed the lock.
        let held = a.fair_lock("kept").unwrap().lock().await.unwrap();
        let first = wait_for(&b, "kept");
        until_queued(&conn, "kept", 1).await;
        assert!(!redisson_acquire(&mut conn, "kept", "r:1").await);
        held.release().await.unwrap();
        let first = first.await.unwrap().unwrap();
        assert_entry_outlasted(&mut conn, "kept", "r:1").await;
        let mut listener = server.client().unwrap().get_async_pubsub().await.unwrap();
        listener
            .subscribe("redisson_lock__channel:{kept}:r:1")
            .await
            .unwrap();
        first.release().await.unwrap();
        told_its_turn(&mut listener, Duration::from_secs(2)).await;
        assert!(redisson_acquire(&mut conn, "kept", "r:1").await);

        // Giving up.
        let held = a.fair_lock("left").unwrap().lock().await.unwrap();
        let gives_up = tokio::spawn({
            let lock = b.fair_lock("left").unwrap();
            async move { lock.try_lock_for(Duration::from_millis(1500)).await }
        });
        until_queued(&conn, "left", 1).await;
        assert!(!redisson_acquire(&mut conn, "left", "r:2").await);
        assert!(gives_up.await.unwrap().unwrap().is_none());
        assert_eq!(queued(&mut conn, "left").await, ["r:2"]);
        assert_entry_outlasted(&mut conn, "left", "r:2").await;
        held.release().await.unwrap();
        assert!(redisson_acquire(&mut conn, "left", "r:2").await);
    })
    .await;
}

/// Issue 30 (1.2): a distlock waiter that died at the head of a free lock (a Redisson
/// release told it to try, and it never did) is dropped by the next distlock script once
/// its alive time passes, and the Redisson waiter that is now the head of a free lock is
/// told its turn then, not after its own timer (about 30 s in the review).
#[tokio::test]
async fn a_redisson_waiter_is_told_its_turn_when_a_dead_waiter_ahead_is_dropped() {
    let server = server().await;
    let live = client_with_watchdog(&server, Duration::from_secs(2)).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let now = server_time_ms(&mut conn).await;
        let _: () = redis::pipe()
            .cmd("RPUSH")
            .arg(queue("stall"))
            .arg("dead:1")
            .ignore()
            .cmd("ZADD")
            .arg(timeouts("stall"))
            .arg(now + 300_000)
            .arg("dead:1")
            .ignore()
            .cmd("HSET")
            .arg(waiters("stall"))
            .arg("dead:1")
            .arg(format!("30000:{}", now + 1500))
            .ignore()
            .query_async(&mut conn)
            .await
            .unwrap();
        let mut listener = server.client().unwrap().get_async_pubsub().await.unwrap();
        listener
            .subscribe("redisson_lock__channel:{stall}:r:1")
            .await
            .unwrap();
        assert!(!redisson_acquire(&mut conn, "stall", "r:1").await);
        let behind = wait_for(&live, "stall");
        until_queued(&conn, "stall", 3).await;
        told_its_turn(&mut listener, Duration::from_secs(6)).await;
        assert!(redisson_acquire(&mut conn, "stall", "r:1").await);
        assert!(!behind.is_finished());
        behind.abort();
    })
    .await;
}

/// Issue 30 (1.3): a Redisson waiter that gives up removes its own entry and lowers the
/// score of the distlock waiter behind it by one wait; the distlock waiter is then the
/// head, and takes the lock on the next release. (docs/layout.md had said Redisson's
/// `tryLock` leaves its entry behind after a timeout; measured against Redisson, it does
/// not.)
#[tokio::test]
async fn a_redisson_waiter_that_gives_up_moves_the_distlock_waiter_behind_it_up() {
    let server = server().await;
    let a = client(&server).await;
    let b = client_with_watchdog(&server, Duration::from_secs(2)).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let held = a.fair_lock("quit").unwrap().lock().await.unwrap();
        assert!(!redisson_acquire(&mut conn, "quit", "r:1").await);
        let waiting = wait_for(&b, "quit");
        until_queued(&conn, "quit", 2).await;
        let distlock_waiter = queued(&mut conn, "quit").await[1].clone();
        let before = score_left_ms(&mut conn, "quit", &distlock_waiter).await;
        let _: () = redis::Script::new(REDISSON_FAIR_GIVE_UP)
            .key(queue("quit"))
            .key(timeouts("quit"))
            .arg("r:1")
            .arg(300_000)
            .invoke_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            queued(&mut conn, "quit").await,
            std::slice::from_ref(&distlock_waiter)
        );
        let after = score_left_ms(&mut conn, "quit", &distlock_waiter).await;
        assert!(
            (before - after - 300_000).abs() < 2_000,
            "one wait off: {before} ms, then {after} ms"
        );
        held.release().await.unwrap();
        let guard = waiting.await.unwrap().unwrap();
        assert_eq!(queue_length(&mut conn, "quit").await, 0);
        guard.release().await.unwrap();
    })
    .await;
}

/// A grant published while the waiter's subscription is not live yet is not heard; the
/// waiter's look after subscribing (`fair_look.lua`, in place of a second queueing
/// attempt) must find the lock already its own and take it at once, not at its next
/// refresh of its place (a second later). The waiter's client is behind a 20 ms delay
/// each way, and the holder releases the moment the waiter's entry is queued: the grant
/// goes out while the waiter's reply, and then its first SUBSCRIBE, are still on their
/// way.
#[tokio::test]
async fn a_grant_made_before_the_waiter_subscribed_is_taken_at_once() {
    let server = server().await;
    let holder = client(&server).await;
    let (proxy, waiter_client) = behind_a_proxy(
        &server,
        distlock::Client::builder().response_timeout(Duration::from_secs(3)),
    )
    .await;
    proxy.set_delay(Duration::from_millis(20));
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        // The waiter's client opens its pub/sub connection first (a wait that times
        // out): a connection opened for the waiter itself would wake it once it is up,
        // and that wake-up, not the look, would find the grant.
        let warm = holder.fair_lock("fair:warm").unwrap().lock().await.unwrap();
        let timed_out = waiter_client
            .fair_lock("fair:warm")
            .unwrap()
            .try_lock_for(Duration::from_millis(300))
            .await
            .unwrap();
        assert!(timed_out.is_none());
        warm.release().await.unwrap();
        let name = "fair:missed-grant";
        let guard = holder.fair_lock(name).unwrap().lock().await.unwrap();
        let waiter = wait_for(&waiter_client, name);
        // Polled without pause: the release must go out before the waiter subscribes.
        while queue_length(&mut conn, name).await == 0 {}
        let released_at = std::time::Instant::now();
        guard.release().await.unwrap();
        let taken = waiter.await.unwrap().unwrap();
        let after = released_at.elapsed();
        // Its own refresh would come a second after its look; everything else (the
        // reply, a SUBSCRIBE, the look and the attempt, 40 ms each) takes far less.
        assert!(
            after < Duration::from_millis(800),
            "the waiter took a grant it missed {after:?} after the release"
        );
        taken.release().await.unwrap();
    })
    .await;
}

/// Every command the server ran since the last `SLOWLOG RESET`, oldest first, as its
/// arguments (the server logs every command: `slowlog-log-slower-than 0`).
async fn commands_run(conn: &mut redis::aio::MultiplexedConnection) -> Vec<Vec<String>> {
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(100_000)
        .query_async(conn)
        .await
        .expect("SLOWLOG GET");
    let mut commands = Vec::new();
    for entry in entries.into_iter().rev() {
        let redis::Value::Array(fields) = entry else {
            continue;
        };
        let Some(args) = fields.get(3) else { continue };
        let args: Vec<String> = redis::from_redis_value(args.clone()).expect("slowlog args");
        commands.push(args);
    }
    commands
}

/// How many of `commands` were a fair waiter's look (`fair_look.lua`, the one fair
/// script with one key).
fn looks_run(commands: &[Vec<String>]) -> usize {
    commands
        .iter()
        .filter(|args| {
            args[0].eq_ignore_ascii_case("evalsha") && args.get(2).map(String::as_str) == Some("1")
        })
        .count()
}

/// Starts logging every command the server runs, from an empty log.
async fn log_every_command(conn: &mut redis::aio::MultiplexedConnection) {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(0)
        .arg("slowlog-max-len")
        .arg(100_000)
        .query_async(conn)
        .await
        .unwrap();
    let _: () = redis::cmd("SLOWLOG")
        .arg("RESET")
        .query_async(conn)
        .await
        .unwrap();
}

/// One contended round on `waiter`: `holder` takes the lock, the waiter queues behind
/// it, and the holder releases once the waiter is queued. Returns the waiter's owner id
/// and the two holdings' tokens.
async fn contended_round(
    holder: &distlock::FairLock,
    waiter: &distlock::FairLock,
    conn: &mut redis::aio::MultiplexedConnection,
) -> (String, u64, u64) {
    let name = waiter.name().to_owned();
    let held = holder.lock().await.unwrap();
    let waiting = waiting_on(waiter);
    until_queued(conn, &name, 1).await;
    let owner = queued(conn, &name).await.remove(0);
    let holder_token = held.fencing_token();
    held.release().await.unwrap();
    let taken = waiting.await.unwrap().unwrap();
    let waiter_token = taken.fencing_token();
    taken.release().await.unwrap();
    (owner, holder_token, waiter_token)
}

/// Issue 32: a client's waits on a lock take up the owner id of its last wait, whose
/// channel stayed subscribed, even through a new handle of the lock made once every
/// other was dropped (one per call, as a request handler makes them): the second
/// contended acquisition sends no
/// SUBSCRIBE or UNSUBSCRIBE and no look at the lock (`fair_look.lua`, the one fair
/// script with one key), only its queueing attempt, and still gets the grant.
#[tokio::test]
async fn the_next_wait_on_a_client_reuses_its_owner_and_subscribes_nothing() {
    let server = server().await;
    let (holder, waiter_client) = (client(&server).await, client(&server).await);
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let name = "fair:reuse";
        let (holder, waiter) = (
            holder.fair_lock(name).unwrap(),
            waiter_client.fair_lock(name).unwrap(),
        );
        let (first_owner, _, _) = contended_round(&holder, &waiter, &mut conn).await;
        // Between the waits, the id's channel stays subscribed.
        let channel = format!("redisson_lock__channel:{{{name}}}:{first_owner}");
        let (_, listeners): (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(listeners, 1, "the idle id's channel is kept subscribed");
        // Every handle of the lock on the waiter's client is gone.
        drop(waiter);
        log_every_command(&mut conn).await;
        let another_handle = waiter_client.fair_lock(name).unwrap();
        let (second_owner, holder_token, waiter_token) =
            contended_round(&holder, &another_handle, &mut conn).await;
        assert_eq!(
            second_owner, first_owner,
            "the next wait took up the same id"
        );
        assert!(waiter_token > holder_token);
        let commands = commands_run(&mut conn).await;
        let named = |command: &str| {
            commands
                .iter()
                .filter(|args| args[0].eq_ignore_ascii_case(command))
                .count()
        };
        assert_eq!(named("subscribe") + named("unsubscribe"), 0, "{commands:?}");
        let looks = looks_run(&commands);
        assert_eq!(looks, 0, "no look after a busy first attempt: {commands:?}");
    })
    .await;
}

/// Issue 32: a grant made while a reused id's new wait is on its way in is in the id's
/// kept mailbox when the wait starts listening: taken at once, without a look. The
/// waiter's runtime is blocked right after its queueing attempt goes out, and the holder
/// releases the moment the waiter is queued: the grant reaches the client (whose own
/// thread reads pub/sub) before the waiter has read its attempt's answer.
#[tokio::test]
async fn a_reused_owner_takes_a_grant_made_before_it_listened() {
    let server = server().await;
    let (holder, waiter) = (client(&server).await, client(&server).await);
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let name = "fair:kept-mailbox";
        let (holder, waiter) = (
            holder.fair_lock(name).unwrap(),
            waiter.fair_lock(name).unwrap(),
        );
        let (first_owner, _, _) = contended_round(&holder, &waiter, &mut conn).await;
        let guard = holder.lock().await.unwrap();
        let blocked_for = Duration::from_millis(300);
        let waiter_side = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let waiting = tokio::spawn(async move { waiter.lock().await });
                // Runs once the waiter's first poll has sent its attempt.
                tokio::spawn(async move { std::thread::sleep(blocked_for) });
                waiting.await.unwrap()
            })
        });
        until_queued(&conn, name, 1).await;
        assert_eq!(queued(&mut conn, name).await, [first_owner]);
        let released_at = std::time::Instant::now();
        guard.release().await.unwrap();
        let taken = tokio::task::spawn_blocking(move || waiter_side.join().unwrap())
            .await
            .unwrap()
            .unwrap();
        let after = released_at.elapsed();
        // Its refresh would come a second after its attempt's answer was read.
        assert!(
            after < blocked_for + Duration::from_millis(500),
            "the grant was taken {after:?} after the release"
        );
        taken.release().await.unwrap();
    })
    .await;
}

/// Issue 32: the grant of an id's earlier wait, delivered late to the same id's next wait,
/// is stale: the waiter keeps waiting, and takes the lock only from the holder's release,
/// with a newer token.
#[tokio::test]
async fn a_reused_owner_refuses_a_grant_of_its_earlier_wait() {
    let server = server().await;
    let (holder, waiter) = (client(&server).await, client(&server).await);
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let name = "fair:stale-grant";
        let (holder, waiter) = (holder.fair_lock(name).unwrap(), waiter.fair_lock(name).unwrap());
        let (owner, _, earlier_grant) = contended_round(&holder, &waiter, &mut conn).await;
        let held = holder.lock().await.unwrap();
        let waiting = waiting_on(&waiter);
        until_queued(&conn, name, 1).await;
        assert_eq!(queued(&mut conn, name).await, std::slice::from_ref(&owner));
        // The earlier wait's grant, as if delivered late.
        let channel = format!("redisson_lock__channel:{{{name}}}:{owner}");
        let _: i64 = redis::cmd("PUBLISH")
            .arg(&channel)
            .arg(earlier_grant)
            .query_async(&mut conn)
            .await
            .unwrap();
        let holder_token = held.fencing_token();
        held.release().await.unwrap();
        let taken = waiting.await.unwrap().unwrap();
        assert!(
            taken.fencing_token() > holder_token,
            "the waiter took the stale grant {earlier_grant} (its token {}, the holder's {holder_token})",
            taken.fencing_token()
        );
        taken.release().await.unwrap();
    })
    .await;
}

/// Issue 32: an id whose holding ended in doubt (its release never answered: the link
/// was blackholed) may still own the lock, and is never taken up again: the handle's next
/// wait queues as a new owner and gets the lock once the old holding's lease runs out.
#[tokio::test]
async fn an_owner_whose_release_went_unanswered_is_not_reused() {
    let server = server().await;
    let holder = client(&server).await;
    let (proxy, waiter_client) = behind_a_proxy(
        &server,
        // Short enough for the blackholed release to fail soon, long enough that no call
        // of the rounds before it times out on a busy machine (which would put the id in
        // doubt as well).
        distlock::Client::builder()
            .watchdog_timeout(Duration::from_secs(2))
            .response_timeout(Duration::from_secs(1))
            .connection_timeout(Duration::from_secs(1)),
    )
    .await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let name = "fair:in-doubt";
        let (holder, waiter) = (
            holder.fair_lock(name).unwrap(),
            waiter_client.fair_lock(name).unwrap(),
        );
        let (first_owner, _, _) = contended_round(&holder, &waiter, &mut conn).await;
        // The id, taken up again, holds the lock when the link goes dark.
        let held = holder.lock().await.unwrap();
        let waiting = waiting_on(&waiter);
        until_queued(&conn, name, 1).await;
        held.release().await.unwrap();
        let taken = waiting.await.unwrap().unwrap();
        let owners: Vec<String> = redis::cmd("HKEYS")
            .arg(name)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(owners, std::slice::from_ref(&first_owner));
        proxy.blackhole();
        assert!(
            taken.release().await.is_err(),
            "a release over a blackholed link fails"
        );
        proxy.heal();
        // The next wait: the old holding still owns the lock until its lease runs out.
        let next = bounded(Duration::from_secs(10), waiter.lock())
            .await
            .unwrap();
        let owners: Vec<String> = redis::cmd("HKEYS")
            .arg(name)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(owners.len(), 1);
        assert_ne!(owners[0], first_owner, "the id in doubt was taken up again");
        next.release().await.unwrap();
    })
    .await;
}

/// Issue 32: tasks that share one handle (clones) each wait as an owner of their own,
/// taken up from the handle's kept ids, some of them given back by a leave: no overlap,
/// every token newer than the last.
#[tokio::test]
async fn tasks_sharing_a_handle_never_overlap() {
    let (report, held) = take_turns("shared-handle", 15, true, Some(5)).await;
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.holds, held);
}

/// Review of issue 32: a reused id's wait skips the look after its busy first attempt,
/// but a grant made after that attempt ran may reach the mailbox only later; its lease
/// must still count from when the first attempt was sent, never from the skipped look.
/// Replies and messages to the waiter are delayed 500 ms, and the holder releases 100 ms
/// after the waiter is queued: the grant arrives after the waiter has read its busy
/// answer (and skipped the look: the server ran none). The lease the waiter trusts must
/// not outlast the server's.
#[tokio::test]
async fn a_reused_owners_late_grant_counts_its_lease_from_its_attempt() {
    let server = server().await;
    let holder = client(&server).await;
    let (proxy, waiter_client) = behind_a_proxy(
        &server,
        distlock::Client::builder().response_timeout(Duration::from_secs(3)),
    )
    .await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let name = "fair:late-grant";
        let lease = Duration::from_secs(2);
        let holder = holder.fair_lock(name).unwrap();
        let waiter = waiter_client.fair_lock(name).unwrap().with_lease(lease);
        let (first_owner, _, _) = contended_round(&holder, &waiter, &mut conn).await;
        proxy.set_delay_in(
            distlock_testkit::Direction::ToClient,
            Duration::from_millis(500),
        );
        let held = holder.lock().await.unwrap();
        log_every_command(&mut conn).await;
        let waiting = waiting_on(&waiter);
        until_queued(&conn, name, 1).await;
        assert_eq!(queued(&mut conn, name).await, [first_owner]);
        // The gap between the waiter's busy answer and the grant, on its side.
        tokio::time::sleep(Duration::from_millis(100)).await;
        held.release().await.unwrap();
        let taken = waiting.await.unwrap().unwrap();
        let looks = looks_run(&commands_run(&mut conn).await);
        assert_eq!(looks, 0, "the reused id's wait skipped its look");
        let server_left: i64 = redis::cmd("PTTL")
            .arg(name)
            .query_async(&mut conn)
            .await
            .unwrap();
        let trusted = taken.lease_remaining();
        assert!(
            trusted.as_millis() <= u128::try_from(server_left).unwrap(),
            "the waiter trusts its lease for {trusted:?}, the server keeps it {server_left} ms"
        );
        taken.release().await.unwrap();
    })
    .await;
}
