//! Hostile review of the read-write lock on etcd (issue 31, commit 31dd0eb).
//!
//! Each test named `b*` fails on 31dd0eb and asserts the behaviour the design
//! (docs/safety.md, etcd, "The read-write lock") or the API docs promise. Tests named
//! `h_*` are attacks the code withstood; they pass and stay as regression tests.
//!
//! `cargo test -p distlock --features etcd --test review31_etcdrw -- --test-threads=1`
//!
//! | test | what breaks |
//! |---|---|
//! | b1 | `Lock::owners` names one reader of several, as `"\x7f<owner>"`, not as its guard does |
//! | b2 | `Lock::force_unlock` on a lock readers hold deletes the oldest reader only: it answers true, the lock stays held |
//! | b3 | `Lock::force_unlock_held_by(reader.owner())` never ends a reader's holding |
//! | b4 | `Lock::remaining_ttl` reports the oldest reader's lease, not the longest |
//! | b5 | a reader's placement sent twice, given up before the first send lands, leaves its key on the session lease: writers are shut out for as long as the client renews anything |
//! | b6 | a waiter placed again after its key vanished (session lease ended) is woken by no release for the rest of its wait: a quarter session TTL per handoff |
#![cfg(feature = "etcd")]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::etcd::{b64, client_at, client_with, cluster, gw, num, queue};
use common::{bounded, join_bounded};
use distlock::{Client, Error, ReleaseOutcome};
use serde_json::json;

/// Who held, from when to when.
type Spans = Arc<Mutex<Vec<(&'static str, Instant, Instant)>>>;
const LIMIT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------
// Fixtures (copied from review31_etcd.rs)
// ---------------------------------------------------------------------------------------

async fn wait_queue_len(port: u16, name: &str, len: usize) {
    bounded(Duration::from_secs(20), async {
        while queue(port, name).await.len() != len {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

// =======================================================================================
// BREAKS
// =======================================================================================

/// B1. `Lock::owners` is documented as "the owners that hold the lock right now
/// (`"<client id>:<n>"`, as `LockGuard::owner` gives them)", for an operator to pass one
/// to `force_unlock_held_by`. On etcd it reads the queue's first key only
/// (`inspect::first`), so of two readers it names one, and that one as the text after the
/// queue's NUL, `"\x7f<owner>"`, which no guard's `owner()` is. (ZooKeeper's was fixed to
/// list every holder in 31dd0eb.)
#[tokio::test]
async fn b1_owners_names_every_reader_as_its_guard_does() {
    let etcd = cluster(1).await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let name = "rw:b1";
    bounded(LIMIT, async {
        let rw = client.rw_lock(name).unwrap();
        let first = rw.read().await.unwrap();
        let second = rw.read().await.unwrap();
        let mut owners = client.lock(name).unwrap().owners().await.unwrap();
        owners.sort();
        let mut expected = vec![first.owner().to_owned(), second.owner().to_owned()];
        expected.sort();
        println!("B1: owners() = {owners:?}, readers are {expected:?}");
        assert_eq!(
            owners, expected,
            "owners() does not name the readers that hold"
        );
        first.release().await.unwrap();
        second.release().await.unwrap();
    })
    .await;
}

/// B2. `Lock::force_unlock` "deletes the lock whoever holds it and wakes a waiter; returns
/// whether a lock was deleted". With two readers holding, it deletes the oldest reader's
/// key only (`inspect::force_unlock` acts on `first`): it answers true, yet the other
/// reader still holds and a writer is still refused.
#[tokio::test]
async fn b2_force_unlock_frees_a_lock_that_readers_hold() {
    let etcd = cluster(1).await;
    let readers = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let operator = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let name = "rw:b2";
    bounded(LIMIT, async {
        let rw = readers.rw_lock(name).unwrap();
        let first = rw.read().await.unwrap();
        let second = rw.read().await.unwrap();
        let lock = operator.lock(name).unwrap();
        assert!(lock.force_unlock().await.unwrap(), "force_unlock deleted nothing");
        let still_locked = lock.is_locked().await.unwrap();
        let writer = operator.rw_lock(name).unwrap().try_write().await.unwrap();
        println!(
            "B2: after force_unlock() = true: is_locked = {still_locked}, try_write got the lock = {}, queue = {:?}",
            writer.is_some(),
            queue(etcd.client_ports()[0], name).await
        );
        assert!(
            writer.is_some() && !still_locked,
            "force_unlock answered true but a reader still holds the lock"
        );
        drop(writer);
        drop(first);
        drop(second);
    })
    .await;
}

/// B3. `Lock::force_unlock_held_by(owner)` ends "only that holding", for an owner
/// `owners()` showed or a guard's `owner()` names. A reader's owner as its guard names it
/// never matches: `inspect::force_unlock` compares it with the text after the first key's
/// NUL, `"\x7f<owner>"`, and answers false; the reader keeps the lock.
#[tokio::test]
async fn b3_force_unlock_held_by_a_readers_owner_ends_its_holding() {
    let etcd = cluster(1).await;
    let readers = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let operator = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let name = "rw:b3";
    bounded(LIMIT, async {
        let reader = readers.rw_lock(name).unwrap().read().await.unwrap();
        let ended = operator
            .lock(name)
            .unwrap()
            .force_unlock_held_by(reader.owner())
            .await
            .unwrap();
        println!("B3: force_unlock_held_by({:?}) = {ended}", reader.owner());
        assert!(ended, "the reader's holding was not ended");
        common::eventually(Duration::from_secs(10), "the reader's loss", || async {
            reader.is_lost()
        })
        .await;
    })
    .await;
}

/// B4. `Lock::remaining_ttl` is "how long the current lease has left on the server". With
/// a reader on a 2 s lease and another on a 30 s lease, the lock stays held for 30 s, but
/// etcd's answer is the oldest key's lease (`inspect::lease_left` on `first`): 2 s. An
/// operator told "free in 2 s" waits 28 s more. (ZooKeeper's answers the longest since
/// 31dd0eb.)
#[tokio::test]
async fn b4_remaining_ttl_is_the_longest_readers_lease() {
    let etcd = cluster(1).await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let name = "rw:b4";
    bounded(LIMIT, async {
        let rw = client.rw_lock(name).unwrap();
        let short = rw.with_lease(Duration::from_secs(2)).read().await.unwrap();
        let long = rw.with_lease(Duration::from_secs(30)).read().await.unwrap();
        let left = client
            .lock(name)
            .unwrap()
            .remaining_ttl()
            .await
            .unwrap()
            .expect("the lock is held");
        println!("B4: remaining_ttl() = {left:?} with readers on 2 s and 30 s leases");
        assert!(
            left >= Duration::from_secs(20),
            "remaining_ttl() = {left:?}, but a reader holds for 30 s"
        );
        drop(short);
        drop(long);
    })
    .await;
}

/// Held: a writer behind two readers watches the newer; the newer's release makes its
/// watch follow the older one (the topic's task reads again after each deletion and
/// answers only when nothing older is left), so the older one's release wakes it at once,
/// not at its retry a quarter session TTL (7.5 s) later.
#[tokio::test]
async fn h_a_writer_behind_two_readers_is_woken_by_the_older_ones_release() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let readers = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let writers = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let name = "rw:b5";
    bounded(LIMIT, async {
        let rw = readers.rw_lock(name).unwrap();
        let older = rw.read().await.unwrap();
        let newer = rw.read().await.unwrap();
        let writer_lock = writers.rw_lock(name).unwrap();
        let writer = tokio::spawn(async move {
            let guard = writer_lock.write().await.unwrap();
            let at = Instant::now();
            guard.release().await.unwrap();
            at
        });
        wait_queue_len(port, name, 3).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        newer.release().await.unwrap();
        // The writer is woken, finds the older reader, and goes back to waiting.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert!(!writer.is_finished(), "the writer held beside a reader");
        let released_at = Instant::now();
        older.release().await.unwrap();
        let held_at = writer.await.unwrap();
        let after = held_at.duration_since(released_at);
        println!("H-two-readers: the writer held {after:?} after the last reader's release");
        assert!(
            after < Duration::from_secs(2),
            "the writer slept {after:?} with the lock free"
        );
    })
    .await;
}

/// Held: a reader watches the newest older writer, a waiter behind the holder; that
/// waiter's give-up moves its watch to the holder, whose release wakes it at once.
#[tokio::test]
async fn h_a_reader_behind_a_writer_that_gave_up_is_woken_by_the_holders_release() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let holder = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let impatient = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let readers = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let name = "rw:b6";
    bounded(LIMIT, async {
        let held = holder.rw_lock(name).unwrap().write().await.unwrap();
        let waiting = impatient.rw_lock(name).unwrap();
        let gave_up = tokio::spawn(async move {
            waiting
                .try_write_for(Duration::from_millis(2500))
                .await
                .unwrap()
                .is_none()
        });
        wait_queue_len(port, name, 2).await;
        let reader_lock = readers.rw_lock(name).unwrap();
        let reader = tokio::spawn(async move {
            let guard = reader_lock.read().await.unwrap();
            let at = Instant::now();
            guard.release().await.unwrap();
            at
        });
        wait_queue_len(port, name, 3).await;
        assert!(gave_up.await.unwrap(), "the impatient writer held");
        wait_queue_len(port, name, 2).await;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert!(!reader.is_finished(), "the reader held beside the writer");
        let released_at = Instant::now();
        held.release().await.unwrap();
        let held_at = reader.await.unwrap();
        let after = held_at.duration_since(released_at);
        println!("H-gave-up: the reader held {after:?} after the writer's release");
        assert!(
            after < Duration::from_secs(2),
            "the reader slept {after:?} with the lock free"
        );
    })
    .await;
}

/// B5. docs/safety.md (etcd, Members): "a waiter's placement sent twice, whose first send
/// reaches the cluster after the waiter gave up (or released) and deleted its key, writes
/// the key again; the client then looks for that key at every renewal for a session TTL
/// and deletes it (so a lock is blocked at most a renewal interval)". For a give-up it
/// does not: the engine builds the clean-up (`EtcdAttempt::abandon`) when the acquisition
/// *starts* (engine/acquire.rs, `Abandon::new(core, primitive.abandon())`), and `abandon`
/// reads `resent` right then, synchronously, when no placement has been sent: it is
/// always false, so `watch_for_late_copy` is never called for a give-up. A reader's
/// `try_read` whose placement went to a slow member first and then to another, given up
/// before the slow copy lands, leaves a reader's key on the session lease: no writer gets
/// in for as long as the client renews anything (here: another lock it holds).
///
/// Made deterministic with two proxies in front of one member, listed as two members:
/// requests to the first are delayed 1.2 s on their way in, so the placement's first send
/// times out after a third of the 1.5 s response timeout, the second send (through the
/// other proxy) places the key, the give-up deletes it, and the first send lands after.
#[tokio::test]
async fn b5_a_readers_late_placement_after_its_give_up_blocks_writers_for_good() {
    use distlock_testkit::{Direction, FaultProxy};
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let slow = FaultProxy::start(upstream).await.unwrap();
    let fast = FaultProxy::start(upstream).await.unwrap();
    let through = format!("etcd://127.0.0.1:{},127.0.0.1:{}", slow.port(), fast.port());
    let readers = client_with(
        &through,
        Duration::from_secs(6),
        Duration::from_millis(1500),
    )
    .await;
    let writers = client_at(&etcd.url(), Duration::from_secs(6)).await;
    let name = "rw:b5";
    bounded(LIMIT, async {
        // Other work on the reader's client keeps its session lease renewed.
        let _other_work = readers.lock("rw:b5:other-work").unwrap().lock().await.unwrap();
        let held = writers.rw_lock(name).unwrap().write().await.unwrap();
        slow.set_delay_in(Direction::ToServer, Duration::from_millis(1200));
        let tried = readers.rw_lock(name).unwrap().try_read().await.unwrap();
        assert!(tried.is_none(), "a reader held beside a writer");
        let after_give_up = queue(port, name).await;
        // The slow first send lands.
        tokio::time::sleep(Duration::from_millis(2000)).await;
        slow.set_delay_in(Direction::ToServer, Duration::ZERO);
        let after_late_copy = queue(port, name).await;
        held.release().await.unwrap();
        let released_at = Instant::now();
        let writer = writers
            .rw_lock(name)
            .unwrap()
            .try_write_for(Duration::from_secs(15))
            .await
            .unwrap();
        println!(
            "B5: queue after the give-up {after_give_up:?}; after the late send {after_late_copy:?}; \
             a writer {} {:?} after the holder's release; queue now {:?}",
            if writer.is_some() { "held" } else { "was still refused" },
            released_at.elapsed(),
            queue(port, name).await
        );
        assert!(
            writer.is_some(),
            "no writer got in for 15 s (session TTL 6 s): the given-up reader's late key holds the lock"
        );
    })
    .await;
}

// =======================================================================================
// HELD
// =======================================================================================

/// What the exclusion checks count: exclusive holders (a `Lock`, a writer) and readers in
/// at once, and the worst seen.
#[derive(Default)]
struct Inside {
    exclusive: AtomicUsize,
    readers: AtomicUsize,
    most_readers: AtomicUsize,
    overlaps: Mutex<Vec<String>>,
}

impl Inside {
    fn enter_exclusive(&self, who: &str) {
        let before = self.exclusive.fetch_add(1, Ordering::SeqCst);
        let readers = self.readers.load(Ordering::SeqCst);
        if before != 0 || readers != 0 {
            self.overlaps.lock().unwrap().push(format!(
                "{who} in with {before} exclusive, {readers} readers"
            ));
        }
    }

    fn leave_exclusive(&self) {
        self.exclusive.fetch_sub(1, Ordering::SeqCst);
    }

    fn enter_reader(&self, who: &str) {
        let now = self.readers.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_readers.fetch_max(now, Ordering::SeqCst);
        let exclusive = self.exclusive.load(Ordering::SeqCst);
        if exclusive != 0 {
            self.overlaps
                .lock()
                .unwrap()
                .push(format!("{who} in with {exclusive} exclusive"));
        }
    }

    fn leave_reader(&self) {
        self.readers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One round of the mixed workload: `kind` picks a `Lock`, a writer or a reader (watchdog
/// or fixed lease), a try_*, a try_*_for, or a wait dropped mid-way. Answers the write
/// token, if a write hold was taken. Errors (a leader election) are counted, not fatal.
async fn mixed_round(
    client: &Client,
    name: &str,
    kind: usize,
    inside: &Inside,
    errors: &AtomicUsize,
) -> Option<u64> {
    let rw = client.rw_lock(name).unwrap();
    let fixed = rw.with_lease(Duration::from_secs(4));
    let hold = Duration::from_millis(3);
    macro_rules! exclusive {
        ($acquired:expr, $who:expr) => {
            match $acquired {
                Ok(Some(guard)) => {
                    inside.enter_exclusive($who);
                    let token = guard.fencing_token();
                    tokio::time::sleep(hold).await;
                    inside.leave_exclusive();
                    let _ = guard.release().await;
                    Some(token)
                }
                Ok(None) => None,
                Err(_) => {
                    errors.fetch_add(1, Ordering::SeqCst);
                    None
                }
            }
        };
    }
    macro_rules! shared {
        ($acquired:expr, $who:expr) => {
            match $acquired {
                Ok(Some(guard)) => {
                    inside.enter_reader($who);
                    tokio::time::sleep(hold * 2).await;
                    inside.leave_reader();
                    let _ = guard.release().await;
                    None
                }
                Ok(None) => None,
                Err(_) => {
                    errors.fetch_add(1, Ordering::SeqCst);
                    None
                }
            }
        };
    }
    match kind % 10 {
        0 => exclusive!(client.lock(name).unwrap().lock().await.map(Some), "lock"),
        1 => exclusive!(rw.write().await.map(Some), "writer"),
        2 => exclusive!(fixed.write().await.map(Some), "fixed writer"),
        3 => shared!(rw.read().await.map(Some), "reader"),
        4 => shared!(fixed.read().await.map(Some), "fixed reader"),
        5 => shared!(rw.try_read().await, "try_read"),
        6 => exclusive!(rw.try_write().await, "try_write"),
        7 => shared!(
            rw.try_read_for(Duration::from_millis(40)).await,
            "try_read_for"
        ),
        8 => exclusive!(
            fixed.try_write_for(Duration::from_millis(40)).await,
            "try_write_for"
        ),
        _ => {
            // A wait dropped mid-way (select!), a reader's or a writer's.
            if kind % 20 < 10 {
                let _ = tokio::time::timeout(Duration::from_millis(15), rw.read()).await;
            } else {
                let _ = tokio::time::timeout(Duration::from_millis(15), rw.write()).await;
            }
            None
        }
    }
}

/// Held: exclusion across every kind of holder: a `Lock`, writers and readers in watchdog
/// mode and on a fixed lease, try_*, try_*_for with short timeouts and waits dropped
/// mid-way, 9 tasks on 3 clients, 90 rounds: no exclusive holder is ever in with anyone,
/// readers share, write tokens never repeat, and no key is left behind.
#[tokio::test]
async fn h_every_kind_of_holder_on_three_clients_never_overlaps() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(client_at(&etcd.url(), Duration::from_secs(5)).await);
    }
    let clients = Arc::new(clients);
    let inside = Arc::new(Inside::default());
    let errors = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let name = "rw:h-mixed";
    let mut tasks = Vec::new();
    for n in 0..9_usize {
        let (clients, inside, errors, tokens) = (
            Arc::clone(&clients),
            Arc::clone(&inside),
            Arc::clone(&errors),
            Arc::clone(&tokens),
        );
        tasks.push(tokio::spawn(async move {
            for round in 0..10_usize {
                let kind = n * 7 + round * 3;
                let token = mixed_round(&clients[n % 3], name, kind, &inside, &errors).await;
                if let Some(token) = token {
                    tokens.lock().unwrap().push(token);
                }
            }
        }));
    }
    join_bounded(LIMIT, tasks).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let left = queue(port, name).await;
    let overlaps = inside.overlaps.lock().unwrap().clone();
    let mut tokens = tokens.lock().unwrap().clone();
    let handed_out = tokens.len();
    tokens.sort_unstable();
    tokens.dedup();
    println!(
        "H-mixed: {handed_out} write holds, most readers together {}, {} errors, overlaps {overlaps:?}, keys left {left:?}",
        inside.most_readers.load(Ordering::SeqCst),
        errors.load(Ordering::SeqCst)
    );
    assert!(overlaps.is_empty(), "{overlaps:?}");
    assert_eq!(tokens.len(), handed_out, "a write token repeated");
    assert_eq!(errors.load(Ordering::SeqCst), 0);
    assert!(left.is_empty(), "keys left behind: {left:?}");
}

/// Held: the same workload (minus the dropped waits) on three members while the leader
/// is killed: no overlap.
#[tokio::test]
async fn h_a_killed_leader_breaks_no_read_write_exclusion() {
    let mut etcd = cluster(3).await;
    let mut clients = Vec::new();
    for _ in 0..2 {
        clients.push(client_at(&etcd.url(), Duration::from_secs(5)).await);
    }
    let clients = Arc::new(clients);
    let inside = Arc::new(Inside::default());
    let errors = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let rounds = Arc::new(AtomicUsize::new(0));
    let name = "rw:h-leader";
    let mut tasks = Vec::new();
    for n in 0..6_usize {
        let (clients, inside, errors, stop, rounds) = (
            Arc::clone(&clients),
            Arc::clone(&inside),
            Arc::clone(&errors),
            Arc::clone(&stop),
            Arc::clone(&rounds),
        );
        tasks.push(tokio::spawn(async move {
            let mut round = 0_usize;
            while !stop.load(Ordering::SeqCst) {
                let kind = (n * 7 + round * 3) % 9;
                let attempt = tokio::time::timeout(
                    Duration::from_secs(15),
                    mixed_round(&clients[n % 2], name, kind, &inside, &errors),
                );
                if attempt.await.is_err() {
                    errors.fetch_add(1, Ordering::SeqCst);
                }
                rounds.fetch_add(1, Ordering::SeqCst);
                round += 1;
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let leader = etcd.leader().await.unwrap();
    etcd.kill(leader).await.unwrap();
    let killed_at_round = rounds.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(8)).await;
    stop.store(true, Ordering::SeqCst);
    join_bounded(Duration::from_secs(40), tasks).await;
    let overlaps = inside.overlaps.lock().unwrap().clone();
    println!(
        "H-leader: {} rounds ({} after the kill), most readers {}, {} errors, overlaps {overlaps:?}",
        rounds.load(Ordering::SeqCst),
        rounds.load(Ordering::SeqCst) - killed_at_round,
        inside.most_readers.load(Ordering::SeqCst),
        errors.load(Ordering::SeqCst)
    );
    assert!(overlaps.is_empty(), "{overlaps:?}");
    assert!(
        rounds.load(Ordering::SeqCst) > killed_at_round,
        "nothing ran after the kill"
    );
}

/// Held: FIFO across sides. Behind a writer: two readers, a writer, a reader. The two
/// readers hold together, the second writer only once both are gone, the last reader
/// only once that writer is gone.
#[tokio::test]
async fn h_a_mixed_queue_is_served_in_order() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let a = client_at(&etcd.url(), Duration::from_secs(10)).await;
    let b = client_at(&etcd.url(), Duration::from_secs(10)).await;
    let name = "rw:h-fifo";
    bounded(LIMIT, async {
        let first = a.rw_lock(name).unwrap().write().await.unwrap();
        let spans: Spans = Arc::default();
        let mut tasks = Vec::new();
        for (n, (label, write)) in [("r1", false), ("r2", false), ("w2", true), ("r3", false)]
            .into_iter()
            .enumerate()
        {
            let lock = [&a, &b][n % 2].rw_lock(name).unwrap();
            let spans = Arc::clone(&spans);
            tasks.push(tokio::spawn(async move {
                let (start, end) = if write {
                    let guard = lock.write().await.unwrap();
                    let start = Instant::now();
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    let end = Instant::now();
                    guard.release().await.unwrap();
                    (start, end)
                } else {
                    let guard = lock.read().await.unwrap();
                    let start = Instant::now();
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    let end = Instant::now();
                    guard.release().await.unwrap();
                    (start, end)
                };
                spans.lock().unwrap().push((label, start, end));
            }));
            wait_queue_len(port, name, n + 2).await;
        }
        first.release().await.unwrap();
        join_bounded(LIMIT, tasks).await;
        let spans = spans.lock().unwrap().clone();
        let span = |label: &str| *spans.iter().find(|(l, _, _)| *l == label).unwrap();
        let (r1, r2, w2, r3) = (span("r1"), span("r2"), span("w2"), span("r3"));
        println!(
            "H-fifo: r1 +{:?}, r2 +{:?}, w2 +{:?}, r3 +{:?}",
            r1.1.duration_since(r1.1),
            r2.1.duration_since(r1.1),
            w2.1.duration_since(r1.1),
            r3.1.duration_since(r1.1)
        );
        assert!(r2.1 < r1.2 && r1.1 < r2.2, "the two readers did not share");
        assert!(
            w2.1 >= r1.2 && w2.1 >= r2.2,
            "the writer came in beside a reader"
        );
        assert!(
            r3.1 >= w2.2,
            "the last reader passed the writer queued ahead of it"
        );
    })
    .await;
}

/// B6. A waiter whose key vanished while it waited (its session lease ended: the client
/// cut off or paused past its TTL; here revoked by hand, as an expiry does) is placed
/// again at the end of the queue. That part held: a writer queued after its first
/// placement holds before it, never beside it. But from then on nothing wakes it: its
/// `first:` topic was answered when its own key was found gone (transport/etcd/watch.rs,
/// `first_step`: "answered when the key is gone"), and a topic is answered once and never
/// followed again while the wait lasts (`EtcdSink::set` skips a topic still in
/// `following`; the engine keeps one subscription for the whole wait). Its predecessor's
/// release wakes nobody; it looks again only at its retry, a quarter session TTL later
/// (7.5 s with the default 30 s watchdog). docs/safety.md: "each watches only its
/// predecessor's key"; "each woken by its predecessor's release".
#[tokio::test]
async fn b6_a_reader_placed_again_is_not_woken_by_its_predecessors_release() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let a = client_at(&etcd.url(), Duration::from_secs(10)).await;
    let b = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let c = client_at(&etcd.url(), Duration::from_secs(10)).await;
    let name = "rw:h-requeue";
    bounded(LIMIT, async {
        let first = a.rw_lock(name).unwrap().write().await.unwrap();
        let reader_lock = b.rw_lock(name).unwrap();
        let reader = tokio::spawn(async move {
            let guard = reader_lock.read().await.unwrap();
            let at = Instant::now();
            guard.release().await.unwrap();
            at
        });
        wait_queue_len(port, name, 2).await;
        let reader_lease = queue(port, name).await[1].2;
        let writer_lock = c.rw_lock(name).unwrap();
        let writer = tokio::spawn(async move {
            let guard = writer_lock.write().await.unwrap();
            let at = Instant::now();
            tokio::time::sleep(Duration::from_millis(500)).await;
            let end = Instant::now();
            guard.release().await.unwrap();
            (at, end)
        });
        wait_queue_len(port, name, 3).await;
        gw(
            port,
            "/v3/lease/revoke",
            json!({"ID": reader_lease.to_string()}),
        )
        .await;
        wait_queue_len(port, name, 2).await;
        first.release().await.unwrap();
        let (writer_at, writer_end) = writer.await.unwrap();
        let reader_at = reader.await.unwrap();
        let woken_after = reader_at.saturating_duration_since(writer_end);
        println!(
            "B6: the writer held first: {}; the re-placed reader held {woken_after:?} after the writer let go",
            writer_at < reader_at,
        );
        assert!(reader_at >= writer_end, "the re-placed reader held beside or before the writer queued behind it");
        assert!(
            woken_after < Duration::from_secs(2),
            "the re-placed reader slept {woken_after:?} after its predecessor's release"
        );
    })
    .await;
}

/// Held: downgrades. (a) Readers and writers queued behind a writer stay out while its
/// read hold lives, whichever of the two holds is released first, and the queue is
/// served in order after; (b) a downgrade whose future is dropped gives its hold back;
/// (c) a fixed-lease writer's read hold is lost with its lease, before another holds.
#[tokio::test]
async fn h_downgrades_release_orders_cancel_and_a_fixed_lease() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let a = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let b = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let name = "rw:h-downgrade";
    bounded(LIMIT, async {
        // (a) the read hold released first, then the write hold.
        let lock = a.rw_lock(name).unwrap();
        let writer = lock.write().await.unwrap();
        let token = writer.fencing_token();
        let next_lock = b.rw_lock(name).unwrap();
        let next = tokio::spawn(async move {
            let guard = next_lock.write().await.unwrap();
            let at = (Instant::now(), guard.fencing_token());
            guard.release().await.unwrap();
            at
        });
        wait_queue_len(port, name, 2).await;
        let read_lock = b.rw_lock(name).unwrap();
        let reader = tokio::spawn(async move {
            let guard = read_lock.read().await.unwrap();
            let at = Instant::now();
            guard.release().await.unwrap();
            at
        });
        wait_queue_len(port, name, 3).await;
        let read = lock.downgrade(&writer).await.unwrap();
        assert!(read.verify().await.unwrap());
        assert_eq!(read.release().await.unwrap(), ReleaseOutcome::Released);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !next.is_finished() && !reader.is_finished(),
            "someone came in beside the writer"
        );
        assert!(writer.verify().await.unwrap());
        writer.release().await.unwrap();
        let (next_at, next_token) = next.await.unwrap();
        let reader_at = reader.await.unwrap();
        assert!(next_token > token);
        assert!(
            reader_at > next_at,
            "the reader passed the writer queued ahead of it"
        );

        // (b) a downgrade dropped after its first poll.
        let writer = lock.write().await.unwrap();
        common::cancel_after_first_poll(lock.downgrade(&writer)).await;
        writer.release().await.unwrap();
        let other = b.rw_lock(name).unwrap();
        let freed = other.try_write_for(Duration::from_secs(5)).await.unwrap();
        assert!(
            freed.is_some(),
            "a cancelled downgrade's hold kept the lock"
        );
        drop(freed);
        wait_queue_len(port, name, 0).await;

        // (c) a fixed-lease writer's read hold ends with its lease.
        let fixed = lock.with_lease(Duration::from_secs(2));
        let writer = fixed.write().await.unwrap();
        let read = fixed.downgrade(&writer).await.unwrap();
        writer.release().await.unwrap();
        let lost_at =
            common::lost_before_another_holds(read.lost_token(), b.lock(name).unwrap()).await;
        assert_eq!(read.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
        let _ = lost_at;
    })
    .await;
    assert_eq!(queue(port, name).await.len(), 0, "a key left behind");
}

/// Entry point of the child process below; skipped in a normal run.
#[tokio::test]
#[ignore = "run as a child process by h_a_killed_readers_lock_is_free_when_its_lease_ends"]
async fn etcd_child_reader() {
    let Ok(url) = std::env::var("DISTLOCK_ETCDRW_CHILD_URL") else {
        panic!("etcd_child_reader runs only as a child process");
    };
    let client = client_at(&url, Duration::from_secs(2)).await;
    let _guard = client
        .rw_lock("rw:h-orphaned")
        .unwrap()
        .read()
        .await
        .unwrap();
    println!("HELD 0");
    std::future::pending::<()>().await;
}

/// Held: a reader's process killed with kill -9 frees the lock for a writer when its
/// session lease ends, not before; another reader shares with it meanwhile.
#[tokio::test]
async fn h_a_killed_readers_lock_is_free_when_its_lease_ends() {
    let etcd = cluster(1).await;
    let client = client_at(&etcd.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let (mut child, _) = common::child_holding(
            "etcd_child_reader",
            "DISTLOCK_ETCDRW_CHILD_URL",
            &etcd.url(),
        )
        .await;
        let rw = client.rw_lock("rw:h-orphaned").unwrap();
        assert!(rw.try_write().await.unwrap().is_none());
        let shared = rw.try_read().await.unwrap().expect("readers share");
        shared.release().await.unwrap();
        child.kill().await.unwrap();
        let killed_at = Instant::now();
        let writer = rw.write().await.unwrap();
        let freed_after = killed_at.elapsed();
        println!("H-kill: a writer held {freed_after:?} after the reader's kill -9");
        assert!(freed_after < Duration::from_secs(8), "{freed_after:?}");
        writer.release().await.unwrap();
    })
    .await;
}

/// Held: tokens. With readers holding and a writer queued behind them (its key created
/// earlier), `last_fencing_token` read now is below the writer's token when its turn
/// comes, and a later `Lock`'s is above both.
#[tokio::test]
async fn h_a_queued_writers_token_is_above_the_floor_read_while_readers_held() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let a = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let b = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let name = "rw:h-tokens";
    bounded(LIMIT, async {
        let reader = a.rw_lock(name).unwrap().read().await.unwrap();
        let writer_lock = b.rw_lock(name).unwrap();
        let writer = tokio::spawn(async move { writer_lock.write().await.unwrap() });
        wait_queue_len(port, name, 2).await;
        let floor = a.lock(name).unwrap().last_fencing_token().await.unwrap();
        reader.release().await.unwrap();
        let writer = writer.await.unwrap();
        let token = writer.fencing_token();
        writer.release().await.unwrap();
        let floor2 = a.lock(name).unwrap().last_fencing_token().await.unwrap();
        let plain = a.lock(name).unwrap().lock().await.unwrap();
        println!(
            "H-tokens: floor {floor} < writer {token} <= floor {floor2} < lock {}",
            plain.fencing_token()
        );
        assert!(token > floor && plain.fencing_token() > floor2 && floor2 >= token);
        plain.release().await.unwrap();
    })
    .await;
}

/// Held: a fixed-lease reader's `extend` moves its end (a writer still waits past the
/// first lease), its release then lets the writer in at once; an `extend` after the
/// lease ended is `NotHeld`, and a release then `AlreadyLost`.
#[tokio::test]
async fn h_a_fixed_lease_readers_extend_and_its_end() {
    let etcd = cluster(1).await;
    let a = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let b = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let name = "rw:h-extend";
    bounded(LIMIT, async {
        let fixed = a.rw_lock(name).unwrap().with_lease(Duration::from_secs(2));
        let reader = fixed.read().await.unwrap();
        reader.extend(Duration::from_secs(6)).await.unwrap();
        let writers = b.rw_lock(name).unwrap();
        assert!(
            writers
                .try_write_for(Duration::from_secs(3))
                .await
                .unwrap()
                .is_none(),
            "a writer came in at the reader's first lease end, after its extend"
        );
        assert!(!reader.is_lost());
        let writer = tokio::spawn(async move {
            let guard = writers.write().await.unwrap();
            let at = Instant::now();
            guard.release().await.unwrap();
            at
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let released = Instant::now();
        reader.release().await.unwrap();
        let after = writer.await.unwrap().duration_since(released);
        assert!(after < Duration::from_secs(1), "{after:?}");

        let reader = fixed.read().await.unwrap();
        let lost = reader.lost_token();
        common::lost_before_another_holds(lost, b.lock(name).unwrap()).await;
        assert!(matches!(
            reader.extend(Duration::from_secs(5)).await,
            Err(Error::NotHeld { .. })
        ));
        assert_eq!(reader.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
    })
    .await;
}

/// Held: odd names. `\x7f` inside or at the start of a name, braces, a 60 KiB name:
/// readers share, a `Lock` and a writer of the same name are kept out, and a name that
/// only differs by a trailing `\x7f` is another lock; NUL is refused.
#[tokio::test]
async fn h_odd_names_keep_their_queues_apart() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let a = client_at(&etcd.url(), Duration::from_secs(10)).await;
    let b = client_at(&etcd.url(), Duration::from_secs(10)).await;
    bounded(LIMIT, async {
        let long = "n".repeat(60 * 1024);
        for name in ["\u{7f}", "a\u{7f}", "\u{7f}\u{7f}x", "{x}", "{x}y", "a\u{7f}{b}", long.as_str()] {
            let reader = a.rw_lock(name).unwrap().read().await.unwrap();
            let shared = b.rw_lock(name).unwrap().try_read().await.unwrap();
            assert!(shared.is_some(), "{:.8?}: readers did not share", name);
            assert!(b.lock(name).unwrap().try_lock().await.unwrap().is_none(), "{:.8?}", name);
            assert!(b.rw_lock(name).unwrap().try_write().await.unwrap().is_none(), "{:.8?}", name);
            // The same name with one more \x7f is another lock.
            let other = format!("{name}\u{7f}");
            let free = b.rw_lock(other.as_str()).unwrap().try_write().await.unwrap();
            assert!(free.is_some(), "{:.8?}: a neighbouring name was locked", name);
            drop(free);
            reader.release().await.unwrap();
            drop(shared);
            let writer = b
                .rw_lock(name)
                .unwrap()
                .try_write_for(Duration::from_secs(5))
                .await
                .unwrap();
            assert!(writer.is_some(), "{:.8?}: not freed", name);
            writer.unwrap().release().await.unwrap();
        }
        assert!(matches!(a.rw_lock("x\0y"), Err(Error::InvalidName { .. })));
        tokio::time::sleep(Duration::from_millis(300)).await;
        let prefix_left = {
            let reply = gw(
                port,
                "/v3/kv/range",
                json!({"key": b64(b"distlock/"), "range_end": b64(b"distlock0"), "count_only": true}),
            )
            .await;
            num(&reply["count"])
        };
        assert_eq!(prefix_left, 0, "keys left behind");
    })
    .await;
}

/// Held: a member frozen (SIGSTOP), then restarted, while readers hold on three members:
/// the readers keep the lock (no lost signal), a writer stays out, and gets in once they
/// release.
#[tokio::test]
async fn h_a_frozen_then_restarted_member_keeps_readers_holding() {
    let mut etcd = cluster(3).await;
    let a = client_with(&etcd.url(), Duration::from_secs(3), Duration::from_secs(2)).await;
    let b = client_at(&etcd.url(), Duration::from_secs(5)).await;
    let name = "rw:h-members";
    bounded(LIMIT, async {
        let rw = a.rw_lock(name).unwrap();
        let first = rw.read().await.unwrap();
        let second = rw.read().await.unwrap();
        let leader = etcd.leader().await.unwrap();
        let follower = (leader + 1) % 3;
        etcd.stop(follower).unwrap();
        let writers = b.rw_lock(name).unwrap();
        assert!(writers
            .try_write_for(Duration::from_secs(4))
            .await
            .unwrap()
            .is_none());
        etcd.resume(follower).unwrap();
        etcd.restart(follower).await.unwrap();
        assert!(writers
            .try_write_for(Duration::from_secs(4))
            .await
            .unwrap()
            .is_none());
        assert!(
            !first.is_lost() && !second.is_lost(),
            "a reader lost its hold"
        );
        assert!(first.verify().await.unwrap() && second.verify().await.unwrap());
        first.release().await.unwrap();
        second.release().await.unwrap();
        let writer = writers.try_write_for(Duration::from_secs(5)).await.unwrap();
        assert!(writer.is_some());
        writer.unwrap().release().await.unwrap();
    })
    .await;
}
