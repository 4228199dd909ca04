//! The read-write lock on PostgreSQL: a writer is the lease lock's row, readers rows of
//! their own, and the lock's row keeps how long readers hold (`readers_until`), which is
//! what a writer's acquisition decides on. Readers share, a writer excludes everyone, a
//! lock and a read-write lock of one name exclude each other, the last reader's release
//! wakes a writer at once, a downgrade lets no writer in between, fixed-lease readers
//! share and a writer waits for their leases, a reader cut off learns of its loss before
//! a writer holds, and a table an older distlock made is completed at connect.

use std::time::{Duration, Instant};

use distlock::ReleaseOutcome;

use super::common::{self, bounded, rw};
use super::{behind_proxy, client_at, database, raw, LIMIT};

/// The scenario every store's read-write lock passes (tests/common/rw.rs), on two clients.
#[tokio::test]
async fn readers_share_and_a_writer_excludes_everyone() {
    let server = database().await;
    let clients = [
        client_at(&server.url(), Duration::from_secs(5)).await,
        client_at(&server.url(), Duration::from_secs(5)).await,
    ];
    let most_readers = bounded(
        LIMIT,
        common::rw::writers_exclude_everyone_and_readers_share(&clients, "pg:rw:table"),
    )
    .await;
    assert!(most_readers > 1, "readers never shared");
}

/// The last reader's release wakes a waiting writer at once (NOTIFY), not at the end of
/// the readers' leases; a reader leaving while another stays does not let it in.
#[tokio::test]
async fn the_last_readers_release_wakes_a_writer_at_once() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_secs(30)).await;
    let other = client_at(&server.url(), Duration::from_secs(30)).await;
    let lock = client.rw_lock("pg:rw:wake").unwrap();
    bounded(LIMIT, async {
        let (first, second) = (lock.read().await.unwrap(), lock.read().await.unwrap());
        let writer_lock = other.rw_lock("pg:rw:wake").unwrap();
        let writer = tokio::spawn(async move { writer_lock.write().await.unwrap() });
        assert_eq!(first.release().await.unwrap(), ReleaseOutcome::Released);
        assert!(lock.try_write().await.unwrap().is_none());
        assert!(!writer.is_finished(), "a writer came in beside a reader");
        let released_at = Instant::now();
        second.release().await.unwrap();
        let writer = writer.await.unwrap();
        assert!(
            released_at.elapsed() < Duration::from_secs(5),
            "the writer waited {:?} after the last reader left",
            released_at.elapsed()
        );
        assert!(lock.try_read().await.unwrap().is_none());
        writer.release().await.unwrap();
    })
    .await;
}

/// A downgrade lets no waiting writer in between, while readers join the downgraded one
/// once the writer let go (tests/common/rw.rs).
#[tokio::test]
async fn a_downgrade_lets_no_waiting_writer_in_between() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_secs(5)).await;
    let other = client_at(&server.url(), Duration::from_secs(5)).await;
    // No queue to look at: the writer waits by the time the downgrade is checked, or
    // comes later and finds the reader.
    let until_waiting = || async {};
    bounded(
        LIMIT,
        rw::a_downgrade_lets_no_waiting_writer_in_between(
            (&client, &other),
            "pg:rw:downgrade",
            until_waiting,
            true,
        ),
    )
    .await;
}

/// A read hold re-entered keeps writers out until its last release; the watchdog keeps
/// a read hold past its lease.
#[tokio::test]
async fn a_read_hold_is_renewed_and_reentered() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_millis(900)).await;
    let lock = client.rw_lock("pg:rw:reenter").unwrap();
    bounded(LIMIT, async {
        let reader = lock.read().await.unwrap();
        let again = reader.reenter().await.unwrap();
        assert_eq!(again.hold_count(), 2);
        // Three leases later, still held: renewed.
        tokio::time::sleep(Duration::from_millis(2700)).await;
        assert!(!reader.is_lost());
        assert!(lock.try_write().await.unwrap().is_none());
        assert_eq!(again.release().await.unwrap(), ReleaseOutcome::Released);
        assert!(lock.try_write().await.unwrap().is_none());
        assert_eq!(reader.release().await.unwrap(), ReleaseOutcome::Released);
        let writer = lock.try_write().await.unwrap().expect("the lock is free");
        writer.release().await.unwrap();
    })
    .await;
}

/// A database whose lock table an older distlock made (no readers_until, no readers'
/// table) is completed at connect, and its locks keep working.
#[tokio::test]
async fn a_table_an_older_distlock_made_is_completed_at_connect() {
    let server = database().await;
    let pool = raw(&server).await;
    for statement in [
        "CREATE TABLE distlock_locks (name text PRIMARY KEY, owner text NOT NULL, \
         holds integer NOT NULL, token bigint NOT NULL, expires_at timestamptz NOT NULL, \
         released_by text, released_txid bigint)",
        "CREATE SEQUENCE distlock_tokens AS bigint",
        "INSERT INTO distlock_locks VALUES ('pg:old', '', 0, 41, '-infinity', NULL, NULL)",
    ] {
        sqlx::query(statement).execute(&pool).await.unwrap();
    }
    let client = client_at(&server.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let writer = client.rw_lock("pg:old").unwrap().write().await.unwrap();
        assert!(writer.fencing_token() > 41);
        writer.release().await.unwrap();
        let reader = client.rw_lock("pg:old").unwrap().read().await.unwrap();
        assert!(client
            .lock("pg:old")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none());
        reader.release().await.unwrap();
    })
    .await;
}

/// A lock and a read-write lock of one name exclude each other (tests/common/rw.rs).
#[tokio::test]
async fn a_lock_and_a_read_write_lock_of_one_name_exclude_each_other() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_secs(5)).await;
    bounded(
        LIMIT,
        rw::a_lock_and_a_read_write_lock_of_one_name_exclude_each_other(
            &client,
            "pg:rw:shared-name",
        ),
    )
    .await;
}

/// Fixed-lease readers share; a writer waits for their leases, on the database's clock
/// (tests/common/rw.rs).
#[tokio::test]
async fn fixed_lease_readers_share_and_a_writer_waits_for_their_leases() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_secs(30)).await;
    let other = client_at(&server.url(), Duration::from_secs(30)).await;
    bounded(
        LIMIT,
        rw::fixed_lease_readers_share_and_a_writer_waits_for_their_leases(
            &client,
            &other,
            "pg:rw:fixed",
            Duration::from_millis(1200),
        ),
    )
    .await;
}

/// A reader cut off from the database learns of its loss before a writer holds.
#[tokio::test]
async fn a_reader_cut_off_learns_of_its_loss_before_a_writer_holds() {
    let server = database().await;
    let (proxy, through_proxy) = behind_proxy(&server).await;
    let lease = Duration::from_millis(1500);
    let holder = client_at(&through_proxy, lease).await;
    let other = client_at(&server.url(), Duration::from_secs(5)).await;
    let cut = common::cut_switch(std::slice::from_ref(&proxy));
    bounded(
        LIMIT,
        rw::a_reader_cut_off_learns_of_its_loss_before_a_writer_holds(
            (&holder, &other),
            "pg:rw:cut-off",
            (lease, Duration::from_millis(200)),
            cut,
        ),
    )
    .await;
}

/// An operator's `Lock::force_unlock` of the name ends every reader (not only a writer):
/// a writer then holds at once, and the readers' lost signals fire.
#[tokio::test]
async fn a_force_unlock_ends_every_reader() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_secs(30)).await;
    let operator = client_at(&server.url(), Duration::from_secs(5)).await;
    let name = "pg:rw:force";
    let lock = client.rw_lock(name).unwrap();
    bounded(LIMIT, async {
        let (first, second) = (lock.read().await.unwrap(), lock.read().await.unwrap());
        let plain = operator.lock(name).unwrap();
        assert_eq!(plain.owners().await.unwrap().len(), 2);
        assert!(plain.force_unlock().await.unwrap());
        assert!(!first.verify().await.unwrap() && !second.verify().await.unwrap());
        first.lost().await;
        let writer = operator
            .rw_lock(name)
            .unwrap()
            .try_write()
            .await
            .unwrap()
            .expect("free once the readers were ended");
        writer.release().await.unwrap();
        assert!(!plain.force_unlock().await.unwrap(), "nothing left to end");
    })
    .await;
}

/// A name only readers ever held has a row with no writer's expiry (`-infinity`). An
/// acquisition that waits for another transaction's write of that row, and finds the
/// lock taken once it may go on, answers "busy" from its statement's older view of the
/// row: that answer's time left must not subtract an infinite timestamp (PostgreSQL
/// refuses, "cannot subtract infinite timestamps"; a CI run failed so). Both a reader's
/// and a writer's acquisition answer busy, with no error.
#[tokio::test]
async fn an_acquisition_that_waited_on_a_readers_row_answers_busy() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_secs(30)).await;
    let pool = raw(&server).await;
    bounded(LIMIT, async {
        let rw = client.rw_lock("pg:rw:infinite").unwrap();
        // Readers came and went: the row's expiry and readers_until are both -infinity.
        rw.try_read()
            .await
            .unwrap()
            .expect("free")
            .release()
            .await
            .unwrap();
        for write in [false, true] {
            // Another transaction holds the row and makes it a writer's, as another
            // client's acquisition would; the attempt waits for it in the database.
            let mut blocking = pool.begin().await.unwrap();
            sqlx::query(
                "UPDATE distlock_locks SET owner = 'elsewhere', holds = 1, token = token + 1, \
                 expires_at = clock_timestamp() + interval '30 seconds' WHERE name = $1",
            )
            .bind("pg:rw:infinite")
            .execute(&mut *blocking)
            .await
            .unwrap();
            let attempt = {
                let rw = rw.clone();
                tokio::spawn(async move {
                    if write {
                        rw.try_write().await.map(|held| held.is_some())
                    } else {
                        rw.try_read().await.map(|held| held.is_some())
                    }
                })
            };
            while common::pg::lock_waiters(&pool).await == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            blocking.commit().await.unwrap();
            let taken = attempt.await.unwrap();
            assert!(
                matches!(taken, Ok(false)),
                "write {write}: {taken:?} where busy was due"
            );
            // Free the row again, as a writer's lease running out would.
            sqlx::query(
                "UPDATE distlock_locks SET owner = '', holds = 0, expires_at = '-infinity' \
                 WHERE name = $1",
            )
            .bind("pg:rw:infinite")
            .execute(&pool)
            .await
            .unwrap();
        }
    })
    .await;
}
