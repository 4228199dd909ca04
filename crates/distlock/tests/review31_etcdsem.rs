//! Hostile review of the permit semaphore on etcd (issue 31, commit 681c1cf).
//!
//! Tests named `break_*` fail on 681c1cf and assert what docs/safety.md ("The permit
//! semaphore") or the API docs promise; `held_*` are attacks the code withstood.
//!
//! `cargo test -p distlock --features etcd --test review31_etcdsem -- --test-threads=2`
//!
//! | test | what breaks |
//! |---|---|
//! | break_available_permits_… | `available_permits` counts permits behind a head that does not fit (1 of 3, 3 of 3) as free; `try_acquire(1)` gets none |
//! | break_a_waiter_refused_… | a waiter whose `fits:` topic was answered, then refused (total lowered meanwhile), is woken by nothing after: 17 s (its retry) instead of ~4 s |
mod common;

use std::io::{BufRead, BufReader};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::bounded;
use common::etcd::{b64, client_at, client_with, cluster, gw, unb64};
use distlock::{Error, PermitSemaphore, PermitsSet};
use distlock_testkit::{EtcdCluster, FaultProxy};
use serde_json::{json, Value};

const LIMIT: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------

/// A proxy in front of member 0, and the URL through it.
async fn proxied(etcd: &EtcdCluster) -> (FaultProxy, String) {
    let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], etcd.client_ports()[0]));
    let proxy = FaultProxy::start(upstream).await.unwrap();
    let url = format!("etcd://127.0.0.1:{}", proxy.port());
    (proxy, url)
}

fn num(value: &Value) -> i64 {
    match value {
        Value::String(text) => text.parse().unwrap_or(0),
        other => other.as_i64().unwrap_or(0),
    }
}

/// The prefix of semaphore `name`'s queue (default prefix `distlock/`).
fn queue_prefix(name: &str) -> Vec<u8> {
    format!("distlock/\0permits\0{name}\0").into_bytes()
}

/// Semaphore `name`'s queue, oldest first: (owner, value, create revision, lease).
async fn sem_queue(port: u16, name: &str) -> Vec<(String, String, i64, i64)> {
    let prefix = queue_prefix(name);
    let mut end = prefix.clone();
    *end.last_mut().unwrap() += 1;
    let reply = gw(
        port,
        "/v3/kv/range",
        json!({"key": b64(&prefix), "range_end": b64(&end),
               "sort_order": "ASCEND", "sort_target": "CREATE"}),
    )
    .await;
    let kvs = reply["kvs"].as_array().cloned().unwrap_or_default();
    kvs.iter()
        .map(|kv| {
            let key = unb64(kv["key"].as_str().unwrap());
            let owner = String::from_utf8_lossy(&key[prefix.len()..]).into_owned();
            let value =
                String::from_utf8_lossy(&unb64(kv["value"].as_str().unwrap_or(""))).into_owned();
            (owner, value, num(&kv["create_revision"]), num(&kv["lease"]))
        })
        .collect()
}

async fn raw_put(port: u16, key: &[u8], value: &str) {
    gw(
        port,
        "/v3/kv/put",
        json!({"key": b64(key), "value": b64(value.as_bytes())}),
    )
    .await;
}

async fn wait_queue_len(port: u16, name: &str, len: usize) {
    let what = format!("{name}: a queue of {len}");
    common::eventually(Duration::from_secs(30), &what, || async move {
        sem_queue(port, name).await.len() == len
    })
    .await;
}

/// Permits in use, and the most seen at once.
#[derive(Clone, Default)]
struct InUse(Arc<(AtomicI64, AtomicI64)>);

impl InUse {
    fn take(&self, n: i64) -> i64 {
        let now = self.0 .0.fetch_add(n, Ordering::SeqCst) + n;
        self.0 .1.fetch_max(now, Ordering::SeqCst);
        now
    }
    fn give(&self, n: i64) {
        self.0 .0.fetch_sub(n, Ordering::SeqCst);
    }
    fn most(&self) -> i64 {
        self.0 .1.load(Ordering::SeqCst)
    }
}

// =======================================================================================
// BREAKS
// =======================================================================================

/// `available_permits` is "how many permits are free right now". etcd's count
/// (`permit_semaphore/etcd.rs::counts`) adds up the queue's head while it fits and stops
/// at the first key that does not, so a waiter at the head that does not fit leaves its
/// would-be permits counted as free although no acquisition can take them: every later
/// ask queues behind it (`permits_fit` counts every key ahead). Three shapes: a holder of
/// 2 of 3 with a waiter for 2 behind it; an ask of 5 of 3; a key an operator wrote whose
/// value is not a count. tokio's semaphore, whose order the docs invoke, assigns freed
/// permits to its head waiter and reports 0 available in all three.
#[tokio::test]
async fn break_available_permits_counts_permits_no_acquisition_can_take() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let client = client_at(&etcd.url(), Duration::from_secs(10)).await;
    let other = client_at(&etcd.url(), Duration::from_secs(10)).await;
    bounded(LIMIT, async {
        let mut figures = Vec::new();
        // 1. A holder of 2, a waiter for 2 behind it.
        let sem = client.permit_semaphore("c:behind").unwrap();
        assert!(sem.try_set_permits(3).await.unwrap().is_set());
        let held = sem.acquire(2).await.unwrap();
        let waiting = other.permit_semaphore("c:behind").unwrap();
        let waiter = tokio::spawn(async move { waiting.acquire(2).await });
        wait_queue_len(port, "c:behind", 2).await;
        let free = sem.available_permits().await.unwrap();
        let took = sem.try_acquire(1).await.unwrap().is_some();
        figures.push(("holder 2 + waiter 2 of 3", free, took));
        // 2. An ask of more than the total.
        let big = client.permit_semaphore("c:oversize").unwrap();
        assert!(big.try_set_permits(3).await.unwrap().is_set());
        let asking = other.permit_semaphore("c:oversize").unwrap();
        let oversize = tokio::spawn(async move { asking.acquire(5).await });
        wait_queue_len(port, "c:oversize", 1).await;
        let free = big.available_permits().await.unwrap();
        let took = big.try_acquire(1).await.unwrap().is_some();
        figures.push(("an ask of 5 of 3", free, took));
        // 3. An operator's key whose value is not a count.
        let junk = client.permit_semaphore("c:junk").unwrap();
        assert!(junk.try_set_permits(3).await.unwrap().is_set());
        let mut key = queue_prefix("c:junk");
        key.extend_from_slice(b"operator");
        raw_put(port, &key, "lots").await;
        let free = junk.available_permits().await.unwrap();
        let took = junk.try_acquire(1).await.unwrap().is_some();
        figures.push(("an operator's key valued \"lots\"", free, took));
        println!("available_permits() vs try_acquire(1): {figures:?}");
        waiter.abort();
        oversize.abort();
        drop(held);
        for (shape, free, took) in figures {
            assert!(
                free == 0 || took,
                "{shape}: available_permits() = {free}, yet try_acquire(1) got nothing"
            );
        }
    })
    .await;
}

/// A waiter's `fits:` topic is answered once (`transport/etcd/watch.rs::follow` returns
/// after `Step::Answer`), and the hub keeps it as followed (`EtcdSink::set` skips a topic
/// it has) for the rest of the wait. If the waiter's attempt then finds it no longer fits
/// (the total was lowered between the watch's read and the attempt's), nothing watches
/// for it any more: a later release or new total wakes it only at its retry timer (a
/// quarter of the session TTL, 15 s here), which docs/safety.md says waiters never
/// sleep out. The waiter's link is slowed (400 ms each way) so that the lowering lands
/// between the two reads (lowered 150 ms after the release instead, before the watch's
/// read, the same waiter holds 4.4 s after the raise).
#[tokio::test]
async fn break_a_waiter_refused_after_its_wake_up_is_never_woken_again() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let (proxy, through) = proxied(&etcd).await;
    let operator = client_at(&etcd.url(), Duration::from_secs(30)).await;
    proxy.set_delay(Duration::from_millis(400));
    let slow = client_with(&through, Duration::from_secs(60), Duration::from_secs(6)).await;
    let name = "w:refused";
    bounded(LIMIT, async {
        let sem = operator.permit_semaphore(name).unwrap();
        assert!(sem.try_set_permits(2).await.unwrap().is_set());
        let held = sem.acquire(1).await.unwrap();
        let waiting = slow.permit_semaphore(name).unwrap();
        let waiter = tokio::spawn(async move {
            let permits = waiting.acquire(2).await.unwrap();
            (Instant::now(), permits)
        });
        wait_queue_len(port, name, 2).await;
        // Its watch reads and starts (two slow round trips).
        tokio::time::sleep(Duration::from_secs(4)).await;
        let released_at = Instant::now();
        held.release().await.unwrap();
        // The watch reads "fits" about 800 ms after the release, the attempt reads about
        // 1600 ms after it: the total drops to 1 between them.
        tokio::time::sleep_until((released_at + Duration::from_millis(1150)).into()).await;
        sem.add_permits(-1).await.unwrap();
        tokio::time::sleep_until((released_at + Duration::from_millis(3000)).into()).await;
        assert!(
            !waiter.is_finished(),
            "timing missed: the waiter took 2 of 1 permits?"
        );
        let raised_at = Instant::now();
        sem.add_permits(1).await.unwrap();
        let (held_at, permits) = waiter.await.unwrap();
        let after = held_at.duration_since(raised_at);
        println!(
            "the waiter held {after:?} after the total was raised back to 2 (its retry: 15 s)"
        );
        drop(permits);
        // Through the slow link a wake-up takes a few round trips: 4.4 s when the total
        // is lowered before the watch reads (150 ms after the release), 17 s here.
        assert!(
            after < Duration::from_secs(8),
            "a new total woke the waiter only at its retry timer: {after:?}"
        );
    })
    .await;
}

// =======================================================================================
// HELD
// =======================================================================================

/// 12 tasks on 4 clients, watchdog and fixed-lease handles, asks of 1 to 3 of 4, some
/// giving up (`try_acquire_for` of 0–40 ms) and some dropped mid-placement: never more
/// than 4 permits in use, and the queue empty at the end.
#[tokio::test]
async fn held_never_more_permits_in_use_than_the_total_under_give_ups_and_drops() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(client_at(&etcd.url(), Duration::from_secs(5)).await);
    }
    let name = "o:mixed";
    let in_use = InUse::default();
    let (taken, given_up) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    bounded(LIMIT, async {
        assert!(clients[0]
            .permit_semaphore(name)
            .unwrap()
            .try_set_permits(4)
            .await
            .unwrap()
            .is_set());
        let mut tasks = Vec::new();
        for n in 0..12usize {
            let base = clients[n % 4].permit_semaphore(name).unwrap();
            let sem = if n % 3 == 0 {
                base.with_lease(Duration::from_secs(3))
            } else {
                base
            };
            let (in_use, taken, given_up) = (in_use.clone(), taken.clone(), given_up.clone());
            tasks.push(tokio::spawn(async move {
                for round in 0..12u64 {
                    let ask = 1 + ((n as i64 + round as i64) % 3);
                    let permits = match (n + round as usize) % 4 {
                        0 => sem
                            .try_acquire_for(ask, Duration::from_millis(1 + round * 4))
                            .await
                            .unwrap(),
                        1 => {
                            let dropped = tokio::time::timeout(
                                Duration::from_micros(round * 700),
                                sem.acquire(ask),
                            );
                            dropped.await.ok().map(Result::unwrap)
                        }
                        _ => Some(sem.acquire(ask).await.unwrap()),
                    };
                    let Some(permits) = permits else {
                        given_up.fetch_add(1, Ordering::SeqCst);
                        continue;
                    };
                    taken.fetch_add(1, Ordering::SeqCst);
                    let now = in_use.take(ask);
                    assert!(now <= 4, "{now} permits in use of 4");
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    in_use.give(ask);
                    permits.release().await.unwrap();
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        common::eventually(Duration::from_secs(10), "the queue empties", || async {
            sem_queue(port, name).await.is_empty()
        })
        .await;
    })
    .await;
    println!(
        "most in use: {} of 4; {} holdings, {} give-ups or drops",
        in_use.most(),
        taken.load(Ordering::SeqCst),
        given_up.load(Ordering::SeqCst)
    );
    assert!(in_use.most() <= 4 && in_use.most() > 1);
}

/// Strict FIFO across three clients with mixed asks (3, 1, 2, 1, 3, 1 of 3): each holds
/// in the order its key was created, whatever fits earlier.
#[tokio::test]
async fn held_waiters_are_served_strictly_in_creation_order_across_clients() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(client_at(&etcd.url(), Duration::from_secs(10)).await);
    }
    let name = "f:order";
    bounded(LIMIT, async {
        let sem = clients[0].permit_semaphore(name).unwrap();
        assert!(sem.try_set_permits(3).await.unwrap().is_set());
        let blocker = sem.acquire(3).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (n, ask) in [3, 1, 2, 1, 3, 1].into_iter().enumerate() {
            let sem = clients[n % 3].permit_semaphore(name).unwrap();
            let order = order.clone();
            tasks.push(tokio::spawn(async move {
                let permits = sem.acquire(ask).await.unwrap();
                order.lock().unwrap().push(n);
                tokio::time::sleep(Duration::from_millis(30)).await;
                permits.release().await.unwrap();
            }));
            wait_queue_len(port, name, n + 2).await;
        }
        blocker.release().await.unwrap();
        common::join_bounded(Duration::from_secs(30), tasks).await;
        let order = order.lock().unwrap().clone();
        println!("served in order {order:?}");
        // 1 and 2 may hold together, and so may 3 and 4 after them: the order of pushes
        // within such a pair is the tasks' own. No one passes an older key that did not fit.
        let rank = |n: usize| order.iter().position(|&m| m == n).unwrap();
        assert!(rank(0) == 0 && rank(3) > rank(1).min(rank(2)));
        assert!(rank(0) < rank(1) && rank(0) < rank(2));
        assert!(rank(1).max(rank(2)) < rank(4) && rank(3) < rank(4) && rank(4) < rank(5));
    })
    .await;
}

/// A fixed-lease holder that waited (its key moved onto a lease of its own when its turn
/// came, while a waiter behind counted it), then cut off: its lost signal fires before
/// the waiter takes its permit.
#[tokio::test]
async fn held_a_fixed_lease_holder_cut_off_loses_before_another_takes() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let (proxy, through) = proxied(&etcd).await;
    let direct = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let holder = client_at(&through, Duration::from_secs(30)).await;
    let name = "l:fixed";
    bounded(LIMIT, async {
        let sem = direct.permit_semaphore(name).unwrap();
        assert!(sem.try_set_permits(1).await.unwrap().is_set());
        let first = sem.acquire(1).await.unwrap();
        let fixed = holder
            .permit_semaphore(name)
            .unwrap()
            .with_lease(Duration::from_secs(3));
        let fixed_waiter = tokio::spawn(async move { fixed.acquire(1).await.unwrap() });
        wait_queue_len(port, name, 1 + 1).await;
        let waiting = sem.clone();
        let taker = tokio::spawn(async move {
            let taken = waiting.acquire(1).await.unwrap();
            (Instant::now(), taken)
        });
        wait_queue_len(port, name, 3).await;
        first.release().await.unwrap();
        let permits = fixed_waiter.await.unwrap();
        let queue = sem_queue(port, name).await;
        println!("after the fixed-lease take: {queue:?}");
        let ttl = gw(port, "/v3/lease/timetolive", json!({"ID": queue[0].3})).await;
        println!(
            "the fixed holder's key is on a lease granted {} s",
            num(&ttl["grantedTTL"])
        );
        assert!(
            num(&ttl["grantedTTL"]) <= 3,
            "the fixed holder's key is still on its session lease"
        );
        let lost = permits.lost_token();
        let cut_at = Instant::now();
        proxy.blackhole();
        lost.cancelled().await;
        let lost_at = Instant::now();
        let (taken_at, taken) = taker.await.unwrap();
        println!(
            "lost {:?} after the cut, the next took it {:?} after the cut",
            lost_at - cut_at,
            taken_at - cut_at
        );
        assert!(lost_at < taken_at);
        proxy.heal();
        drop(taken);
        drop(permits);
    })
    .await;
}

/// Waiters are woken at once (watchdog 30 s: their retry is 7.5 s) by a give-up ahead of
/// them, by a new total, and by a release.
#[tokio::test]
async fn held_give_ups_new_totals_and_releases_wake_waiters_at_once() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let a = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let b = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let c = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let name = "p:wake";
    bounded(LIMIT, async {
        let sem = a.permit_semaphore(name).unwrap();
        assert!(sem.try_set_permits(2).await.unwrap().is_set());
        let one = sem.acquire(1).await.unwrap();
        // A big ask that gives up at 3 s, and a small ask behind it.
        let big = b.permit_semaphore(name).unwrap();
        let giving_up = tokio::spawn(async move {
            let got = big.try_acquire_for(2, Duration::from_secs(3)).await.unwrap();
            (Instant::now(), got.is_some())
        });
        wait_queue_len(port, name, 2).await;
        let small = c.permit_semaphore(name).unwrap();
        let small_waiter = tokio::spawn(async move {
            let permits = small.acquire(1).await.unwrap();
            (Instant::now(), permits)
        });
        let (gave_up_at, got) = giving_up.await.unwrap();
        assert!(!got);
        let (small_at, small_held) = small_waiter.await.unwrap();
        let after_give_up = small_at.saturating_duration_since(gave_up_at);
        // A new total wakes an ask of 2 behind two holders.
        let bigger = b.permit_semaphore(name).unwrap();
        let new_total = tokio::spawn(async move {
            let permits = bigger.acquire(2).await.unwrap();
            (Instant::now(), permits)
        });
        wait_queue_len(port, name, 3).await;
        let added_at = Instant::now();
        sem.add_permits(2).await.unwrap();
        let (bigger_at, bigger_held) = new_total.await.unwrap();
        let after_total = bigger_at - added_at;
        // A release wakes an ask of all 4.
        let all = c.permit_semaphore(name).unwrap();
        let everything = tokio::spawn(async move {
            let permits = all.acquire(4).await.unwrap();
            (Instant::now(), permits)
        });
        wait_queue_len(port, name, 4).await;
        one.release().await.unwrap();
        small_held.release().await.unwrap();
        let released_at = Instant::now();
        bigger_held.release().await.unwrap();
        let (all_at, all_held) = everything.await.unwrap();
        let after_release = all_at - released_at;
        println!("woken after a give-up {after_give_up:?}, a new total {after_total:?}, a release {after_release:?}");
        for wake in [after_give_up, after_total, after_release] {
            assert!(wake < Duration::from_millis(1500));
        }
        drop(all_held);
    })
    .await;
}

/// Acquisitions dropped at 14 points (waiting behind a holder, and fitting at once) with
/// a 30 s session: no key is left in the queue beyond a moment, and all permits come back
/// within 2 s, not a session TTL later.
#[tokio::test]
async fn held_cancellation_at_any_point_leaves_no_key_behind() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let a = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let b = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let name = "x:cancel";
    bounded(LIMIT, async {
        let sem = a.permit_semaphore(name).unwrap();
        assert!(sem.try_set_permits(2).await.unwrap().is_set());
        let other = b.permit_semaphore(name).unwrap();
        let points = [
            0u64, 30, 100, 250, 500, 800, 1200, 2000, 3000, 5000, 8000, 12_000, 20_000, 40_000,
        ];
        let mut slowest = Duration::ZERO;
        for behind in [true, false] {
            let holder = if behind {
                Some(sem.acquire(2).await.unwrap())
            } else {
                None
            };
            for micros in points {
                drop(tokio::time::timeout(Duration::from_micros(micros), other.acquire(2)).await);
                drop(
                    tokio::time::timeout(
                        Duration::from_micros(micros),
                        other.with_lease(Duration::from_secs(20)).acquire(1),
                    )
                    .await,
                );
            }
            drop(holder);
            let since = Instant::now();
            common::eventually(Duration::from_secs(2), "the queue empties", || async {
                sem_queue(port, name).await.is_empty()
            })
            .await;
            slowest = slowest.max(since.elapsed());
            assert_eq!(sem.available_permits().await.unwrap(), 2);
            let all = sem
                .try_acquire(2)
                .await
                .unwrap()
                .expect("both permits free");
            all.release().await.unwrap();
        }
        println!(
            "queue empty at most {slowest:?} after the last drop (28 drops per round, 2 rounds)"
        );
    })
    .await;
}

/// Names that prefix one another, \x01, braces, unicode and 60 000 bytes, and a lock of
/// the same name: each semaphore of 1 permit is held at once, each is full, and a release
/// of one frees that one only.
#[tokio::test]
async fn held_names_that_prefix_each_other_and_a_lock_of_the_same_name_stay_apart() {
    let etcd = cluster(1).await;
    let client = client_at(&etcd.url(), Duration::from_secs(10)).await;
    let other = client_at(&etcd.url(), Duration::from_secs(10)).await;
    let long = "n".repeat(60_000);
    let names = [
        "a",
        "ab",
        "a\u{1}",
        "a\u{1}b",
        "{a}b",
        "a{b}",
        "ünï€😀",
        "a\u{7f}",
        long.as_str(),
    ];
    bounded(LIMIT, async {
        let lock = client.lock("a").unwrap().lock().await.unwrap();
        let mut held = Vec::new();
        for name in names {
            let sem = client.permit_semaphore(name).unwrap();
            assert!(sem.try_set_permits(1).await.unwrap().is_set(), "{name:.8}");
            held.push(sem.try_acquire(1).await.unwrap().expect("its one permit"));
        }
        for name in names {
            let sem = other.permit_semaphore(name).unwrap();
            assert!(
                sem.try_acquire(1).await.unwrap().is_none(),
                "{name:.8} is full"
            );
            assert_eq!(
                (
                    sem.total_permits().await.unwrap(),
                    sem.available_permits().await.unwrap()
                ),
                (1, 0)
            );
        }
        assert!(client.lock("a").unwrap().is_locked().await.unwrap());
        held.remove(0).release().await.unwrap();
        let free: Vec<i64> = {
            let mut free = Vec::new();
            for name in names {
                free.push(
                    other
                        .permit_semaphore(name)
                        .unwrap()
                        .available_permits()
                        .await
                        .unwrap(),
                );
            }
            free
        };
        println!("free after releasing \"a\": {free:?}");
        assert_eq!(free[0], 1);
        assert!(free[1..].iter().all(|&f| f == 0));
        assert!(client.lock("a").unwrap().is_locked().await.unwrap());
        lock.release().await.unwrap();
    })
    .await;
}

/// 60 concurrent `add_permits(1)` on 3 clients make 60; the total at i64::MAX refuses one
/// more with InvalidArgument and keeps it; a negative total lets nobody in, and raising
/// it wakes a waiter at once.
#[tokio::test]
async fn held_add_permits_races_overflow_and_negative_totals() {
    let etcd = cluster(1).await;
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(client_at(&etcd.url(), Duration::from_secs(30)).await);
    }
    let name = "t:add";
    bounded(LIMIT, async {
        let mut tasks = Vec::new();
        for n in 0..60 {
            let sem = clients[n % 3].permit_semaphore(name).unwrap();
            tasks.push(tokio::spawn(
                async move { sem.add_permits(1).await.unwrap() },
            ));
        }
        common::join_bounded(Duration::from_secs(60), tasks).await;
        let sem = clients[0].permit_semaphore(name).unwrap();
        let total = sem.total_permits().await.unwrap();
        assert_eq!(total, 60, "lost updates");
        assert_eq!(sem.add_permits(i64::MAX - 60).await.unwrap(), i64::MAX);
        let over = sem.add_permits(1).await;
        assert!(
            matches!(over, Err(Error::InvalidArgument { .. })),
            "{over:?}"
        );
        assert_eq!(sem.total_permits().await.unwrap(), i64::MAX);
        let many = sem
            .try_acquire(PermitSemaphore::MAX_PERMITS_PER_CALL)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(sem.available_permits().await.unwrap(), i64::MAX - 10_000);
        many.release().await.unwrap();
        assert_eq!(sem.add_permits(i64::MIN).await.unwrap(), -1);
        assert!(sem.try_acquire(1).await.unwrap().is_none());
        let waiting = clients[1].permit_semaphore(name).unwrap();
        let waiter = tokio::spawn(async move {
            let permits = waiting.acquire(1).await.unwrap();
            (Instant::now(), permits)
        });
        wait_queue_len(etcd.client_ports()[0], name, 1).await;
        let raised_at = Instant::now();
        sem.add_permits(2).await.unwrap();
        let (at, permits) = waiter.await.unwrap();
        println!(
            "60 racing adds made {total}; from -1 to 1: the waiter held after {:?}",
            at - raised_at
        );
        assert!(at - raised_at < Duration::from_millis(1500));
        drop(permits);
    })
    .await;
}

/// 30 racing `try_set_permits(k)` on 3 clients: one sets, every other is told the total
/// the winner set.
#[tokio::test]
async fn held_try_set_permits_races_have_one_winner() {
    let etcd = cluster(1).await;
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(client_at(&etcd.url(), Duration::from_secs(10)).await);
    }
    bounded(LIMIT, async {
        let mut tasks = Vec::new();
        for k in 1..=30i64 {
            let sem = clients[k as usize % 3].permit_semaphore("s:race").unwrap();
            tasks.push(tokio::spawn(async move {
                (k, sem.try_set_permits(k).await.unwrap())
            }));
        }
        let answers = common::join_bounded(Duration::from_secs(30), tasks).await;
        let winners: Vec<i64> = answers
            .iter()
            .filter(|(_, set)| set.is_set())
            .map(|(k, _)| *k)
            .collect();
        assert_eq!(winners.len(), 1, "{answers:?}");
        let total = clients[0]
            .permit_semaphore("s:race")
            .unwrap()
            .total_permits()
            .await
            .unwrap();
        println!("winner {winners:?}, total {total}");
        assert_eq!(total, winners[0]);
        for (_, set) in answers {
            assert!(set.is_set() || set == PermitsSet::Kept { found: total });
        }
    })
    .await;
}

/// 50 waiters on 2 clients for 1 permit (watchdog 30 s): each holds alone, in the order of
/// its key's creation, and the handoffs (each a release that wakes the whole queue's
/// watches) stay quick.
#[tokio::test]
async fn held_fifty_waiters_are_served_in_order_alone_and_quickly() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let a = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let b = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let name = "h:fifty";
    let in_use = InUse::default();
    bounded(LIMIT, async {
        let sem = a.permit_semaphore(name).unwrap();
        assert!(sem.try_set_permits(1).await.unwrap().is_set());
        let blocker = sem.acquire(1).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for n in 0..50 {
            let sem = if n % 2 == 0 { &a } else { &b }
                .permit_semaphore(name)
                .unwrap();
            let (order, in_use) = (order.clone(), in_use.clone());
            tasks.push(tokio::spawn(async move {
                let permits = sem.acquire(1).await.unwrap();
                assert_eq!(in_use.take(1), 1, "two holders at once");
                order
                    .lock()
                    .unwrap()
                    .push(permits.ids().next().unwrap().to_owned());
                tokio::time::sleep(Duration::from_millis(2)).await;
                in_use.give(1);
                permits.release().await.unwrap();
            }));
        }
        wait_queue_len(port, name, 51).await;
        let queued: Vec<String> = sem_queue(port, name)
            .await
            .into_iter()
            .skip(1)
            .map(|kv| kv.0)
            .collect();
        let started = Instant::now();
        blocker.release().await.unwrap();
        common::join_bounded(Duration::from_secs(100), tasks).await;
        let took = started.elapsed();
        let order = order.lock().unwrap().clone();
        println!(
            "50 handoffs in {took:?} ({:?} each); most in use {}",
            took / 50,
            in_use.most()
        );
        assert_eq!(order, queued, "not served in creation order");
        assert!(took / 50 < Duration::from_millis(600));
    })
    .await;
}

/// A waiter cut off past its session lease (its key vanishes) is placed again when back,
/// behind a waiter that queued meanwhile, and is woken by that waiter's release at once:
/// no two hold together, and nothing is left in the queue.
#[tokio::test]
async fn held_a_waiter_whose_session_lease_expired_queues_again_and_is_woken() {
    let etcd = cluster(1).await;
    let port = etcd.client_ports()[0];
    let (proxy, through) = proxied(&etcd).await;
    let direct = client_at(&etcd.url(), Duration::from_secs(30)).await;
    let cut = client_at(&through, Duration::from_secs(8)).await;
    let name = "e:expired";
    bounded(LIMIT, async {
        let sem = direct.permit_semaphore(name).unwrap();
        assert!(sem.try_set_permits(1).await.unwrap().is_set());
        let holder = sem.acquire(1).await.unwrap();
        let waiting = cut.permit_semaphore(name).unwrap();
        let cut_waiter = tokio::spawn(async move {
            let permits = waiting.acquire(1).await.unwrap();
            (Instant::now(), permits)
        });
        wait_queue_len(port, name, 2).await;
        proxy.blackhole();
        wait_queue_len(port, name, 1).await;
        let later = sem.clone();
        let later_waiter = tokio::spawn(async move {
            let permits = later.acquire(1).await.unwrap();
            (Instant::now(), permits)
        });
        wait_queue_len(port, name, 2).await;
        proxy.heal();
        wait_queue_len(port, name, 3).await;
        holder.release().await.unwrap();
        let (later_at, later_permits) = later_waiter.await.unwrap();
        assert!(
            !cut_waiter.is_finished(),
            "the re-placed waiter passed the later one"
        );
        let released_at = Instant::now();
        later_permits.release().await.unwrap();
        let (cut_at, cut_permits) = cut_waiter.await.unwrap();
        println!(
            "re-placed waiter held {:?} after the release (its retry: 2 s)",
            cut_at - released_at
        );
        assert!(cut_at > later_at && cut_at - released_at < Duration::from_millis(1500));
        cut_permits.release().await.unwrap();
        wait_queue_len(port, name, 0).await;
    })
    .await;
}

/// 3 members: 4 tasks on 2 clients cycle 1 or 2 of 2 permits while the leader is killed,
/// then each member restarted in turn: never more than 2 in use.
#[tokio::test]
async fn held_leader_kill_and_rolling_restarts_never_overbook() {
    let mut etcd = cluster(3).await;
    let clients = [
        client_with(&etcd.url(), Duration::from_secs(6), Duration::from_secs(2)).await,
        client_with(&etcd.url(), Duration::from_secs(6), Duration::from_secs(2)).await,
    ];
    let name = "k:leader";
    let in_use = InUse::default();
    let stop = Arc::new(AtomicBool::new(false));
    let (holds, losses, errors) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    assert!(clients[0]
        .permit_semaphore(name)
        .unwrap()
        .try_set_permits(2)
        .await
        .unwrap()
        .is_set());
    let mut tasks = Vec::new();
    for n in 0..4usize {
        let sem = clients[n % 2].permit_semaphore(name).unwrap();
        let (in_use, stop, holds, losses, errors) = (
            in_use.clone(),
            stop.clone(),
            holds.clone(),
            losses.clone(),
            errors.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let ask = 1 + (n % 2) as i64;
            while !stop.load(Ordering::SeqCst) {
                let permits = match sem.try_acquire_for(ask, Duration::from_secs(5)).await {
                    Ok(Some(permits)) => permits,
                    Ok(None) => continue,
                    Err(_) => {
                        errors.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                holds.fetch_add(1, Ordering::SeqCst);
                let now = in_use.take(ask);
                assert!(now <= 2, "{now} permits in use of 2");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(40)) => {}
                    _ = permits.lost() => { losses.fetch_add(1, Ordering::SeqCst); }
                }
                in_use.give(ask);
                let _ = permits.release().await;
            }
        }));
    }
    bounded(Duration::from_secs(150), async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let leader = etcd.leader().await.unwrap();
        etcd.kill(leader).await.unwrap();
        let elected = Instant::now();
        etcd.leader().await.unwrap();
        println!("new leader after {:?}", elected.elapsed());
        tokio::time::sleep(Duration::from_secs(2)).await;
        etcd.restart(leader).await.unwrap();
        for member in 0..3 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            etcd.restart(member).await.unwrap();
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.store(true, Ordering::SeqCst);
        common::join_bounded(Duration::from_secs(60), tasks).await;
    })
    .await;
    println!(
        "most in use {} of 2; {} holds, {} lost, {} failed attempts",
        in_use.most(),
        holds.load(Ordering::SeqCst),
        losses.load(Ordering::SeqCst),
        errors.load(Ordering::SeqCst)
    );
    assert!(in_use.most() <= 2 && holds.load(Ordering::SeqCst) > 10);
}

/// Entry point of the child process of the test below; skipped in a normal run.
#[tokio::test]
#[ignore = "run as a child process by held_a_frozen_holder_process_knows_its_loss_on_waking"]
async fn child_holding_a_permit_reports_its_state() {
    let Ok(url) = std::env::var("REVIEW31_ETCDSEM_CHILD") else {
        panic!("run only as a child process");
    };
    let client = client_at(&url, Duration::from_secs(2)).await;
    let sem = client.permit_semaphore("z:frozen").unwrap();
    let _ = sem.try_set_permits(1).await.unwrap();
    let permits = sem.acquire(1).await.unwrap();
    println!("CHILD HELD");
    let give_up = Instant::now() + Duration::from_secs(60);
    while Instant::now() < give_up {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let lost = permits.is_lost() || permits.lease_remaining().is_zero();
        println!("CHILD AT {nanos} {}", u8::from(lost));
        if lost {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(permits);
}

/// A holder process frozen with SIGSTOP past its session lease: another client takes the
/// permit once the lease is gone; the holder, woken, never reports the permit as held at
/// a moment after that (every line it prints after the other took it says lost).
#[tokio::test]
async fn held_a_frozen_holder_process_knows_its_loss_on_waking() {
    let etcd = cluster(1).await;
    let other = client_at(&etcd.url(), Duration::from_secs(10)).await;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child_holding_a_permit_reports_its_state",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("REVIEW31_ETCDSEM_CHILD", etcd.url())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    let (lines_tx, mut lines_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let outcome = bounded(LIMIT, async {
        loop {
            let line = lines_rx.recv().await.expect("the child's output");
            if line.contains("CHILD HELD") {
                break;
            }
        }
        let signal = |what: &str| {
            assert!(std::process::Command::new("kill")
                .args([what, &pid])
                .status()
                .unwrap()
                .success())
        };
        signal("-STOP");
        let sem = other.permit_semaphore("z:frozen").unwrap();
        let frozen_at = Instant::now();
        let taken = sem.acquire(1).await.unwrap();
        let taken_nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        println!("taken {:?} after the freeze", frozen_at.elapsed());
        tokio::time::sleep(Duration::from_millis(500)).await;
        signal("-CONT");
        let (mut after, mut held_after) = (0, 0);
        loop {
            let line = lines_rx.recv().await.expect("the child's output");
            let Some(rest) = line.strip_prefix("CHILD AT ") else {
                continue;
            };
            let (at, lost) = rest.split_once(' ').unwrap();
            if at.parse::<u128>().unwrap() > taken_nanos {
                after += 1;
                held_after += usize::from(lost == "0");
            }
            if lost == "1" {
                break;
            }
        }
        drop(taken);
        (after, held_after)
    })
    .await;
    let _ = child.kill();
    let _ = child.wait();
    println!(
        "the woken holder's reports after the take: {} ({} saying held)",
        outcome.0, outcome.1
    );
    assert_eq!(outcome.1, 0);
}
