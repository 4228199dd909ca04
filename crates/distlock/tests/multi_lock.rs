//! MultiLock: all or nothing, a stable order that cannot deadlock, one release and one
//! lost signal for the whole set.

mod common;

use std::time::Duration;

use common::{bounded, client, client_with_watchdog, server};
use distlock::{Error, MultiLock};
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
    assert!(matches!(guard.release().await, Err(Error::NotHeld { .. })));
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
        MultiLock::new(Vec::new()),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        MultiLock::new([client.lock("d").unwrap(), client.lock("d").unwrap()]),
        Err(Error::InvalidConfig { .. })
    ));
}
