//! MultiLock: all or nothing, a stable order that cannot deadlock, one release and one
//! lost signal for the whole set.

mod common;

use std::time::Duration;

use common::{bounded, client, client_with_watchdog, raw, server};
use distlock::{Error, MultiLock, MultiLockMember};
use distlock_testkit::ExclusionChecker;

const LIMIT: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takes_every_member_or_none() {
    let server = server().await;
    let client = client(&server).await;
    let multi = MultiLock::new([client.lock("m:a").unwrap(), client.lock("m:b").unwrap()]).unwrap();

    // b is held elsewhere: the set is not had, and a is left free.
    let held_b = client.lock("m:b").unwrap().lock().await.unwrap();
    let attempt = bounded(LIMIT, multi.try_lock_for(Duration::from_millis(200)))
        .await
        .unwrap();
    assert!(attempt.is_none());
    assert!(
        !client.lock("m:a").unwrap().is_locked().await.unwrap(),
        "a member taken before the busy one was kept"
    );
    held_b.release().await.unwrap();

    let guard = bounded(LIMIT, multi.lock()).await.unwrap();
    assert_eq!(guard.names(), ["m:a", "m:b"]);
    for name in ["m:a", "m:b"] {
        assert!(client
            .lock(name)
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none());
    }
    guard.release().await.unwrap();
    for name in ["m:a", "m:b"] {
        assert!(
            !client.lock(name).unwrap().is_locked().await.unwrap(),
            "{name} still held"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_sets_named_in_opposite_order_never_deadlock() {
    let server = server().await;
    let client = client(&server).await;
    // Named in opposite orders; two of the three members are shared.
    let forward =
        MultiLock::new(["o:a", "o:b", "o:c"].map(|name| client.lock(name).unwrap())).unwrap();
    let backward =
        MultiLock::new(["o:d", "o:c", "o:b"].map(|name| client.lock(name).unwrap())).unwrap();
    let checker = ExclusionChecker::new();
    let mut tasks = Vec::new();
    for contender in 0..8 {
        let multi = if contender % 2 == 0 {
            forward.clone()
        } else {
            backward.clone()
        };
        let checker = checker.clone();
        tasks.push(tokio::spawn(async move {
            for round in 0..15 {
                let guard = multi.lock().await.unwrap();
                let hold = checker.enter(round, format!("c{contender}"));
                tokio::task::yield_now().await;
                hold.finish();
                guard.release().await.unwrap();
            }
        }));
    }
    common::join_bounded(LIMIT, tasks).await;
    let report = checker.report();
    assert_eq!(report.holds, 120);
    // Every set shares b and c with every other, so no two holds may overlap.
    assert!(report.overlaps.is_empty(), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_on_different_servers_are_one_set() {
    let (first, second) = (server().await, server().await);
    let (one, two) = (client(&first).await, client(&second).await);
    let multi = MultiLock::new([one.lock("x").unwrap(), two.lock("x").unwrap()]).unwrap();
    let guard = bounded(LIMIT, multi.lock()).await.unwrap();
    assert_eq!(guard.members().len(), 2);
    assert!(one.lock("x").unwrap().try_lock().await.unwrap().is_none());
    assert!(two.lock("x").unwrap().try_lock().await.unwrap().is_none());
    guard.release().await.unwrap();
    assert!(!one.lock("x").unwrap().is_locked().await.unwrap());
    assert!(!two.lock("x").unwrap().is_locked().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_set_is_lost_when_any_member_is() {
    let server = server().await;
    let client = client_with_watchdog(&server, Duration::from_millis(600)).await;
    let multi =
        MultiLock::new(["l:a", "l:b", "l:c"].map(|name| client.lock(name).unwrap())).unwrap();
    let guard = bounded(LIMIT, multi.lock()).await.unwrap();
    let lost = guard.lost();
    let token = guard.lost_token();
    assert!(!guard.is_lost());
    assert!(guard.lease_remaining() > Duration::ZERO);

    // An operator deletes one member: its next renewal finds it gone.
    assert!(client.lock("l:b").unwrap().force_unlock().await.unwrap());
    bounded(Duration::from_secs(5), lost).await;
    bounded(Duration::from_secs(1), token.cancelled()).await;
    assert!(guard.is_lost());
    assert_eq!(guard.lease_remaining(), Duration::ZERO);
    // The release still frees the others, and reports the lost member.
    assert_eq!(
        guard.release().await.unwrap(),
        distlock::ReleaseOutcome::AlreadyLost
    );
    for name in ["l:a", "l:c"] {
        assert!(
            !client.lock(name).unwrap().is_locked().await.unwrap(),
            "{name} kept"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_wait_gives_back_the_members_it_took() {
    let server = server().await;
    let client = client(&server).await;
    let multi = MultiLock::new([client.lock("c:a").unwrap(), client.lock("c:b").unwrap()]).unwrap();
    let held_b = client.lock("c:b").unwrap().lock().await.unwrap();
    // Waits on b while holding a, then is dropped.
    let outcome = tokio::time::timeout(Duration::from_millis(300), multi.lock()).await;
    assert!(outcome.is_err(), "the set was had while b was held");
    common::eventually(Duration::from_secs(5), "a given back", || async {
        !client.lock("c:a").unwrap().is_locked().await.unwrap()
    })
    .await;
    held_b.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_empty_and_duplicate_sets() {
    let server = server().await;
    let client = client(&server).await;
    assert!(matches!(
        MultiLock::new(Vec::<distlock::Lock>::new()),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        MultiLock::new([client.lock("d").unwrap(), client.lock("d").unwrap()]),
        Err(Error::InvalidConfig { .. })
    ));
}

/// A member with a fixed lease does not run out while later members are awaited: its lease
/// counts from the moment the whole set is held. (Review 9: the guard came back with that
/// member already expired and another client holding it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_lease_member_does_not_expire_while_later_members_are_awaited() {
    let server = server().await;
    let ours = client(&server).await;
    let theirs = client(&server).await;
    // "b" is busy for 800 ms.
    let blocker = theirs
        .lock("b")
        .expect("lock")
        .with_lease(Duration::from_millis(800))
        .try_lock()
        .await
        .expect("try_lock")
        .expect("free");
    let multi = MultiLock::new([
        ours.lock("a")
            .expect("lock")
            .with_lease(Duration::from_millis(300)),
        ours.lock("b").expect("lock"),
    ])
    .expect("multi");
    let guard = bounded(LIMIT, multi.try_lock_for(Duration::from_secs(5)))
        .await
        .expect("try_lock_for")
        .expect("both can be had within 5 s");
    // Someone else takes "a" while our guard says all members are held.
    let stolen = theirs
        .lock("a")
        .expect("lock")
        .try_lock()
        .await
        .expect("try_lock");
    let lost = guard.is_lost();
    drop(blocker);
    assert!(
        !lost && stolen.is_none(),
        "MultiLock returned a guard with is_lost()={lost}, and another client took member \
         \"a\": {}",
        stolen.is_some()
    );
    // Member "a" keeps its own 300 ms lease, set when the set was complete, and nothing
    // renews it past that: the watchdog that held it while "b" was awaited let go.
    let pttl: i64 = redis::cmd("PTTL")
        .arg("a")
        .query_async(&mut raw(&server).await)
        .await
        .expect("PTTL");
    assert!(
        (1..=300).contains(&pttl),
        "member a's lease on the server: {pttl} ms"
    );
    bounded(Duration::from_secs(2), guard.lost()).await;
    common::eventually(Duration::from_secs(1), "member a to expire", || async {
        !common::key_exists(&server, "a").await
    })
    .await;
}

/// One member's server dies: the set's lost signal and token fire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_set_is_lost_when_one_members_server_dies() {
    let one = server().await;
    let mut two = server().await;
    let c1 = client_with_watchdog(&one, Duration::from_millis(600)).await;
    let c2 = client_with_watchdog(&two, Duration::from_millis(600)).await;
    let multi =
        MultiLock::new([c1.lock("x").expect("lock"), c2.lock("x").expect("lock")]).expect("multi");
    let guard = bounded(LIMIT, multi.lock()).await.expect("lock");
    let token = guard.lost_token();
    two.kill().await.expect("kill");
    bounded(Duration::from_secs(3), guard.lost()).await;
    bounded(Duration::from_secs(1), token.cancelled()).await;
    assert!(guard.is_lost());
    assert_eq!(guard.lease_remaining(), Duration::ZERO);
    drop(guard);
}

/// A member whose fixed lease is shorter than a round trip is handed out like a plain
/// `Lock` with that lease would be (already running out), not retried forever: the set
/// is checked for losses before the fixed leases are set, not after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_lease_shorter_than_a_round_trip_does_not_make_lock_spin() {
    let server = server().await;
    let client = client(&server).await;
    let multi = MultiLock::new([
        client
            .lock("brief")
            .unwrap()
            .with_lease(Duration::from_millis(1)),
        client.lock("steady").unwrap(),
    ])
    .unwrap();
    let guard = bounded(Duration::from_secs(5), multi.lock()).await.unwrap();
    bounded(Duration::from_secs(1), guard.lost()).await;
    drop(guard);
    let again = bounded(
        Duration::from_secs(5),
        multi.try_lock_for(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    assert!(again.is_some(), "try_lock_for gave up on a free set");
}

/// A MultiLock takes any lock whose guard is a holding with a lease: a lease lock, a fair
/// lock, a read hold and a write hold of read-write locks, all or nothing; each member is
/// then held as it would be alone, and a fixed lease counts from when the set is held.
#[tokio::test]
async fn members_of_every_kind_are_held_together() {
    let server = server().await;
    let (a, b) = (client(&server).await, client(&server).await);
    bounded(LIMIT, async {
        let catalog = a.rw_lock("catalog").unwrap();
        let ledger = a.rw_lock("ledger").unwrap();
        let set = MultiLock::new([
            MultiLockMember::from(a.lock("order").unwrap()),
            MultiLockMember::from(a.fair_lock("payout").unwrap()),
            MultiLockMember::read(&catalog.with_lease(Duration::from_secs(2))),
            MultiLockMember::write(&ledger),
        ])
        .unwrap();
        let guard = set.lock().await.unwrap();
        assert_eq!(guard.names(), ["catalog", "ledger", "order", "payout"]);
        assert!(guard.lease_remaining() <= Duration::from_secs(2));
        assert!(b.lock("order").unwrap().try_lock().await.unwrap().is_none());
        assert!(b
            .fair_lock("payout")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none());
        assert!(b
            .rw_lock("catalog")
            .unwrap()
            .try_write()
            .await
            .unwrap()
            .is_none());
        let shared = b.rw_lock("catalog").unwrap().try_read().await.unwrap();
        assert!(shared.is_some(), "a read member keeps other readers out");
        drop(shared);
        assert!(b
            .rw_lock("ledger")
            .unwrap()
            .try_read()
            .await
            .unwrap()
            .is_none());
        guard.release().await.unwrap();
        assert!(b
            .rw_lock("ledger")
            .unwrap()
            .try_write()
            .await
            .unwrap()
            .is_some());
        // One key twice (a read and a write of one lock) would wait for itself.
        assert!(MultiLock::new([
            MultiLockMember::read(&catalog),
            MultiLockMember::write(&catalog)
        ])
        .is_err());
    })
    .await;
}

/// Issue 30, 4.2, for a set: its lost signal is made of its members', and a member
/// force-unlocked under it is noticed at the force-unlock's message, not at the next
/// renewal (10 s away with the default watchdog).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_unlocked_member_is_noticed_at_its_message() {
    let server = server().await;
    let client = client(&server).await;
    let multi = MultiLock::new(["m:a", "m:b"].map(|name| client.lock(name).unwrap())).unwrap();
    let guard = bounded(LIMIT, multi.lock()).await.unwrap();
    let token = guard.lost_token();
    let started = std::time::Instant::now();
    assert!(client.lock("m:b").unwrap().force_unlock().await.unwrap());
    let noticed = tokio::time::timeout(Duration::from_secs(2), token.cancelled()).await;
    let gap = started.elapsed();
    eprintln!("a force-unlocked member of a MultiLock: lost after {gap:?}");
    assert!(noticed.is_ok(), "not noticed 2 s after the force-unlock");
    assert!(gap < Duration::from_millis(200), "noticed after {gap:?}");
    assert!(guard.release().await.unwrap().was_lost());
}
