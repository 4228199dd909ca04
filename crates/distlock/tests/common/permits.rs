//! What a permit semaphore promises on every store, as one scenario each store's tests
//! run.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock::{Client, Error, PermitSemaphore, PermitsSet, ReleaseOutcome};

/// Six tasks on `clients` (taken in turn) take 1 or 2 of 3 permits of `name`, ten rounds
/// each: the permits in use never pass 3, and every task gets its turns. Answers the most
/// permits seen in use at once, for the caller to assert they were shared.
pub async fn holders_never_hold_more_permits_than_there_are(clients: &[Client], name: &str) -> i64 {
    let total = 3;
    let semaphore = clients[0].permit_semaphore(name).unwrap();
    assert!(semaphore.try_set_permits(total).await.unwrap().is_set());
    let in_use = Arc::new(AtomicI64::new(0));
    let most = Arc::new(AtomicI64::new(0));
    let mut tasks = Vec::new();
    for n in 0..6 {
        let semaphore = clients[n % clients.len()].permit_semaphore(name).unwrap();
        let (in_use, most) = (Arc::clone(&in_use), Arc::clone(&most));
        tasks.push(tokio::spawn(async move {
            let ask = 1 + (n % 2) as i64;
            for _ in 0..10 {
                let permits = semaphore.acquire(ask).await.unwrap();
                assert_eq!(permits.permits(), ask);
                let now = in_use.fetch_add(ask, Ordering::SeqCst) + ask;
                most.fetch_max(now, Ordering::SeqCst);
                assert!(now <= 3, "{now} permits in use of 3");
                tokio::time::sleep(Duration::from_millis(2)).await;
                in_use.fetch_sub(ask, Ordering::SeqCst);
                assert_eq!(permits.release().await.unwrap(), ReleaseOutcome::Released);
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(semaphore.available_permits().await.unwrap(), total);
    most.load(Ordering::SeqCst)
}

/// A release wakes a waiter on another client at once, well before the holder's lease
/// (`client`'s and `other`'s watchdog timeouts are long) would have let it in.
pub async fn a_release_wakes_a_waiter_at_once(client: &Client, other: &Client, name: &str) {
    let semaphore = client.permit_semaphore(name).unwrap();
    assert!(semaphore.try_set_permits(2).await.unwrap().is_set());
    let held = semaphore.acquire(2).await.unwrap();
    let waiting = other.permit_semaphore(name).unwrap();
    assert!(waiting.try_acquire(1).await.unwrap().is_none());
    let waiter = tokio::spawn(async move { waiting.acquire(1).await.unwrap() });
    let released_at = Instant::now();
    held.release().await.unwrap();
    let permits = waiter.await.unwrap();
    assert!(
        released_at.elapsed() < Duration::from_secs(2),
        "the waiter took {:?} to notice the release",
        released_at.elapsed()
    );
    permits.release().await.unwrap();
}

/// A permit taken with a fixed lease is not renewed: its loss is signalled at its
/// deadline, it is free again then, and its release says it was lost.
pub async fn a_fixed_lease_runs_out_and_says_so(client: &Client, name: &str) {
    let semaphore = client.permit_semaphore(name).unwrap();
    assert!(semaphore.try_set_permits(1).await.unwrap().is_set());
    let permits = semaphore
        .with_lease(Duration::from_millis(300))
        .acquire(1)
        .await
        .unwrap();
    let lost = permits.lost_token();
    tokio::time::timeout(Duration::from_secs(3), permits.lost())
        .await
        .expect("lost at the deadline");
    assert!(lost.is_cancelled() && permits.is_lost());
    let again = semaphore
        .try_acquire_for(1, Duration::from_secs(4))
        .await
        .unwrap()
        .expect("the permit is free once its lease ran out on the store");
    assert!(permits.release().await.unwrap().was_lost());
    assert_eq!(again.release().await.unwrap(), ReleaseOutcome::Released);
    assert_eq!(semaphore.available_permits().await.unwrap(), 1);
}

/// Watchdog permits outlive several leases while their holder lives, and are still its
/// own (`verify`); another client cannot take them meanwhile.
pub async fn watchdog_permits_outlive_their_lease(
    client: &Client,
    other: &Client,
    name: &str,
    lease: Duration,
) {
    let semaphore = client.permit_semaphore(name).unwrap();
    assert!(semaphore.try_set_permits(1).await.unwrap().is_set());
    let permits = semaphore.acquire(1).await.unwrap();
    let waiting = other.permit_semaphore(name).unwrap();
    // Three leases: a waiter that gets the permit meanwhile shows a renewal failed.
    assert!(waiting
        .try_acquire_for(1, lease * 3)
        .await
        .unwrap()
        .is_none());
    assert!(!permits.is_lost() && permits.verify().await.unwrap());
    permits.release().await.unwrap();
}

/// Acquisitions cancelled at every point leave no permit taken, and a dropped guard gives
/// its permits back.
pub async fn cancellation_leaves_no_permit_taken(client: &Client, name: &str) {
    let semaphore = client.permit_semaphore(name).unwrap();
    assert!(semaphore.try_set_permits(3).await.unwrap().is_set());
    let permits = semaphore.acquire(2).await.unwrap();
    assert_eq!(semaphore.available_permits().await.unwrap(), 1);
    drop(permits);
    all_free(&semaphore, 3).await;
    for micros in [0u64, 100, 300, 1000, 3000, 10_000] {
        let attempt = tokio::time::timeout(Duration::from_micros(micros), semaphore.acquire(3));
        drop(attempt.await);
        all_free(&semaphore, 3).await;
    }
}

/// Waits until all `total` permits of `semaphore` are free again.
async fn all_free(semaphore: &PermitSemaphore, total: i64) {
    let semaphore = semaphore.clone();
    super::eventually(Duration::from_secs(5), "the permits are back", move || {
        let semaphore = semaphore.clone();
        async move { semaphore.available_permits().await.unwrap() == total }
    })
    .await;
}

/// The counts: `try_set_permits` sets once and then says the total it kept; taken permits
/// count in the total, not in the free count; `add_permits` moves both and answers the
/// free count. Bad asks are typed errors. Answers the free count `add_permits` gave after
/// lowering the total below the 5 permits held (to 3), which stores read differently:
/// -2 on Redis and PostgreSQL, which know their holders; 0 on etcd, which keeps waiters
/// and holders in one queue and keeps what is left for the first that does not fit.
pub async fn counts_and_bad_asks(client: &Client, name: &str) -> i64 {
    let semaphore = client.permit_semaphore(name).unwrap();
    assert_eq!(semaphore.total_permits().await.unwrap(), 0);
    assert!(
        semaphore.try_acquire(1).await.unwrap().is_none(),
        "no total yet"
    );
    assert!(matches!(
        semaphore.try_set_permits(-1).await,
        Err(Error::InvalidArgument { .. })
    ));
    assert!(semaphore.try_set_permits(3).await.unwrap().is_set());
    assert_eq!(
        semaphore.try_set_permits(5).await.unwrap(),
        PermitsSet::Kept { found: 3 }
    );
    let permits = semaphore.acquire(2).await.unwrap();
    assert_eq!(semaphore.available_permits().await.unwrap(), 1);
    assert_eq!(semaphore.total_permits().await.unwrap(), 3);
    assert!(semaphore.try_acquire(2).await.unwrap().is_none());
    assert_eq!(semaphore.add_permits(2).await.unwrap(), 3);
    assert_eq!(semaphore.total_permits().await.unwrap(), 5);
    let more = semaphore
        .try_acquire(3)
        .await
        .unwrap()
        .expect("3 of 5 free");
    let lowered = semaphore.add_permits(-2).await.unwrap();
    assert!(semaphore.try_acquire(1).await.unwrap().is_none());
    more.release().await.unwrap();
    permits.release().await.unwrap();
    assert_eq!(semaphore.available_permits().await.unwrap(), 3);
    for ask in [0, -1, PermitSemaphore::MAX_PERMITS_PER_CALL + 1, i64::MAX] {
        assert!(
            matches!(
                semaphore.acquire(ask).await,
                Err(Error::InvalidArgument { .. })
            ),
            "an ask of {ask}"
        );
    }
    lowered
}

/// Permits of `name` held on `holder` (whose store `cut` cuts off, and `heal` brings back)
/// are known lost before `other` takes them, and within `lease` (plus `slack`) of the cut.
pub async fn a_holder_cut_off_learns_of_its_loss_before_another_takes_its_permits(
    (holder, other): (&Client, &Client),
    name: &str,
    (lease, slack): (Duration, Duration),
    cut: impl Fn(bool),
) {
    let semaphore = holder.permit_semaphore(name).unwrap();
    assert!(semaphore.try_set_permits(2).await.unwrap().is_set());
    let permits = semaphore.acquire(2).await.unwrap();
    let lost = permits.lost_token();
    let waiting = other.permit_semaphore(name).unwrap();
    let taker = tokio::spawn(async move {
        let taken = waiting.acquire(1).await.unwrap();
        let at = Instant::now();
        taken.release().await.unwrap();
        at
    });
    let cut_at = Instant::now();
    cut(true);
    lost.cancelled().await;
    let lost_at = Instant::now();
    let taken_at = taker.await.unwrap();
    assert!(
        lost_at < taken_at,
        "the holder learned of its loss {:?} after another client took its permits",
        lost_at.duration_since(taken_at)
    );
    assert!(lost_at.duration_since(cut_at) < lease + slack);
    cut(false);
    drop(permits);
}

/// The child process's side of [`a_killed_holders_permits_come_back`]: takes a permit of
/// `name` on `client`, says so on stdout (as [`super::child_holding`] expects), and waits
/// to be killed.
pub async fn child_takes_a_permit(client: &Client, name: &str) {
    let permits = client
        .permit_semaphore(name)
        .unwrap()
        .acquire(1)
        .await
        .unwrap();
    println!("HELD 0");
    tokio::time::sleep(Duration::from_secs(60)).await;
    drop(permits);
}

/// kill -9 of a process holding a renewed permit of `name` (the child test `child`, told
/// the store's `url` in `variable`, which runs [`child_takes_a_permit`] with a watchdog
/// shorter than `renewed`): the permit is renewed for `renewed` while the process lives,
/// and comes back within `within` of the kill.
pub async fn a_killed_holders_permits_come_back(
    client: &Client,
    name: &str,
    (child, variable, url): (&str, &str, &str),
    (renewed, within): (Duration, Duration),
) {
    let semaphore = client.permit_semaphore(name).unwrap();
    assert!(semaphore.try_set_permits(1).await.unwrap().is_set());
    let (mut child, _) = super::child_holding(child, variable, url).await;
    assert!(
        semaphore
            .try_acquire_for(1, renewed)
            .await
            .unwrap()
            .is_none(),
        "renewed while the holder lives"
    );
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    let killed_at = Instant::now();
    let permits = semaphore.acquire(1).await.unwrap();
    assert!(
        killed_at.elapsed() < within,
        "came back after {:?}",
        killed_at.elapsed()
    );
    permits.release().await.unwrap();
}
