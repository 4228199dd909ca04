//! The lease lock on ZooKeeper (feature `zk`): the same `Client` and `Lock` API, on a
//! ZooKeeper ensemble each test starts (distlock_testkit::ZkEnsemble: one server, or
//! three where a leader is killed).
//!
//! Each test asserts an outcome that could fail: overlaps and token regressions counted
//! and asserted zero, waiters served in the order they asked, a holder that learns of
//! its loss before anyone else holds, no node left behind by a waiter that gave up,
//! typed errors for bad input.

mod common;
// Holdings on a fixed lease (`Lock::with_lease`), and the examples that take them.
mod zk_fixed;
// The read-write lock.
mod zk_rw;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bounded, child_holding, contend, join_bounded};
use distlock::{Client, Error, ReleaseOutcome, StoreKind};
use distlock_testkit::{ExclusionChecker, FaultProxy, ZkEnsemble};

const LIMIT: Duration = Duration::from_secs(60);

async fn ensemble(servers: usize) -> ZkEnsemble {
    ZkEnsemble::start(servers).await.expect("start ZooKeeper")
}

/// A client whose ZooKeeper session timeout is `session` (the watchdog timeout).
async fn client_at(url: &str, session: Duration) -> Client {
    Client::builder()
        .watchdog_timeout(session)
        .response_timeout(Duration::from_secs(2))
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .expect("connect to ZooKeeper")
}

/// The nodes under lock `name`'s node (holder and waiters), read with a client of the
/// test's own.
async fn queue_len(zk: &ZkEnsemble, name: &str) -> usize {
    let client = zookeeper_client::Client::connect(&zk.connect_string())
        .await
        .expect("a ZooKeeper client of the test's");
    match client.list_children(&format!("/distlock/{name}")).await {
        Ok(children) => children.len(),
        Err(zookeeper_client::Error::NoNode) => 0,
        Err(err) => panic!("listing the queue: {err}"),
    }
}

#[tokio::test]
async fn holders_on_two_clients_never_overlap_and_their_tokens_grow() {
    let zk = ensemble(1).await;
    let clients = [
        client_at(&zk.url(), Duration::from_secs(5)).await,
        client_at(&zk.url(), Duration::from_secs(5)).await,
    ];
    assert_eq!(clients[0].store(), StoreKind::Zk);
    let (report, count) = contend(&clients, "zk:contended", 3, 8).await;
    assert_eq!(report.holds, 48);
    assert!(report.overlaps.is_empty(), "{:?}", report.overlaps);
    assert!(
        report.token_regressions.is_empty(),
        "{:?}",
        report.token_regressions
    );
    assert_eq!(count, 48, "an update was lost");
}

/// Tokens grow across clients and sessions: a later client's first acquisition gets a
/// larger token than every earlier one's, and than the last token an operator read.
#[tokio::test]
async fn tokens_grow_across_clients_and_sessions() {
    let zk = ensemble(1).await;
    bounded(LIMIT, async {
        let mut last = 0;
        for round in 0..4 {
            let client = client_at(&zk.url(), Duration::from_secs(5)).await;
            let guard = client.lock("zk:tokens").unwrap().lock().await.unwrap();
            let token = guard.fencing_token();
            assert!(token > last, "round {round}: {token} after {last}");
            let lock = client.lock("zk:tokens").unwrap();
            // Below the holder's (which may not hold yet, for all the reader knows)...
            assert_eq!(lock.last_fencing_token().await.unwrap(), token - 1);
            guard.release().await.unwrap();
            // ...and at least it once the queue is empty.
            last = lock.last_fencing_token().await.unwrap();
            assert!(last >= token, "{last} after {token}");
            client.shutdown().await;
        }
    })
    .await;
}

/// Waiters get the lock in the order they asked, and each is woken by its predecessor's
/// release, well before anything times out.
#[tokio::test]
async fn waiters_are_served_in_the_order_they_asked() {
    let zk = ensemble(1).await;
    let holder = client_at(&zk.url(), Duration::from_secs(30)).await;
    let waiting = client_at(&zk.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let lock = holder.lock("zk:fifo").unwrap();
        let guard = lock.lock().await.unwrap();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for n in 0..4 {
            let lock = waiting.lock("zk:fifo").unwrap();
            let order = Arc::clone(&order);
            tasks.push(tokio::spawn(async move {
                let guard = lock.lock().await.unwrap();
                order.lock().unwrap().push(n);
                guard.release().await.unwrap();
            }));
            // Each waiter's node is created before the next one asks.
            while queue_len(&zk, "zk:fifo").await < n + 2 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let released_at = Instant::now();
        guard.release().await.unwrap();
        join_bounded(LIMIT, tasks).await;
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3]);
        assert!(
            released_at.elapsed() < Duration::from_secs(2),
            "four handoffs took {:?}: not woken by the watches",
            released_at.elapsed()
        );
    })
    .await;
}

#[tokio::test]
async fn the_session_keeps_a_lock_past_its_timeout_and_a_release_frees_it() {
    let zk = ensemble(1).await;
    let holder = client_at(&zk.url(), Duration::from_secs(2)).await;
    let other = client_at(&zk.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let guard = holder.lock("zk:renewed").unwrap().lock().await.unwrap();
        let lock = other.lock("zk:renewed").unwrap();
        tokio::select! {
            _ = guard.lost() => panic!("a held lock was reported lost"),
            _ = tokio::time::sleep(Duration::from_millis(5000)) => {}
        }
        assert!(guard.verify().await.unwrap());
        assert!(lock.try_lock().await.unwrap().is_none());
        assert!(lock.is_locked().await.unwrap());
        assert_eq!(lock.owners().await.unwrap(), vec![guard.owner().to_owned()]);
        let again = guard.reenter().await.unwrap();
        assert_eq!(again.release().await.unwrap(), ReleaseOutcome::Released);
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
        assert!(!lock.is_locked().await.unwrap());
        assert!(lock.try_lock().await.unwrap().is_some());
    })
    .await;
}

#[tokio::test]
async fn a_force_unlock_fires_the_lost_signal_at_its_deletion() {
    let zk = ensemble(1).await;
    let holder = client_at(&zk.url(), Duration::from_secs(30)).await;
    let operator = client_at(&zk.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let guard = holder.lock("zk:forced").unwrap().lock().await.unwrap();
        let lost = guard.lost_token();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let forced_at = Instant::now();
        let lock = operator.lock("zk:forced").unwrap();
        assert!(!lock.force_unlock_held_by("someone:else").await.unwrap());
        assert!(lock.force_unlock().await.unwrap());
        bounded(Duration::from_secs(5), lost.cancelled()).await;
        assert!(forced_at.elapsed() < Duration::from_secs(2));
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
    })
    .await;
}

/// A force-unlock is noticed by the watchdog too: a holder that never asked for its
/// lost signal finds itself lost at the next renewal, which reads its node.
#[tokio::test]
async fn a_force_unlocked_holder_that_never_listened_is_lost_at_the_next_renewal() {
    let zk = ensemble(1).await;
    let holder = client_at(&zk.url(), Duration::from_secs(2)).await;
    let operator = client_at(&zk.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let guard = holder
            .lock("zk:forced-quietly")
            .unwrap()
            .lock()
            .await
            .unwrap();
        let lock = operator.lock("zk:forced-quietly").unwrap();
        assert!(lock.force_unlock().await.unwrap());
        let forced_at = Instant::now();
        while !guard.is_lost() {
            assert!(
                forced_at.elapsed() < Duration::from_secs(2),
                "still trusted after a renewal interval"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
    })
    .await;
}

/// A guard left to expire keeps the lock as a crashed holder's would: its node goes a
/// session timeout later, though the client's session lives on.
#[tokio::test]
async fn a_guard_left_to_expire_frees_the_lock_a_session_timeout_later() {
    let zk = ensemble(1).await;
    let session = Duration::from_secs(2);
    let holder = client_at(&zk.url(), session).await;
    let other = client_at(&zk.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let guard = holder.lock("zk:left").unwrap().lock().await.unwrap();
        let token = guard.fencing_token();
        let left_at = Instant::now();
        guard.leave_to_expire();
        let lock = other.lock("zk:left").unwrap();
        assert!(lock.try_lock().await.unwrap().is_none());
        let next = lock.lock().await.unwrap();
        let freed_after = left_at.elapsed();
        assert!(
            freed_after > session - Duration::from_millis(300),
            "{freed_after:?}"
        );
        assert!(freed_after < session * 3, "{freed_after:?}");
        assert!(next.fencing_token() > token);
        next.release().await.unwrap();
    })
    .await;
}

/// A waiter that gives up while the ensemble is out of its reach cannot delete its node
/// then; it is deleted once the ensemble answers again, so the lock does not stay taken
/// behind it while its client's session lives.
#[tokio::test]
async fn a_waiter_that_gives_up_out_of_reach_deletes_its_node_later() {
    let zk = ensemble(1).await;
    let (proxies, through) = behind_proxies(&zk).await;
    let waiting = client_at(&through, Duration::from_secs(10)).await;
    let holder = client_at(&zk.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let guard = holder.lock("zk:blip").unwrap().lock().await.unwrap();
        let lock = waiting.lock("zk:blip").unwrap();
        let waiter = tokio::spawn(async move { lock.lock().await.map(drop) });
        while queue_len(&zk, "zk:blip").await < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for proxy in &proxies {
            proxy.blackhole();
        }
        waiter.abort();
        let _ = waiter.await;
        // Longer than the response timeout: the give-up's delete has failed.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(queue_len(&zk, "zk:blip").await, 2);
        for proxy in &proxies {
            proxy.heal();
        }
        let healed_at = Instant::now();
        while queue_len(&zk, "zk:blip").await != 1 {
            assert!(
                healed_at.elapsed() < Duration::from_secs(8),
                "the waiter's node is still there"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        guard.release().await.unwrap();
    })
    .await;
}

/// A waiter that gives up (a timeout, or its future dropped) deletes its node: the queue
/// holds the holder's alone, and the next waiter is not stuck behind a ghost.
#[tokio::test]
async fn a_waiter_that_gives_up_leaves_no_node_behind() {
    let zk = ensemble(1).await;
    let holder = client_at(&zk.url(), Duration::from_secs(30)).await;
    let waiting = client_at(&zk.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let guard = holder.lock("zk:give-up").unwrap().lock().await.unwrap();
        let lock = waiting.lock("zk:give-up").unwrap();
        assert!(lock
            .try_lock_for(Duration::from_millis(300))
            .await
            .unwrap()
            .is_none());
        let dropped = tokio::spawn({
            let lock = lock.clone();
            async move { lock.lock().await.map(drop) }
        });
        while queue_len(&zk, "zk:give-up").await < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        dropped.abort();
        let _ = dropped.await;
        let mut nodes = queue_len(&zk, "zk:give-up").await;
        let since = Instant::now();
        while nodes != 1 && since.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            nodes = queue_len(&zk, "zk:give-up").await;
        }
        assert_eq!(nodes, 1, "a waiter that gave up left its node");
        let released_at = Instant::now();
        let next = tokio::spawn(async move { lock.lock().await.unwrap() });
        tokio::time::sleep(Duration::from_millis(100)).await;
        guard.release().await.unwrap();
        let next = bounded(Duration::from_secs(5), next).await.unwrap();
        assert!(released_at.elapsed() < Duration::from_secs(3));
        next.release().await.unwrap();
    })
    .await;
}

/// How many client connections server `index` serves (`cons`, one line each).
async fn connections_on(zk: &ZkEnsemble, index: usize) -> usize {
    let cons = zk.four_letter_word(index, "cons").await.unwrap();
    cons.lines().filter(|line| line.contains("queued=")).count()
}

/// The leader of three servers is killed while locks change hands, and while one is
/// held by a client connected to that leader: no overlap, tokens still grow, and the
/// held lock stays held (its client reconnects to a follower, and its session lives
/// through the election).
#[tokio::test]
async fn a_killed_leader_breaks_no_exclusion_and_keeps_a_held_lock() {
    let mut zk = ensemble(3).await;
    let session = Duration::from_secs(4);
    let leader = zk.leader().await.unwrap();
    // A client connected to the leader (each picks a server at random).
    let mut keeper = None;
    for _ in 0..30 {
        let before = connections_on(&zk, leader).await;
        let candidate = client_at(&zk.url(), session).await;
        if connections_on(&zk, leader).await > before {
            keeper = Some(candidate);
            break;
        }
        candidate.shutdown().await;
    }
    let keeper = keeper.expect("no client connected to the leader in 30 tries");
    let client = client_at(&zk.url(), session).await;
    let kept = keeper.lock("zk:kept").unwrap().lock().await.unwrap();
    let kept_lost = kept.lost_token();
    let checker = Arc::new(ExclusionChecker::new());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..3 {
        let lock = client.lock("zk:leaderless").unwrap();
        let (checker, stop) = (Arc::clone(&checker), Arc::clone(&stop));
        tasks.push(tokio::spawn(async move {
            let mut held = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let Ok(Some(guard)) = lock.try_lock_for(Duration::from_secs(3)).await else {
                    continue;
                };
                let hold = checker.enter(guard.fencing_token(), format!("{t}"));
                tokio::time::sleep(Duration::from_millis(5)).await;
                hold.finish();
                let _ = guard.release().await;
                held += 1;
            }
            held
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(zk.leader().await.unwrap(), leader);
    zk.kill(leader).await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let held: usize = join_bounded(LIMIT, tasks).await.into_iter().sum();
    let report = checker.report();
    assert!(held > 10, "only {held} holds");
    assert!(report.overlaps.is_empty(), "{:?}", report.overlaps);
    assert!(
        report.token_regressions.is_empty(),
        "{:?}",
        report.token_regressions
    );
    assert!(!kept_lost.is_cancelled(), "the held lock was lost");
    assert!(bounded(LIMIT, kept.verify()).await.unwrap());
    assert_eq!(
        bounded(LIMIT, kept.release()).await.unwrap(),
        ReleaseOutcome::Released
    );
}

/// Entry point of the child processes below; skipped in a normal run. Holds a lock on a
/// 2 s session, says `HELD <token>`, then `LOST` once its lost signal fires.
#[tokio::test]
#[ignore = "run as a child process by the kill -9 and SIGSTOP tests"]
async fn zk_child_holder() {
    let Ok(url) = std::env::var("DISTLOCK_ZK_CHILD_URL") else {
        panic!("zk_child_holder runs only as a child process");
    };
    let client = client_at(&url, Duration::from_secs(2)).await;
    let guard = client.lock("zk:orphaned").unwrap().lock().await.unwrap();
    println!("HELD {}", guard.fencing_token());
    guard.lost().await;
    println!("LOST");
    std::future::pending::<()>().await;
}

#[tokio::test]
async fn a_killed_holders_lock_is_free_when_its_session_ends() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let (mut child, token) =
            child_holding("zk_child_holder", "DISTLOCK_ZK_CHILD_URL", &zk.url()).await;
        let lock = client.lock("zk:orphaned").unwrap();
        assert!(lock.is_locked().await.unwrap());
        child.kill().await.unwrap();
        let killed_at = Instant::now();
        let guard = lock.lock().await.unwrap();
        let freed_after = killed_at.elapsed();
        // The session timeout is 2 s; the server expires sessions on its tick (200 ms).
        assert!(freed_after > Duration::from_millis(1500), "{freed_after:?}");
        assert!(freed_after < Duration::from_secs(5), "{freed_after:?}");
        assert!(guard.fencing_token() > token);
        guard.release().await.unwrap();
    })
    .await;
}

/// The holder's process is stopped (SIGSTOP) past its session timeout: the ensemble
/// expires its session and another client holds the lock with a larger token; once the
/// holder runs again, its lost signal fires at once.
#[tokio::test]
async fn a_holder_paused_past_its_session_learns_of_its_loss_at_once() {
    use tokio::io::AsyncBufReadExt;
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "zk_child_holder",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("DISTLOCK_ZK_CHILD_URL", zk.url())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let token = loop {
            let line = lines.next_line().await.unwrap().expect("the child holds");
            if let Some((_, token)) = line.split_once("HELD ") {
                break token.trim().parse::<u64>().unwrap();
            }
        };
        let pid = child.id().unwrap().to_string();
        let signal = |name: &str| {
            let status = std::process::Command::new("kill")
                .args([name, &pid])
                .status()
                .unwrap();
            assert!(status.success());
        };
        signal("-STOP");
        let guard = client.lock("zk:orphaned").unwrap().lock().await.unwrap();
        assert!(guard.fencing_token() > token);
        signal("-CONT");
        let resumed_at = Instant::now();
        loop {
            let line = bounded(Duration::from_secs(5), lines.next_line())
                .await
                .unwrap()
                .expect("the child says it lost the lock");
            if line.contains("LOST") {
                break;
            }
        }
        assert!(resumed_at.elapsed() < Duration::from_secs(2));
        guard.release().await.unwrap();
        child.kill().await.unwrap();
    })
    .await;
}

/// The holder reaches the ensemble through proxies that then swallow everything: its
/// session is no longer heard from, and its lost signal must fire before another
/// client, on direct connections, can take the lock.
#[tokio::test]
async fn an_ensemble_out_of_reach_fires_the_lost_signal_before_anyone_else_holds() {
    let zk = ensemble(1).await;
    let (proxies, through) = behind_proxies(&zk).await;
    let session = Duration::from_secs(2);
    let holder = client_at(&through, session).await;
    let other = client_at(&zk.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let guard = holder.lock("zk:cut-off").unwrap().lock().await.unwrap();
        let again = guard.reenter().await.unwrap();
        // Late in a renewal interval, so that a deadline moved by the partial release
        // would outlast the ensemble's.
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(again.release().await.unwrap(), ReleaseOutcome::Released);
        let cut_at = Instant::now();
        for proxy in &proxies {
            proxy.blackhole();
        }
        let lost = guard.lost_token();
        let lost_at =
            common::lost_before_another_holds(lost, other.lock("zk:cut-off").unwrap()).await;
        assert!(lost_at.duration_since(cut_at) < session + Duration::from_millis(300));
        for proxy in &proxies {
            proxy.heal();
        }
        drop(guard);
    })
    .await;
}

/// A client cut off past its session timeout finds its session expired once it is back:
/// its old holding is lost, and it opens a new session for what it takes next, which
/// holds (with a larger token than the lock's holder meanwhile).
#[tokio::test]
async fn a_client_whose_session_expired_opens_a_new_one_and_locks_again() {
    let zk = ensemble(1).await;
    let (proxies, through) = behind_proxies(&zk).await;
    let client = client_at(&through, Duration::from_secs(2)).await;
    let other = client_at(&zk.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let guard = client.lock("zk:expired").unwrap().lock().await.unwrap();
        for proxy in &proxies {
            proxy.blackhole();
        }
        guard.lost().await;
        let meanwhile = other.lock("zk:expired").unwrap().lock().await.unwrap();
        for proxy in &proxies {
            proxy.heal();
        }
        // Back: the first calls may still fail while the client reconnects.
        let lock = client.lock("zk:expired").unwrap();
        let waiting = tokio::spawn(async move {
            loop {
                match lock.lock().await {
                    Ok(guard) => return guard,
                    Err(err) => assert!(err.is_connection_error(), "{err:?}"),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let meanwhile_token = meanwhile.fencing_token();
        meanwhile.release().await.unwrap();
        let again = bounded(Duration::from_secs(20), waiting).await.unwrap();
        assert!(again.fencing_token() > meanwhile_token);
        assert!(again.verify().await.unwrap());
        tokio::select! {
            _ = again.lost() => panic!("a holding of the new session was reported lost"),
            _ = tokio::time::sleep(Duration::from_millis(2500)) => {}
        }
        assert_eq!(again.release().await.unwrap(), ReleaseOutcome::Released);
        assert!(matches!(
            guard.release().await,
            Ok(ReleaseOutcome::AlreadyLost) | Err(Error::NotHeld { .. })
        ));
    })
    .await;
}

#[tokio::test]
async fn bad_input_and_a_down_ensemble_are_typed_errors() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(5)).await;
    for bad in [".", "..", "nul\0name", "bell\u{7}", "private\u{e000}use"] {
        assert!(
            matches!(client.lock(bad), Err(Error::InvalidName { .. })),
            "{bad:?}"
        );
    }
    // A `/` is escaped: "a/b" is a lock of its own, apart from "a".
    bounded(LIMIT, async {
        let slash = client.lock("zk:a/b").unwrap().lock().await.unwrap();
        let plain = client.lock("zk:a").unwrap().try_lock().await.unwrap();
        assert!(plain.is_some());
        assert_eq!(queue_len(&zk, "zk:a%2Fb").await, 1);
        slash.release().await.unwrap();
    })
    .await;
    assert!(matches!(
        client.fair_lock("f"),
        Err(Error::Unsupported {
            store: "ZooKeeper",
            ..
        })
    ));
    let lock = client.lock("zk:fixed").unwrap();
    assert!(matches!(
        lock.with_lease(Duration::ZERO).try_lock().await,
        Err(Error::InvalidDuration { what: "lease", .. })
    ));
    assert!(matches!(
        lock.advance_fencing_counter(1 << 62).await,
        Err(Error::Unsupported { .. })
    ));
    // The testkit's servers grant sessions of at most 60 s: a longer watchdog timeout
    // would let the ensemble free a lock its holder still trusts.
    assert!(matches!(
        Client::builder()
            .watchdog_timeout(Duration::from_secs(120))
            .connect(&zk.url())
            .await,
        Err(Error::InvalidConfig {
            what: "watchdog_timeout",
            ..
        })
    ));
    // Nothing listens there.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let started = Instant::now();
    match Client::builder()
        .connection_timeout(Duration::from_secs(1))
        .connect(&format!("zk://127.0.0.1:{port}"))
        .await
    {
        Err(err) => assert!(err.is_connection_error(), "{err:?}"),
        Ok(_) => panic!("connected to a closed port"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(
        Client::connect("zk://").await,
        Err(Error::InvalidUrl { .. })
    ));
}

/// A fault proxy in front of every server, and the `zk://` URL that goes through them.
async fn behind_proxies(zk: &ZkEnsemble) -> (Vec<FaultProxy>, String) {
    let mut proxies = Vec::new();
    for port in zk.client_ports() {
        let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        proxies.push(FaultProxy::start(upstream).await.unwrap());
    }
    let through: Vec<String> = proxies
        .iter()
        .map(|proxy| format!("127.0.0.1:{}", proxy.port()))
        .collect();
    (proxies, format!("zk://{}", through.join(",")))
}
