//! Faults: script cache flushes, server restarts, a paused server mid-call, and a holder
//! process that dies.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{
    bounded, client, client_with_watchdog, eventually, raw, server, until_free, until_subscribers,
};
use distlock::{Client, Error};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::Instant;

const LIMIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn scripts_survive_a_script_flush() {
    let server = server().await;
    let watchdog = Duration::from_millis(600);
    let client = client_with_watchdog(&server, watchdog).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("flushed").unwrap();
        lock.lock().await.unwrap().release().await.unwrap();
        let guard = lock.lock().await.unwrap();
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut conn)
            .await
            .unwrap();
        // Renewals reload their script too.
        tokio::time::sleep(watchdog * 2).await;
        assert!(!guard.is_lost());
        guard.release().await.unwrap();
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut conn)
            .await
            .unwrap();
        let again = lock.try_lock().await.unwrap().expect("free after release");
        assert!(again.fencing_token() > 0);
        again.release().await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn a_server_restart_loses_the_lock_and_the_client_recovers() {
    let mut server = server().await;
    let watchdog = Duration::from_millis(900);
    let client = client_with_watchdog(&server, watchdog).await;
    let other = client_with_watchdog(&server, watchdog).await;
    bounded(LIMIT, async {
        let lock = client.lock("restarted").unwrap();
        let held = lock.lock().await.unwrap();
        // A waiter in another client, blocked on the 900 ms lease.
        let waiting = other.lock("restarted").unwrap();
        let waiter = tokio::spawn(async move { waiting.lock().await });
        let conn = raw(&server).await;
        until_subscribers(&conn, "redisson_lock__channel:{restarted}", 1).await;
        drop(conn);

        server.restart().await.unwrap();
        // Without persistence the lock is gone: the holder must learn it was lost.
        held.lost().await;
        let guard = waiter.await.unwrap().unwrap();
        assert!(
            !guard.is_lost(),
            "the waiter holds the lock on the restarted server"
        );
        guard.release().await.unwrap();
        // The first client works again on the restarted server.
        let mine = lock.lock().await.unwrap();
        mine.release().await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn after_a_restart_the_fencing_counter_is_advanced_past_what_a_resource_saw() {
    let mut server = server().await;
    let client = client_with_watchdog(&server, Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let lock = client.lock("fenced-restart").unwrap();
        let mut highest_seen = 0;
        for _ in 0..5 {
            let guard = lock.lock().await.unwrap();
            highest_seen = guard.fencing_token();
            guard.release().await.unwrap();
        }
        server.restart().await.unwrap();
        // Without persistence the counter is gone: tokens start again below what the
        // resource accepted, and it would refuse them.
        let reset = lock.lock().await.unwrap();
        assert!(reset.fencing_token() <= highest_seen);
        reset.release().await.unwrap();

        assert_eq!(
            lock.advance_fencing_counter(highest_seen).await.unwrap(),
            highest_seen
        );
        let guard = lock.lock().await.unwrap();
        assert!(guard.fencing_token() > highest_seen);
        guard.release().await.unwrap();
        // Never lowered.
        let now = lock.advance_fencing_counter(1).await.unwrap();
        assert!(now > highest_seen, "{now}");
        // Past what a Redis counter holds: refused (guard_api.rs tests the range).
        assert!(matches!(
            lock.advance_fencing_counter(u64::MAX).await,
            Err(Error::InvalidConfig { .. })
        ));
    })
    .await;
}

/// Review of issue 30: a counter someone wrote above 2^63 - 1 (INCR fails on it, so every
/// acquisition is refused) is not a counter to keep: advancing it replaces it with the
/// floor, and tokens start above that. One at exactly 2^63 - 1 handed out the last token
/// and is kept (lowering it would repeat tokens).
#[tokio::test]
async fn advancing_replaces_a_counter_too_large_for_a_token() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("oversized").unwrap();
        lock.lock().await.unwrap().release().await.unwrap();
        let counters: Vec<String> = redis::cmd("KEYS")
            .arg("distlock_fence:*")
            .query_async(&mut conn)
            .await
            .unwrap();
        let _: () = redis::cmd("SET")
            .arg(&counters[0])
            .arg("99999999999999999999")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(
            lock.try_lock().await.is_err(),
            "INCR cannot take this counter"
        );
        assert_eq!(lock.advance_fencing_counter(5).await.unwrap(), 5);
        let guard = lock.lock().await.unwrap();
        assert_eq!(guard.fencing_token(), 6);
        guard.release().await.unwrap();
        let _: () = redis::cmd("SET")
            .arg(&counters[0])
            .arg(i64::MAX)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            lock.advance_fencing_counter(5).await.unwrap(),
            i64::MAX.unsigned_abs()
        );
    })
    .await;
}

#[tokio::test]
async fn a_call_to_a_paused_server_fails_within_the_response_timeout() {
    let server = server().await;
    let client = client_with_watchdog(&server, Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let lock = client.lock("stalled").unwrap();
        server.pause().unwrap();
        let started = Instant::now();
        let outcome = lock.try_lock().await;
        let took = started.elapsed();
        server.resume().unwrap();
        assert!(matches!(outcome, Err(Error::Redis(_))), "{outcome:?}");
        assert!(took < Duration::from_secs(2), "took {took:?}");
        // The connection recovers once the server answers again.
        eventually(Duration::from_secs(5), "client works again", || {
            let lock = lock.clone();
            async move { lock.is_locked().await.is_ok() }
        })
        .await;
        // Whether or not the stalled attempt ran, no lock outlives its lease.
        until_free(&lock).await;
    })
    .await;
}

/// Entry point of the child process below; skipped in a normal run.
#[tokio::test]
#[ignore = "run as a child process by a_killed_holders_lock_expires_with_its_lease"]
async fn child_holder() {
    let Ok(url) = std::env::var("DISTLOCK_CHILD_URL") else {
        panic!("child_holder runs only as a child process");
    };
    let client = Client::builder()
        .watchdog_timeout(Duration::from_millis(600))
        .connect(&url)
        .await
        .unwrap();
    let guard = client.lock("orphaned").unwrap().lock().await.unwrap();
    println!("HELD {}", guard.fencing_token());
    std::future::pending::<()>().await;
}

#[tokio::test]
async fn a_killed_holders_lock_expires_with_its_lease() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_holder",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("DISTLOCK_CHILD_URL", server.url())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        loop {
            let line = lines
                .next_line()
                .await
                .unwrap()
                .expect("child announces its lock");
            if line.contains("HELD ") {
                break;
            }
        }
        let lock = client.lock("orphaned").unwrap();
        assert!(lock.is_locked().await.unwrap());
        child.kill().await.unwrap();
        let killed_at = Instant::now();
        let guard = lock.lock().await.unwrap();
        let freed_after = killed_at.elapsed();
        assert!(
            freed_after <= Duration::from_millis(600) + Duration::from_millis(300),
            "{freed_after:?}"
        );
        guard.release().await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn a_release_retried_after_a_lost_reply_gets_the_first_answer() {
    let server = server().await;
    // Replies wait at most 200 ms; a release is sent up to three times, 25 and 50 ms apart.
    let client = client_with_watchdog(&server, Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let lock = client.lock("latched").unwrap();
        let guard = lock.lock().await.unwrap();
        server.pause().unwrap();
        let release = tokio::spawn(guard.release());
        // Long enough for the first attempt to time out and the second to be sent; the
        // server then runs both: the first releases, the second must read the latch.
        tokio::time::sleep(Duration::from_millis(300)).await;
        server.resume().unwrap();
        let outcome = release.await.unwrap();
        assert!(outcome.is_ok(), "a retried release said {outcome:?}");
        assert!(!lock.is_locked().await.unwrap());
    })
    .await;
}

/// The local deadline passes while a renewal is stuck in a paused server; the server then
/// applies the renewal. The guard reports lost (it could not know), but its release must
/// still be sent: refusing it locally would orphan a lock the server holds for a full lease.
#[tokio::test]
async fn a_release_after_a_deadline_passed_mid_renewal_still_frees_the_lock() {
    let server = server().await;
    let lease = Duration::from_secs(3);
    let client = Client::builder()
        .watchdog_timeout(lease)
        // Long enough that the renewal stuck in the paused server is not given up on.
        .response_timeout(Duration::from_secs(5))
        .connect(&server.url())
        .await
        .unwrap();
    let mut conn = raw(&server).await;
    bounded(Duration::from_secs(60), async {
        let mut formed = 0;
        for round in 0..4 {
            let lock = client.lock(format!("mid-renewal-{round}")).unwrap();
            let guard = lock.lock().await.unwrap();
            // Find the moment a renewal lands: the key's PTTL jumps back up.
            let mut last: i64 = redis::cmd("PTTL")
                .arg(lock.name())
                .query_async(&mut conn)
                .await
                .unwrap();
            let renewed_at = loop {
                tokio::time::sleep(Duration::from_millis(1)).await;
                let pttl: i64 = redis::cmd("PTTL")
                    .arg(lock.name())
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                if pttl > last + 50 {
                    break Instant::now();
                }
                last = pttl;
            };
            // Stop the server just before the next renewal is sent, and resume it after
            // the local deadline (lease less a 35 ms margin) but before the server's.
            tokio::time::sleep_until(renewed_at + lease / 3 - Duration::from_millis(100)).await;
            server.pause().unwrap();
            tokio::time::sleep_until(renewed_at + lease - Duration::from_millis(12)).await;
            server.resume().unwrap();
            let lost_locally = guard.is_lost();
            let exists: i64 = redis::cmd("EXISTS")
                .arg(lock.name())
                .query_async(&mut conn)
                .await
                .unwrap();
            let _ = guard.release().await;
            let after: i64 = redis::cmd("EXISTS")
                .arg(lock.name())
                .query_async(&mut conn)
                .await
                .unwrap();
            if lost_locally && exists == 1 {
                formed += 1;
                assert_eq!(
                    after, 0,
                    "round {round}: the release was refused and the lock orphaned"
                );
            }
            if formed >= 2 {
                break;
            }
        }
        assert!(formed >= 1, "the paused-renewal scenario never formed");
    })
    .await;
}

/// After a restart, the first call of each kind works: a connection found dropped is
/// reopened by that failure, and the call is sent once more instead of failing.
async fn first_calls_after_a_restart_succeed() {
    let mut server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("after-restart").unwrap();
        assert!(!lock.is_locked().await.unwrap());
        server.restart().await.unwrap();
        assert!(!lock.is_locked().await.unwrap(), "is_locked");
        server.restart().await.unwrap();
        assert_eq!(lock.remaining_ttl().await.unwrap(), None, "remaining_ttl");
        server.restart().await.unwrap();
        assert!(!lock.force_unlock().await.unwrap(), "force_unlock");
        server.restart().await.unwrap();
        let guard = lock
            .try_lock()
            .await
            .unwrap()
            .expect("free after a restart");
        guard.release().await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn first_calls_after_a_restart_succeed_on_a_current_thread_runtime() {
    first_calls_after_a_restart_succeed().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_calls_after_a_restart_succeed_on_a_multi_thread_runtime() {
    first_calls_after_a_restart_succeed().await;
}
