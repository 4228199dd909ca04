//! The guard's API as users of rslock, redsync and Redisson expect it (issue 21): a lease
//! per acquisition without consuming the handle, `extend`, leaving a lock to expire,
//! release outcomes, asking the server now, and fencing tokens that stay exact.

mod common;

use std::time::{Duration, Instant};

use common::{bounded, client, raw, server, until_free};
use distlock::{Client, Error, FencingCounter, ReleaseOutcome};

const LIMIT: Duration = Duration::from_secs(20);

async fn pttl(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query_async(conn).await.unwrap()
}

#[tokio::test]
async fn a_lease_per_call_leaves_the_handle_usable() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("per-call").unwrap();
        let fixed = lock
            .with_lease(Duration::from_millis(700))
            .lock()
            .await
            .unwrap();
        assert!(pttl(&mut conn, "per-call").await <= 700);
        fixed.release().await.unwrap();
        // The same handle, still in watchdog mode.
        let renewed = lock.lock().await.unwrap();
        assert!(pttl(&mut conn, "per-call").await > 20_000);
        renewed.release().await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn extend_moves_the_servers_lease_the_local_deadline_and_the_lost_signal() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("extended").unwrap();
        let guard = lock
            .with_lease(Duration::from_millis(300))
            .lock()
            .await
            .unwrap();
        let lost = guard.lost();
        let token = guard.lost_token();
        guard.extend(Duration::from_secs(5)).await.unwrap();
        assert!(pttl(&mut conn, "extended").await > 4_000);
        assert!(guard.lease_remaining() > Duration::from_secs(4));
        // Past the first lease: still held, and no signal fired.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!guard.is_lost());
        assert!(!token.is_cancelled());
        assert!(lock.is_locked().await.unwrap());
        // Shortening works too: the signal follows the new deadline.
        guard.extend(Duration::from_millis(200)).await.unwrap();
        let started = Instant::now();
        bounded(Duration::from_secs(2), lost).await;
        assert!(started.elapsed() < Duration::from_millis(400));
        assert!(token.is_cancelled());
        // The signal fires a margin early; once the server lets the key go too, the
        // release finds it gone.
        until_free(&lock).await;
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
    })
    .await;
}

#[tokio::test]
async fn extend_fails_typed_once_the_lock_is_not_the_guards() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("extend-lost").unwrap();
        let guard = lock
            .with_lease(Duration::from_secs(30))
            .lock()
            .await
            .unwrap();
        assert!(lock.force_unlock().await.unwrap());
        let err = guard.extend(Duration::from_secs(30)).await.unwrap_err();
        assert!(matches!(err, Error::NotHeld { .. }), "{err}");
        assert!(guard.is_lost());
        assert!(!lock.is_locked().await.unwrap(), "extend wrote nothing");

        let watched = lock.lock().await.unwrap();
        let err = watched.extend(Duration::from_secs(1)).await.unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
        assert!(!watched.is_lost());
        assert_eq!(watched.release().await.unwrap(), ReleaseOutcome::Released);
    })
    .await;
}

/// Review: a nested release reset a fixed lease to its full length, so a holding that
/// kept re-entering never expired, against `with_lease`'s own promise.
#[tokio::test]
async fn a_nested_release_leaves_a_fixed_lease_where_it_was() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("nested-fixed").unwrap();
        let guard = lock
            .with_lease(Duration::from_millis(800))
            .lock()
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
        let nested = guard.reenter().await.unwrap();
        assert_eq!(nested.release().await.unwrap(), ReleaseOutcome::Released);
        let left = pttl(&mut conn, "nested-fixed").await;
        assert!(left <= 450, "the lease was reset to {left} ms");
        assert!(guard.lease_remaining() <= Duration::from_millis(450));
        bounded(Duration::from_secs(2), guard.lost()).await;
        until_free(&lock).await;
    })
    .await;
}

#[tokio::test]
async fn a_lock_left_to_expire_stays_taken_until_its_lease_ends_and_keeps_nothing() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("cron:once").unwrap();
        let started = Instant::now();
        let guard = lock
            .with_lease(Duration::from_millis(600))
            .lock()
            .await
            .unwrap();
        let reenter = guard.reenter().await.unwrap();
        assert!(reenter.release().await.unwrap() == ReleaseOutcome::Released);
        let left = guard.leave_to_expire();
        assert!(left > Duration::ZERO && left <= Duration::from_millis(600));
        assert_eq!(client.tracked_leases(), 0, "nothing renews or watches it");
        assert!(lock.try_lock().await.unwrap().is_none());
        assert!(pttl(&mut conn, "cron:once").await > 0);
        // Nothing on the client holds it: a shutdown does not release it either.
        client.shutdown().await;
        let other = Client::connect(&server.url()).await.unwrap();
        let next = other
            .lock("cron:once")
            .unwrap()
            .try_lock_for(Duration::from_secs(5))
            .await
            .unwrap()
            .expect("free once the lease ran out");
        assert!(started.elapsed() >= Duration::from_millis(550));
        next.release().await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn a_watchdog_lock_left_to_expire_is_no_longer_renewed() {
    let server = server().await;
    let client = common::client_with_watchdog(&server, Duration::from_millis(600)).await;
    bounded(LIMIT, async {
        let lock = client.lock("left-watchdog").unwrap();
        let guard = lock.lock().await.unwrap();
        let started = Instant::now();
        guard.leave_to_expire();
        assert_eq!(client.tracked_leases(), 0);
        until_free(&lock).await;
        assert!(started.elapsed() < Duration::from_millis(1_000));
    })
    .await;
}

#[tokio::test]
async fn verify_notices_a_force_unlock_before_any_renewal() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("verified").unwrap();
        let guard = lock
            .with_lease(Duration::from_secs(60))
            .lock()
            .await
            .unwrap();
        let token = guard.lost_token();
        assert!(guard.verify().await.unwrap());
        assert!(lock.force_unlock().await.unwrap());
        assert!(!guard.verify().await.unwrap());
        assert!(guard.is_lost());
        assert!(token.is_cancelled());
        bounded(Duration::from_millis(100), guard.lost()).await;
        assert!(guard.release().await.unwrap().was_lost());
    })
    .await;
}

/// Review: Lua returns numbers through a double, so tokens repeated past 2^53.
#[tokio::test]
async fn fencing_tokens_stay_exact_and_increasing_up_to_i64_max() {
    let server = server().await;
    bounded(LIMIT, async {
        for counter in [FencingCounter::PerSlot, FencingCounter::PerName] {
            let client = Client::builder()
                .fencing_counter(counter)
                .connect(&server.url())
                .await
                .unwrap();
            let lock = client.lock(format!("big-tokens:{counter:?}")).unwrap();
            let floor = (1u64 << 53) - 1;
            assert_eq!(lock.advance_fencing_counter(floor).await.unwrap(), floor);
            let mut last = floor;
            for _ in 0..4 {
                let guard = lock.lock().await.unwrap();
                assert_eq!(guard.fencing_token(), last + 1, "{counter:?}");
                assert_eq!(guard.fencing_token_i64(), i64::try_from(last + 1).unwrap());
                last = guard.fencing_token();
                guard.release().await.unwrap();
            }
            // The last token Redis can count to.
            let top = i64::MAX.unsigned_abs();
            assert!(matches!(
                lock.advance_fencing_counter(top).await,
                Err(Error::InvalidConfig { .. })
            ));
            assert!(matches!(
                lock.advance_fencing_counter(u64::MAX).await,
                Err(Error::InvalidConfig { .. })
            ));
            assert_eq!(
                lock.advance_fencing_counter(top - 1).await.unwrap(),
                top - 1
            );
            let guard = lock.lock().await.unwrap();
            assert_eq!(guard.fencing_token(), top);
            assert_eq!(guard.fencing_token_i64(), i64::MAX);
            guard.release().await.unwrap();
            // No token is left: refused, never repeated or wrapped.
            assert!(lock.try_lock().await.is_err());
            assert!(
                !lock.is_locked().await.unwrap(),
                "a refused acquisition holds nothing"
            );
            client.shutdown().await;
        }
    })
    .await;
}

/// Review: one client counting per slot and one per name handed out 1, 1, 2, 2, 3, 3.
#[tokio::test]
async fn clients_with_different_counter_settings_never_repeat_a_token() {
    let server = server().await;
    bounded(LIMIT, async {
        let per_slot = Client::builder()
            .fencing_counter(FencingCounter::PerSlot)
            .connect(&server.url())
            .await
            .unwrap();
        let per_name = Client::builder()
            .fencing_counter(FencingCounter::PerName)
            .connect(&server.url())
            .await
            .unwrap();
        let mut tokens = Vec::new();
        for round in 0..12 {
            let client = if round % 3 == 0 { &per_name } else { &per_slot };
            let guard = client.lock("mixed-fleet").unwrap().lock().await.unwrap();
            tokens.push(guard.fencing_token());
            guard.release().await.unwrap();
        }
        assert!(
            tokens.windows(2).all(|pair| pair[0] < pair[1]),
            "tokens not strictly increasing: {tokens:?}"
        );
    })
    .await;
}

/// Everything the API takes or returns is named through `distlock` itself, at the
/// version it was built with (users had to add `redis` and `tokio-util` to name these).
#[tokio::test]
async fn the_public_types_are_named_from_distlock_alone() {
    let server = server().await;
    bounded(LIMIT, async {
        let redis_client: distlock::redis::Client =
            distlock::redis::Client::open(server.url()).unwrap();
        let client = Client::builder().connect_with(redis_client).await.unwrap();
        let guard = client.lock("re-exported").unwrap().lock().await.unwrap();
        let token: distlock::CancellationToken = guard.lost_token();
        assert!(!token.is_cancelled());
        #[cfg(feature = "tls")]
        let _certificates = distlock::redis::TlsCertificates {
            client_tls: None,
            root_cert: None,
        };
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
    })
    .await;
}

/// Review: an `extend` that shortened the lease and was cut short (its future dropped, or
/// its reply timed out) reached the server, but the guard kept trusting the old deadline
/// while another client took the lock.
#[tokio::test]
async fn an_extend_cut_short_never_leaves_two_holders() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("cut-short").unwrap();
        let guard = lock
            .with_lease(Duration::from_secs(10))
            .lock()
            .await
            .unwrap();
        // Writes wait 300 ms on the server: the extension is queued, then applied.
        let _: () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(300)
            .arg("WRITE")
            .query_async(&mut conn)
            .await
            .unwrap();
        let cut = tokio::time::timeout(
            Duration::from_millis(50),
            guard.extend(Duration::from_millis(400)),
        )
        .await;
        assert!(cut.is_err(), "the extension was cut short");
        assert!(guard.lease_remaining() <= Duration::from_millis(400));
        tokio::time::sleep(Duration::from_millis(900)).await;
        let other = client.lock("cut-short").unwrap().try_lock().await.unwrap();
        assert!(
            other.is_none() || guard.is_lost(),
            "another client holds it while the guard still trusts it"
        );
    })
    .await;
}

/// Review: `verify` answered a key of another type at the lock's name with an error
/// instead of "not held".
#[tokio::test]
async fn verify_says_not_held_when_another_kind_of_key_took_the_name() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("retyped").unwrap();
        let guard = lock
            .with_lease(Duration::from_secs(30))
            .lock()
            .await
            .unwrap();
        let _: () = redis::cmd("SET")
            .arg("retyped")
            .arg("a string now")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(!guard.verify().await.unwrap());
        assert!(guard.is_lost());
    })
    .await;
}

/// Review: a garbage per-name counter (too large, or at i64::MAX) was copied into the
/// shared per-slot counter, after which every acquisition of the slot failed for good; a
/// negative counter made a token below 1, read as "busy", with the lock left held by an
/// owner nobody tracked.
#[tokio::test]
async fn counters_that_are_not_tokens_never_spread_nor_leave_a_lock_behind() {
    let server = server().await;
    let per_slot = client(&server).await;
    let per_name = Client::builder()
        .fencing_counter(FencingCounter::PerName)
        .connect(&server.url())
        .await
        .unwrap();
    let mut conn = raw(&server).await;
    let set = |key: &'static str, value: &'static str| {
        let mut conn = conn.clone();
        async move {
            let _: () = redis::cmd("SET")
                .arg(key)
                .arg(value)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    };
    bounded(LIMIT, async {
        for garbage in ["99999999999999999999", "12abc", "-7", "007", "1.5"] {
            set("redisson_lock_token:{x}", garbage).await;
            let guard = per_slot.lock("x").unwrap().try_lock().await.unwrap();
            assert!(guard.expect("free").fencing_token() >= 1, "{garbage}");
            // The slot's counter still serves every name of the slot.
            let other = per_slot.lock("{x}other").unwrap().try_lock().await.unwrap();
            other.expect("free").release().await.unwrap();
        }
        // A per-name counter at its last token refuses its own lock (no token can be
        // above it), and nothing else: the slot's counter still serves the other names.
        set("redisson_lock_token:{x}", "9223372036854775807").await;
        assert!(per_slot.lock("x").unwrap().try_lock().await.is_err());
        let other = per_slot.lock("{x}other").unwrap().try_lock().await.unwrap();
        other.expect("free").release().await.unwrap();
        for bad in ["-3", "not a number"] {
            set("redisson_lock_token:{y}", bad).await;
            let lock = per_name.lock("y").unwrap();
            let err = lock.try_lock().await.unwrap_err();
            assert!(matches!(err, Error::Redis(_)), "{bad}: {err}");
            assert!(
                !lock.is_locked().await.unwrap(),
                "{bad}: a lock was left behind"
            );
            // The operator's recovery call repairs it.
            assert_eq!(lock.advance_fencing_counter(10).await.unwrap(), 10);
            let guard = lock.try_lock().await.unwrap().expect("free");
            assert_eq!(guard.fencing_token(), 11);
            guard.release().await.unwrap();
        }
    })
    .await;
    let _ = &mut conn;
}

/// Second review: a counter at i64::MAX (its last token handed out) was taken for garbage
/// and lowered to the other setting's smaller counter, so tokens went backwards (2 after
/// i64::MAX). It must stay, and the next acquisition be refused.
#[tokio::test]
async fn a_counter_at_its_last_token_is_never_lowered() {
    let server = server().await;
    let per_name = Client::builder()
        .fencing_counter(FencingCounter::PerName)
        .connect(&server.url())
        .await
        .unwrap();
    let per_slot = client(&server).await;
    bounded(LIMIT, async {
        per_name
            .lock("last")
            .unwrap()
            .lock()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        let lock = per_slot.lock("last").unwrap();
        let top = i64::MAX.unsigned_abs();
        lock.advance_fencing_counter(top - 1).await.unwrap();
        let guard = lock.lock().await.unwrap();
        assert_eq!(guard.fencing_token(), top);
        guard.release().await.unwrap();
        assert!(lock.try_lock().await.is_err(), "no token is left");
        // Nor for the other setting: its counter is far lower, but a token must be above
        // every token of the lock.
        let other = per_name.lock("last").unwrap();
        assert!(other.try_lock().await.is_err(), "a token below i64::MAX");
        assert!(!lock.is_locked().await.unwrap());
    })
    .await;
}
