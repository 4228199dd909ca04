//! The read-write lock on etcd (etcd's `recipes.RWMutex` on the lock's queue): readers
//! share, a writer excludes everyone, the queue is FIFO (a reader waits behind a writer
//! queued ahead of it), a lock and a read-write lock of one name exclude each other,
//! fixed-lease readers share and a writer waits for their leases, a reader cut off learns
//! of its loss before a writer holds, a downgrade lets no writer in between.

use std::time::{Duration, Instant};

use distlock::{Error, ReleaseOutcome};
use distlock_testkit::EtcdCluster;

use super::common::{self, bounded};
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

/// FIFO: a reader that comes after a waiting writer waits behind it, even while readers
/// hold; the writer holds once the reader ahead is gone, and the late reader once the
/// writer is.
#[tokio::test]
async fn a_reader_waits_behind_a_writer_queued_ahead_of_it() {
    let etcd = one_member().await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let other = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let name = "etcd:rw:fifo";
    let lock = client.rw_lock(name).unwrap();
    bounded(LIMIT, async {
        let first = lock.read().await.unwrap();
        let waiting = other.rw_lock(name).unwrap();
        let writer = tokio::spawn(async move { waiting.write().await.unwrap() });
        common::eventually(LIMIT, "the writer queued", || async {
            lock_queue_len(&etcd, name).await == 2
        })
        .await;
        assert!(
            lock.try_read().await.unwrap().is_none(),
            "a reader passed a waiting writer"
        );
        let late = {
            let lock = lock.clone();
            tokio::spawn(async move { lock.read().await.unwrap() })
        };
        common::eventually(LIMIT, "the late reader queued", || async {
            lock_queue_len(&etcd, name).await == 3
        })
        .await;
        assert!(!writer.is_finished(), "the writer held beside a reader");
        first.release().await.unwrap();
        let writer = writer.await.unwrap();
        assert!(writer.fencing_token() > 0);
        assert!(!late.is_finished(), "a reader held beside the writer");
        assert_eq!(writer.release().await.unwrap(), ReleaseOutcome::Released);
        let late = late.await.unwrap();
        assert!(lock.is_locked().await.unwrap());
        late.release().await.unwrap();
        assert!(!lock.is_locked().await.unwrap());
    })
    .await;
}

/// A lock and a read-write lock of one name are one queue: the lock excludes readers and
/// writers, a reader excludes the lock, and tokens grow across them. A downgrade is
/// refused, leaving the writer holding.
#[tokio::test]
async fn a_lock_and_a_read_write_lock_of_one_name_exclude_each_other() {
    let etcd = one_member().await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let (plain, rw) = (
        client.lock("etcd:rw:shared-name").unwrap(),
        client.rw_lock("etcd:rw:shared-name").unwrap(),
    );
    bounded(LIMIT, async {
        let held = plain.lock().await.unwrap();
        assert!(rw.try_read().await.unwrap().is_none());
        assert!(rw.try_write().await.unwrap().is_none());
        held.release().await.unwrap();
        let reader = rw.read().await.unwrap();
        assert!(plain.try_lock().await.unwrap().is_none());
        assert!(plain.is_locked().await.unwrap());
        reader.release().await.unwrap();
        let writer = rw.write().await.unwrap();
        let token = writer.fencing_token();
        writer.release().await.unwrap();
        let held = plain.lock().await.unwrap();
        assert!(held.fencing_token() > token, "a token did not grow");
        held.release().await.unwrap();
    })
    .await;
}

/// A downgrade lets no writer in between: the read hold is one more hold on the writer's
/// key, so a writer waiting behind it, and a reader, come in only once it is released
/// too. A force-unlocked writer's downgrade is `NotHeld`.
#[tokio::test]
async fn a_downgrade_lets_no_waiting_writer_in_between() {
    let etcd = one_member().await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let other = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let name = "etcd:rw:downgrade";
    let lock = client.rw_lock(name).unwrap();
    bounded(LIMIT, async {
        let writer = lock.write().await.unwrap();
        let next = other.rw_lock(name).unwrap();
        let next_writer = tokio::spawn(async move { next.write().await.unwrap() });
        common::eventually(LIMIT, "the next writer queued", || async {
            lock_queue_len(&etcd, name).await == 2
        })
        .await;
        let reader = lock.downgrade(&writer).await.unwrap();
        assert_eq!(writer.release().await.unwrap(), ReleaseOutcome::Released);
        assert!(reader.verify().await.unwrap());
        assert!(lock.try_write().await.unwrap().is_none());
        assert!(
            !next_writer.is_finished(),
            "a writer came in after a downgrade"
        );
        reader.release().await.unwrap();
        let next_writer = next_writer.await.unwrap();
        assert_eq!(
            next_writer.release().await.unwrap(),
            ReleaseOutcome::Released
        );

        let writer = lock.write().await.unwrap();
        assert!(client.lock(name).unwrap().force_unlock().await.unwrap());
        common::eventually(LIMIT, "the writer's loss", || async {
            !writer.verify().await.unwrap()
        })
        .await;
        let err = lock.downgrade(&writer).await.unwrap_err();
        assert!(matches!(err, Error::NotHeld { .. }), "{err}");
    })
    .await;
    assert_eq!(lock_queue_len(&etcd, name).await, 0, "a key left behind");
}

/// Readers on a fixed lease share: a writer waits for the last reader's lease to end,
/// and every reader's lost signal fired before it held. A writer on a fixed lease keeps
/// readers out likewise.
#[tokio::test]
async fn fixed_lease_readers_share_and_a_writer_waits_for_their_leases() {
    let etcd = one_member().await;
    let client = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let other = client_at(&etcd.url(), Duration::from_secs(30)).await;
    // etcd's leases are whole seconds, and at least its minimum TTL.
    let lease = Duration::from_secs(2);
    let name = "etcd:rw:fixed";
    let readers = client.rw_lock(name).unwrap().with_lease(lease);
    bounded(LIMIT, async {
        let first = readers.read().await.unwrap();
        let second = readers.read().await.unwrap();
        let writer_lock = other.rw_lock(name).unwrap();
        assert!(writer_lock.try_write().await.unwrap().is_none());
        let (first_lost, second_lost) = (first.lost_token(), second.lost_token());
        let writer = writer_lock.write().await.unwrap();
        assert!(first_lost.is_cancelled() && second_lost.is_cancelled());
        assert_eq!(first.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
        drop(second);
        writer.release().await.unwrap();

        let writer = writer_lock.with_lease(lease).write().await.unwrap();
        assert!(readers.try_read().await.unwrap().is_none());
        let lost = writer.lost_token();
        let reader = readers.read().await.unwrap();
        assert!(
            lost.is_cancelled(),
            "a reader held before the writer's loss"
        );
        reader.release().await.unwrap();
        drop(writer);
    })
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
    bounded(LIMIT, async {
        let reader = holder
            .rw_lock("etcd:rw:cut-off")
            .unwrap()
            .read()
            .await
            .unwrap();
        let taken_at = Instant::now();
        for proxy in &proxies {
            proxy.blackhole();
        }
        let lost_at = common::lost_before_another_holds(
            reader.lost_token(),
            other.lock("etcd:rw:cut-off").unwrap(),
        )
        .await;
        assert!(lost_at.duration_since(taken_at) < lease + Duration::from_millis(300));
        for proxy in &proxies {
            proxy.heal();
        }
        drop(reader);
    })
    .await;
}

/// A read hold re-entered keeps writers out until its last release.
#[tokio::test]
async fn a_read_hold_reentered_is_freed_by_its_last_release() {
    let etcd = one_member().await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let lock = client.rw_lock("etcd:rw:reenter").unwrap();
    bounded(LIMIT, async {
        let reader = lock.read().await.unwrap();
        let again = reader.reenter().await.unwrap();
        assert_eq!(again.hold_count(), 2);
        assert!(lock.try_write().await.unwrap().is_none());
        assert_eq!(again.release().await.unwrap(), ReleaseOutcome::Released);
        assert!(lock.try_write().await.unwrap().is_none());
        reader.release().await.unwrap();
        let writer = lock.try_write().await.unwrap().expect("the lock is free");
        writer.release().await.unwrap();
    })
    .await;
}
