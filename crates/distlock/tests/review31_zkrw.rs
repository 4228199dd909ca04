//! Hostile review of the read-write lock on ZooKeeper (issue 31, commit d0f7ce0).
//!
//! Each test whose comment says "BREAK" fails on d0f7ce0 and asserts the behaviour the
//! design (docs/safety.md, "The read-write lock") or the API docs promise. Tests marked
//! "held" are attacks that the code withstood; they pass and stay as regression tests.
//! Every break is fixed since (docs/safety.md lists how); its test is the proof.
#![cfg(feature = "zk")]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bounded, join_bounded};
use distlock::{Client, Error, ReleaseOutcome};
use distlock_testkit::{Direction, FaultProxy, ZkEnsemble};

const LIMIT: Duration = Duration::from_secs(60);

async fn ensemble(servers: usize) -> ZkEnsemble {
    ZkEnsemble::start(servers).await.expect("start ZooKeeper")
}

/// A client whose ZooKeeper session timeout is `session` (the watchdog timeout).
async fn client_at(url: &str, session: Duration) -> Client {
    Client::builder()
        .watchdog_timeout(session)
        .response_timeout(Duration::from_secs(2))
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .expect("connect to ZooKeeper")
}

/// A raw ZooKeeper client of the test's own.
async fn raw(zk: &ZkEnsemble) -> zookeeper_client::Client {
    zookeeper_client::Client::connect(&zk.connect_string())
        .await
        .expect("a ZooKeeper client of the test's")
}

/// The children of lock `name`'s node (escaped name), sorted.
async fn children(zk: &ZkEnsemble, name: &str) -> Vec<String> {
    let client = raw(zk).await;
    match client.list_children(&format!("/distlock/{name}")).await {
        Ok(mut children) => {
            children.sort();
            children
        }
        Err(zookeeper_client::Error::NoNode) => Vec::new(),
        Err(err) => panic!("listing the queue: {err}"),
    }
}

async fn queue_len(zk: &ZkEnsemble, name: &str) -> usize {
    children(zk, name).await.len()
}

/// A fault proxy in front of every server, and the `zk://` URL that goes through them.
async fn behind_proxies(zk: &ZkEnsemble) -> (Vec<FaultProxy>, String) {
    let mut proxies = Vec::new();
    for port in zk.client_ports() {
        let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        proxies.push(FaultProxy::start(upstream).await.unwrap());
    }
    let through: Vec<String> = proxies
        .iter()
        .map(|proxy| format!("127.0.0.1:{}", proxy.port()))
        .collect();
    (proxies, format!("zk://{}", through.join(",")))
}

/// The data versions of the `read-` nodes of lock `name` (each try of a waiter blocked by
/// a fixed-lease holding writes its own node once, to learn the ensemble's clock).
async fn read_versions(
    zk: &ZkEnsemble,
    zk_client: &zookeeper_client::Client,
    name: &str,
) -> Vec<i32> {
    let mut versions = Vec::new();
    for child in children(zk, name).await {
        if child.starts_with("read-") {
            let stat = zk_client
                .check_stat(&format!("/distlock/{name}/{child}"))
                .await
                .unwrap()
                .unwrap();
            versions.push(stat.version);
        }
    }
    versions
}

async fn eventually_len(zk: &ZkEnsemble, name: &str, len: usize) {
    common::eventually(LIMIT, &format!("{name} has {len} children"), || async {
        queue_len(zk, name).await == len
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// BREAK: a downgrade of a fixed-lease writer checks only that the writer's `held-` node
// exists, not that its lease is still live on the ensemble's clock. A downgrade sent while
// the writer still trusted its lease, that reaches the ensemble after the lease ended,
// creates the reader's node after a waiting writer listed the queue and before it deleted
// the expired `held-` node (its version-checked delete does not see the downgrade, which
// leaves the held node's version alone): the new writer holds beside the new reader.
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn review_a_late_downgrade_of_an_ended_fixed_lease_lets_a_writer_in_beside_the_reader() {
    let zk = ensemble(1).await;
    let (slow_w, through_w) = behind_proxies(&zk).await;
    let (slow_next, through_next) = behind_proxies(&zk).await;
    // Replies may take 5 s: a downgrade is three requests (a listing, the multi-op, the
    // reader's stat), each 700 ms late.
    let holder = Client::builder()
        .watchdog_timeout(Duration::from_secs(30))
        .response_timeout(Duration::from_secs(5))
        .connect(&through_w)
        .await
        .unwrap();
    let next = client_at(&through_next, Duration::from_secs(30)).await;
    let name = "zkrw:late-downgrade";
    bounded(LIMIT, async {
        let lease = Duration::from_secs(3);
        let lock = holder.rw_lock(name).unwrap();
        let writer = lock.with_lease(lease).write().await.unwrap();
        // The writer's requests now take 700 ms to reach the ensemble; the next writer's
        // 400 ms (replies come back at once).
        slow_w[0].set_delay_in(Direction::ToServer, Duration::from_millis(700));
        slow_next[0].set_delay_in(Direction::ToServer, Duration::from_millis(400));
        // Still trusted: the downgrade is sent 250 ms before the writer's local deadline.
        tokio::time::sleep(writer.lease_remaining() - Duration::from_millis(250)).await;
        assert!(!writer.is_lost());
        let called = Instant::now();
        let downgrading = {
            let lock = lock.clone();
            tokio::spawn(async move {
                let reader = lock.downgrade(&writer).await;
                (reader, writer)
            })
        };
        let next_lock = next.rw_lock(name).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let next_writer =
            tokio::spawn(async move { next_lock.try_write_for(Duration::from_secs(10)).await });
        let (reader, writer) = downgrading.await.unwrap();
        let next_writer = next_writer.await.unwrap().unwrap();
        eprintln!(
            "downgrade: {:?} after {:?}; next writer holds: {}",
            reader.as_ref().map(|r| r.owner().to_owned()),
            called.elapsed(),
            next_writer.is_some()
        );
        slow_w[0].set_delay_in(Direction::ToServer, Duration::ZERO);
        slow_next[0].set_delay_in(Direction::ToServer, Duration::ZERO);
        if let Ok(reader) = &reader {
            let reader_there = reader.verify().await.unwrap() && !reader.is_lost();
            assert!(
                !(reader_there && next_writer.is_some()),
                "a writer holds beside a reader that a downgrade made after the old writer's \
                 lease ended (queue: {:?})",
                children(&zk, "zkrw:late-downgrade").await
            );
        }
        drop((reader, writer, next_writer));
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// BREAK: `Lock::force_unlock` on a name that readers hold deletes one reader's node and
// answers `true`, but the lock stays held by the others: "Deletes the lock whoever holds
// it". On Redis the same call deletes the read-write lock's hash, every reader with it.
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn review_force_unlock_of_a_name_readers_hold_frees_it() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(10)).await;
    let operator = client_at(&zk.url(), Duration::from_secs(10)).await;
    let name = "zkrw:forced-readers";
    bounded(LIMIT, async {
        let rw = client.rw_lock(name).unwrap();
        let first = rw.read().await.unwrap();
        let second = rw.read().await.unwrap();
        let fixed = rw.with_lease(Duration::from_secs(20)).read().await.unwrap();
        let lock = operator.lock(name).unwrap();
        assert!(lock.force_unlock().await.unwrap());
        let free = !lock.is_locked().await.unwrap();
        let writer = operator.rw_lock(name).unwrap().try_write().await.unwrap();
        assert!(
            free && writer.is_some(),
            "force_unlock answered true but the lock is still held (is_locked: {}, queue: {:?})",
            !free,
            children(&zk, name).await
        );
        drop((first, second, fixed, writer));
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// BREAK: after a downgrade, while the writer still holds its write hold, `Lock::owners`
// names the downgraded reader only (its node sorts first, at sequence 0) and not the
// writer; so `force_unlock_held_by(<the writer>)` refuses ("the lock passed to another
// holder") while the writer holds, and `force_unlock()` deletes the reader and leaves
// the writer holding.
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn review_owners_name_a_writer_that_downgraded_and_still_holds() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(10)).await;
    let operator = client_at(&zk.url(), Duration::from_secs(10)).await;
    let name = "zkrw:owners-after-downgrade";
    bounded(LIMIT, async {
        // A first node, so that the writer's sequence is not 0 (ties sort by name).
        let rw = client.rw_lock(name).unwrap();
        let before = rw.read().await.unwrap();
        before.release().await.unwrap();
        let writer = rw.write().await.unwrap();
        let reader = rw.downgrade(&writer).await.unwrap();
        let lock = operator.lock(name).unwrap();
        let owners = lock.owners().await.unwrap();
        eprintln!(
            "owners: {owners:?}; writer {}, reader {}",
            writer.owner(),
            reader.owner()
        );
        let unlocked_writer = lock.force_unlock_held_by(writer.owner()).await.unwrap();
        assert!(
            owners.iter().any(|owner| owner == writer.owner()) && unlocked_writer,
            "the writer holds, but owners() says {owners:?} and force_unlock_held_by(writer) \
             answered {unlocked_writer}"
        );
        drop((writer, reader));
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// BREAK (thundering herd): readers waiting behind a live fixed-lease writer have no queued
// node to watch (the writer's `held-` node is not in the queue), so each watches the whole
// queue, and every change of it wakes every one of them for a full try (a listing, a write
// of its own node, a read of the held node), though nothing they wait for changed: 20
// changes behind them cost each waiting reader about 20 tries. "Each watches only its
// predecessor's node".
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn review_readers_behind_a_fixed_lease_writer_are_not_woken_by_every_queue_change() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(10)).await;
    let other = client_at(&zk.url(), Duration::from_secs(10)).await;
    let name = "zkrw:herd";
    bounded(LIMIT, async {
        let rw = client.rw_lock(name).unwrap();
        let writer = rw
            .with_lease(Duration::from_secs(40))
            .write()
            .await
            .unwrap();
        let mut readers = Vec::new();
        for _ in 0..6 {
            let rw = rw.clone();
            readers.push(tokio::spawn(async move { rw.read().await.unwrap() }));
        }
        eventually_len(&zk, name, 7).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let zk_client = raw(&zk).await;
        let before = read_versions(&zk, &zk_client, name).await;
        // Twenty changes behind them: ten tries of a writer, each a node made and deleted.
        let late = other.rw_lock(name).unwrap();
        for _ in 0..10 {
            assert!(late.try_write().await.unwrap().is_none());
        }
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let after = read_versions(&zk, &zk_client, name).await;
        let tries: Vec<i32> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
        eprintln!("tries of each waiting reader during 20 unrelated changes: {tries:?}");
        assert!(
            tries.iter().all(|tries| *tries <= 2),
            "waiting readers were woken for a try by unrelated queue changes: {tries:?}"
        );
        writer.release().await.unwrap();
        for reader in join_bounded(LIMIT, readers).await {
            reader.release().await.unwrap();
        }
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Exclusion under a mix of every kind of holder, counted with atomics (held).
// ---------------------------------------------------------------------------------------

/// Who is in, as the holders themselves say: any writer with anyone else is a violation,
/// and write tokens must grow in the order writers came in.
#[derive(Default)]
struct Ledger {
    writers: AtomicUsize,
    readers: AtomicUsize,
    last_token: std::sync::Mutex<u64>,
    violations: std::sync::Mutex<Vec<String>>,
    writes: AtomicUsize,
    reads: AtomicUsize,
    most_readers: AtomicUsize,
}

impl Ledger {
    fn writer_in(&self, who: &str, token: u64) {
        let writers = self.writers.fetch_add(1, Ordering::SeqCst);
        let readers = self.readers.load(Ordering::SeqCst);
        if writers != 0 || readers != 0 {
            self.violate(format!(
                "{who} (token {token}) in with {writers} writers, {readers} readers"
            ));
        }
        let mut last = self.last_token.lock().unwrap();
        if token <= *last {
            self.violate(format!("{who}: token {token} after {}", *last));
        }
        *last = token.max(*last);
        self.writes.fetch_add(1, Ordering::SeqCst);
    }

    fn writer_out(&self) {
        self.writers.fetch_sub(1, Ordering::SeqCst);
    }

    fn reader_in(&self, who: &str) {
        let readers = self.readers.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_readers.fetch_max(readers, Ordering::SeqCst);
        let writers = self.writers.load(Ordering::SeqCst);
        if writers != 0 {
            self.violate(format!("{who}: a reader in with {writers} writers"));
        }
        self.reads.fetch_add(1, Ordering::SeqCst);
    }

    fn reader_out(&self) {
        self.readers.fetch_sub(1, Ordering::SeqCst);
    }

    fn violate(&self, what: String) {
        eprintln!("VIOLATION: {what}");
        self.violations.lock().unwrap().push(what);
    }
}

/// A small deterministic generator per task.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % below
    }
}

async fn hold_a_moment(rng: &mut Lcg) {
    tokio::time::sleep(Duration::from_millis(1 + rng.next(5))).await;
}

/// One task of the mix: `role` picks what it does each round.
async fn mixed_role(
    role: usize,
    client: Client,
    name: &'static str,
    ledger: Arc<Ledger>,
    until: Instant,
) -> usize {
    let rw = client.rw_lock(name).unwrap();
    let fixed = rw.with_lease(Duration::from_secs(5));
    let plain = client.lock(name).unwrap();
    let mut rng = Lcg(role as u64 * 7919 + 13);
    let who = format!("role {role}");
    let mut rounds = 0;
    while Instant::now() < until {
        rounds += 1;
        match role {
            // Watchdog writers, waiting or trying for a while.
            0 | 1 => {
                let guard = if role == 0 || rng.next(2) == 0 {
                    Some(rw.write().await.unwrap())
                } else {
                    rw.try_write_for(Duration::from_millis(rng.next(300)))
                        .await
                        .unwrap()
                };
                if let Some(guard) = guard {
                    ledger.writer_in(&who, guard.fencing_token());
                    hold_a_moment(&mut rng).await;
                    ledger.writer_out();
                    assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
                }
            }
            // A fixed-lease writer.
            2 => {
                let guard = fixed.write().await.unwrap();
                ledger.writer_in(&who, guard.fencing_token());
                hold_a_moment(&mut rng).await;
                ledger.writer_out();
                assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
            }
            // Watchdog readers: waiting, trying, trying for a while.
            3 | 4 => {
                let guard = match rng.next(3) {
                    0 => Some(rw.read().await.unwrap()),
                    1 => rw.try_read().await.unwrap(),
                    _ => rw
                        .try_read_for(Duration::from_millis(rng.next(200)))
                        .await
                        .unwrap(),
                };
                if let Some(guard) = guard {
                    ledger.reader_in(&who);
                    let again = if rng.next(4) == 0 {
                        Some(guard.reenter().await.unwrap())
                    } else {
                        None
                    };
                    hold_a_moment(&mut rng).await;
                    ledger.reader_out();
                    if let Some(again) = again {
                        again.release().await.unwrap();
                    }
                    assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
                }
            }
            // A fixed-lease reader.
            5 => {
                let guard = fixed.read().await.unwrap();
                ledger.reader_in(&who);
                hold_a_moment(&mut rng).await;
                ledger.reader_out();
                assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
            }
            // A plain lock of the same name: a writer.
            6 => {
                let guard = plain.lock().await.unwrap();
                ledger.writer_in(&who, guard.fencing_token());
                hold_a_moment(&mut rng).await;
                ledger.writer_out();
                assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
            }
            // A downgrader, watchdog or fixed on either side.
            7 => {
                let writer_side = if rng.next(2) == 0 { &rw } else { &fixed };
                let reader_side = if rng.next(2) == 0 { &rw } else { &fixed };
                let writer = writer_side.write().await.unwrap();
                ledger.writer_in(&who, writer.fencing_token());
                hold_a_moment(&mut rng).await;
                let reader = reader_side.downgrade(&writer).await.unwrap();
                ledger.readers.fetch_add(1, Ordering::SeqCst);
                ledger.writer_out();
                if rng.next(2) == 0 {
                    assert_eq!(writer.release().await.unwrap(), ReleaseOutcome::Released);
                    hold_a_moment(&mut rng).await;
                    ledger.reader_out();
                    assert_eq!(reader.release().await.unwrap(), ReleaseOutcome::Released);
                } else {
                    // The reader goes first: the writer is alone again, and counted so.
                    ledger.reader_out();
                    ledger.writers.fetch_add(1, Ordering::SeqCst);
                    assert_eq!(reader.release().await.unwrap(), ReleaseOutcome::Released);
                    hold_a_moment(&mut rng).await;
                    ledger.writer_out();
                    assert_eq!(writer.release().await.unwrap(), ReleaseOutcome::Released);
                }
            }
            // A canceller: waits dropped after a few milliseconds, either side.
            _ => {
                let patience = Duration::from_millis(rng.next(40));
                if rng.next(2) == 0 {
                    if let Ok(guard) = tokio::time::timeout(patience, rw.write()).await {
                        let guard = guard.unwrap();
                        ledger.writer_in(&who, guard.fencing_token());
                        hold_a_moment(&mut rng).await;
                        ledger.writer_out();
                        guard.release().await.unwrap();
                    }
                } else if let Ok(guard) = tokio::time::timeout(patience, rw.read()).await {
                    let guard = guard.unwrap();
                    ledger.reader_in(&who);
                    hold_a_moment(&mut rng).await;
                    ledger.reader_out();
                    guard.release().await.unwrap();
                }
            }
        }
    }
    rounds
}

/// Held: 10 tasks on 3 clients (watchdog and fixed-lease writers and readers, a plain
/// lock, a downgrader, a canceller) for 12 s: no writer with anyone, tokens grow, and no
/// node is left behind.
#[tokio::test]
async fn review_mixed_holders_on_three_clients_never_overlap() {
    let zk = ensemble(1).await;
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(client_at(&zk.url(), Duration::from_secs(5)).await);
    }
    let name = "zkrw:mixed";
    let ledger = Arc::new(Ledger::default());
    let until = Instant::now() + Duration::from_secs(12);
    let mut tasks = Vec::new();
    for role in 0..10 {
        let client = clients[role % 3].clone();
        tasks.push(tokio::spawn(mixed_role(
            role,
            client,
            name,
            Arc::clone(&ledger),
            until,
        )));
    }
    let rounds = join_bounded(Duration::from_secs(40), tasks).await;
    eprintln!(
        "rounds per role {rounds:?}; {} writes, {} reads, at most {} readers together",
        ledger.writes.load(Ordering::SeqCst),
        ledger.reads.load(Ordering::SeqCst),
        ledger.most_readers.load(Ordering::SeqCst)
    );
    let violations = ledger.violations.lock().unwrap().clone();
    assert!(violations.is_empty(), "{violations:?}");
    assert!(ledger.writes.load(Ordering::SeqCst) > 20);
    assert!(ledger.most_readers.load(Ordering::SeqCst) > 1);
    common::eventually(Duration::from_secs(10), "the queue emptied", || async {
        queue_len(&zk, name).await == 0
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Downgrades: cancelled, misused, repeated, in every order (held), and one whose reply is
// lost (BREAK on a fixed lease).
// ---------------------------------------------------------------------------------------

/// Held: downgrade futures dropped after their first poll, or timed out after a few
/// milliseconds, leave no reader behind; the writer still holds, and once it releases
/// another client's writer holds at once (not a session timeout later).
#[tokio::test]
async fn review_a_cancelled_downgrade_leaves_no_reader_behind() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(30)).await;
    let other = client_at(&zk.url(), Duration::from_secs(30)).await;
    let name = "zkrw:cancelled-downgrade";
    bounded(LIMIT, async {
        for fixed in [false, true] {
            let rw = client.rw_lock(name).unwrap();
            let rw = if fixed {
                rw.with_lease(Duration::from_secs(30))
            } else {
                rw
            };
            let writer = rw.write().await.unwrap();
            for _ in 0..3 {
                common::cancel_after_first_poll(rw.downgrade(&writer)).await;
            }
            for millis in [0, 1, 2, 3, 5, 8] {
                let _ = tokio::time::timeout(Duration::from_millis(millis), rw.downgrade(&writer))
                    .await;
            }
            // The writer's node alone (a fixed-lease writer's `held-` node).
            common::eventually(
                Duration::from_secs(5),
                "the cancelled readers gone",
                || async { queue_len(&zk, name).await == 1 },
            )
            .await;
            assert!(writer.verify().await.unwrap());
            assert_eq!(writer.release().await.unwrap(), ReleaseOutcome::Released);
            let next = other
                .rw_lock(name)
                .unwrap()
                .try_write_for(Duration::from_secs(3))
                .await
                .unwrap()
                .expect("a writer holds once the downgrades were cancelled");
            next.release().await.unwrap();
        }
    })
    .await;
}

/// Held: every misuse of `downgrade` is a typed error that leaves the writer as it was:
/// a plain lock's guard, a writer of another name, a read guard's owner is not even a
/// `LockGuard`; twice on one writer gives two readers; release orders both ways;
/// `is_locked` says true until the last one goes; a fixed-lease writer downgraded by a
/// watchdog handle and the other way round.
#[tokio::test]
async fn review_downgrades_in_every_order_and_misuses() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(10)).await;
    let other = client_at(&zk.url(), Duration::from_secs(10)).await;
    let name = "zkrw:downgrades";
    bounded(LIMIT, async {
        let rw = client.rw_lock(name).unwrap();
        let fixed = rw.with_lease(Duration::from_secs(20));
        let probe = other.rw_lock(name).unwrap();
        // A plain lock's guard, and a writer of another name.
        let plain = client.lock(name).unwrap().lock().await.unwrap();
        assert!(matches!(
            rw.downgrade(&plain).await,
            Err(Error::InvalidArgument { .. })
        ));
        plain.release().await.unwrap();
        let elsewhere = client
            .rw_lock("zkrw:elsewhere")
            .unwrap()
            .write()
            .await
            .unwrap();
        assert!(matches!(
            rw.downgrade(&elsewhere).await,
            Err(Error::InvalidArgument { .. })
        ));
        elsewhere.release().await.unwrap();

        for (writer_side, reader_side) in
            [(&rw, &rw), (&rw, &fixed), (&fixed, &rw), (&fixed, &fixed)]
        {
            for writer_first in [true, false] {
                let writer = writer_side.write().await.unwrap();
                let one = reader_side.downgrade(&writer).await.unwrap();
                let two = reader_side.downgrade(&writer).await.unwrap();
                assert!(probe.try_write().await.unwrap().is_none());
                assert!(
                    probe.try_read().await.unwrap().is_none(),
                    "a reader beside a writer"
                );
                if writer_first {
                    assert_eq!(writer.release().await.unwrap(), ReleaseOutcome::Released);
                    let shared = probe.try_read().await.unwrap().expect("readers share");
                    shared.release().await.unwrap();
                } else {
                    assert_eq!(one.release().await.unwrap(), ReleaseOutcome::Released);
                    assert!(probe.try_read().await.unwrap().is_none());
                    assert!(probe.is_locked().await.unwrap());
                    assert_eq!(writer.release().await.unwrap(), ReleaseOutcome::Released);
                    // A dummy so that both branches release `one`.
                    let one = probe.try_read().await.unwrap().expect("readers share");
                    one.release().await.unwrap();
                    assert!(probe.is_locked().await.unwrap());
                    assert!(probe.try_write().await.unwrap().is_none());
                    assert_eq!(two.release().await.unwrap(), ReleaseOutcome::Released);
                    assert!(
                        !probe.is_locked().await.unwrap(),
                        "{:?}",
                        children(&zk, name).await
                    );
                    continue;
                }
                assert!(probe.is_locked().await.unwrap());
                assert!(probe.try_write().await.unwrap().is_none());
                assert_eq!(one.release().await.unwrap(), ReleaseOutcome::Released);
                assert!(probe.try_write().await.unwrap().is_none());
                assert_eq!(two.release().await.unwrap(), ReleaseOutcome::Released);
                assert!(
                    !probe.is_locked().await.unwrap(),
                    "{:?}",
                    children(&zk, name).await
                );
                let w = probe.try_write().await.unwrap().expect("free again");
                w.release().await.unwrap();
            }
        }
        // A writer of this name on another client downgraded through this client.
        let theirs = probe.write().await.unwrap();
        let mine = rw.downgrade(&theirs).await;
        eprintln!(
            "a downgrade of another client's writer: {:?}",
            mine.as_ref().map(|r| r.owner().to_owned())
        );
        theirs.release().await.unwrap();
        drop(mine);
    })
    .await;
    common::eventually(Duration::from_secs(10), "the queue emptied", || async {
        queue_len(&zk, name).await == 0
    })
    .await;
}

/// A downgrade whose reply is lost (the ensemble made the reader's node, the caller got a
/// connection error) must leave no read hold behind: the caller was told it has none.
/// Held in watchdog mode (the node is reaped once the ensemble answers); BREAK on a fixed
/// lease: the `held-read-` node is left to its whole lease (beside.rs: "a fixed-lease
/// one, to its lease"), and keeps every writer out that long, though nobody holds it (an
/// acquisition's abandon deletes such a node; a downgrade's does not).
async fn a_downgrade_whose_reply_is_lost(fixed: bool) {
    let zk = ensemble(1).await;
    let (slow, through) = behind_proxies(&zk).await;
    let client = client_at(&through, Duration::from_secs(30)).await;
    let other = client_at(&zk.url(), Duration::from_secs(30)).await;
    let name = "zkrw:downgrade-reply-lost";
    bounded(LIMIT, async {
        let rw = client.rw_lock(name).unwrap();
        let reader_side = if fixed {
            rw.with_lease(Duration::from_secs(25))
        } else {
            rw.clone()
        };
        let writer = rw.write().await.unwrap();
        // Each request reaches the ensemble 800 ms late: the listing at 0.8 s, the multi-op
        // at 1.6 s, and the reader's stat would at 2.4 s, past the 2 s response timeout.
        slow[0].set_delay_in(Direction::ToServer, Duration::from_millis(800));
        let downgraded = reader_side.downgrade(&writer).await;
        slow[0].set_delay_in(Direction::ToServer, Duration::ZERO);
        let err = downgraded.expect_err("the downgrade's reply came too late");
        assert!(err.is_connection_error(), "{err:?}");
        eprintln!(
            "after the failed downgrade: {:?}",
            children(&zk, name).await
        );
        assert_eq!(writer.release().await.unwrap(), ReleaseOutcome::Released);
        let next = other
            .rw_lock(name)
            .unwrap()
            .try_write_for(Duration::from_secs(8))
            .await
            .unwrap();
        assert!(
            next.is_some(),
            "a downgrade that failed left a read hold that keeps writers out: {:?}",
            children(&zk, name).await
        );
        drop(next);
    })
    .await;
}

/// Held.
#[tokio::test]
async fn review_a_watchdog_downgrade_whose_reply_is_lost_leaves_no_reader() {
    a_downgrade_whose_reply_is_lost(false).await;
}

/// BREAK.
#[tokio::test]
async fn review_a_fixed_lease_downgrade_whose_reply_is_lost_leaves_no_reader() {
    a_downgrade_whose_reply_is_lost(true).await;
}

// ---------------------------------------------------------------------------------------
// Odd names, and nodes written into the lock's node by hand.
// ---------------------------------------------------------------------------------------

/// Held: names with braces, slashes, percent signs, empty parts, names that look like
/// the lock's own node names, and a 10,000-character name are each a lock of their own,
/// whose readers share and whose writer excludes; `.`, `..` and the empty name are refused.
/// (A lone `{` or `}` is refused on ZooKeeper too, with a Redis Cluster reason, for every
/// primitive: keys.rs `validate_name` runs for every store. Not the read-write lock's.)
#[tokio::test]
async fn review_odd_names_are_locks_of_their_own() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(10)).await;
    let long = "n".repeat(10_000);
    let names: Vec<String> = [
        "{a}",
        "x{a}y",
        "a/b",
        "a%2Fb",
        "%",
        "/",
        "//",
        "a//b",
        "a/..",
        "read-x-0000000000",
        "held-read-x",
        "lock-1-2",
        "zookeeper",
        " ",
    ]
    .iter()
    .map(|name| name.to_string())
    .chain([long])
    .collect();
    bounded(LIMIT, async {
        for bad in ["", ".", ".."] {
            let refused = client.rw_lock(bad);
            eprintln!("rw_lock({bad:?}): {:?}", refused.as_ref().map(|_| ()));
            assert!(
                matches!(
                    refused,
                    Err(Error::InvalidName { .. }) | Err(Error::InvalidArgument { .. })
                ),
                "{bad:?}"
            );
        }
        let mut readers = Vec::new();
        for name in &names {
            let rw = client.rw_lock(name.as_str()).unwrap();
            readers.push(rw.read().await.unwrap());
            assert!(rw.try_read().await.unwrap().is_some(), "{name:.40}");
            assert!(rw.try_write().await.unwrap().is_none(), "{name:.40}");
        }
        // Every name is a lock of its own: each one's writer holds while the others' readers do.
        for (n, name) in names.iter().enumerate() {
            let reader = readers.remove(0);
            reader.release().await.unwrap();
            let rw = client.rw_lock(name.as_str()).unwrap();
            let writer = rw
                .try_write()
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{name:.40} ({n}) is held by another name's reader"));
            writer.release().await.unwrap();
        }
    })
    .await;
}

/// Nodes written by hand into a lock's node: junk names are ignored by both sides; a
/// persistent `read-` node with a sequence is a reader (writers wait, readers pass); a
/// `held-` node whose data is no lease is deleted by the first writer; a `held-read-` node
/// with a live lease keeps writers out and lets readers in. Held.
#[tokio::test]
async fn review_hand_written_nodes() {
    use zookeeper_client::{Acls, CreateMode};
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(10)).await;
    let zk_client = raw(&zk).await;
    let name = "zkrw:hand";
    let parent = format!("/distlock/{name}");
    let persistent = CreateMode::Persistent.with_acls(Acls::anyone_all());
    bounded(LIMIT, async {
        let rw = client.rw_lock(name).unwrap();
        // Make the lock's node.
        rw.read().await.unwrap().release().await.unwrap();
        let _ = zk_client.create(&parent, b"", &persistent).await;
        for junk in [
            "foo",
            "lock-",
            "read-",
            "lock-x",
            "read-x-abc",
            "lock-x-",
            "held",
            "read-x-9999999999999999999999",
        ] {
            zk_client
                .create(&format!("{parent}/{junk}"), b"", &persistent)
                .await
                .unwrap();
        }
        let writer = rw.try_write().await.unwrap().expect("junk is no holder");
        writer.release().await.unwrap();
        // A junk held- node (no lease in its data): expired, deleted by a writer.
        zk_client
            .create(&format!("{parent}/held-junk"), b"soon", &persistent)
            .await
            .unwrap();
        let writer = rw
            .try_write()
            .await
            .unwrap()
            .expect("a held- node without a lease holds nothing");
        writer.release().await.unwrap();
        // A persistent reader node at sequence 1.
        zk_client
            .create(&format!("{parent}/read-hand-0000000001"), b"1", &persistent)
            .await
            .unwrap();
        assert!(
            rw.try_write().await.unwrap().is_none(),
            "a writer beside a reader"
        );
        let reader = rw.try_read().await.unwrap().expect("readers share");
        reader.release().await.unwrap();
        zk_client
            .delete(&format!("{parent}/read-hand-0000000001"), None)
            .await
            .unwrap();
        // A shared fixed-lease holding of 20 s.
        zk_client
            .create(&format!("{parent}/held-read-hand"), b"20000", &persistent)
            .await
            .unwrap();
        assert!(rw.try_write().await.unwrap().is_none());
        assert!(client
            .lock(name)
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none());
        let reader = rw.try_read().await.unwrap().expect("readers share");
        reader.release().await.unwrap();
        zk_client
            .delete(&format!("{parent}/held-read-hand"), None)
            .await
            .unwrap();
        let writer = rw.try_write().await.unwrap().expect("free again");
        writer.release().await.unwrap();
    })
    .await;
}

/// Held: a 1.1 MB name (past ZooKeeper's default jute.maxbuffer of 1 MiB) is a typed
/// error at once (names are capped at 64 KiB), and disturbs no other holding.
#[tokio::test]
async fn review_a_name_too_long_for_zookeeper_is_a_typed_error_and_disturbs_nothing() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(2)).await;
    bounded(LIMIT, async {
        let held = client
            .rw_lock("zkrw:bystander")
            .unwrap()
            .read()
            .await
            .unwrap();
        let lost = held.lost_token();
        let huge = "h".repeat(1_100_000);
        let started = Instant::now();
        let outcome = client.rw_lock(huge.as_str());
        let outcome = match outcome {
            Ok(rw) => {
                let tried = bounded(
                    Duration::from_secs(20),
                    rw.try_read_for(Duration::from_secs(5)),
                )
                .await;
                tried.map(|reader| reader.is_some())
            }
            Err(err) => Err(err),
        };
        eprintln!("a 1.1 MB name: {outcome:?} after {:?}", started.elapsed());
        assert!(outcome.is_err(), "{outcome:?}");
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(!lost.is_cancelled(), "a bystander's read hold was lost");
        assert!(held.verify().await.unwrap());
        assert_eq!(held.release().await.unwrap(), ReleaseOutcome::Released);
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Order, wake-ups and tokens (held).
// ---------------------------------------------------------------------------------------

/// Held: a queue R1 R2 W3 R4 W5 R6 behind a writer is served in that order (R1 and R2
/// together), every hand-off woken by a watch (well under the 1 s fallback), on two
/// clients.
#[tokio::test]
async fn review_a_mixed_queue_is_served_in_order_and_woken_at_once() {
    let zk = ensemble(1).await;
    let clients = [
        client_at(&zk.url(), Duration::from_secs(10)).await,
        client_at(&zk.url(), Duration::from_secs(10)).await,
    ];
    let name = "zkrw:order";
    bounded(LIMIT, async {
        let first = clients[0].rw_lock(name).unwrap().write().await.unwrap();
        let events = Arc::new(std::sync::Mutex::new(Vec::<(String, bool, Instant)>::new()));
        let mut tasks = Vec::new();
        for (n, kind) in ["R1", "R2", "W3", "R4", "W5", "R6"].into_iter().enumerate() {
            let rw = clients[n % 2].rw_lock(name).unwrap();
            let events = Arc::clone(&events);
            tasks.push(tokio::spawn(async move {
                let record = |inside: bool| {
                    events
                        .lock()
                        .unwrap()
                        .push((kind.to_owned(), inside, Instant::now()))
                };
                if kind.starts_with('W') {
                    let guard = rw.write().await.unwrap();
                    record(true);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    record(false);
                    guard.release().await.unwrap();
                } else {
                    let guard = rw.read().await.unwrap();
                    record(true);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    record(false);
                    guard.release().await.unwrap();
                }
            }));
            eventually_len(&zk, name, n + 2).await;
        }
        let released = Instant::now();
        first.release().await.unwrap();
        join_bounded(LIMIT, tasks).await;
        let took = released.elapsed();
        let events = events.lock().unwrap().clone();
        let order: Vec<String> = events
            .iter()
            .map(|(kind, inside, _)| format!("{}{kind}", if *inside { "+" } else { "-" }))
            .collect();
        eprintln!("{order:?} in {took:?}");
        let at = |what: &str| order.iter().position(|event| event == what).unwrap();
        assert!(
            at("+R2") < at("-R1") && at("+R1") < at("-R2"),
            "R1 and R2 did not share: {order:?}"
        );
        assert!(at("+W3") > at("-R1") && at("+W3") > at("-R2"), "{order:?}");
        assert!(at("+R4") > at("-W3"), "{order:?}");
        assert!(at("+W5") > at("-R4"), "{order:?}");
        assert!(at("+R6") > at("-W5"), "{order:?}");
        // Five hand-offs of 100 ms holds: a missed wake-up costs a 1 s fallback.
        assert!(took < Duration::from_millis(1500), "woken late: {took:?}");
    })
    .await;
}

/// Held: a writer's token exceeds `last_fencing_token()` read before it, whatever holds
/// then: watchdog readers, a fixed-lease reader, a downgraded reader, a fixed-lease writer,
/// a waiting writer.
#[tokio::test]
async fn review_write_tokens_pass_the_last_token_read_before_them() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(10)).await;
    let other = client_at(&zk.url(), Duration::from_secs(10)).await;
    let name = "zkrw:tokens";
    bounded(LIMIT, async {
        let rw = client.rw_lock(name).unwrap();
        let fixed = rw.with_lease(Duration::from_secs(20));
        let probe = other.lock(name).unwrap();
        let writers = other.rw_lock(name).unwrap();
        let mut last_token = 0;
        for round in 0..5 {
            // What holds while the last token is read.
            let mut readers = Vec::new();
            let mut writer_held = None;
            match round {
                0 => {
                    readers.push(rw.read().await.unwrap());
                    readers.push(rw.read().await.unwrap());
                }
                1 => readers.push(fixed.read().await.unwrap()),
                2 => {
                    let writer = rw.write().await.unwrap();
                    readers.push(rw.downgrade(&writer).await.unwrap());
                    writer.release().await.unwrap();
                }
                3 => writer_held = Some(fixed.write().await.unwrap()),
                _ => {
                    readers.push(rw.read().await.unwrap());
                }
            }
            // A writer already waiting (round 4 reads the token while it waits).
            let waiting = if round == 4 {
                let writers = writers.clone();
                let task = tokio::spawn(async move { writers.write().await.unwrap() });
                eventually_len(&zk, name, 2).await;
                Some(task)
            } else {
                None
            };
            let before = probe.last_fencing_token().await.unwrap();
            assert!(
                before >= last_token,
                "round {round}: the last token went back: {before} < {last_token}"
            );
            let next = match waiting {
                Some(task) => {
                    for reader in readers.drain(..) {
                        reader.release().await.unwrap();
                    }
                    task.await.unwrap()
                }
                None => {
                    let task = {
                        let writers = writers.clone();
                        tokio::spawn(async move { writers.write().await.unwrap() })
                    };
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    for reader in readers.drain(..) {
                        reader.release().await.unwrap();
                    }
                    if let Some(writer) = writer_held.take() {
                        assert!(writer.fencing_token() <= before || writer.fencing_token() > 0);
                        writer.release().await.unwrap();
                    }
                    task.await.unwrap()
                }
            };
            let token = next.fencing_token();
            assert!(
                token > before,
                "round {round}: token {token} after last_fencing_token {before}"
            );
            assert!(
                token > last_token,
                "round {round}: token {token} after {last_token}"
            );
            last_token = token;
            next.release().await.unwrap();
        }
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Faults: a reader killed, paused, cut off past its session; a leader killed (held).
// ---------------------------------------------------------------------------------------

/// Entry point of the child processes below; skipped in a normal run. Holds a read lock
/// on a 2 s session, says `HELD 0`, then `LOST` once its lost signal fires.
#[tokio::test]
#[ignore = "run as a child process by the kill -9 and SIGSTOP tests"]
async fn zkrw_child_reader() {
    let Ok(url) = std::env::var("DISTLOCK_ZKRW_CHILD_URL") else {
        panic!("zkrw_child_reader runs only as a child process");
    };
    let client = client_at(&url, Duration::from_secs(2)).await;
    let guard = client
        .rw_lock("zkrw:orphaned")
        .unwrap()
        .read()
        .await
        .unwrap();
    println!("HELD 0");
    guard.lost().await;
    println!("LOST");
    std::future::pending::<()>().await;
}

/// Held: a reader killed with kill -9 keeps writers out until its session ends (2 s),
/// not longer; readers share with it meanwhile.
#[tokio::test]
async fn review_a_killed_readers_hold_ends_with_its_session() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let (mut child, _) =
            common::child_holding("zkrw_child_reader", "DISTLOCK_ZKRW_CHILD_URL", &zk.url()).await;
        let rw = client.rw_lock("zkrw:orphaned").unwrap();
        let shared = rw
            .try_read()
            .await
            .unwrap()
            .expect("readers share with the child");
        shared.release().await.unwrap();
        assert!(rw.try_write().await.unwrap().is_none());
        child.kill().await.unwrap();
        let killed_at = Instant::now();
        let writer = rw.write().await.unwrap();
        let freed_after = killed_at.elapsed();
        assert!(freed_after > Duration::from_millis(1500), "{freed_after:?}");
        assert!(freed_after < Duration::from_secs(5), "{freed_after:?}");
        writer.release().await.unwrap();
    })
    .await;
}

/// Held: a reader paused (SIGSTOP) past its session: a writer holds, and the reader's
/// lost signal fires as soon as it runs again.
#[tokio::test]
async fn review_a_reader_paused_past_its_session_learns_of_its_loss_at_once() {
    use tokio::io::AsyncBufReadExt;
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "zkrw_child_reader",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("DISTLOCK_ZKRW_CHILD_URL", zk.url())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        loop {
            let line = lines.next_line().await.unwrap().expect("the child holds");
            if line.contains("HELD ") {
                break;
            }
        }
        let pid = child.id().unwrap().to_string();
        let signal = |name: &str| {
            let status = std::process::Command::new("kill")
                .args([name, &pid])
                .status()
                .unwrap();
            assert!(status.success());
        };
        signal("-STOP");
        let writer = client
            .rw_lock("zkrw:orphaned")
            .unwrap()
            .write()
            .await
            .unwrap();
        signal("-CONT");
        let resumed_at = Instant::now();
        loop {
            let line = bounded(Duration::from_secs(5), lines.next_line())
                .await
                .unwrap()
                .expect("the child says it lost the lock");
            if line.contains("LOST") {
                break;
            }
        }
        assert!(resumed_at.elapsed() < Duration::from_secs(2));
        writer.release().await.unwrap();
        child.kill().await.unwrap();
    })
    .await;
}

/// Held: a downgraded reader and a fixed-lease reader on a client cut off from the
/// ensemble: each learns of its loss before a writer on another client holds, and once
/// back the client's release says the hold was lost and it reads again.
#[tokio::test]
async fn review_readers_cut_off_learn_of_their_loss_before_a_writer_holds() {
    let zk = ensemble(1).await;
    let (proxies, through) = behind_proxies(&zk).await;
    let holder = client_at(&through, Duration::from_secs(2)).await;
    let other = client_at(&zk.url(), Duration::from_secs(5)).await;
    let name = "zkrw:cut-off-readers";
    bounded(LIMIT, async {
        let rw = holder.rw_lock(name).unwrap();
        let writer = rw.write().await.unwrap();
        let downgraded = rw.downgrade(&writer).await.unwrap();
        writer.release().await.unwrap();
        let fixed = rw.with_lease(Duration::from_secs(3)).read().await.unwrap();
        let (lost_a, lost_b) = (downgraded.lost_token(), fixed.lost_token());
        for proxy in &proxies {
            proxy.blackhole();
        }
        let both = tokio_util::sync::CancellationToken::new();
        {
            let both = both.clone();
            tokio::spawn(async move {
                lost_a.cancelled().await;
                lost_b.cancelled().await;
                both.cancel();
            });
        }
        common::lost_before_another_holds(both, other.lock(name).unwrap()).await;
        for proxy in &proxies {
            proxy.heal();
        }
        assert!(matches!(
            downgraded.release().await,
            Ok(ReleaseOutcome::AlreadyLost) | Err(Error::NotHeld { .. })
        ));
        assert!(matches!(
            fixed.release().await,
            Ok(ReleaseOutcome::AlreadyLost) | Err(Error::NotHeld { .. })
        ));
        let again = loop {
            match rw.try_read_for(Duration::from_secs(5)).await {
                Ok(Some(reader)) => break reader,
                Ok(None) => panic!("the lock is free"),
                Err(err) => assert!(err.is_connection_error(), "{err:?}"),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(again.verify().await.unwrap());
        again.release().await.unwrap();
    })
    .await;
}

/// How many client connections server `index` serves.
async fn connections_on(zk: &ZkEnsemble, index: usize) -> usize {
    let cons = zk.four_letter_word(index, "cons").await.unwrap();
    cons.lines().filter(|line| line.contains("queued=")).count()
}

/// Held: the leader of three is killed while readers, writers (watchdog and fixed),
/// and a downgrader on two clients take turns: no writer is ever in with anyone, tokens
/// grow, and a read hold of a client connected to the leader stays held.
#[tokio::test]
async fn review_a_killed_leader_breaks_no_read_write_exclusion() {
    let mut zk = ensemble(3).await;
    let session = Duration::from_secs(4);
    let leader = zk.leader().await.unwrap();
    let mut keeper = None;
    for _ in 0..30 {
        let before = connections_on(&zk, leader).await;
        let candidate = client_at(&zk.url(), session).await;
        if connections_on(&zk, leader).await > before {
            keeper = Some(candidate);
            break;
        }
        candidate.shutdown().await;
    }
    let keeper = keeper.expect("no client connected to the leader in 30 tries");
    let kept = keeper.rw_lock("zkrw:kept").unwrap().read().await.unwrap();
    let kept_lost = kept.lost_token();
    let clients = [
        client_at(&zk.url(), session).await,
        client_at(&zk.url(), session).await,
    ];
    let name = "zkrw:leaderless";
    let ledger = Arc::new(Ledger::default());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for role in 0..6 {
        let rw = clients[role % 2].rw_lock(name).unwrap();
        let (ledger, stop) = (Arc::clone(&ledger), Arc::clone(&stop));
        tasks.push(tokio::spawn(async move {
            let fixed = rw.with_lease(Duration::from_secs(4));
            let who = format!("role {role}");
            let mut rng = Lcg(role as u64 + 1);
            while !stop.load(Ordering::Relaxed) {
                let patience = Duration::from_secs(3);
                match role {
                    0 | 1 => {
                        let side = if role == 0 { &rw } else { &fixed };
                        let Ok(Some(guard)) = side.try_write_for(patience).await else {
                            continue;
                        };
                        ledger.writer_in(&who, guard.fencing_token());
                        hold_a_moment(&mut rng).await;
                        ledger.writer_out();
                        let _ = guard.release().await;
                    }
                    2 | 3 => {
                        let side = if role == 2 { &rw } else { &fixed };
                        let Ok(Some(guard)) = side.try_read_for(patience).await else {
                            continue;
                        };
                        ledger.reader_in(&who);
                        hold_a_moment(&mut rng).await;
                        ledger.reader_out();
                        let _ = guard.release().await;
                    }
                    _ => {
                        let Ok(Some(writer)) = rw.try_write_for(patience).await else {
                            continue;
                        };
                        ledger.writer_in(&who, writer.fencing_token());
                        hold_a_moment(&mut rng).await;
                        let side = if role == 4 { &rw } else { &fixed };
                        match side.downgrade(&writer).await {
                            Ok(reader) => {
                                ledger.readers.fetch_add(1, Ordering::SeqCst);
                                ledger.writer_out();
                                let _ = writer.release().await;
                                hold_a_moment(&mut rng).await;
                                ledger.reader_out();
                                let _ = reader.release().await;
                            }
                            Err(_) => {
                                ledger.writer_out();
                                let _ = writer.release().await;
                            }
                        }
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(zk.leader().await.unwrap(), leader);
    zk.kill(leader).await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, Ordering::Relaxed);
    join_bounded(LIMIT, tasks).await;
    let violations = ledger.violations.lock().unwrap().clone();
    eprintln!(
        "{} writes, {} reads, {} violations",
        ledger.writes.load(Ordering::SeqCst),
        ledger.reads.load(Ordering::SeqCst),
        violations.len()
    );
    assert!(violations.is_empty(), "{violations:?}");
    assert!(ledger.writes.load(Ordering::SeqCst) > 10);
    assert!(!kept_lost.is_cancelled(), "the held read lock was lost");
    assert!(bounded(LIMIT, kept.verify()).await.unwrap());
    assert_eq!(
        bounded(LIMIT, kept.release()).await.unwrap(),
        ReleaseOutcome::Released
    );
}

/// Held: fixed-lease readers: one extends its lease while a writer waits; the writer
/// holds only after the extended lease ended and both readers' lost signals fired; the
/// extended reader's release then says AlreadyLost; `is_locked` is false once every lease
/// ended with nobody left.
#[tokio::test]
async fn review_an_extended_fixed_lease_reader_keeps_a_waiting_writer_out_until_its_new_end() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(30)).await;
    let other = client_at(&zk.url(), Duration::from_secs(30)).await;
    let name = "zkrw:extend";
    bounded(LIMIT, async {
        let readers = client
            .rw_lock(name)
            .unwrap()
            .with_lease(Duration::from_millis(1500));
        let first = readers.read().await.unwrap();
        let second = readers.read().await.unwrap();
        let (first_lost, second_lost) = (first.lost_token(), second.lost_token());
        let writer_lock = other.rw_lock(name).unwrap();
        let writer = {
            let writer_lock = writer_lock.clone();
            tokio::spawn(async move { writer_lock.write().await.unwrap() })
        };
        tokio::time::sleep(Duration::from_millis(800)).await;
        first.extend(Duration::from_secs(3)).await.unwrap();
        let extended_at = Instant::now();
        let writer = writer.await.unwrap();
        let held_after = extended_at.elapsed();
        assert!(held_after > Duration::from_millis(2900), "{held_after:?}");
        assert!(first_lost.is_cancelled() && second_lost.is_cancelled());
        assert_eq!(first.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
        assert_eq!(second.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
        writer.release().await.unwrap();
        // Leases that end with nobody waiting: free once they end.
        let alone = readers.read().await.unwrap();
        alone.lost().await;
        // The holder stops trusting its lease a margin before the ensemble ends it.
        common::eventually(
            Duration::from_secs(2),
            "free once the lease ended",
            || async { !writer_lock.is_locked().await.unwrap() },
        )
        .await;
        assert_eq!(alone.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
    })
    .await;
}

/// Held: fixed-lease (30 s) read and write acquisitions dropped at random points while
/// the lock changes hands leave no `held-` node or queue node behind: once the churn
/// stops, another client's writer holds at once (not 30 s later).
#[tokio::test]
async fn review_cancelled_fixed_lease_acquisitions_leave_nothing_behind() {
    let zk = ensemble(1).await;
    let client = client_at(&zk.url(), Duration::from_secs(10)).await;
    let other = client_at(&zk.url(), Duration::from_secs(10)).await;
    let name = "zkrw:cancelled-fixed";
    bounded(LIMIT, async {
        let rw = client.rw_lock(name).unwrap();
        let fixed = rw.with_lease(Duration::from_secs(30));
        let toggler = {
            let rw = other.rw_lock(name).unwrap();
            tokio::spawn(async move {
                for n in 0..40 {
                    if n % 2 == 0 {
                        let w = rw.write().await.unwrap();
                        tokio::time::sleep(Duration::from_millis(15)).await;
                        w.release().await.unwrap();
                    } else {
                        let r = rw.read().await.unwrap();
                        tokio::time::sleep(Duration::from_millis(15)).await;
                        r.release().await.unwrap();
                    }
                }
            })
        };
        let mut rng = Lcg(99);
        let mut kept = 0;
        for _ in 0..120 {
            let patience = Duration::from_millis(rng.next(30));
            let taken = if rng.next(2) == 0 {
                tokio::time::timeout(patience, fixed.write())
                    .await
                    .map(|g| g.map(drop))
                    .is_ok()
            } else {
                tokio::time::timeout(patience, fixed.read())
                    .await
                    .map(|g| g.map(drop))
                    .is_ok()
            };
            kept += usize::from(taken);
        }
        toggler.await.unwrap();
        eprintln!("{kept} of 120 acquisitions finished before their timeout");
        let started = Instant::now();
        let writer = other
            .rw_lock(name)
            .unwrap()
            .try_write_for(Duration::from_secs(5))
            .await
            .unwrap();
        assert!(
            writer.is_some(),
            "a cancelled acquisition left something behind: {:?}",
            children(&zk, name).await
        );
        eprintln!("the writer held after {:?}", started.elapsed());
        drop(writer);
    })
    .await;
}
