//! What a read-write lock promises on every store, as one scenario each store's tests run.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock::Client;

/// Six tasks on `clients` (taken in turn) read and write lock `name` ten rounds each: a
/// writer is never in with anyone, and write tokens never repeat. Answers the most
/// readers seen in together, for the caller to assert they shared.
pub async fn writers_exclude_everyone_and_readers_share(clients: &[Client], name: &str) -> usize {
    let readers = Arc::new(AtomicUsize::new(0));
    let writers = Arc::new(AtomicUsize::new(0));
    let most_readers = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for n in 0..6 {
        let lock = clients[n % clients.len()].rw_lock(name).unwrap();
        let (readers, writers, most) = (
            Arc::clone(&readers),
            Arc::clone(&writers),
            Arc::clone(&most_readers),
        );
        let tokens = Arc::clone(&tokens);
        tasks.push(tokio::spawn(async move {
            for round in 0..10 {
                if (n + round) % 3 == 0 {
                    let guard = lock.write().await.unwrap();
                    assert_eq!(writers.fetch_add(1, Ordering::SeqCst), 0, "two writers");
                    assert_eq!(readers.load(Ordering::SeqCst), 0, "a writer with readers");
                    tokens.lock().unwrap().push(guard.fencing_token());
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    writers.fetch_sub(1, Ordering::SeqCst);
                    guard.release().await.unwrap();
                } else {
                    let guard = lock.read().await.unwrap();
                    let now = readers.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    assert_eq!(writers.load(Ordering::SeqCst), 0, "a reader with a writer");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    readers.fetch_sub(1, Ordering::SeqCst);
                    guard.release().await.unwrap();
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let mut tokens = tokens.lock().unwrap().clone();
    let handed_out = tokens.len();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), handed_out, "a write token repeated");
    most_readers.load(Ordering::SeqCst)
}

/// A lock and a read-write lock called `name` on `client` exclude each other: the lock
/// keeps readers and writers out, a reader keeps the lock out, and tokens grow across
/// them.
pub async fn a_lock_and_a_read_write_lock_of_one_name_exclude_each_other(
    client: &Client,
    name: &str,
) {
    let (plain, rw) = (client.lock(name).unwrap(), client.rw_lock(name).unwrap());
    let held = plain.lock().await.unwrap();
    assert!(rw.try_read().await.unwrap().is_none());
    assert!(rw.try_write().await.unwrap().is_none());
    held.release().await.unwrap();
    let reader = rw.read().await.unwrap();
    assert!(rw.is_locked().await.unwrap());
    assert!(plain.try_lock().await.unwrap().is_none());
    assert!(plain.is_locked().await.unwrap());
    reader.release().await.unwrap();
    assert!(!rw.is_locked().await.unwrap());
    let writer = rw.write().await.unwrap();
    let token = writer.fencing_token();
    writer.release().await.unwrap();
    let held = plain.lock().await.unwrap();
    assert!(held.fencing_token() > token, "a token did not grow");
    held.release().await.unwrap();
}

/// Two readers of `name` on `client` with a fixed `lease` share it, and a writer on
/// `other` holds only once both leases ended and both lost signals fired (the first
/// reader's release then says `AlreadyLost`); a writer on a fixed lease keeps readers out
/// likewise.
pub async fn fixed_lease_readers_share_and_a_writer_waits_for_their_leases(
    client: &Client,
    other: &Client,
    name: &str,
    lease: Duration,
) {
    let readers = client.rw_lock(name).unwrap().with_lease(lease);
    let first = readers.read().await.unwrap();
    let second = readers.read().await.unwrap();
    assert!(first.lease_remaining() <= lease);
    let writer_lock = other.rw_lock(name).unwrap();
    assert!(writer_lock.try_write().await.unwrap().is_none());
    let (first_lost, second_lost) = (first.lost_token(), second.lost_token());
    let writer = writer_lock.write().await.unwrap();
    assert!(first_lost.is_cancelled() && second_lost.is_cancelled());
    assert!(first.is_lost() && second.is_lost());
    assert_eq!(
        first.release().await.unwrap(),
        distlock::ReleaseOutcome::AlreadyLost
    );
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
}

/// A reader of `name` on `holder` (whose store `cut` cuts off, and `heal` brings back)
/// learns of its loss before a lock of the name on `other` holds, and within `lease`
/// (plus `slack`) of the cut.
pub async fn a_reader_cut_off_learns_of_its_loss_before_a_writer_holds(
    (holder, other): (&Client, &Client),
    name: &str,
    (lease, slack): (Duration, Duration),
    cut: impl Fn(bool),
) {
    let reader = holder.rw_lock(name).unwrap().read().await.unwrap();
    let cut_at = std::time::Instant::now();
    cut(true);
    let lost_at =
        super::lost_before_another_holds(reader.lost_token(), other.lock(name).unwrap()).await;
    assert!(lost_at.duration_since(cut_at) < lease + slack);
    cut(false);
    drop(reader);
}

/// A read hold of `lock` re-entered counts two holds and keeps writers out until its
/// last release.
pub async fn a_read_hold_reentered_is_freed_by_its_last_release(lock: &distlock::RwLock) {
    use distlock::ReleaseOutcome;
    let reader = lock.read().await.unwrap();
    let again = reader.reenter().await.unwrap();
    assert_eq!(again.hold_count(), 2);
    assert!(lock.try_write().await.unwrap().is_none());
    assert_eq!(again.release().await.unwrap(), ReleaseOutcome::Released);
    assert!(lock.try_write().await.unwrap().is_none());
    assert_eq!(reader.release().await.unwrap(), ReleaseOutcome::Released);
    let writer = lock.try_write().await.unwrap().expect("the lock is free");
    writer.release().await.unwrap();
}

/// FIFO on a queue store: with a reader of `name` holding on `client`, a writer from
/// `other` queues, and a reader that comes after it waits behind it even though a reader
/// holds; the writer holds once the first reader is gone, the late reader once the
/// writer is. `queued` answers how many nodes or keys the lock's queue has.
pub async fn a_reader_waits_behind_a_writer_queued_ahead_of_it<F, Fut>(
    client: &Client,
    other: &Client,
    name: &str,
    queued: F,
) where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = usize>,
{
    use distlock::ReleaseOutcome;
    let limit = Duration::from_secs(30);
    let lock = client.rw_lock(name).unwrap();
    let first = lock.read().await.unwrap();
    let waiting = other.rw_lock(name).unwrap();
    let writer = tokio::spawn(async move { waiting.write().await.unwrap() });
    super::eventually(limit, "the writer queued", || async { queued().await == 2 }).await;
    assert!(
        lock.try_read().await.unwrap().is_none(),
        "a reader passed a waiting writer"
    );
    assert_eq!(queued().await, 2, "a try left a node behind");
    let late = {
        let lock = lock.clone();
        tokio::spawn(async move { lock.read().await.unwrap() })
    };
    super::eventually(limit, "the late reader queued", || async {
        queued().await == 3
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
}

/// A downgrade of a writer of `name` on `client` lets no writer in between: a writer
/// from `other` that waits (`until_waiting` answers once it waits) stays out while the
/// downgraded reader holds, after the old writer let go, and holds once that reader is
/// gone; if `readers_join`, another reader joins the downgraded one meanwhile. A writer
/// force-unlocked cannot be downgraded (`NotHeld`).
pub async fn a_downgrade_lets_no_waiting_writer_in_between<F, Fut>(
    (client, other): (&Client, &Client),
    name: &str,
    until_waiting: F,
    readers_join: bool,
) where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    use distlock::ReleaseOutcome;
    let lock = client.rw_lock(name).unwrap();
    let writer = lock.write().await.unwrap();
    let next = other.rw_lock(name).unwrap();
    let next_writer = tokio::spawn(async move { next.write().await.unwrap() });
    until_waiting().await;
    let reader = lock.downgrade(&writer).await.unwrap();
    assert_eq!(writer.release().await.unwrap(), ReleaseOutcome::Released);
    assert!(reader.verify().await.unwrap());
    let joined = if readers_join {
        Some(lock.try_read().await.unwrap().expect("a reader joins"))
    } else {
        None
    };
    assert!(lock.try_write().await.unwrap().is_none());
    assert!(
        !next_writer.is_finished(),
        "a writer came in after a downgrade"
    );
    reader.release().await.unwrap();
    if let Some(joined) = joined {
        joined.release().await.unwrap();
    }
    let next_writer = next_writer.await.unwrap();
    assert_eq!(
        next_writer.release().await.unwrap(),
        ReleaseOutcome::Released
    );

    let writer = lock.write().await.unwrap();
    assert!(client.lock(name).unwrap().force_unlock().await.unwrap());
    super::eventually(Duration::from_secs(30), "the writer's loss", || async {
        !writer.verify().await.unwrap()
    })
    .await;
    let err = lock.downgrade(&writer).await.unwrap_err();
    assert!(matches!(err, distlock::Error::NotHeld { .. }), "{err}");
}
