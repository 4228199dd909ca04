//! The permit semaphore on etcd: each acquisition a key in the semaphore's queue valued
//! with its permits, holding when the permits asked ahead of it plus its own fit the
//! total. The scenarios every store passes (tests/common/permits.rs), then etcd's own:
//! waiters are served in order (a big ask is not passed by later small ones), a new
//! total wakes waiters, and a killed holder's permits come back with its session lease.

use std::time::{Duration, Instant};

use distlock_testkit::EtcdCluster;

use super::common::{self, bounded, permits};
use super::{behind_proxies, client_at, LIMIT};

/// One member: nothing here kills or freezes one.
async fn one_member() -> EtcdCluster {
    EtcdCluster::start(1).await.expect("start etcd")
}

#[tokio::test]
async fn holders_never_hold_more_permits_than_there_are() {
    let etcd = one_member().await;
    let clients = [
        client_at(&etcd.url(), Duration::from_secs(5)).await,
        client_at(&etcd.url(), Duration::from_secs(5)).await,
    ];
    let most = bounded(
        LIMIT,
        permits::holders_never_hold_more_permits_than_there_are(&clients, "etcd:sem:table"),
    )
    .await;
    assert!(most > 1, "the permits were never shared");
}

#[tokio::test]
async fn release_leases_counts_and_cancellation() {
    let etcd = one_member().await;
    let lease = Duration::from_secs(2);
    let client = client_at(&etcd.url(), lease).await;
    let other = client_at(&etcd.url(), lease).await;
    bounded(LIMIT, async {
        permits::a_release_wakes_a_waiter_at_once(&client, &other, "etcd:sem:wake").await;
        permits::a_fixed_lease_runs_out_and_says_so(&client, "etcd:sem:fixed").await;
        permits::watchdog_permits_outlive_their_lease(&client, &other, "etcd:sem:renewed", lease)
            .await;
        // Holders of 2 and 3 permits, the total lowered to 3: the head (2) fits it, the
        // second (3) no longer does, and what is left is kept for it, so etcd reads 0
        // free (docs/safety.md), not Redis's -2.
        assert_eq!(
            permits::counts_and_bad_asks(&client, "etcd:sem:counts").await,
            0
        );
        permits::cancellation_leaves_no_permit_taken(&client, "etcd:sem:cancel").await;
    })
    .await;
}

#[tokio::test]
async fn a_holder_cut_off_learns_of_its_loss_before_another_takes_its_permits() {
    let etcd = one_member().await;
    let (proxies, through) = behind_proxies(&etcd).await;
    let lease = Duration::from_secs(2);
    let holder = client_at(&through, lease).await;
    let other = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let cut = common::cut_switch(&proxies);
    bounded(
        LIMIT,
        permits::a_holder_cut_off_learns_of_its_loss_before_another_takes_its_permits(
            (&holder, &other),
            "etcd:sem:cut-off",
            (lease, Duration::from_millis(300)),
            cut,
        ),
    )
    .await;
}

/// The queue is served in order across clients: a waiter asking for 2 of 2 permits is
/// not passed by a later waiter asking for 1 while one is held, and a new total (more
/// permits) wakes waiters at once.
#[tokio::test]
async fn waiters_are_served_in_order_and_a_new_total_wakes_them() {
    let etcd = one_member().await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let other = client_at(&etcd.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let semaphore = client.permit_semaphore("etcd:sem:order").unwrap();
        assert!(semaphore.try_set_permits(2).await.unwrap().is_set());
        let first = semaphore.acquire(1).await.unwrap();
        let big = other.permit_semaphore("etcd:sem:order").unwrap();
        let big_waiter = tokio::spawn(async move { big.acquire(2).await.unwrap() });
        // Once the big ask is queued, a later small ask waits behind it although one
        // permit is free.
        common::eventually(Duration::from_secs(5), "the big ask is queued", || {
            let semaphore = semaphore.clone();
            async move { semaphore.try_acquire(1).await.unwrap().is_none() }
        })
        .await;
        let small = semaphore.clone();
        let small_waiter = tokio::spawn(async move { small.acquire(1).await.unwrap() });
        assert!(!big_waiter.is_finished() && !small_waiter.is_finished());
        let released_at = Instant::now();
        first.release().await.unwrap();
        let big_held = big_waiter.await.unwrap();
        assert!(released_at.elapsed() < Duration::from_secs(2));
        assert!(
            !small_waiter.is_finished(),
            "the small ask passed the big one"
        );
        // Two more permits: the small waiter fits at once. (Its permit counts as taken
        // from the moment it fits, so 1 of the 2 is free.)
        let added_at = Instant::now();
        assert_eq!(semaphore.add_permits(2).await.unwrap(), 1);
        let small_held = small_waiter.await.unwrap();
        assert!(added_at.elapsed() < Duration::from_secs(2));
        big_held.release().await.unwrap();
        small_held.release().await.unwrap();
        assert_eq!(semaphore.available_permits().await.unwrap(), 4);
    })
    .await;
}

/// Entry point of the child process of the test below; skipped in a normal run.
#[tokio::test]
#[ignore = "run as a child process by a_killed_holders_permits_come_back_with_its_session"]
async fn child_taking_a_permit() {
    let Ok(url) = std::env::var("DISTLOCK_ETCD_PERMIT_CHILD") else {
        panic!("run only as a child of a_killed_holders_permits_come_back_with_its_session");
    };
    let client = client_at(&url, Duration::from_secs(2)).await;
    permits::child_takes_a_permit(&client, "etcd:sem:killed").await;
}

/// kill -9 of a process holding a permit: renewed past its lease while the process
/// lives, free within the session lease (2 s, plus etcd's own rounding) of the kill.
#[tokio::test]
async fn a_killed_holders_permits_come_back_with_its_session() {
    let etcd = one_member().await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    bounded(
        LIMIT,
        permits::a_killed_holders_permits_come_back(
            &client,
            "etcd:sem:killed",
            (
                "etcd_permits::child_taking_a_permit",
                "DISTLOCK_ETCD_PERMIT_CHILD",
                &etcd.url(),
            ),
            (Duration::from_secs(4), Duration::from_millis(3500)),
        ),
    )
    .await;
}
