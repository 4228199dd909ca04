//! Review 31: a hostile review of the permit semaphore on PostgreSQL (feature `postgres`,
//! commit 254648b). Each test is bounded (< 60 s) and starts its own private PostgreSQL.
//!
//! Tests named `break_*` show a defect: they assert what the docs promise (or a user would
//! expect) and fail on 254648b. Tests named `held_*` tried to break something and found
//! it holding; they pass. Every test prints its figures (run with --nocapture).

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::process::Stdio;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pg::{client_at, signal, Pg};
use common::{bounded, join_bounded};
use distlock::{Client, Error, LeasedPermits, PermitsSet, ReleaseOutcome};
use distlock_testkit::{monotonic_ns, Direction, FaultProxy};
use sqlx::Executor;
use tokio::io::{AsyncBufReadExt, BufReader};

const LIMIT: Duration = Duration::from_secs(58);

/// The live permit rows of semaphore `name`: (rows, permits), on the database's clock.
async fn live(admin: &sqlx::PgPool, name: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*), coalesce(sum(permits), 0)::bigint FROM distlock_permits \
         WHERE name = $1 AND expires_at > clock_timestamp()",
    )
    .bind(name)
    .fetch_one(admin)
    .await
    .unwrap()
}

/// The owners of the live permit rows of `name`.
async fn live_owners(admin: &sqlx::PgPool, name: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT owner FROM distlock_permits WHERE name = $1 AND expires_at > clock_timestamp() \
         ORDER BY owner",
    )
    .bind(name)
    .fetch_all(admin)
    .await
    .unwrap()
}

/// A small xorshift generator: the tests need spread, not quality.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// A transaction holding semaphore `name`'s row, as a long one of the application would.
async fn hold_row(admin: &sqlx::PgPool, name: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut blocker = admin.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM distlock_semaphores WHERE name = $1 FOR UPDATE")
        .bind(name)
        .execute(&mut *blocker)
        .await
        .unwrap();
    blocker
}

/// The ids of what an acquisition answered.
fn ids(held: &Option<LeasedPermits>) -> Vec<String> {
    held.iter()
        .flat_map(|p| p.ids().map(str::to_owned))
        .collect()
}

fn proxy_url(proxy: &FaultProxy) -> String {
    format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port())
}

// =======================================================================================
// Breaks
// =======================================================================================

/// docs/safety.md: "Releases and new totals notify the semaphore's own channel with the
/// free count, which wakes the client's waiters whose asks fit". A waiter's fallback
/// timer is the soonest live lease it saw at its last attempt (acquire.sql's `left_ms`),
/// and is never moved again. Here a waiter asks for 2 of 2 while a watchdog holder (30 s
/// lease) holds 1; then a second permit is taken with a 400 ms fixed lease; the watchdog
/// holder releases (the message says 1 free: the waiter's ask does not fit, it sleeps
/// on); the fixed lease runs out 400 ms later, silently. Both permits are free from then
/// on, and the waiter sleeps until the old 30 s hint.
#[tokio::test]
async fn break_a_waiter_sleeps_through_permits_a_fixed_lease_gave_back() {
    let pg = Pg::start(&[]).await;
    let holders = client_at(&pg.url(), Duration::from_secs(30)).await;
    let waiters = client_at(&pg.url(), Duration::from_secs(30)).await;
    let name = "sem:stale-hint";
    bounded(LIMIT, async {
        let sem = holders.permit_semaphore(name).unwrap();
        assert!(sem.try_set_permits(2).await.unwrap().is_set());
        let long = sem.acquire(1).await.unwrap();
        let wanting = waiters.permit_semaphore(name).unwrap();
        let started = Instant::now();
        let waiting = tokio::spawn(async move {
            let got = wanting
                .try_acquire_for(2, Duration::from_secs(8))
                .await
                .unwrap();
            (got, started.elapsed())
        });
        tokio::time::sleep(Duration::from_millis(400)).await;
        let short = sem
            .with_lease(Duration::from_millis(400))
            .try_acquire(1)
            .await
            .unwrap()
            .expect("the second permit is free");
        let short_ends = started.elapsed() + Duration::from_millis(400);
        assert_eq!(long.release().await.unwrap(), ReleaseOutcome::Released);
        let (got, after) = waiting.await.unwrap();
        println!(
            "both permits free from {short_ends:?} on; the waiter {} at {after:?}",
            if got.is_some() { "held" } else { "gave up" }
        );
        assert!(
            got.is_some() && after < short_ends + Duration::from_millis(1500),
            "the waiter for 2 permits was not woken when the fixed lease ran out at \
             {short_ends:?}: {} after {after:?} (it sleeps to the 30 s hint)",
            if got.is_some() {
                "held"
            } else {
                "still waiting"
            }
        );
        drop(short);
    })
    .await;
}

/// LeasedPermits::verify: "false, and the lost signal fired, when one is gone (its lease
/// ran out on the server, the semaphore was deleted, or ...)"; docs/safety.md: "a
/// semaphore whose row was deleted by hand loses its permits at their next renewal". On
/// PostgreSQL verify.sql checks the permit row alone: after the semaphore's row is
/// deleted it answers true, and the next renewal (renew.sql joins distlock_semaphores)
/// fires the lost signal: the one-round-trip check and the watchdog disagree.
#[tokio::test]
async fn break_verify_says_held_after_the_semaphore_row_is_deleted() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let client = client_at(&pg.url(), Duration::from_millis(1500)).await;
    let name = "sem:row-deleted";
    bounded(LIMIT, async {
        let sem = client.permit_semaphore(name).unwrap();
        let _ = sem.try_set_permits(1).await.unwrap();
        let permits = sem.acquire(1).await.unwrap();
        sqlx::query("DELETE FROM distlock_semaphores WHERE name = $1")
            .bind(name)
            .execute(&admin)
            .await
            .unwrap();
        let verified = permits.verify().await.unwrap();
        let deleted = Instant::now();
        let lost = tokio::time::timeout(Duration::from_secs(3), permits.lost())
            .await
            .is_ok();
        println!(
            "after the row's deletion: verify {verified}; lost signal {} ({:?} later)",
            if lost { "fired" } else { "silent" },
            deleted.elapsed()
        );
        assert!(
            !(verified && lost),
            "verify() said the permits were held after the semaphore's row was deleted, and \
             the watchdog declared them lost {:?} later",
            deleted.elapsed()
        );
        drop(permits);
    })
    .await;
}

/// docs/safety.md: "An acquisition whose reply was lost gives back its row (each attempt
/// is a new owner)". The give-back (`forget`, a release by owner on the upkeep pool) is
/// sent on another connection than the acquisition. When the acquisition's statement is
/// still on its way (a slow TCP segment; here the proxy's one-way delay, lowered while it
/// is in flight), the give-back reaches the database first, finds no row and does
/// nothing; the statement then lands and takes a permit for an owner nobody renews or
/// releases: it stays taken for the whole lease (the watchdog's, 10 s here).
#[tokio::test]
async fn break_a_give_back_that_overtakes_its_acquisition_leaves_a_permit_taken() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let proxy = FaultProxy::start(SocketAddr::from((Ipv4Addr::LOCALHOST, pg.port)))
        .await
        .unwrap();
    let client = client_at(&proxy_url(&proxy), Duration::from_secs(10)).await;
    bounded(LIMIT, async {
        // Rounds until one shows it: the delayed statement runs only if its connection
        // had it prepared (else it waits for its Parse's answer, and is never sent) and
        // was not pinged first.
        let mut rounds = Vec::new();
        for round in 0..5 {
            let name = format!("sem:overtaken:{round}");
            let sem = client.permit_semaphore(name.as_str()).unwrap();
            let _ = sem.try_set_permits(2).await.unwrap();
            for _ in 0..3 {
                let tries = (0..8).map(|_| {
                    let sem = sem.clone();
                    tokio::spawn(async move { sem.try_acquire(1).await.unwrap() })
                });
                join_bounded(LIMIT, tries.collect()).await;
            }
            // Used just now: not pinged first (a connection idle 250 ms is, and the ping
            // would be what the delay holds up).
            for _ in 0..3 {
                drop(sem.try_acquire(1).await.unwrap());
            }
            proxy.set_delay_in(Direction::ToServer, Duration::from_millis(1500));
            let sent = Instant::now();
            let trying = sem.clone();
            let attempt =
                tokio::spawn(
                    async move { trying.try_acquire_for(1, Duration::from_secs(5)).await },
                );
            tokio::time::sleep(Duration::from_millis(150)).await;
            proxy.set_delay_in(Direction::ToServer, Duration::ZERO);
            let held = attempt.await.unwrap().unwrap();
            tokio::time::sleep_until((sent + Duration::from_millis(2500)).into()).await;
            let (mine, owners) = (ids(&held), live_owners(&admin, &name).await);
            let (_, taken) = live(&admin, &name).await;
            let free = sem.available_permits().await.unwrap();
            let left: f64 = sqlx::query_scalar(
                "SELECT coalesce(extract(epoch FROM max(expires_at) - clock_timestamp()), 0)\
                 ::float8 FROM distlock_permits WHERE name = $1",
            )
            .bind(&name)
            .fetch_one(&admin)
            .await
            .unwrap();
            println!(
                "round {round}: held by the caller: {mine:?}; live rows: {owners:?}; free: \
                 {free}; the last row runs out in {left:.1} s"
            );
            rounds.push((taken, mine.len() as i64, owners, free));
            drop(held);
            if taken != mine.len() as i64 {
                break;
            }
        }
        let (taken, mine, owners, free) = rounds.pop().unwrap();
        assert_eq!(
            taken, mine,
            "{taken} permit(s) taken while the caller holds {mine}: rows {owners:?}, free {free}"
        );
    })
    .await;
}

// =======================================================================================
// Held
// =======================================================================================

/// Three clients with different watchdogs (0.8 s, 2 s, 5 s), 12 tasks asking 1–3 of 5
/// permits with watchdog and fixed leases, no patience, short patience, and cancelled
/// waits: never more than 5 in use by the holders' count, nor in the table.
#[tokio::test]
async fn held_never_oversubscribed_under_churn_and_mixed_watchdogs() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let mut clients = Vec::new();
    for watchdog in [800, 2000, 5000] {
        clients.push(client_at(&pg.url(), Duration::from_millis(watchdog)).await);
    }
    let name = "sem:churn";
    let total = 5;
    let _ = clients[0]
        .permit_semaphore(name)
        .unwrap()
        .try_set_permits(total)
        .await
        .unwrap();
    // In use, most in use, holds over the total, holds, holds lost while held.
    let stats: Arc<[AtomicI64; 5]> = Arc::new(Default::default());
    let [in_use, most, over, holds, lost] = [0, 1, 2, 3, 4];
    let end = Instant::now() + Duration::from_secs(8);
    let mut tasks = Vec::new();
    for task in 0..12u64 {
        let sem = clients[task as usize % 3].permit_semaphore(name).unwrap();
        let stats = stats.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((task + 1) * 7919));
            while Instant::now() < end {
                let ask = 1 + rng.below(3) as i64;
                let fixed = rng.below(3) == 0;
                let handle = if fixed {
                    sem.with_lease(Duration::from_secs(1))
                } else {
                    sem.clone()
                };
                let got = match rng.below(3) {
                    0 => handle.try_acquire(ask).await.unwrap(),
                    1 => handle
                        .try_acquire_for(ask, Duration::from_millis(300))
                        .await
                        .unwrap(),
                    _ => tokio::time::timeout(
                        Duration::from_millis(rng.below(40)),
                        handle.acquire(ask),
                    )
                    .await
                    .map(Result::unwrap)
                    .ok(),
                };
                let Some(permits) = got else { continue };
                let now = stats[in_use].fetch_add(ask, Ordering::SeqCst) + ask;
                stats[most].fetch_max(now, Ordering::SeqCst);
                if now > total {
                    stats[over].fetch_add(1, Ordering::SeqCst);
                }
                stats[holds].fetch_add(1, Ordering::SeqCst);
                let hold = Duration::from_millis(rng.below(60));
                let was_lost = tokio::select! {
                    _ = tokio::time::sleep(hold) => false,
                    _ = permits.lost() => true,
                };
                stats[in_use].fetch_sub(ask, Ordering::SeqCst);
                if was_lost {
                    stats[lost].fetch_add(1, Ordering::SeqCst);
                }
                if rng.below(2) == 0 {
                    permits.release().await.unwrap();
                } else {
                    drop(permits);
                }
            }
        }));
    }
    let sampling = {
        let admin = admin.clone();
        tokio::spawn(async move {
            let (mut samples, mut most) = (0, 0);
            while Instant::now() < end {
                let (_, taken) = live(&admin, name).await;
                most = most.max(taken);
                samples += 1;
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
            (samples, most)
        })
    };
    join_bounded(LIMIT, tasks).await;
    let (samples, table_most) = sampling.await.unwrap();
    let [held, most_in_use, oversubscribed, lost_held] =
        [holds, most, over, lost].map(|at| stats[at].load(Ordering::SeqCst));
    println!(
        "{held} holds, at most {most_in_use} in use by the holders' count, {oversubscribed} \
         over {total}; table: at most {table_most} taken in {samples} samples; {lost_held} \
         lost while held"
    );
    assert_eq!(oversubscribed, 0, "oversubscribed");
    assert!(
        table_most <= total,
        "the table had {table_most} taken of {total}"
    );
    assert!(held > 50, "too few holds to mean anything");
    bounded(Duration::from_secs(5), async {
        while live(&admin, name).await.1 != 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
}

/// 40 semaphores, 3 clients whose watchdogs (0.6 s) renew batches spanning many of them,
/// 24 tasks each holding two permits of two random semaphores at once while taking,
/// releasing and adding permits: no deadlock in the server's log, no error.
#[tokio::test]
async fn held_renewal_batches_and_acquisitions_across_many_semaphores_never_deadlock() {
    let pg = Pg::start(&["deadlock_timeout=100ms"]).await;
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(client_at(&pg.url(), Duration::from_millis(600)).await);
    }
    let names: Vec<String> = (0..40).map(|i| format!("sem:many:{i:02}")).collect();
    for name in &names {
        let _ = clients[0]
            .permit_semaphore(name.as_str())
            .unwrap()
            .try_set_permits(2)
            .await
            .unwrap();
    }
    let end = Instant::now() + Duration::from_secs(8);
    let (cycles, errors) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut tasks = Vec::new();
    for task in 0..24u64 {
        let client: Client = clients[task as usize % 3].clone();
        let names = names.clone();
        let (cycles, errors) = (cycles.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ ((task + 1) * 104_729));
            while Instant::now() < end {
                let a = client
                    .permit_semaphore(names[rng.below(40) as usize].as_str())
                    .unwrap();
                let b = client
                    .permit_semaphore(names[rng.below(40) as usize].as_str())
                    .unwrap();
                let first = a.try_acquire_for(1, Duration::from_millis(200)).await;
                let second = b.try_acquire_for(1, Duration::from_millis(200)).await;
                if rng.below(8) == 0 {
                    let c = client
                        .permit_semaphore(names[rng.below(40) as usize].as_str())
                        .unwrap();
                    if c.add_permits(1).await.is_err() || c.add_permits(-1).await.is_err() {
                        errors.fetch_add(1, Ordering::SeqCst);
                    }
                }
                tokio::time::sleep(Duration::from_millis(rng.below(250))).await;
                for got in [first, second] {
                    match got {
                        Ok(Some(permits)) => {
                            if permits.release().await.is_err() {
                                errors.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                        Ok(None) => {}
                        Err(_) => {
                            errors.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                cycles.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }
    join_bounded(LIMIT, tasks).await;
    let deadlocks = pg.deadlocks();
    println!(
        "{} cycles on 40 semaphores, {} errors, {} deadlocks in the server's log",
        cycles.load(Ordering::SeqCst),
        errors.load(Ordering::SeqCst),
        deadlocks.len()
    );
    assert!(
        deadlocks.is_empty(),
        "deadlocks:\n{}",
        deadlocks.join("\n---\n")
    );
    assert_eq!(errors.load(Ordering::SeqCst), 0);
    assert!(cycles.load(Ordering::SeqCst) > 100);
}

/// A renewal and an acquisition queued behind the semaphore's row (held by another
/// transaction) around the holder's lease end, in either order: the permit is never both
/// renewed and taken by the other, and the holder's loss comes first.
#[tokio::test]
async fn held_a_renewal_at_the_lease_edge_never_revives_a_counted_permit() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let holders = client_at(&pg.url(), Duration::from_millis(600)).await;
    let others = client_at(&pg.url(), Duration::from_secs(5)).await;
    let name = "sem:edge";
    bounded(LIMIT, async {
        let sem = holders.permit_semaphore(name).unwrap();
        let _ = sem.try_set_permits(1).await.unwrap();
        let (mut taken, mut kept) = (0, 0);
        for blocked_ms in [450u64, 550, 600, 650, 700, 800, 500, 620] {
            let permits = sem.acquire(1).await.unwrap();
            tokio::time::sleep(Duration::from_millis(blocked_ms % 200)).await;
            let lost = permits.lost_token();
            let lost_at = tokio::spawn(async move {
                lost.cancelled().await;
                monotonic_ns()
            });
            let blocker = hold_row(&admin, name).await;
            let other = others.permit_semaphore(name).unwrap();
            let taking = tokio::spawn(async move {
                let got = other.try_acquire_for(1, Duration::from_secs(3)).await.unwrap();
                (got, monotonic_ns())
            });
            tokio::time::sleep(Duration::from_millis(blocked_ms)).await;
            blocker.commit().await.unwrap();
            let (got, got_at) = taking.await.unwrap();
            let (_, in_table) = live(&admin, name).await;
            assert!(in_table <= 1, "{in_table} permits taken of 1 (blocked {blocked_ms} ms)");
            match got {
                Some(theirs) => {
                    let lost_at = bounded(Duration::from_secs(1), lost_at).await.unwrap();
                    assert!(lost_at <= got_at, "the other held before the holder's loss");
                    assert!(!permits.verify().await.unwrap());
                    taken += 1;
                    drop(theirs);
                }
                None => {
                    assert!(!permits.is_lost() && permits.verify().await.unwrap());
                    kept += 1;
                    lost_at.abort();
                }
            }
            drop(permits);
            while live(&admin, name).await.1 != 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        println!("{taken} rounds the other took the permit after the holder's loss, {kept} the holder kept it");
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// A holder in a process of its own: frozen with SIGSTOP, killed with kill -9.
// ---------------------------------------------------------------------------------------

#[tokio::test]
#[ignore = "run as a child process by the tests below"]
async fn review31_pgsem_child() {
    let Ok(url) = std::env::var("REVIEW31_PGSEM_URL") else {
        panic!("review31_pgsem_child runs only as a child process");
    };
    let client = client_at(&url, Duration::from_millis(1000)).await;
    let permits = client
        .permit_semaphore("sem:child")
        .unwrap()
        .acquire(2)
        .await
        .unwrap();
    println!("HELD");
    if std::env::var("REVIEW31_PGSEM_TICK").is_ok() {
        loop {
            let at = monotonic_ns();
            if permits.is_lost() {
                println!("LOST {at}");
                break;
            }
            println!("OK {at}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    std::future::pending::<()>().await;
}

/// The child holding both permits of "sem:child"; its stdout's lines.
async fn child(
    pg: &Pg,
    tick: bool,
) -> (
    tokio::process::Child,
    tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
) {
    let mut command = tokio::process::Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--exact",
            "review31_pgsem_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("REVIEW31_PGSEM_URL", pg.url())
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    if tick {
        command.env("REVIEW31_PGSEM_TICK", "1");
    }
    let mut process = command.spawn().unwrap();
    let mut lines = BufReader::new(process.stdout.take().unwrap()).lines();
    loop {
        let line = lines.next_line().await.unwrap().expect("the child holds");
        if line.contains("HELD") {
            break;
        }
    }
    (process, lines)
}

/// The holder's process frozen past its lease; another takes both permits; the holder is
/// thawed: it never trusts its permits after the freeze began.
#[tokio::test]
async fn held_a_frozen_holder_distrusts_its_permits_when_thawed() {
    let pg = Pg::start(&[]).await;
    let client = client_at(&pg.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let _ = client.permit_semaphore("sem:child").unwrap().try_set_permits(2).await.unwrap();
        let (process, mut lines) = child(&pg, true).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        signal(process.id().unwrap(), "STOP");
        let frozen_ns = monotonic_ns();
        let mine = client.permit_semaphore("sem:child").unwrap().acquire(2).await.unwrap();
        let held_ns = monotonic_ns();
        signal(process.id().unwrap(), "CONT");
        let mut trusted_after = Vec::new();
        loop {
            let line = lines.next_line().await.unwrap().expect("the child goes on");
            let Some(ns) = line.split_whitespace().last().and_then(|ns| ns.parse::<u64>().ok()) else {
                continue;
            };
            if line.starts_with("LOST") {
                break;
            }
            if line.starts_with("OK") && ns >= frozen_ns {
                trusted_after.push(ns);
            }
        }
        println!(
            "both permits taken {} ms after the freeze; ticks trusted after it: {}",
            (held_ns - frozen_ns) / 1_000_000,
            trusted_after.len()
        );
        assert!(
            trusted_after.iter().all(|&ns| ns < frozen_ns + 5_000_000),
            "the thawed holder trusted its permits at {trusted_after:?}; another held from {held_ns}"
        );
        mine.release().await.unwrap();
    })
    .await;
}

/// kill -9 of the holder of both permits: a waiter on another client has one within the
/// holder's 1 s lease (plus slack), with no release message to wake it.
#[tokio::test]
async fn held_a_killed_holders_permits_reach_a_waiter_within_its_lease() {
    let pg = Pg::start(&[]).await;
    let client = client_at(&pg.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let sem = client.permit_semaphore("sem:child").unwrap();
        let _ = sem.try_set_permits(2).await.unwrap();
        let (mut process, _lines) = child(&pg, false).await;
        let waiting = tokio::spawn(async move { sem.acquire(2).await.unwrap() });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !waiting.is_finished(),
            "the waiter took permits a live holder held"
        );
        process.start_kill().unwrap();
        process.wait().await.unwrap();
        let killed = Instant::now();
        let permits = bounded(Duration::from_secs(5), waiting).await.unwrap();
        println!(
            "the waiter held {:?} after the kill (lease 1 s)",
            killed.elapsed()
        );
        assert!(killed.elapsed() < Duration::from_millis(2000));
        permits.release().await.unwrap();
    })
    .await;
}

/// Four holders of all four permits behind a blackholed link: each learns of its loss
/// before another client (direct) holds all four.
#[tokio::test]
async fn held_cut_off_holders_of_every_permit_learn_before_another_takes_them() {
    let pg = Pg::start(&[]).await;
    let proxy = FaultProxy::start(SocketAddr::from((Ipv4Addr::LOCALHOST, pg.port)))
        .await
        .unwrap();
    let cut_off = client_at(&proxy_url(&proxy), Duration::from_millis(1500)).await;
    let direct = client_at(&pg.url(), Duration::from_secs(5)).await;
    let name = "sem:cut-off";
    bounded(LIMIT, async {
        let sem = cut_off.permit_semaphore(name).unwrap();
        let _ = sem.try_set_permits(4).await.unwrap();
        let mut holders = Vec::new();
        for _ in 0..4 {
            holders.push(sem.acquire(1).await.unwrap());
        }
        let losses: Vec<_> = holders
            .iter()
            .map(|held| {
                let token = held.lost_token();
                tokio::spawn(async move {
                    token.cancelled().await;
                    monotonic_ns()
                })
            })
            .collect();
        let other = direct.permit_semaphore(name).unwrap();
        let taking = tokio::spawn(async move {
            let permits = other.acquire(4).await.unwrap();
            (monotonic_ns(), permits)
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let cut_at = monotonic_ns();
        proxy.blackhole();
        let (held_at, theirs) = bounded(Duration::from_secs(10), taking).await.unwrap();
        let lost_at: Vec<u64> = join_bounded(Duration::from_secs(1), losses).await;
        println!(
            "losses {:?} ms after the cut; the other held at {} ms",
            lost_at
                .iter()
                .map(|at| (at - cut_at) / 1_000_000)
                .collect::<Vec<_>>(),
            (held_at - cut_at) / 1_000_000
        );
        assert!(
            lost_at.iter().all(|&at| at < held_at),
            "a holder learned of its loss late"
        );
        proxy.heal();
        theirs.release().await.unwrap();
        drop(holders);
    })
    .await;
}

/// Acquisitions and releases cancelled at random points (0–15 ms, including mid-round-
/// trip and mid-wait), 200 times, with 30 s watchdog leases: nothing stays taken.
#[tokio::test]
async fn held_cancellation_at_random_points_leaves_no_permit_taken() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let client = client_at(&pg.url(), Duration::from_secs(30)).await;
    let other = client_at(&pg.url(), Duration::from_secs(30)).await;
    let name = "sem:cancelled";
    bounded(LIMIT, async {
        let sem = client.permit_semaphore(name).unwrap();
        let _ = sem.try_set_permits(3).await.unwrap();
        let blocker_sem = other.permit_semaphore(name).unwrap();
        let mut rng = Rng(0x1234_5678_9abc_def1);
        let (mut cut, mut kept) = (0, 0);
        for round in 0..200 {
            // Half the rounds, two permits are held elsewhere: an ask of 2 waits.
            let blocker = if round % 2 == 0 { blocker_sem.try_acquire(2).await.unwrap() } else { None };
            let ask = 1 + rng.below(2) as i64;
            let patience = Duration::from_micros(rng.below(15_000));
            match tokio::time::timeout(patience, sem.acquire(ask)).await {
                Ok(permits) => {
                    kept += 1;
                    let permits = permits.unwrap();
                    let _ = tokio::time::timeout(
                        Duration::from_micros(rng.below(3_000)),
                        permits.release(),
                    )
                    .await;
                }
                Err(_) => cut += 1,
            }
            drop(blocker);
        }
        let settled = Instant::now();
        while live(&admin, name).await.1 != 0 && settled.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (rows, taken) = live(&admin, name).await;
        println!("{cut} acquisitions cut, {kept} completed (releases cut at random); {rows} rows with {taken} permits live 5 s later");
        assert_eq!(taken, 0, "permits stayed taken: {:?}", live_owners(&admin, name).await);
        assert_eq!(sem.available_permits().await.unwrap(), 3);
    })
    .await;
}

/// Acquisitions stuck behind a transaction holding the semaphore's row past the response
/// timeout (three attempts fail with no answer, and their give-backs with them), then the
/// row is free: one permit row is left, the caller's.
#[tokio::test]
async fn held_acquisitions_whose_replies_were_lost_leave_only_the_callers_row() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let client = client_at(&pg.url(), Duration::from_secs(20)).await;
    let name = "sem:lost-replies";
    bounded(LIMIT, async {
        let sem = client.permit_semaphore(name).unwrap();
        let _ = sem.try_set_permits(1).await.unwrap();
        let blocker = hold_row(&admin, name).await;
        let trying = sem.clone();
        let attempt =
            tokio::spawn(async move { trying.try_acquire_for(1, Duration::from_secs(8)).await });
        tokio::time::sleep(Duration::from_millis(1700)).await;
        blocker.commit().await.unwrap();
        let held = attempt.await.unwrap().unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let owners = live_owners(&admin, name).await;
        let mine = ids(&held);
        println!("held: {mine:?}; live rows: {owners:?}");
        assert!(!mine.is_empty(), "the caller gave up with the permit free");
        assert_eq!(owners, mine);
        held.unwrap().release().await.unwrap();
        assert_eq!(sem.available_permits().await.unwrap(), 1);
    })
    .await;
}

/// Names with braces, empty parts, quotes, control and non-ASCII characters, and 2048
/// bytes, all held at once (one renewal batch) past three leases: each renews, verifies,
/// counts and releases; a 2049-byte name is a typed error.
#[tokio::test]
async fn held_odd_names() {
    let pg = Pg::start(&[]).await;
    let client = client_at(&pg.url(), Duration::from_millis(600)).await;
    let long = "ü".repeat(1024);
    let names: Vec<String> = [
        "{",
        "}",
        "{}",
        "a{b}c",
        "{x}",
        "::",
        " ",
        "'; DROP TABLE distlock_permits; --",
        "\"\\%_",
        "é🚀名前",
        "x\u{1}permits",
        "\u{7f}\u{202e}",
        long.as_str(),
    ]
    .iter()
    .map(|name| (*name).to_owned())
    .collect();
    bounded(LIMIT, async {
        let mut held = Vec::new();
        let mut refused = Vec::new();
        for name in &names {
            let sem = match client.permit_semaphore(name.as_str()) {
                Ok(sem) => sem,
                Err(Error::InvalidName { .. }) => {
                    refused.push(name.escape_debug().to_string());
                    continue;
                }
                Err(err) => panic!("{name:?}: {err}"),
            };
            assert!(sem.try_set_permits(2).await.unwrap().is_set(), "{name:?}");
            held.push((name.clone(), sem.acquire(2).await.unwrap(), sem));
        }
        tokio::time::sleep(Duration::from_millis(2000)).await;
        for (name, permits, sem) in held.drain(..) {
            assert!(
                !permits.is_lost() && permits.verify().await.unwrap(),
                "{name:?} lost"
            );
            assert_eq!(sem.available_permits().await.unwrap(), 0, "{name:?}");
            assert_eq!(sem.total_permits().await.unwrap(), 2, "{name:?}");
            assert_eq!(
                permits.release().await.unwrap(),
                ReleaseOutcome::Released,
                "{name:?}"
            );
            assert_eq!(sem.available_permits().await.unwrap(), 2, "{name:?}");
        }
        let too_long = "ü".repeat(1024) + "x";
        let refused_long = matches!(
            client.permit_semaphore(too_long),
            Err(Error::InvalidName { .. })
        );
        assert!(matches!(
            client.permit_semaphore(""),
            Err(Error::InvalidName { .. })
        ));
        println!(
            "{} odd names held and renewed past 3 leases; refused by name checks: {refused:?}; \
             a 2049-byte name refused: {refused_long}",
            names.len() - refused.len()
        );
        assert!(refused_long);
        assert!(refused.len() < names.len() / 2);
    })
    .await;
}

/// Zero, negative, i64::MAX and i64::MIN totals, adds that overflow, asks out of range:
/// typed errors or exact counts, nothing half-written, the semaphore still usable.
#[tokio::test]
async fn held_counts_at_the_extremes() {
    let pg = Pg::start(&[]).await;
    let client = client_at(&pg.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let zero = client.permit_semaphore("sem:zero").unwrap();
        assert!(matches!(
            zero.try_set_permits(-1).await,
            Err(Error::InvalidArgument { .. })
        ));
        assert_eq!(zero.total_permits().await.unwrap(), 0);
        assert!(zero.try_set_permits(0).await.unwrap().is_set());
        assert!(zero.try_acquire(1).await.unwrap().is_none());
        for ask in [0, -1, 10_001, i64::MAX, i64::MIN] {
            assert!(
                matches!(
                    zero.try_acquire(ask).await,
                    Err(Error::InvalidArgument { .. })
                ),
                "ask {ask}"
            );
        }
        let waiting = {
            let zero = zero.clone();
            tokio::spawn(async move { zero.acquire(1).await.unwrap() })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let added = Instant::now();
        assert_eq!(zero.add_permits(1).await.unwrap(), 1);
        let woken = bounded(Duration::from_secs(3), waiting).await.unwrap();
        let woke_in = added.elapsed();
        drop(woken);

        let max = client.permit_semaphore("sem:max").unwrap();
        assert!(max.try_set_permits(i64::MAX).await.unwrap().is_set());
        let many = max.acquire(10_000).await.unwrap();
        assert_eq!(max.available_permits().await.unwrap(), i64::MAX - 10_000);
        let overflow = max.add_permits(i64::MAX).await;
        assert!(
            overflow.is_err(),
            "adding i64::MAX to i64::MAX answered {overflow:?}"
        );
        assert_eq!(max.total_permits().await.unwrap(), i64::MAX);
        assert_eq!(
            max.try_set_permits(1).await.unwrap(),
            PermitsSet::Kept { found: i64::MAX }
        );
        assert_eq!(many.release().await.unwrap(), ReleaseOutcome::Released);
        assert_eq!(max.available_permits().await.unwrap(), i64::MAX);

        let min = client.permit_semaphore("sem:min").unwrap();
        assert_eq!(min.add_permits(i64::MIN).await.unwrap(), i64::MIN);
        assert_eq!(min.available_permits().await.unwrap(), i64::MIN);
        assert!(min.try_acquire(1).await.unwrap().is_none());
        assert!(min.add_permits(-1).await.is_err());
        assert_eq!(min.add_permits(i64::MAX).await.unwrap(), -1);
        assert_eq!(min.add_permits(2).await.unwrap(), 1);
        let one = min.try_acquire(1).await.unwrap().expect("one free");
        assert_eq!(min.available_permits().await.unwrap(), 0);
        println!(
            "zero total: a waiter woken {woke_in:?} after add_permits(1); i64::MAX + i64::MAX: \
             {}; i64::MIN total then -1 refused, back to 1 free",
            overflow.unwrap_err()
        );
        one.release().await.unwrap();
    })
    .await;
}

/// Ten clients connecting together to an empty database (racing the schema's creation),
/// then setting ten different totals at once: one sets, nine report its total; a waiter
/// that started before any total is woken.
#[tokio::test]
async fn held_try_set_permits_raced_by_clients_starting_together() {
    let pg = Pg::start(&[]).await;
    let url = pg.url();
    bounded(LIMIT, async {
        let connecting: Vec<_> = (0..10)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move { client_at(&url, Duration::from_secs(5)).await })
            })
            .collect();
        let clients: Vec<Client> = join_bounded(Duration::from_secs(20), connecting).await;
        let name = "sem:raced";
        let waiter = clients[9].permit_semaphore(name).unwrap();
        let waiting = tokio::spawn(async move { waiter.acquire(1).await.unwrap() });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let start = Arc::new(tokio::sync::Barrier::new(10));
        let setting: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(i, client)| {
                let (sem, start) = (client.permit_semaphore(name).unwrap(), start.clone());
                tokio::spawn(async move {
                    start.wait().await;
                    (
                        i as i64 + 1,
                        sem.try_set_permits(i as i64 + 1).await.unwrap(),
                    )
                })
            })
            .collect();
        let set_at = Instant::now();
        let answers = join_bounded(Duration::from_secs(10), setting).await;
        let winners: Vec<i64> = answers
            .iter()
            .filter(|(_, a)| a.is_set())
            .map(|(n, _)| *n)
            .collect();
        assert_eq!(winners.len(), 1, "{answers:?}");
        for (_, answer) in &answers {
            if let PermitsSet::Kept { found } = answer {
                assert_eq!(*found, winners[0], "{answers:?}");
            }
        }
        let permits = bounded(Duration::from_secs(3), waiting).await.unwrap();
        println!(
            "total {} set by one of 10; the early waiter held {:?} after the sets began",
            winners[0],
            set_at.elapsed()
        );
        assert_eq!(
            clients[0]
                .permit_semaphore(name)
                .unwrap()
                .total_permits()
                .await
                .unwrap(),
            winners[0]
        );
        permits.release().await.unwrap();
    })
    .await;
}

/// A lock and a permit semaphore of the same name, and a lock named as the semaphore's
/// channel is derived ("x\u{1}permits"): each keeps its own holders; permit messages do
/// not let a lock waiter in, and a lock release does not hand out permits.
#[tokio::test]
async fn held_a_lock_and_a_permit_semaphore_of_one_name_stay_apart() {
    let pg = Pg::start(&[]).await;
    let a = client_at(&pg.url(), Duration::from_secs(5)).await;
    let b = client_at(&pg.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        for name in ["shared", "shared\u{1}permits"] {
            let sem_name = "shared";
            let sem = a.permit_semaphore(sem_name).unwrap();
            let _ = sem.try_set_permits(1).await.unwrap();
            let lock = a.lock(name).unwrap().lock().await.unwrap();
            let permit = sem.acquire(1).await.unwrap();
            let lock_waiter = {
                let lock = b.lock(name).unwrap();
                tokio::spawn(async move { lock.try_lock_for(Duration::from_millis(1500)).await.unwrap() })
            };
            let sem_waiter = {
                let sem = b.permit_semaphore(sem_name).unwrap();
                tokio::spawn(async move { sem.try_acquire_for(1, Duration::from_millis(1500)).await.unwrap() })
            };
            tokio::time::sleep(Duration::from_millis(200)).await;
            // Permit traffic on the channel while the lock is held.
            permit.release().await.unwrap();
            let theirs = sem_waiter.await.unwrap().expect("the permit went to the waiter");
            assert!(lock_waiter.await.unwrap().is_none(), "{name:?}: a lock waiter held beside the holder");
            assert!(!lock.is_lost());
            // A lock release with a permit held: no permit appears.
            lock.release().await.unwrap();
            assert!(sem.try_acquire(1).await.unwrap().is_none(), "{name:?}: a permit appeared");
            theirs.release().await.unwrap();
        }
        println!("lock names \"shared\" and \"shared\\u{{1}}permits\" beside permit semaphore \"shared\": apart");
    })
    .await;
}

/// Every backend of both clients terminated while one holds and another waits, then a
/// database restart (fast shutdown, 0.5 s down) under a holder and a waiter: the holder
/// keeps its permit through both (or learns of its loss), the waiter is woken by the
/// release, never more than the total is taken.
#[tokio::test]
async fn held_terminated_backends_and_a_database_restart() {
    let mut pg = Pg::start(&[]).await;
    let holders = client_at(&pg.url(), Duration::from_secs(3)).await;
    let waiters = client_at(&pg.url(), Duration::from_secs(3)).await;
    let name = "sem:terminated";
    bounded(LIMIT, async {
        let sem = holders.permit_semaphore(name).unwrap();
        let _ = sem.try_set_permits(1).await.unwrap();
        let permits = sem.acquire(1).await.unwrap();
        let other = waiters.permit_semaphore(name).unwrap();
        let waiting = tokio::spawn(async move { other.acquire(1).await.unwrap() });
        tokio::time::sleep(Duration::from_millis(300)).await;
        {
            let admin = pg.admin().await;
            let killed: Vec<bool> = sqlx::query_scalar(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'",
            )
            .fetch_all(&admin)
            .await
            .unwrap();
            println!("terminated {} backends", killed.len());
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(!waiting.is_finished(), "the waiter held beside the holder");
        assert!(!permits.is_lost() && permits.verify().await.unwrap());
        let released = Instant::now();
        permits.release().await.unwrap();
        let theirs = bounded(Duration::from_secs(5), waiting).await.unwrap();
        let woke_terminated = released.elapsed();

        let again = sem.clone();
        let waiting = tokio::spawn(async move { again.acquire(1).await.unwrap() });
        tokio::time::sleep(Duration::from_millis(300)).await;
        pg.stop("INT");
        tokio::time::sleep(Duration::from_millis(500)).await;
        pg.start_again().await;
        let admin = pg.admin().await;
        let back = Instant::now();
        let mut verified = false;
        while back.elapsed() < Duration::from_secs(5) && !theirs.is_lost() {
            if let Ok(true) = theirs.verify().await {
                verified = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(verified || theirs.is_lost(), "neither held nor lost after the restart");
        assert!(!waiting.is_finished() || theirs.is_lost(), "the waiter held beside the holder");
        assert!(live(&admin, name).await.1 <= 1);
        let released = Instant::now();
        drop(theirs);
        let last = bounded(Duration::from_secs(5), waiting).await.unwrap();
        let woke_restart = released.elapsed();
        println!(
            "after terminated backends: the waiter held {woke_terminated:?} after the release; \
             after the restart: holder verified {verified}, waiter held {woke_restart:?} after the release"
        );
        assert!(woke_terminated < Duration::from_millis(1000));
        assert!(woke_restart < Duration::from_millis(1500));
        last.release().await.unwrap();
    })
    .await;
}

/// Both tables truncated under two holders and a waiter: both holders learn of their
/// loss within a renewal, the waiter waits for a new total and then holds, no error
/// storms; the holders' releases say AlreadyLost.
#[tokio::test]
async fn held_truncated_tables_under_holders_and_a_waiter() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let holders = client_at(&pg.url(), Duration::from_millis(900)).await;
    let waiters = client_at(&pg.url(), Duration::from_secs(5)).await;
    let name = "sem:truncated";
    bounded(LIMIT, async {
        let sem = holders.permit_semaphore(name).unwrap();
        let _ = sem.try_set_permits(2).await.unwrap();
        let held: Vec<LeasedPermits> = vec![sem.acquire(1).await.unwrap(), sem.acquire(1).await.unwrap()];
        let other = waiters.permit_semaphore(name).unwrap();
        let waiting = tokio::spawn(async move { other.acquire(2).await.unwrap() });
        tokio::time::sleep(Duration::from_millis(200)).await;
        let truncated = Instant::now();
        admin.execute("TRUNCATE distlock_semaphores, distlock_permits").await.unwrap();
        for permits in &held {
            bounded(Duration::from_secs(2), permits.lost()).await;
        }
        let lost_in = truncated.elapsed();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "the waiter held with no total");
        let set = Instant::now();
        assert!(sem.try_set_permits(2).await.unwrap().is_set());
        let theirs = bounded(Duration::from_secs(3), waiting).await.unwrap();
        let woke = set.elapsed();
        for permits in held {
            assert_eq!(permits.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
        }
        assert_eq!(live(&admin, name).await.1, 2);
        println!("both holders lost {lost_in:?} after the TRUNCATE; the waiter held {woke:?} after the new total");
        theirs.release().await.unwrap();
    })
    .await;
}
