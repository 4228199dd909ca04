//! The read-write lock on ZooKeeper (Curator's shared lock recipe): readers share, a
//! writer excludes everyone, the queue is FIFO (a reader waits behind a writer queued
//! ahead of it), a downgrade lets no writer in between, a lock and a read-write lock of
//! one name exclude each other, fixed-lease readers share and a writer waits for their
//! leases, and a reader cut off learns of its loss before a writer holds.

use std::time::Duration;

use super::common::{self, bounded, rw};
use super::{behind_proxies, client_at, ensemble, queue_len, LIMIT};

/// The scenario every store's read-write lock passes (tests/common/rw.rs), on two clients.
#[tokio::test]
async fn readers_share_and_a_writer_excludes_everyone() {
    let zk = ensemble(1).await;
    let clients = [
        client_at(&zk.url(), Duration::from_secs(5)).await,
        client_at(&zk.url(), Duration::from_secs(5)).await,
    ];
    let most_readers = bounded(
        LIMIT,
        common::rw::writers_exclude_everyone_and_readers_share(&clients, "zk:rw:table"),
    )
    .await;
    assert!(most_readers > 1, "readers never shared");
    assert_eq!(queue_len(&zk, "zk:rw:table").await, 0, "a node left behind");
}

/// A downgrade lets no waiting writer in between (tests/common/rw.rs), and leaves no
/// node behind.
#[tokio::test]
async fn a_downgrade_lets_no_waiting_writer_in_between() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(5)).await;
    let other = client_at(&zk.url(), Duration::from_secs(5)).await;
    let name = "zk:rw:downgrade";
    let until_waiting = || {
        common::eventually(LIMIT, "the next writer queued", || async {
            queue_len(&zk, name).await == 2
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
    common::eventually(LIMIT, "the queue emptied", || async {
        queue_len(&zk, name).await == 0
    })
    .await;
}

/// FIFO: a reader that comes after a waiting writer waits behind it (tests/common/rw.rs).
#[tokio::test]
async fn a_reader_waits_behind_a_writer_queued_ahead_of_it() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(5)).await;
    let other = client_at(&zk.url(), Duration::from_secs(5)).await;
    let queued = || queue_len(&zk, "zk:rw:fifo");
    bounded(
        LIMIT,
        rw::a_reader_waits_behind_a_writer_queued_ahead_of_it(
            &client,
            &other,
            "zk:rw:fifo",
            queued,
        ),
    )
    .await;
}

/// A lock and a read-write lock of one name are one queue (tests/common/rw.rs).
#[tokio::test]
async fn a_lock_and_a_read_write_lock_of_one_name_exclude_each_other() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(5)).await;
    bounded(
        LIMIT,
        rw::a_lock_and_a_read_write_lock_of_one_name_exclude_each_other(
            &client,
            "zk:rw:shared-name",
        ),
    )
    .await;
}

/// Fixed-lease readers share; a writer waits for their leases, by the ensemble's clock
/// (tests/common/rw.rs).
#[tokio::test]
async fn fixed_lease_readers_share_and_a_writer_waits_for_their_leases() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(30)).await;
    let other = client_at(&zk.url(), Duration::from_secs(30)).await;
    let lease = Duration::from_millis(1500);
    bounded(
        LIMIT,
        rw::fixed_lease_readers_share_and_a_writer_waits_for_their_leases(
            &client,
            &other,
            "zk:rw:fixed",
            lease,
        ),
    )
    .await;
}

/// A reader cut off from the ensemble learns of its loss before a writer holds (its
/// session, and so its node, ends after the session timeout; its trust ends before).
#[tokio::test]
async fn a_reader_cut_off_learns_of_its_loss_before_a_writer_holds() {
    let zk = ensemble(1).await;
    let (proxies, through) = behind_proxies(&zk).await;
    let session = Duration::from_secs(2);
    let holder = client_at(&through, session).await;
    let other = client_at(&zk.url(), Duration::from_secs(5)).await;
    let cut = common::cut_switch(&proxies);
    bounded(
        LIMIT,
        rw::a_reader_cut_off_learns_of_its_loss_before_a_writer_holds(
            (&holder, &other),
            "zk:rw:cut-off",
            (session, Duration::from_millis(300)),
            cut,
        ),
    )
    .await;
}

/// A read hold re-entered keeps writers out until its last release (tests/common/rw.rs).
#[tokio::test]
async fn a_read_hold_reentered_is_freed_by_its_last_release() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(5)).await;
    let lock = client.rw_lock("zk:rw:reenter").unwrap();
    bounded(
        LIMIT,
        rw::a_read_hold_reentered_is_freed_by_its_last_release(&lock),
    )
    .await;
}
