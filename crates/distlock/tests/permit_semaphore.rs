//! The permit semaphore: permits that are leases. Never more holders than permits; a
//! holder that stops (no renewals, no release) gives its permits back within its lease;
//! renewed permits last while held and signal a loss; cancellation leaves nothing taken;
//! Redisson's layout.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bounded, client, client_with_watchdog, raw, server};
use distlock::{Error, PermitSemaphore, PermitsSet};

const LIMIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn contenders_never_hold_more_permits_than_there_are() {
    let server = server().await;
    let clients = [client(&server).await, client(&server).await];
    let gpus = clients[0].permit_semaphore("gpus").unwrap();
    assert!(gpus.try_set_permits(2).await.unwrap().is_set());
    let holding = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    bounded(LIMIT, async {
        let mut tasks = Vec::new();
        for n in 0..3 {
            let semaphore = clients[n % 2].permit_semaphore("gpus").unwrap();
            let (holding, most) = (Arc::clone(&holding), Arc::clone(&most));
            tasks.push(tokio::spawn(async move {
                for _ in 0..15 {
                    let permits = semaphore.acquire(1).await.unwrap();
                    let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    holding.fetch_sub(1, Ordering::SeqCst);
                    assert!(permits.release().await.unwrap() == distlock::ReleaseOutcome::Released);
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
    })
    .await;
    assert_eq!(most.load(Ordering::SeqCst), 2);
    assert_eq!(gpus.available_permits().await.unwrap(), 2);
}

/// A holder that stops without giving its permits back (its client gone, the guard never
/// released: what a killed process leaves) loses them at the end of the lease, and the
/// next acquisition takes them back. Redisson's permits do this too, but only with a
/// fixed lease; here the permit was renewed until its holder stopped.
#[tokio::test]
async fn a_stopped_holders_permits_come_back_within_the_lease() {
    let server = server().await;
    let holder = client_with_watchdog(&server, Duration::from_millis(600)).await;
    let other = client(&server).await;
    bounded(LIMIT, async {
        let pool = holder.permit_semaphore("pool").unwrap();
        assert!(pool.try_set_permits(1).await.unwrap().is_set());
        let permits = pool.acquire(1).await.unwrap();
        // Renewed past its lease while the holder lives.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert!(!permits.is_lost());
        let waiting = other.permit_semaphore("pool").unwrap();
        assert!(waiting.try_acquire(1).await.unwrap().is_none());
        // The holder stops: nothing renews, nothing releases.
        std::mem::forget(permits);
        holder.shutdown().await;
        let stopped_at = Instant::now();
        let back = waiting.acquire(1).await.unwrap();
        assert!(
            stopped_at.elapsed() < Duration::from_millis(1500),
            "the permit came back after {:?}",
            stopped_at.elapsed()
        );
        back.release().await.unwrap();
    })
    .await;
}

/// A fixed lease is not renewed: the permit's loss is signalled at its deadline, and its
/// release says it was lost.
#[tokio::test]
async fn a_fixed_lease_runs_out_and_says_so() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let pool = client.permit_semaphore("fixed").unwrap();
        assert!(pool.try_set_permits(1).await.unwrap().is_set());
        let permits = pool
            .with_lease(Duration::from_millis(200))
            .acquire(1)
            .await
            .unwrap();
        let lost = permits.lost_token();
        tokio::time::timeout(Duration::from_secs(2), permits.lost())
            .await
            .expect("lost at the deadline");
        assert!(lost.is_cancelled() && permits.is_lost());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(permits.release().await.unwrap().was_lost());
        assert_eq!(pool.available_permits().await.unwrap(), 1);
    })
    .await;
}

/// Cancelled at every point, acquisitions leave no permit taken; a dropped guard gives
/// its permits back. The layout is Redisson's: the free count at the name, the taken
/// permits' ids scored with their deadlines in `{name}:timeout`.
#[tokio::test]
async fn cancellation_leaves_nothing_and_the_layout_is_redissons() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let pool = client.permit_semaphore("layout").unwrap();
        assert!(pool.try_set_permits(3).await.unwrap().is_set());
        let permits = pool.acquire(2).await.unwrap();
        let ids: Vec<String> = permits.ids().map(str::to_owned).collect();
        let mut stored: Vec<String> = redis::cmd("ZRANGE")
            .arg("{layout}:timeout")
            .arg(0)
            .arg(-1)
            .query_async(&mut conn)
            .await
            .unwrap();
        stored.sort();
        let mut expected = ids.clone();
        expected.sort();
        assert_eq!(stored, expected);
        let free: String = redis::cmd("GET")
            .arg("layout")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(free, "1");
        drop(permits);
        common::eventually(Duration::from_secs(5), "dropped permits given back", || {
            let pool = pool.clone();
            async move { pool.available_permits().await.unwrap() == 3 }
        })
        .await;
        for micros in [0u64, 50, 100, 200, 400, 800, 1600] {
            let attempt = tokio::time::timeout(Duration::from_micros(micros), pool.acquire(3));
            drop(attempt.await);
            common::eventually(Duration::from_secs(5), "the permits are back", || {
                let pool = pool.clone();
                async move { pool.available_permits().await.unwrap() == 3 }
            })
            .await;
        }
        let left: i64 = redis::cmd("ZCARD")
            .arg("{layout}:timeout")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(left, 0);
        assert!(matches!(
            pool.acquire(0).await,
            Err(Error::InvalidArgument { .. })
        ));
    })
    .await;
}

/// Entry point of the child process of the test below; skipped in a normal run. It takes
/// the permit, says so on stdout, and waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as a child process by a_killed_holders_permits_come_back"]
async fn child_holder() {
    let Ok(url) = std::env::var("DISTLOCK_CHILD_URL") else {
        panic!("child_holder runs only as a child of a_killed_holders_permits_come_back");
    };
    let client = distlock::Client::builder()
        .watchdog_timeout(Duration::from_millis(900))
        .connect(&url)
        .await
        .unwrap();
    let permits = client
        .permit_semaphore("killed")
        .unwrap()
        .acquire(1)
        .await
        .unwrap();
    println!("HELD");
    tokio::time::sleep(Duration::from_secs(60)).await;
    drop(permits);
}

/// kill -9 of a process holding a renewed permit: the permit comes back within its lease
/// (Redisson's permit-expirable semaphore has no renewal; its permits last only their
/// fixed lease, held or not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holders_permits_come_back() {
    use tokio::io::AsyncBufReadExt;
    let server = server().await;
    let client = client(&server).await;
    let pool = client.permit_semaphore("killed").unwrap();
    assert!(pool.try_set_permits(1).await.unwrap().is_set());
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_holder",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("DISTLOCK_CHILD_URL", server.url())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    bounded(LIMIT, async {
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("HELD") {
                break;
            }
        }
        // Held and renewed past its 0.9 s lease.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(
            pool.try_acquire(1).await.unwrap().is_none(),
            "renewed while alive"
        );
        child.start_kill().unwrap();
        child.wait().await.unwrap();
        let killed_at = Instant::now();
        let permits = pool.acquire(1).await.unwrap();
        assert!(
            killed_at.elapsed() < Duration::from_millis(1500),
            "came back after {:?}",
            killed_at.elapsed()
        );
        permits.release().await.unwrap();
    })
    .await;
}

/// Review: every permit asked for got an id built before Redis was asked, so an ask for
/// `u32::MAX` permits tried to allocate 64 GiB and aborted the process. Asks above the
/// documented bound, and zero, are typed errors; nothing is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asks_outside_the_bound_are_typed_errors() {
    let server = server().await;
    let client = client(&server).await;
    let pool = client.permit_semaphore("bounded-ask").unwrap();
    assert!(pool.try_set_permits(3).await.unwrap().is_set());
    for ask in [0, PermitSemaphore::MAX_PERMITS_PER_CALL + 1, i64::MAX] {
        let outcome = bounded(LIMIT, pool.try_acquire(ask)).await;
        assert!(
            matches!(
                outcome,
                Err(Error::InvalidArgument {
                    what: "permits",
                    ..
                })
            ),
            "{ask}: {outcome:?}"
        );
        let waited = bounded(LIMIT, pool.acquire(ask)).await;
        assert!(
            matches!(waited, Err(Error::InvalidArgument { .. })),
            "{ask}"
        );
    }
    assert_eq!(pool.available_permits().await.unwrap(), 3);
    let most = bounded(LIMIT, pool.try_acquire(3))
        .await
        .unwrap()
        .expect("free");
    assert_eq!(most.permits(), 3);
    most.release().await.unwrap();
}

/// `verify` asks the server: a permit whose entry is gone (the server restarted without
/// its data, or the set was deleted) is reported, and its lost signal fires, before any
/// renewal would notice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_notices_a_permit_that_is_gone() {
    let server = server().await;
    let client = client(&server).await;
    let pool = client.permit_semaphore("verified").unwrap();
    assert!(pool.try_set_permits(2).await.unwrap().is_set());
    let held = bounded(LIMIT, pool.try_acquire(2))
        .await
        .unwrap()
        .expect("free");
    assert!(held.verify().await.unwrap());
    let mut conn = raw(&server).await;
    let _: () = redis::cmd("DEL")
        .arg("{verified}:timeout")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!held.verify().await.unwrap());
    assert!(held.is_lost());
    bounded(LIMIT, held.lost()).await;

    // Review: a permit whose lease ran out on the server stays in the set until the next
    // acquisition reclaims it; verify must still say it is gone.
    let short = client
        .permit_semaphore("expiring")
        .unwrap()
        .with_lease(Duration::from_millis(300));
    assert!(short.try_set_permits(1).await.unwrap().is_set());
    let expiring = bounded(LIMIT, short.try_acquire(1))
        .await
        .unwrap()
        .expect("free");
    bounded(LIMIT, expiring.lost()).await;
    common::eventually(
        Duration::from_secs(5),
        "verify says the permit ran out",
        || async { !expiring.verify().await.unwrap() },
    )
    .await;
}

/// Issue 30, 4.3: a permit semaphore had no way to read its total (the distlock command
/// read it with a raw GET and ZCOUNT), and `try_set_permits` kept an earlier count with a
/// bare `false`. `total_permits` reads free plus taken in one script, and
/// `try_set_permits` says the total it kept.
#[tokio::test]
async fn the_total_can_be_read_and_try_set_permits_says_the_total_it_kept() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let pool = client.permit_semaphore("totals").unwrap();
        assert_eq!(pool.total_permits().await.unwrap(), 0);
        assert_eq!(pool.try_set_permits(3).await.unwrap(), PermitsSet::Set);
        assert_eq!(pool.total_permits().await.unwrap(), 3);
        let permits = pool.acquire(2).await.unwrap();
        assert_eq!(permits.permits(), 2);
        assert_eq!(pool.available_permits().await.unwrap(), 1);
        assert_eq!(pool.total_permits().await.unwrap(), 3);
        // A second user asking for another count is told what the semaphore keeps.
        assert_eq!(
            pool.try_set_permits(5).await.unwrap(),
            PermitsSet::Kept { found: 3 }
        );
        assert_eq!(pool.add_permits(1).await.unwrap(), 2);
        assert_eq!(pool.total_permits().await.unwrap(), 4);
        permits.release().await.unwrap();
        assert_eq!(pool.total_permits().await.unwrap(), 4);
        assert_eq!(pool.available_permits().await.unwrap(), 4);
        // A permit whose lease ran out still counts once, before and after it is back.
        let short = pool.with_lease(Duration::from_millis(100));
        let expiring = short.acquire(1).await.unwrap();
        expiring.lost().await;
        assert_eq!(pool.total_permits().await.unwrap(), 4);
        drop(expiring);
        assert_eq!(pool.total_permits().await.unwrap(), 4);
        for bad in [0, -1, PermitSemaphore::MAX_PERMITS_PER_CALL + 1] {
            assert!(matches!(
                pool.try_acquire(bad).await,
                Err(Error::InvalidArgument { .. })
            ));
        }
        assert!(matches!(
            pool.try_set_permits(-1).await,
            Err(Error::InvalidArgument { .. })
        ));
    })
    .await;
}

/// The scenarios every store's permit semaphore passes (tests/common/permits.rs), here on
/// Redis, which they were written against.
#[tokio::test]
async fn the_scenarios_every_store_passes() {
    let server = server().await;
    let lease = Duration::from_millis(800);
    let clients = [
        client_with_watchdog(&server, lease).await,
        client_with_watchdog(&server, lease).await,
    ];
    bounded(LIMIT, async {
        let most = common::permits::holders_never_hold_more_permits_than_there_are(
            &clients,
            "shared:table",
        )
        .await;
        assert!(most > 1, "the permits were never shared");
        common::permits::a_release_wakes_a_waiter_at_once(&clients[0], &clients[1], "shared:wake")
            .await;
        common::permits::a_fixed_lease_runs_out_and_says_so(&clients[0], "shared:fixed").await;
        common::permits::watchdog_permits_outlive_their_lease(
            &clients[0],
            &clients[1],
            "shared:renewed",
            lease,
        )
        .await;
        assert_eq!(
            common::permits::counts_and_bad_asks(&clients[0], "shared:counts").await,
            -2
        );
        common::permits::cancellation_leaves_no_permit_taken(&clients[0], "shared:cancel").await;
    })
    .await;
}
