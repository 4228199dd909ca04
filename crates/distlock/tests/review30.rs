//! Review 30: attacks on issue 30's changes (fair-lock queue keys kept for Redisson
//! waiters, lost() timing in a block_on body, the holder's listener on the lock's channel,
//! i64 permit counts). Each test here failed against the reviewed code (each comment tells
//! the break it found) and passes since its fix.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::redisson_fair::{
    assert_entry_outlasted, queue, queued, redisson_acquire, server_time_ms, timeouts, waiters,
};
use common::{bounded, client, client_with_watchdog, raw, server};

const LIMIT: Duration = Duration::from_secs(30);

/// Change 4: permit counts became i64, so an ask may now exceed 2^53, beyond which Lua's
/// numbers (doubles) are not exact. `semaphore_acquire.lua` compares the free count and
/// the ask as doubles, so an ask one more than the free count compares equal, passes, and
/// DECRBY takes more than was free: the count goes to -1 and the caller holds permits that
/// did not exist.
#[tokio::test]
async fn an_ask_above_two_to_the_53_never_takes_more_permits_than_are_free() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let free: i64 = 1 << 53;
        let semaphore = client.semaphore("huge").unwrap();
        assert!(semaphore.try_set_permits(free).await.unwrap().is_set());
        let taken = semaphore.try_acquire(free + 1).await.unwrap();
        let left = semaphore.available_permits().await.unwrap();
        assert!(
            taken.is_none(),
            "asked for {} with {free} free: granted, and {left} left free",
            free + 1
        );
    })
    .await;
}

/// Panics whose message says the runtime has no timer, counted by a hook installed once.
fn timer_panics() -> &'static AtomicUsize {
    static COUNT: AtomicUsize = AtomicUsize::new(0);
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let text = info.to_string();
            if text.contains("timers are disabled") {
                COUNT.fetch_add(1, Ordering::SeqCst);
            }
            default(info);
        }));
    });
    &COUNT
}

/// Change 2: awaited in a `block_on` body, lost() now starts the signal's deadline timer as
/// a task on that runtime. On a runtime built without `enable_time` (a current-thread
/// runtime from `Builder::new_current_thread().build()`, common in sync code that only
/// needs I/O, or none at all), that task calls `tokio::time::sleep_until` and panics
/// ("timers are disabled"); in a binary built with `panic = "abort"` that ends the
/// process. Before the change lost() in a block_on body started nothing there.
#[test]
fn lost_awaited_in_a_block_on_without_a_timer_panics_no_task() {
    let panics = timer_panics();
    let setup = common::runtime_with(true, 2);
    let (server, client, guard) = setup.block_on(async {
        let server = server().await;
        let client = client(&server).await;
        let guard = client
            .lock("no-timer")
            .unwrap()
            .with_lease(Duration::from_millis(1500))
            .lock()
            .await
            .unwrap();
        (server, client, guard)
    });
    let before = panics.load(Ordering::SeqCst);
    let lost = guard.lost();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let started = Instant::now();
    std::thread::spawn(move || {
        // I/O only: no `enable_time`.
        let plain = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        plain.block_on(lost);
        let _ = done_tx.send(started.elapsed());
    });
    let fired = done_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("lost() completed within 10 s of a 1.5 s lease");
    let during = panics.load(Ordering::SeqCst) - before;
    eprintln!(
        "lost() in a block_on without a timer: fired after {fired:?}, {during} task panic(s)"
    );
    assert_eq!(
        during, 0,
        "awaiting lost() in a block_on of a runtime without a timer panicked {during} task(s) (\"timers are disabled\"); it fired after {fired:?}"
    );
    drop(guard);
    setup.block_on(async move {
        client.shutdown().await;
        drop(server);
    });
}

async fn pttl(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query_async(conn).await.unwrap()
}

/// Change 1: `redissons_queued` (queue.lua) counts a Redisson waiter as "more entries in
/// the scored set than in distlock's waiters hash". Redisson's scripts drop a gone head by
/// its score (LPOP + ZREM) and never touch distlock's hash, so a distlock waiter that died
/// and was dropped by a Redisson script leaves its hash entry behind (kept, with no
/// expiry, since keep_for_redissons persisted the hash). That stale entry cancels out one
/// Redisson waiter in the count: the next distlock waiter's refreshes see "no Redisson
/// waiter", set an expiry of its alive time on the queue's keys, and when it gives up the
/// keys expire with the Redisson waiter's entry while the lock is still held; a later
/// arrival is served before it.
///
/// The dead distlock waiter's score is made short here so the test need not wait a real
/// score out; with a real one, the same happens whenever no distlock script runs between
/// its alive time passing and its score passing (only Redisson clients active meanwhile).
#[tokio::test]
async fn a_stale_distlock_hash_entry_does_not_hide_a_redisson_waiter() {
    let server = server().await;
    let b = client_with_watchdog(&server, Duration::from_secs(2)).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        // A Redisson client holds the lock (30 s lease).
        assert!(redisson_acquire(&mut conn, "stale", "h:1").await);
        // A distlock waiter that died: in the list, the scored set and distlock's hash.
        let now = server_time_ms(&mut conn).await;
        let _: () = redis::pipe()
            .cmd("RPUSH")
            .arg(queue("stale"))
            .arg("dead:1")
            .ignore()
            .cmd("ZADD")
            .arg(timeouts("stale"))
            .arg(now + 1000)
            .arg("dead:1")
            .ignore()
            .cmd("HSET")
            .arg(waiters("stale"))
            .arg("dead:1")
            .arg(format!("30000:{}", now + 800))
            .ignore()
            .query_async(&mut conn)
            .await
            .unwrap();
        // A Redisson waiter queues behind it.
        assert!(!redisson_acquire(&mut conn, "stale", "r:1").await);
        // The dead waiter's score passes; the Redisson waiter's next poll drops it (LPOP,
        // ZREM: Redisson knows nothing of distlock's hash).
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert!(!redisson_acquire(&mut conn, "stale", "r:1").await);
        assert_eq!(queued(&mut conn, "stale").await, ["r:1"]);
        // A distlock waiter queues behind the Redisson one, then gives up.
        let gave_up = b
            .fair_lock("stale")
            .unwrap()
            .try_lock_for(Duration::from_millis(2000))
            .await
            .unwrap();
        assert!(gave_up.is_none());
        let list_ttl = pttl(&mut conn, &queue("stale")).await;
        let set_ttl = pttl(&mut conn, &timeouts("stale")).await;
        eprintln!("after the distlock waiter gave up: queue PTTL {list_ttl} ms, timeouts PTTL {set_ttl} ms");
        // The lock is still held by h:1 (about 25 s left): r:1 must still be queued.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let lock_ttl = pttl(&mut conn, "stale").await;
        let still = queued(&mut conn, "stale").await;
        assert!(
            still == ["r:1"],
            "the Redisson waiter's entry vanished while the lock was held ({lock_ttl} ms left): queue {still:?}; the queue's keys had been given {list_ttl} ms / {set_ttl} ms to live"
        );
        assert_entry_outlasted(&mut conn, "stale", "r:1").await;
    })
    .await;
}

/// Change 4 ("all permit counts are i64"), at the top of the range (the drain itself is
/// older: try_set_permits took a u64 up to i64::MAX before too): `semaphore_drain.lua`
/// returns the free count as a Lua number (a double), so a count above 2^53 comes back
/// rounded, and i64::MAX does not survive the trip: the caller is told it took a number
/// of permits other than the ones it took (which are all gone from the semaphore).
#[tokio::test]
async fn drain_permits_reports_the_count_it_took_above_two_to_the_53() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let mut wrong = Vec::new();
        for (name, free) in [("drain-53", (1i64 << 53) + 1), ("drain-max", i64::MAX)] {
            let semaphore = client.semaphore(name).unwrap();
            assert!(semaphore.try_set_permits(free).await.unwrap().is_set());
            let drained = semaphore.drain_permits().await;
            let left = semaphore.available_permits().await.unwrap();
            if !matches!(drained, Ok(n) if n == free) {
                wrong.push(format!(
                    "{free} free: drain_permits answered {drained:?}, {left} left"
                ));
            }
        }
        assert!(wrong.is_empty(), "{wrong:#?}");
    })
    .await;
}

/// The same in watchdog mode: the timer task panics, its slot is freed, and lost()'s loop
/// starts another at each renewal, so a holder that waits on lost() in such a body panics
/// a task every third of the watchdog timeout for as long as it holds the lock.
#[test]
fn lost_awaited_in_a_block_on_without_a_timer_panics_at_no_renewal() {
    let panics = timer_panics();
    let setup = common::runtime_with(true, 2);
    let (server, client, guard) = setup.block_on(async {
        let server = server().await;
        let client = client_with_watchdog(&server, Duration::from_millis(900)).await;
        let guard = client
            .lock("no-timer-watchdog")
            .unwrap()
            .lock()
            .await
            .unwrap();
        (server, client, guard)
    });
    let before = panics.load(Ordering::SeqCst);
    let lost = guard.lost();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let plain = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        let fired = plain.block_on(async move {
            tokio::select! {
                _ = lost => true,
                _ = stop_rx => false,
            }
        });
        let _ = done_tx.send(fired);
    });
    std::thread::sleep(Duration::from_secs(3));
    let _ = stop_tx.send(());
    let fired = done_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the block_on ended");
    let during = panics.load(Ordering::SeqCst) - before;
    eprintln!("3 s of lost() in a block_on without a timer, 900 ms watchdog: fired {fired}, {during} task panic(s)");
    assert!(!fired, "lost() fired while the lock was renewed");
    assert_eq!(
        during, 0,
        "{during} task panics (\"timers are disabled\") in 3 s of awaiting lost()"
    );
    drop(guard);
    setup.block_on(async move {
        client.shutdown().await;
        drop(server);
    });
}

/// Change 2, in a test with paused time (`#[tokio::test(start_paused = true)]`, or any
/// runtime built with `start_paused(true)`): lost() awaited in the body now starts the
/// signal's deadline timer as a task on that runtime, whose clock auto-advances to the
/// timer as soon as the runtime is idle. The timer then reads that runtime's (paused,
/// advanced) clock, finds the deadline passed and marks a renewed, live holding lost:
/// lost() fires at once, and the guard says is_lost() while the server still has the
/// lock. Before the change, lost() in a block_on body kept time on the client's clock.
#[test]
fn lost_awaited_in_a_paused_block_on_body_does_not_fire_while_the_lock_is_held() {
    let setup = common::runtime_with(true, 2);
    let (server, client, guard) = setup.block_on(async {
        let server = server().await;
        let client = client(&server).await;
        let guard = client.lock("paused").unwrap().lock().await.unwrap();
        (server, client, guard)
    });
    let lost = guard.lost();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let started = Instant::now();
    std::thread::spawn(move || {
        let paused = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        let fired = paused.block_on(async move {
            tokio::select! {
                _ = lost => true,
                _ = stop_rx => false,
            }
        });
        let _ = done_tx.send((fired, started.elapsed()));
    });
    std::thread::sleep(Duration::from_secs(2));
    let _ = stop_tx.send(());
    let (fired, after) = done_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the block_on ended");
    let (held, lost_now) = setup.block_on(async {
        let mut conn = raw(&server).await;
        (common::holds(&mut conn, &guard).await, guard.is_lost())
    });
    eprintln!("paused block_on: lost() fired {fired} after {after:?}; server holds: {held}; is_lost: {lost_now}");
    assert!(
        !fired && !lost_now,
        "lost() fired after {after:?} (real time) of a 30 s watchdog lease while the server still holds the lock ({held}); is_lost() = {lost_now}"
    );
    drop(guard);
    setup.block_on(async move {
        client.shutdown().await;
        drop(server);
    });
}

/// Change 3: the listener asks the server once per message, and if that one question
/// fails (here: the server stalls for 700 ms, longer than the client's 200 ms response
/// timeout, right after the force-unlock's message) it drops the message and goes back to
/// waiting for another (holding.rs, still_held_after_message: `Err(_) => true`). No
/// other message comes for a deleted lock, so the force-unlock is noticed only at the
/// next watchdog renewal (10 s here), not "about a round trip after the message".
#[tokio::test]
async fn a_force_unlock_whose_question_times_out_is_noticed_when_asked_again() {
    let server = server().await;
    let holder = distlock::Client::builder()
        .response_timeout(Duration::from_millis(200))
        .connect(&server.url())
        .await
        .unwrap();
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let guard = holder.lock("stalled-ask").unwrap().lock().await.unwrap();
        let token = guard.lost_token();
        common::until_subscribers(&conn, "redisson_lock__channel:{stalled-ask}", 1).await;
        let started = Instant::now();
        // Redisson's force-unlock (DEL, then the release message), and a server stall of
        // 700 ms right after it, in one pipeline.
        let _: () = redis::pipe()
            .cmd("DEL")
            .arg("stalled-ask")
            .ignore()
            .cmd("PUBLISH")
            .arg("redisson_lock__channel:{stalled-ask}")
            .arg("0")
            .ignore()
            .cmd("CLIENT")
            .arg("PAUSE")
            .arg(700)
            .arg("ALL")
            .ignore()
            .query_async(&mut conn)
            .await
            .unwrap();
        let noticed = tokio::time::timeout(Duration::from_secs(12), token.cancelled()).await;
        let gap = started.elapsed();
        eprintln!(
            "force-unlock followed by a 700 ms stall: lost after {gap:?} (noticed: {})",
            noticed.is_ok()
        );
        assert!(
            gap < Duration::from_secs(2),
            "a force-unlock followed by a 700 ms server stall was noticed only after {gap:?}"
        );
    })
    .await;
}
