//! The read-write lock: readers share, a writer excludes everyone, a reader that dies
//! loses only its own holds, read holds are renewed, writer preference keeps a stream of
//! readers from starving a writer, downgrade, re-entry, and Redisson's layout.

mod common;

use std::time::{Duration, Instant};

use common::{bounded, client, client_with_watchdog, raw, server};
use futures_util::StreamExt;

const LIMIT: Duration = Duration::from_secs(30);

/// Readers and writers on two clients: a writer is never in with anyone, readers are in
/// together, and write tokens strictly increase.
#[tokio::test]
async fn a_writer_excludes_everyone_and_readers_share() {
    let server = server().await;
    let clients = [client(&server).await, client(&server).await];
    let most_readers = bounded(
        LIMIT,
        common::rw::writers_exclude_everyone_and_readers_share(&clients, "table"),
    )
    .await;
    assert!(most_readers > 1, "readers never shared");
}

/// The layout is Redisson's: `mode`, a field per reader, `<owner>:write`, one key per read
/// hold; the last read release publishes `0`, a write release `1`, on
/// `redisson_rwlock:{name}`. Re-entry adds a hold key; downgrade keeps writers out.
#[tokio::test]
async fn follows_redissons_layout_with_reentry_and_downgrade() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.rw_lock("doc").unwrap();
        let mut listener = server.client().unwrap().get_async_pubsub().await.unwrap();
        listener.subscribe("redisson_rwlock:{doc}").await.unwrap();
        let reader = lock.read().await.unwrap();
        let mode: String = redis::cmd("HGET")
            .arg("doc")
            .arg("mode")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(mode, "read");
        let nested = reader.reenter().await.unwrap();
        assert_eq!(nested.hold_count(), 2);
        for n in [1, 2] {
            let key = format!("{{doc}}:{}:rwlock_timeout:{n}", reader.owner());
            let ttl: i64 = redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .unwrap();
            assert!(ttl > 0, "{key}: {ttl}");
        }
        assert!(lock.try_write().await.unwrap().is_none());
        nested.release().await.unwrap();
        reader.release().await.unwrap();
        let message = listener.on_message().next().await.unwrap();
        assert_eq!(message.get_payload::<String>().unwrap(), "0");
        assert!(!lock.is_locked().await.unwrap());

        let writer = lock.write().await.unwrap();
        assert!(writer.owner().ends_with(":write"));
        let held: i64 = redis::cmd("HEXISTS")
            .arg("doc")
            .arg(writer.owner())
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(held, 1);
        let read_again = lock.downgrade(&writer).await.unwrap();
        writer.release().await.unwrap();
        let mode: String = redis::cmd("HGET")
            .arg("doc")
            .arg("mode")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(mode, "read");
        assert!(
            lock.try_write().await.unwrap().is_none(),
            "a writer got in after a downgrade"
        );
        let another = lock
            .try_read()
            .await
            .unwrap()
            .expect("readers share a downgraded lock");
        another.release().await.unwrap();
        read_again.release().await.unwrap();
        let writer = lock.write().await.unwrap();
        writer.release().await.unwrap();
        // The downgraded writer's release tells waiting readers (`1`), the last reader's
        // release frees the lock (`0`), the last writer's too (`1`).
        let mut payloads = Vec::new();
        while payloads.len() < 3 {
            payloads.push(
                listener
                    .on_message()
                    .next()
                    .await
                    .unwrap()
                    .get_payload::<String>()
                    .unwrap(),
            );
        }
        assert_eq!(
            payloads.last().map(String::as_str),
            Some("1"),
            "{payloads:?}"
        );
    })
    .await;
}

/// A reader whose holds are no longer renewed (a dead process) loses them at the end of
/// its own lease; another reader's holds, renewed, stay, and so does the lock.
#[tokio::test]
async fn a_dead_readers_holds_expire_without_shortening_the_others() {
    let server = server().await;
    let dying = client_with_watchdog(&server, Duration::from_millis(600)).await;
    let living = client_with_watchdog(&server, Duration::from_millis(600)).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let theirs = dying.rw_lock("shared").unwrap().read().await.unwrap();
        let their_key = format!("{{shared}}:{}:rwlock_timeout:1", theirs.owner());
        let mine = living.rw_lock("shared").unwrap().read().await.unwrap();
        std::mem::forget(theirs);
        dying.shutdown().await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let gone: i64 = redis::cmd("EXISTS")
            .arg(&their_key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(gone, 0, "the dead reader's hold outlived its lease");
        assert!(!mine.is_lost(), "the living reader's holds were renewed");
        assert!(mine.verify().await.unwrap());
        let ttl: i64 = redis::cmd("PTTL")
            .arg("shared")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(ttl > 0);
        mine.release().await.unwrap();
    })
    .await;
}

/// With writer preference, a waiting writer keeps new readers out, so a stream of
/// readers cannot starve it; without it, readers keep coming in, as Redisson's do. A
/// writer waiting for readers is woken by the last read release at once.
#[tokio::test]
async fn writer_preference_keeps_new_readers_behind_a_waiting_writer() {
    let server = server().await;
    let (a, b) = (client(&server).await, client(&server).await);
    bounded(LIMIT, async {
        let lock = a.rw_lock("stream").unwrap();
        let first = lock.read().await.unwrap();
        let writing = tokio::spawn({
            let lock = b.rw_lock("stream").unwrap();
            async move { lock.write().await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            lock.prefer_writers(true)
                .try_read()
                .await
                .unwrap()
                .is_none(),
            "a new reader passed a waiting writer"
        );
        let plain = lock
            .try_read()
            .await
            .unwrap()
            .expect("without preference readers share");
        plain.release().await.unwrap();
        let released_at = Instant::now();
        first.release().await.unwrap();
        let writer = writing.await.unwrap().unwrap();
        assert!(
            released_at.elapsed() < Duration::from_millis(300),
            "the writer was not woken by the release: {:?}",
            released_at.elapsed()
        );
        writer.release().await.unwrap();
        assert!(lock
            .prefer_writers(true)
            .try_read()
            .await
            .unwrap()
            .is_some());
    })
    .await;
}

/// Polls `future` once, then drops it: a call cut off right after it sent its command.
async fn cancel_after_first_poll<F: std::future::Future>(future: F) {
    tokio::select! {
        biased;
        _ = future => {}
        _ = std::future::ready(()) => {}
    }
}

async fn hkeys(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> Vec<String> {
    let mut keys: Vec<String> = redis::cmd("HKEYS")
        .arg(key)
        .query_async(conn)
        .await
        .unwrap();
    keys.sort();
    keys
}

/// Review: a downgrade of a write hold that was lost (deleted, its lease run out, another
/// writer in since) is refused and takes nothing; a refused downgrade (a lost hold,
/// another lock's guard) leaves the writer's guard as it was; a downgrade cut off mid-call
/// gives back the read hold it took.
#[tokio::test(flavor = "current_thread")]
async fn a_downgrade_is_refused_when_not_the_callers_and_never_leaves_a_hold() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let rw = client.rw_lock("down").unwrap();
        let writer = rw.write().await.unwrap();
        let _: i64 = redis::cmd("DEL")
            .arg("down")
            .query_async(&mut conn)
            .await
            .unwrap();
        let other = rw
            .try_write()
            .await
            .unwrap()
            .expect("free after the delete");
        other.release().await.unwrap();
        assert!(matches!(
            rw.downgrade(&writer).await,
            Err(distlock::Error::NotHeld { .. })
        ));
        assert!(
            !rw.is_locked().await.unwrap(),
            "a refused downgrade took a read hold"
        );
        drop(writer);

        let short = rw.with_lease(Duration::from_millis(200));
        let writer = short.write().await.unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(short.downgrade(&writer).await.is_err());
        drop(writer);

        let other_lock = client.rw_lock("elsewhere").unwrap();
        let theirs = other_lock.write().await.unwrap();
        assert!(matches!(
            rw.downgrade(&theirs).await,
            Err(distlock::Error::InvalidArgument { .. })
        ));
        assert!(
            theirs.verify().await.unwrap(),
            "a refused downgrade released the guard"
        );
        theirs.release().await.unwrap();

        let writer = rw.write().await.unwrap();
        cancel_after_first_poll(rw.downgrade(&writer)).await;
        writer.release().await.unwrap();
        common::eventually(
            Duration::from_secs(5),
            "the cut-off downgrade's hold is gone",
            || {
                let rw = rw.clone();
                async move { !rw.is_locked().await.unwrap() }
            },
        )
        .await;
    })
    .await;
}

/// Review: when the last live reader leaves and only readers whose leases ran out are
/// left in the hash, the lock is freed and waiters told; releasing a hold whose lease ran
/// out says it was lost; `verify` looks at a read hold's own key, not only its field.
#[tokio::test]
async fn read_holds_whose_leases_ran_out_hold_nothing() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let rw = client.rw_lock("stale").unwrap();
        let lapsed = rw
            .with_lease(Duration::from_millis(300))
            .read()
            .await
            .unwrap();
        let live = rw.read().await.unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(lapsed.is_lost());
        live.release().await.unwrap();
        let started = Instant::now();
        let writer = rw.try_write_for(Duration::from_secs(3)).await.unwrap();
        assert!(
            writer.is_some(),
            "only a lapsed reader was left, yet the lock stayed"
        );
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
        writer.unwrap().release().await.unwrap();
        assert!(lapsed.release().await.unwrap().was_lost());

        let keep = rw.read().await.unwrap();
        let reader = rw.read().await.unwrap();
        let key = format!("{{stale}}:{}:rwlock_timeout:1", reader.owner());
        let _: i64 = redis::cmd("DEL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(
            !reader.verify().await.unwrap(),
            "verify missed a read hold whose key is gone"
        );
        assert!(reader.is_lost());
        assert!(reader.release().await.unwrap().was_lost());
        assert_eq!(
            hkeys(&mut conn, "stale").await,
            [keep.owner().to_owned(), "mode".to_owned()]
        );
        keep.release().await.unwrap();
    })
    .await;
}

/// Review: a read hold taken (or re-entered) while the lock is still in write mode never
/// shortens the writer's lease: no second writer gets in while the first holds.
#[tokio::test]
async fn a_read_hold_in_write_mode_never_shortens_the_writers_lease() {
    let server = server().await;
    let (a, b) = (client(&server).await, client(&server).await);
    bounded(LIMIT, async {
        let rw = a.rw_lock("mixed").unwrap();
        let writer = rw.write().await.unwrap();
        let still_writing = writer.reenter().await.unwrap();
        let reader = rw
            .with_lease(Duration::from_millis(300))
            .downgrade(&writer)
            .await
            .unwrap();
        writer.release().await.unwrap();
        let nested = reader.reenter().await.unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
        let other = b.rw_lock("mixed").unwrap().try_write().await.unwrap();
        assert!(
            other.is_none() || still_writing.is_lost(),
            "a second writer got in while the first held"
        );
        drop((nested, reader, other));
        still_writing.release().await.unwrap();
    })
    .await;
}

/// Review: readers waiting for a writer that downgrades are let in when the writer
/// releases (a message, not their fallback or the lease); a hash with no expiry does not
/// make waiters spin; a plain lock of the same name keeps readers and writers out.
#[tokio::test]
async fn waiters_are_woken_by_a_downgrade_and_never_spin() {
    let server = server().await;
    let (a, b) = (client(&server).await, client(&server).await);
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let rw = a.rw_lock("wake").unwrap();
        let writer = rw.write().await.unwrap();
        let waiting = tokio::spawn({
            let rw = b.rw_lock("wake").unwrap();
            async move { rw.try_read_for(Duration::from_secs(8)).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mine = rw.downgrade(&writer).await.unwrap();
        let released_at = Instant::now();
        writer.release().await.unwrap();
        let theirs = waiting.await.unwrap().unwrap().expect("a reader got in");
        assert!(
            released_at.elapsed() < Duration::from_millis(500),
            "{:?}",
            released_at.elapsed()
        );
        theirs.release().await.unwrap();
        mine.release().await.unwrap();

        let _: () = redis::cmd("HSET")
            .arg("ghost")
            .arg("mode")
            .arg("write")
            .arg("ghost:1:write")
            .arg(1)
            .query_async(&mut conn)
            .await
            .unwrap();
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(&mut conn)
            .await
            .unwrap();
        let ghost = a.rw_lock("ghost").unwrap();
        assert!(ghost
            .try_read_for(Duration::from_secs(1))
            .await
            .unwrap()
            .is_none());
        assert!(ghost
            .try_write_for(Duration::from_secs(1))
            .await
            .unwrap()
            .is_none());
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut conn)
            .await
            .unwrap();
        let calls: u64 = info
            .lines()
            .filter(|line| line.starts_with("cmdstat_evalsha") || line.starts_with("cmdstat_eval:"))
            .filter_map(|line| {
                line.split("calls=")
                    .nth(1)?
                    .split(',')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum();
        assert!(
            calls < 20,
            "{calls} script calls in 2 s of waiting on a lock with no expiry"
        );

        let plain = a.lock("shared-name").unwrap().lock().await.unwrap();
        let rw = b.rw_lock("shared-name").unwrap();
        assert!(
            rw.try_write().await.unwrap().is_none(),
            "a writer got in beside a plain lock"
        );
        assert!(
            rw.try_read().await.unwrap().is_none(),
            "a reader got in beside a plain lock"
        );
        plain.release().await.unwrap();
    })
    .await;
}
