//! The read-write lock on etcd (etcd's `recipes.RWMutex` on the lock's queue): readers
//! share, a writer excludes everyone, the queue is FIFO (a reader waits behind a writer
//! queued ahead of it), a lock and a read-write lock of one name exclude each other,
//! fixed-lease readers share and a writer waits for their leases, a reader cut off learns
//! of its loss before a writer holds, a downgrade lets no writer in between.

use std::time::Duration;

use distlock_testkit::EtcdCluster;

use super::common::{self, bounded, rw};
use super::{behind_proxies, client_at, lock_queue_len, LIMIT};

/// One member: nothing here kills or freezes one.
async fn one_member() -> EtcdCluster {
    EtcdCluster::start(1).await.expect("start etcd")
}

/// The scenario every store's read-write lock passes (tests/common/rw.rs), on two clients.
#[tokio::test]
async fn readers_share_and_a_writer_excludes_everyone() {
    let etcd = one_member().await;
    let clients = [
        client_at(&etcd.url(), Duration::from_secs(5)).await,
        client_at(&etcd.url(), Duration::from_secs(5)).await,
    ];
    let most_readers = bounded(
        LIMIT,
        common::rw::writers_exclude_everyone_and_readers_share(&clients, "etcd:rw:table"),
    )
    .await;
    assert!(most_readers > 1, "readers never shared");
    assert_eq!(
        lock_queue_len(&etcd, "etcd:rw:table").await,
        0,
        "a key left behind"
    );
}

/// A downgrade lets no waiting writer in between (tests/common/rw.rs): its read hold is
/// one more hold on the writer's key, so readers behind wait for it too.
#[tokio::test]
async fn a_downgrade_lets_no_waiting_writer_in_between() {
    let etcd = one_member().await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let other = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let name = "etcd:rw:downgrade";
    let until_waiting = || {
        common::eventually(LIMIT, "the next writer queued", || async {
            lock_queue_len(&etcd, name).await == 2
        })
    };
    bounded(
        LIMIT,
        rw::a_downgrade_lets_no_waiting_writer_in_between(
            (&client, &other),
            name,
            until_waiting,
            false,
        ),
    )
    .await;
    assert_eq!(lock_queue_len(&etcd, name).await, 0, "a key left behind");
}

/// FIFO: a reader that comes after a waiting writer waits behind it (tests/common/rw.rs).
#[tokio::test]
async fn a_reader_waits_behind_a_writer_queued_ahead_of_it() {
    let etcd = one_member().await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let other = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let queued = || lock_queue_len(&etcd, "etcd:rw:fifo");
    bounded(
        LIMIT,
        rw::a_reader_waits_behind_a_writer_queued_ahead_of_it(
            &client,
            &other,
            "etcd:rw:fifo",
            queued,
        ),
    )
    .await;
}

/// A lock and a read-write lock of one name are one queue (tests/common/rw.rs).
#[tokio::test]
async fn a_lock_and_a_read_write_lock_of_one_name_exclude_each_other() {
    let etcd = one_member().await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    bounded(
        LIMIT,
        rw::a_lock_and_a_read_write_lock_of_one_name_exclude_each_other(
            &client,
            "etcd:rw:shared-name",
        ),
    )
    .await;
}

/// Fixed-lease readers share; a writer waits for their leases (etcd's leases are whole
/// seconds, at least its minimum TTL) (tests/common/rw.rs).
#[tokio::test]
async fn fixed_lease_readers_share_and_a_writer_waits_for_their_leases() {
    let etcd = one_member().await;
    let client = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let other = client_at(&etcd.url(), Duration::from_secs(30)).await;
    bounded(
        LIMIT,
        rw::fixed_lease_readers_share_and_a_writer_waits_for_their_leases(
            &client,
            &other,
            "etcd:rw:fixed",
            Duration::from_secs(2),
        ),
    )
    .await;
}

/// A reader cut off from the cluster learns of its loss before a writer holds.
#[tokio::test]
async fn a_reader_cut_off_learns_of_its_loss_before_a_writer_holds() {
    let etcd = one_member().await;
    let (proxies, through) = behind_proxies(&etcd).await;
    let lease = Duration::from_secs(2);
    let holder = client_at(&through, lease).await;
    let other = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let cut = common::cut_switch(&proxies);
    bounded(
        LIMIT,
        rw::a_reader_cut_off_learns_of_its_loss_before_a_writer_holds(
            (&holder, &other),
            "etcd:rw:cut-off",
            (lease, Duration::from_millis(300)),
            cut,
        ),
    )
    .await;
}

/// A read hold re-entered keeps writers out until its last release (tests/common/rw.rs).
#[tokio::test]
async fn a_read_hold_reentered_is_freed_by_its_last_release() {
    let etcd = one_member().await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let lock = client.rw_lock("etcd:rw:reenter").unwrap();
    bounded(
        LIMIT,
        rw::a_read_hold_reentered_is_freed_by_its_last_release(&lock),
    )
    .await;
}
