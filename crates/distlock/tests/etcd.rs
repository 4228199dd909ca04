//! The lease lock on etcd (feature `etcd`): the same `Client` and `Lock` API, on a
//! 3-member etcd cluster each test starts (distlock_testkit::EtcdCluster).
//!
//! Each test asserts an outcome that could fail: overlaps and token regressions counted
//! and asserted zero, waiters served in the order they asked, a holder that learns of
//! its loss before anyone else holds, typed errors for bad input.

mod common;
// The read-write lock.
mod etcd_rw;
// The permit semaphore.
mod etcd_permits;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bounded, child_holding, contend, join_bounded};
use distlock::{Client, Error, ReleaseOutcome, StoreKind};
use distlock_testkit::{EtcdCluster, ExclusionChecker, FaultProxy};

const LIMIT: Duration = Duration::from_secs(60);

async fn cluster() -> EtcdCluster {
    EtcdCluster::start(3).await.expect("start etcd")
}

async fn client_at(url: &str, watchdog: Duration) -> Client {
    Client::builder()
        .watchdog_timeout(watchdog)
        .response_timeout(Duration::from_secs(2))
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .expect("connect to etcd")
}

#[tokio::test]
async fn holders_on_two_clients_never_overlap_and_their_tokens_grow() {
    let etcd = cluster().await;
    let clients = [
        client_at(&etcd.url(), Duration::from_secs(5)).await,
        client_at(&etcd.url(), Duration::from_secs(5)).await,
    ];
    assert_eq!(clients[0].store(), StoreKind::Etcd);
    let (report, count) = contend(&clients, "etcd:contended", 3, 8).await;
    assert_eq!(report.holds, 48);
    assert!(report.overlaps.is_empty(), "{:?}", report.overlaps);
    assert!(
        report.token_regressions.is_empty(),
        "{:?}",
        report.token_regressions
    );
    assert_eq!(count, 48, "an update was lost");
}

/// Waiters get the lock in the order they asked, and each is woken by its predecessor's
/// release, well before the holder's lease ends.
#[tokio::test]
async fn waiters_are_served_in_the_order_they_asked() {
    let etcd = cluster().await;
    let holder = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let waiting = client_at(&etcd.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let lock = holder.lock("etcd:fifo").unwrap();
        let guard = lock.lock().await.unwrap();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for n in 0..4 {
            let lock = waiting.lock("etcd:fifo").unwrap();
            let order = Arc::clone(&order);
            tasks.push(tokio::spawn(async move {
                let guard = lock.lock().await.unwrap();
                order.lock().unwrap().push(n);
                guard.release().await.unwrap();
            }));
            // Each waiter's key is written before the next one asks.
            let queued = n + 2;
            loop {
                let owners = lock_queue_len(&etcd, "etcd:fifo").await;
                if owners >= queued {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let released_at = Instant::now();
        guard.release().await.unwrap();
        join_bounded(LIMIT, tasks).await;
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3]);
        assert!(
            released_at.elapsed() < Duration::from_secs(5),
            "four handoffs took {:?}: not woken by the watches",
            released_at.elapsed()
        );
    })
    .await;
}

/// How many keys the lock's queue holds (holder and waiters).
async fn lock_queue_len(etcd: &EtcdCluster, name: &str) -> usize {
    etcd_range_count(etcd, &format!("distlock/{name}\0")).await
}

/// Counts keys under `prefix` with etcd's v3 JSON gateway.
async fn etcd_range_count(etcd: &EtcdCluster, prefix: &str) -> usize {
    let port = etcd.client_ports()[0];
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    let reply = common::etcd::gw(
        port,
        "/v3/kv/range",
        serde_json::json!({"key": common::etcd::b64(prefix.as_bytes()),
                           "range_end": common::etcd::b64(&end), "count_only": true}),
    )
    .await;
    usize::try_from(common::etcd::num(&reply["count"])).unwrap_or(0)
}

#[tokio::test]
async fn the_watchdog_keeps_a_lock_past_its_lease_and_a_release_frees_it() {
    let etcd = cluster().await;
    let holder = client_at(&etcd.url(), Duration::from_secs(2)).await;
    let other = client_at(&etcd.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let guard = holder.lock("etcd:renewed").unwrap().lock().await.unwrap();
        let lock = other.lock("etcd:renewed").unwrap();
        tokio::select! {
            _ = guard.lost() => panic!("a renewed lock was reported lost"),
            _ = tokio::time::sleep(Duration::from_millis(5000)) => {}
        }
        assert!(lock.try_lock().await.unwrap().is_none());
        assert!(lock.is_locked().await.unwrap());
        assert_eq!(lock.owners().await.unwrap(), vec![guard.owner().to_owned()]);
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
        assert!(!lock.is_locked().await.unwrap());
        assert!(lock.try_lock().await.unwrap().is_some());
    })
    .await;
}

#[tokio::test]
async fn a_force_unlock_fires_the_lost_signal_at_its_deletion() {
    let etcd = cluster().await;
    let holder = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let operator = client_at(&etcd.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let guard = holder.lock("etcd:forced").unwrap().lock().await.unwrap();
        let lost = guard.lost_token();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let forced_at = Instant::now();
        assert!(operator
            .lock("etcd:forced")
            .unwrap()
            .force_unlock()
            .await
            .unwrap());
        bounded(Duration::from_secs(5), lost.cancelled()).await;
        assert!(forced_at.elapsed() < Duration::from_secs(2));
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
    })
    .await;
}

/// The leader is killed while locks change hands: no overlap, tokens still grow.
#[tokio::test]
async fn a_killed_leader_breaks_no_exclusion() {
    let mut etcd = cluster().await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let checker = Arc::new(ExclusionChecker::new());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..3 {
        let lock = client.lock("etcd:leaderless").unwrap();
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
    let leader = etcd.leader().await.unwrap();
    etcd.kill(leader).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
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
}

/// Entry point of the child process below; skipped in a normal run.
#[tokio::test]
#[ignore = "run as a child process by a_killed_holders_lock_is_free_when_its_lease_ends"]
async fn etcd_child_holder() {
    let Ok(url) = std::env::var("DISTLOCK_ETCD_CHILD_URL") else {
        panic!("etcd_child_holder runs only as a child process");
    };
    let client = client_at(&url, Duration::from_secs(2)).await;
    let guard = client.lock("etcd:orphaned").unwrap().lock().await.unwrap();
    println!("HELD {}", guard.fencing_token());
    std::future::pending::<()>().await;
}

#[tokio::test]
async fn a_killed_holders_lock_is_free_when_its_lease_ends() {
    let etcd = cluster().await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let (mut child, token) =
            child_holding("etcd_child_holder", "DISTLOCK_ETCD_CHILD_URL", &etcd.url()).await;
        let lock = client.lock("etcd:orphaned").unwrap();
        assert!(lock.is_locked().await.unwrap());
        child.kill().await.unwrap();
        let killed_at = Instant::now();
        let guard = lock.lock().await.unwrap();
        let freed_after = killed_at.elapsed();
        // The session lease is 2 s; etcd may keep a lease up to its minimum TTL and
        // refreshes leases on a leader change, so allow some seconds more.
        assert!(freed_after < Duration::from_secs(8), "{freed_after:?}");
        assert!(guard.fencing_token() > token);
        guard.release().await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn bad_input_is_a_typed_error() {
    let etcd = cluster().await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    assert!(matches!(
        client.lock("nul\0name"),
        Err(Error::InvalidName { .. })
    ));
    assert!(matches!(
        client.fair_lock("f"),
        Err(Error::Unsupported { store: "etcd", .. })
    ));
    let lock = client.lock("etcd:fenced").unwrap();
    assert!(matches!(
        lock.advance_fencing_counter(1 << 40).await,
        Err(Error::Unsupported { .. })
    ));
    // Nothing listens there.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    match Client::builder()
        .connection_timeout(Duration::from_secs(1))
        .connect(&format!("etcd://127.0.0.1:{port}"))
        .await
    {
        Err(err) => assert!(err.is_connection_error(), "{err:?}"),
        Ok(_) => panic!("connected to a closed port"),
    }
    assert!(matches!(
        Client::connect("etcd://").await,
        Err(Error::InvalidUrl { .. })
    ));
}

/// A client idle for longer than its session lease (nothing held, so nothing kept it
/// alive) still takes a lock, and holds it: the session is confirmed or granted anew
/// before an acquisition counts on it.
#[tokio::test]
async fn a_client_idle_past_its_session_lease_still_holds_what_it_takes() {
    let etcd = cluster().await;
    let client = client_at(&etcd.url(), Duration::from_secs(2)).await;
    bounded(LIMIT, async {
        tokio::time::sleep(Duration::from_millis(4500)).await;
        let guard = client.lock("etcd:idle").unwrap().lock().await.unwrap();
        tokio::select! {
            _ = guard.lost() => panic!("a fresh holding was reported lost"),
            _ = tokio::time::sleep(Duration::from_millis(2500)) => {}
        }
        assert!(guard.verify().await.unwrap());
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
    })
    .await;
}

/// The holder reaches the cluster through proxies that then swallow everything: it
/// cannot keep its session alive, and its lost signal must fire before another client,
/// on direct connections, can take the lock.
#[tokio::test]
async fn a_cluster_out_of_reach_fires_the_lost_signal_before_anyone_else_holds() {
    let etcd = cluster().await;
    let (proxies, through) = behind_proxies(&etcd).await;
    let lease = Duration::from_secs(2);
    let holder = client_at(&through, lease).await;
    let other = client_at(&etcd.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let guard = holder.lock("etcd:cut-off").unwrap().lock().await.unwrap();
        let taken_at = Instant::now();
        for proxy in &proxies {
            proxy.blackhole();
        }
        let lost = guard.lost_token();
        let lost_at =
            common::lost_before_another_holds(lost, other.lock("etcd:cut-off").unwrap()).await;
        assert!(lost_at.duration_since(taken_at) < lease + Duration::from_millis(300));
        for proxy in &proxies {
            proxy.heal();
        }
        drop(guard);
    })
    .await;
}

/// Review (review31-etcd b2): a partial release on etcd rewrites the hold count only, so
/// it must not move the holding's deadline: a holder cut off after one must still learn
/// of its loss before another client holds the lock.
#[tokio::test]
async fn a_partial_release_does_not_stretch_trust_past_the_session_lease() {
    let etcd = cluster().await;
    let (proxies, through) = behind_proxies(&etcd).await;
    let lease = Duration::from_secs(3);
    let holder = client_at(&through, lease).await;
    let other = client_at(&etcd.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let guard = holder.lock("etcd:partial").unwrap().lock().await.unwrap();
        let again = guard.reenter().await.unwrap();
        // Late in the lease, so that a deadline moved by it would outlast the server's.
        tokio::time::sleep(Duration::from_millis(1800)).await;
        assert_eq!(again.release().await.unwrap(), ReleaseOutcome::Released);
        for proxy in &proxies {
            proxy.blackhole();
        }
        let lost = guard.lost_token();
        common::lost_before_another_holds(lost, other.lock("etcd:partial").unwrap()).await;
        for proxy in &proxies {
            proxy.heal();
        }
        drop(guard);
    })
    .await;
}

/// A fault proxy in front of every member, and the `etcd://` URL that goes through them.
async fn behind_proxies(etcd: &EtcdCluster) -> (Vec<FaultProxy>, String) {
    let mut proxies = Vec::new();
    for port in etcd.client_ports() {
        let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        proxies.push(FaultProxy::start(upstream).await.unwrap());
    }
    let through: Vec<String> = proxies
        .iter()
        .map(|proxy| format!("127.0.0.1:{}", proxy.port()))
        .collect();
    (proxies, format!("etcd://{}", through.join(",")))
}

/// The programs in examples/ run on etcd unchanged but for the URL (they read it from
/// REDIS_URL, as on Redis). `cargo test -p distlock --features etcd` builds them first.
#[tokio::test]
async fn the_examples_run_unchanged_on_etcd() {
    let etcd = cluster().await;
    common::examples::all_run_unchanged(&etcd.url(), Some("etcd"));
}

/// A member down when the client connects (listed first in the URL); later, with it
/// back, the member the client then talks to frozen (SIGSTOP: its connection open,
/// nothing coming back): the client connects, and every call answers from the members
/// that are up, none failing.
#[tokio::test]
async fn members_down_or_frozen_cost_no_call() {
    let mut etcd = cluster().await;
    let ports = etcd.client_ports();
    let leader = etcd.leader().await.unwrap();
    let (dead, frozen) = ((leader + 1) % 3, (leader + 2) % 3);
    etcd.kill(dead).await.unwrap();
    // The dead member first, then the one to be frozen, then the leader.
    let url = format!(
        "etcd://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
        ports[dead], ports[frozen], ports[leader]
    );
    bounded(LIMIT, async {
        let client = client_at(&url, Duration::from_secs(5)).await;
        let lock = client.lock("etcd:members").unwrap();
        let mut failed = Vec::new();
        for round in 0..10 {
            if round == 5 {
                // The dead member back, the other frozen: still a majority.
                etcd.restart(dead).await.unwrap();
                etcd.stop(frozen).unwrap();
            }
            match lock.lock().await {
                Ok(guard) => {
                    if let Err(err) = lock.is_locked().await {
                        failed.push(err.to_string());
                    }
                    if let Err(err) = guard.release().await {
                        failed.push(err.to_string());
                    }
                }
                Err(err) => failed.push(err.to_string()),
            }
        }
        etcd.resume(frozen).unwrap();
        assert!(
            failed.is_empty(),
            "{} calls failed: {failed:?}",
            failed.len()
        );
    })
    .await;
}
