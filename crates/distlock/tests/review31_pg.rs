//! Review 31: a hostile review of the PostgreSQL store (feature `postgres`, commit
//! 5fdff6c). Each test is bounded (< 60 s) and starts its own private PostgreSQL.
//!
//! Tests named `break_*` show a defect: they assert the behaviour the docs promise (or a
//! user would expect) and fail on 5fdff6c. Tests named `holds_*` tried to break something
//! and found it holding; they pass.
//!
//! The server here is started by a small helper of this file ([`Pg`]) rather than the
//! testkit's `PostgresServer`, because several tests need what that one cannot do: a
//! restart on the same port and data, extra settings (TLS, timeouts), and roles.

mod common;

use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::pg::{chown, client_at, lock_waiters, postgres_user, signal, Pg};
use common::{bounded, join_bounded};
use distlock::{Client, Error, ReleaseOutcome, StoreFailure};
use distlock_testkit::{
    monotonic_ns, write_test_certificates, Direction, ExclusionChecker, FaultProxy, Interval,
};
use sqlx::Executor;
use tokio::io::{AsyncBufReadExt, BufReader};

const LIMIT: Duration = Duration::from_secs(55);

// =======================================================================================
// Breaks
// =======================================================================================

/// docs/safety.md: "on first connect, CREATE on the schema (or create the table and
/// sequence beforehand from schema.sql); afterwards SELECT, INSERT, UPDATE on
/// distlock_locks, USAGE, SELECT, UPDATE on distlock_tokens" (and, since the read-write
/// lock, SELECT, INSERT, UPDATE, DELETE on distlock_readers). A user with exactly those
/// rights, on a table the owner created, cannot connect at all: every connect runs
/// `CREATE TABLE IF NOT EXISTS`, and PostgreSQL checks CREATE on the schema before it
/// looks whether the table exists. On PostgreSQL 15 no user but the database owner has
/// CREATE on `public`, so this is every least-privileged application user.
#[tokio::test]
async fn break_a_user_with_the_documented_rights_cannot_connect() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    bounded(LIMIT, async {
        // The owner connects first: the table and sequence exist.
        let owner = client_at(&pg.url(), Duration::from_secs(5)).await;
        owner.shutdown().await;
        for statement in [
            "CREATE ROLE app LOGIN",
            "GRANT SELECT, INSERT, UPDATE ON distlock_locks TO app",
            "GRANT USAGE, SELECT, UPDATE ON SEQUENCE distlock_tokens TO app",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON distlock_readers TO app",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON distlock_permits TO app",
            "GRANT SELECT, INSERT, UPDATE ON distlock_semaphores TO app",
        ] {
            admin.execute(statement).await.unwrap();
        }
        let app = match Client::connect(&pg.url_as("app")).await {
            Ok(app) => app,
            Err(err) => panic!(
                "a user with the rights docs/safety.md lists could not connect to a \
                 database where the table exists: {err}"
            ),
        };
        let guard = app.lock("job").unwrap().try_lock().await.unwrap().unwrap();
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
        // The documented rights cover the read-write lock and the permit semaphore too.
        let reader = app.rw_lock("job").unwrap().read().await.unwrap();
        assert_eq!(reader.release().await.unwrap(), ReleaseOutcome::Released);
        let slots = app.permit_semaphore("slots").unwrap();
        assert!(slots.try_set_permits(1).await.unwrap().is_set());
        let permit = slots.acquire(1).await.unwrap();
        assert_eq!(slots.add_permits(1).await.unwrap(), 1);
        assert_eq!(permit.release().await.unwrap(), ReleaseOutcome::Released);
    })
    .await;
}

/// The table and sequence are named without a schema, so each connection finds (or
/// creates) them on its own search_path. PostgreSQL's default search_path is
/// `"$user", public`, and the PostgreSQL docs' recommended pattern since 15 is a schema
/// per user: two services on one database under different users then lock in two
/// different tables, and both hold the same lock at once. Nothing warns.
#[tokio::test]
async fn break_two_users_with_their_own_schemas_both_hold_the_same_lock() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    bounded(LIMIT, async {
        let first = client_at(&pg.url(), Duration::from_secs(5)).await;
        for statement in [
            "CREATE ROLE alice LOGIN",
            "CREATE SCHEMA alice AUTHORIZATION alice",
            "GRANT SELECT, INSERT, UPDATE ON distlock_locks TO alice",
            "GRANT USAGE, SELECT, UPDATE ON SEQUENCE distlock_tokens TO alice",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON distlock_readers TO alice",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON distlock_permits TO alice",
            "GRANT SELECT, INSERT, UPDATE ON distlock_semaphores TO alice",
        ] {
            admin.execute(statement).await.unwrap();
        }
        let second = client_at(&pg.url_as("alice"), Duration::from_secs(5)).await;
        let held = first
            .lock("nightly-report")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .expect("free");
        let also = second
            .lock("nightly-report")
            .unwrap()
            .try_lock()
            .await
            .unwrap();
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT schemaname || '.' || tablename FROM pg_tables \
             WHERE tablename = 'distlock_locks' ORDER BY 1",
        )
        .fetch_all(&admin)
        .await
        .unwrap();
        assert!(
            also.is_none(),
            "two clients on one database both hold `nightly-report` (tokens {} and {}); \
             the lock tables: {tables:?}",
            held.fencing_token(),
            also.as_ref().map(|g| g.fencing_token()).unwrap_or(0)
        );
    })
    .await;
}

/// The same with one user: a client whose URL sets `options=-c search_path=…` (a
/// multi-tenant app, a schema per environment) locks in its own table.
#[tokio::test]
async fn break_a_search_path_in_the_url_splits_the_lock_table() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    bounded(LIMIT, async {
        admin.execute("CREATE SCHEMA tenant").await.unwrap();
        let plain = client_at(&pg.url(), Duration::from_secs(5)).await;
        let url = format!("{}?options=-c%20search_path%3Dtenant,public", pg.url());
        let scoped = client_at(&url, Duration::from_secs(5)).await;
        let held = plain.lock("x").unwrap().try_lock().await.unwrap().unwrap();
        let also = scoped.lock("x").unwrap().try_lock().await.unwrap();
        assert!(
            also.is_none(),
            "a client with search_path=tenant,public also holds `x` (tokens {} and {})",
            held.fencing_token(),
            also.as_ref().map(|g| g.fencing_token()).unwrap_or(0)
        );
    })
    .await;
}

/// docs/safety.md: "A release whose reply was lost is sent again and still answers
/// 'released'". It does only while nobody took the lock in between: acquire.sql sets
/// `released_by = NULL` on the row, so the retry finds another owner and answers -1:
/// the release reports `AlreadyLost` and fires the holder's lost signal, though this
/// holder released in time. A lock with waiters (the case where a release matters) is
/// exactly when someone takes it in between. On Redis the unlock latch is a key of its
/// own and survives the next acquisition.
///
/// The lost reply is made as tests/postgres.rs makes it: another transaction holds the
/// row, so the release waits in the database past the client's response timeout and is
/// sent again; a waiter's attempt queues on the row between the two.
#[tokio::test]
async fn break_a_retried_release_reports_already_lost_when_a_waiter_took_the_lock() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let holder = client_at(&pg.url(), Duration::from_secs(30)).await;
    // The other client waits long for its replies, so its attempt stays queued.
    let other = Client::builder()
        .response_timeout(Duration::from_secs(10))
        .connect(&pg.url())
        .await
        .unwrap();
    bounded(LIMIT, async {
        let guard = holder.lock("pg:handed").unwrap().lock().await.unwrap();
        let lost = guard.lost_token();
        let mut blocking = admin.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM distlock_locks WHERE name = 'pg:handed' FOR UPDATE")
            .execute(&mut *blocking)
            .await
            .unwrap();
        let release = tokio::spawn(guard.release());
        common::eventually(
            Duration::from_secs(5),
            "the release waits on the row",
            || async { lock_waiters(&admin).await == 1 },
        )
        .await;
        let lock = other.lock("pg:handed").unwrap();
        let taking = tokio::spawn(async move { lock.try_lock().await });
        common::eventually(
            Duration::from_secs(5),
            "the other's attempt waits",
            || async { lock_waiters(&admin).await == 2 },
        )
        .await;
        // The holder's response timeout (500 ms) passes: its release is sent again.
        common::eventually(
            Duration::from_secs(5),
            "the release is sent again",
            || async { lock_waiters(&admin).await == 3 },
        )
        .await;
        blocking.commit().await.unwrap();
        let taken = taking.await.unwrap().unwrap();
        assert!(taken.is_some(), "the other client took the freed lock");
        let outcome = release.await.unwrap().unwrap();
        assert_eq!(
            outcome,
            ReleaseOutcome::Released,
            "the holder released in time (its first statement freed the lock), yet the \
             retry answered {outcome:?}; lost signal fired: {}",
            lost.is_cancelled()
        );
        assert!(!lost.is_cancelled(), "a lost signal after a clean release");
    })
    .await;
}

/// The error for TLS settings on a PostgreSQL client says "give sslmode, sslrootcert,
/// sslcert and sslkey in the URL instead", but distlock's sqlx is built without a TLS
/// backend: `sslmode=require` never connects, even to a server that speaks TLS, and the
/// default (`prefer`) silently sends everything, the password included, in plain text to
/// a server that offers TLS. A managed PostgreSQL that requires TLS cannot be used.
#[tokio::test]
async fn break_sslmode_require_cannot_connect_to_a_tls_server() {
    let certs_dir = tempfile::tempdir().unwrap();
    let certs = write_test_certificates(certs_dir.path()).unwrap();
    let owner = postgres_user();
    for path in [&certs.cert, &certs.key] {
        chown(path, owner);
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
    }
    chown(certs_dir.path(), owner);
    let cert = format!("ssl_cert_file={}", certs.cert.display());
    let key = format!("ssl_key_file={}", certs.key.display());
    let pg = Pg::start(&["ssl=on", &cert, &key]).await;
    let admin = pg.admin().await;
    bounded(LIMIT, async {
        // The server speaks TLS: the test's own driver sees it (and would use it if it
        // had a TLS backend). Check what a distlock client gets by default.
        let plain = client_at(&pg.url(), Duration::from_secs(5)).await;
        let guard = plain.lock("t").unwrap().lock().await.unwrap();
        let encrypted: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) \
             WHERE ssl AND pid <> pg_backend_pid()",
        )
        .fetch_one(&admin)
        .await
        .unwrap();
        guard.release().await.unwrap();
        let url = format!("{}?sslmode=require", pg.url());
        let required = Client::connect(&url).await;
        assert!(
            required.is_ok(),
            "sslmode=require against a PostgreSQL with TLS on: {:?} \
             (and with the default sslmode, {encrypted} of the client's connections \
             were encrypted)",
            required.err()
        );
    })
    .await;
}

/// `fencing_token`: "larger than that of every earlier acquisition of the same lock
/// name". The token is `nextval` alone, so an operator's `ALTER SEQUENCE … RESTART` (or
/// a sequence dropped and re-created by a migration; the table keeps its rows) hands
/// the same lock a smaller token than its last holder's, which a fenced resource then
/// refuses forever. The row still has the last token: `greatest(nextval, token + 1)`
/// would keep each lock's tokens growing.
#[tokio::test]
async fn break_a_restarted_sequence_hands_a_lock_a_smaller_token() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let client = client_at(&pg.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let lock = client.lock("pg:fenced").unwrap();
        let mut last = 0;
        for _ in 0..5 {
            let guard = lock.lock().await.unwrap();
            last = guard.fencing_token();
            guard.release().await.unwrap();
        }
        admin
            .execute("ALTER SEQUENCE distlock_tokens RESTART")
            .await
            .unwrap();
        let next = lock.lock().await.unwrap();
        assert!(
            next.fencing_token() > last,
            "after ALTER SEQUENCE RESTART the lock's next token is {}, its last was {last}",
            next.fencing_token()
        );
    })
    .await;
}

/// The same promise broken by a sequence setting a DBA may pick for throughput:
/// `ALTER SEQUENCE distlock_tokens CACHE 50` gives each pooled connection a block of its
/// own, so two clients (or two connections of one) hand out tokens out of order, and a
/// later holder of the same lock gets a smaller token. Again `greatest(nextval, token+1)`
/// on the row would keep each lock's tokens growing whatever the sequence does.
#[tokio::test]
async fn break_a_cached_sequence_hands_out_tokens_out_of_order() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let first = client_at(&pg.url(), Duration::from_secs(5)).await;
    let second = client_at(&pg.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        admin
            .execute("ALTER SEQUENCE distlock_tokens CACHE 50")
            .await
            .unwrap();
        let checker = ExclusionChecker::new();
        for round in 0..20 {
            let client = if round % 2 == 0 { &first } else { &second };
            let guard = client.lock("pg:cached").unwrap().lock().await.unwrap();
            checker
                .enter(guard.fencing_token(), format!("client {}", round % 2))
                .finish();
            guard.release().await.unwrap();
        }
        let report = checker.report();
        assert!(report.token_regressions.is_empty(), "{report}");
    })
    .await;
}

// =======================================================================================
// What held
// =======================================================================================

/// Entry point of the child processes below; skipped in a normal run.
#[tokio::test]
#[ignore = "run as a child process by the tests below"]
async fn review31_child() {
    let Ok(url) = std::env::var("REVIEW31_URL") else {
        panic!("review31_child runs only as a child process");
    };
    let mode = std::env::var("REVIEW31_MODE").unwrap();
    let client = client_at(&url, Duration::from_millis(1000)).await;
    match mode.as_str() {
        // Takes and gives back `pg:burst` in a loop, writing "S token ns" when it holds
        // and "E token ns" just before it releases.
        "burst" => {
            let lock = client.lock("pg:burst").unwrap();
            loop {
                let guard = lock.lock().await.unwrap();
                let token = guard.fencing_token();
                println!("S {token} {}", monotonic_ns());
                tokio::task::yield_now().await;
                println!("E {token} {}", monotonic_ns());
                guard.release().await.unwrap();
            }
        }
        // Holds `pg:frozen` and says every 2 ms whether it still trusts it.
        "tick" => {
            let guard = client.lock("pg:frozen").unwrap().lock().await.unwrap();
            println!("HELD {}", guard.fencing_token());
            let lost = guard.lost();
            tokio::spawn(async move {
                lost.await;
                println!("LOSTSIG {}", monotonic_ns());
            });
            loop {
                let at = monotonic_ns();
                if guard.is_lost() {
                    println!("LOST {at}");
                    break;
                }
                println!("OK {at}");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            std::future::pending::<()>().await;
        }
        other => panic!("unknown mode {other}"),
    }
}

fn child(url: &str, mode: &str) -> tokio::process::Child {
    tokio::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "review31_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("REVIEW31_URL", url)
        .env("REVIEW31_MODE", mode)
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// The process state letter of `pid` (`T` when stopped).
fn process_state(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit(')')
        .next()
        .and_then(|rest| rest.trim().chars().next())
        .unwrap_or('?')
}

/// Two processes contend for one lock in a tight loop; one is killed with kill -9 in the
/// middle of its burst. Every hold of both (the killed one's last hold ending at the
/// kill) is checked for overlaps and token order.
#[tokio::test]
async fn holds_two_processes_under_kill_9_mid_burst() {
    let pg = Pg::start(&[]).await;
    let client = client_at(&pg.url(), Duration::from_secs(1)).await;
    bounded(LIMIT, async {
        let mut burst = child(&pg.url(), "burst");
        let mut lines = BufReader::new(burst.stdout.take().unwrap()).lines();
        let checker = ExclusionChecker::new();
        let child_holds = Arc::new(Mutex::new((Vec::<Interval>::new(), None::<(u64, u64)>)));
        let reading = {
            let child_holds = Arc::clone(&child_holds);
            tokio::spawn(async move {
                while let Ok(Some(line)) = lines.next_line().await {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    let (Some(kind), Some(token), Some(ns)) = (
                        fields.iter().rev().nth(2),
                        fields
                            .iter()
                            .rev()
                            .nth(1)
                            .and_then(|t| t.parse::<u64>().ok()),
                        fields.last().and_then(|t| t.parse::<u64>().ok()),
                    ) else {
                        continue;
                    };
                    let mut holds = child_holds.lock().unwrap();
                    match *kind {
                        "S" => holds.1 = Some((token, ns)),
                        "E" => {
                            if let Some((started, start_ns)) = holds.1.take() {
                                assert_eq!(started, token);
                                holds.0.push(Interval {
                                    start_ns,
                                    end_ns: ns,
                                    token,
                                    holder: "child".into(),
                                });
                            }
                        }
                        _ => {}
                    }
                }
            })
        };
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for t in 0..3 {
            let lock = client.lock("pg:burst").unwrap();
            let (checker, stop) = (checker.clone(), Arc::clone(&stop));
            tasks.push(tokio::spawn(async move {
                let mut holds = 0;
                while !stop.load(Ordering::Relaxed) {
                    let guard = lock.lock().await.unwrap();
                    let hold = checker.enter(guard.fencing_token(), format!("parent/{t}"));
                    tokio::task::yield_now().await;
                    hold.finish();
                    guard.release().await.unwrap();
                    holds += 1;
                }
                holds
            }));
        }
        // Let both sides hold it many times, then kill the child mid-burst.
        common::eventually(
            Duration::from_secs(20),
            "the child holds a few times",
            || async { child_holds.lock().unwrap().0.len() >= 30 },
        )
        .await;
        burst.start_kill().unwrap();
        let killed_ns = monotonic_ns();
        burst.wait().await.unwrap();
        // Its last hold, if one was open, ends at the kill at the latest.
        {
            let mut holds = child_holds.lock().unwrap();
            if let Some((token, start_ns)) = holds.1.take() {
                holds.0.push(Interval {
                    start_ns,
                    end_ns: killed_ns,
                    token,
                    holder: "child (killed)".into(),
                });
            }
        }
        tokio::time::sleep(Duration::from_millis(2500)).await;
        stop.store(true, Ordering::Relaxed);
        let parent_holds: usize = join_bounded(LIMIT, tasks).await.into_iter().sum();
        reading.abort();
        let child_intervals = child_holds.lock().unwrap().0.clone();
        let child_count = child_intervals.len();
        checker.extend(child_intervals);
        let report = checker.report();
        println!("kill -9 burst: {parent_holds} parent holds, {child_count} child holds: {report}");
        assert!(report.is_clean(), "{report}");
        assert!(parent_holds > 10);
    })
    .await;
}

/// A holder process is frozen (SIGSTOP) past its lease, another client takes the lock,
/// and the holder is thawed (SIGCONT). It must not trust the lock for a moment after the
/// other holds it: every "still held" it reports comes from before the freeze, and its
/// lost signal fires.
#[tokio::test]
async fn holds_a_frozen_holder_distrusts_its_lock_when_thawed() {
    let pg = Pg::start(&[]).await;
    let client = client_at(&pg.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let mut ticking = child(&pg.url(), "tick");
        let pid = ticking.id().unwrap();
        let mut lines = BufReader::new(ticking.stdout.take().unwrap()).lines();
        let token = loop {
            let line = lines.next_line().await.unwrap().expect("the child holds");
            if let Some((_, token)) = line.split_once("HELD ") {
                break token.trim().parse::<u64>().unwrap();
            }
        };
        // Let it tick a little, then freeze it.
        tokio::time::sleep(Duration::from_millis(100)).await;
        signal(pid, "STOP");
        common::eventually(Duration::from_secs(5), "the child is stopped", || async {
            process_state(pid) == 'T'
        })
        .await;
        let frozen_ns = monotonic_ns();
        let guard = client.lock("pg:frozen").unwrap().lock().await.unwrap();
        let held_ns = monotonic_ns();
        assert!(guard.fencing_token() > token);
        signal(pid, "CONT");
        let mut trusted_after_freeze = Vec::new();
        let (mut lost_at, mut signal_at) = (None, None);
        while lost_at.is_none() || signal_at.is_none() {
            let line = lines.next_line().await.unwrap().expect("the child goes on");
            let mut fields = line.split_whitespace().rev();
            let ns: u64 = match fields.next().and_then(|ns| ns.parse().ok()) {
                Some(ns) => ns,
                None => continue,
            };
            if line.contains("LOSTSIG") {
                signal_at = Some(ns);
            } else if line.contains("LOST") {
                lost_at = Some(ns);
            } else if line.contains("OK") && ns >= frozen_ns {
                trusted_after_freeze.push(ns);
            }
        }
        println!(
            "frozen {} ms after the freeze began the other held it; thawed child saw the \
             loss {} ms after that",
            (held_ns - frozen_ns) / 1_000_000,
            lost_at.unwrap().saturating_sub(held_ns) / 1_000_000
        );
        assert!(
            trusted_after_freeze.is_empty(),
            "the thawed child still trusted the lock at {trusted_after_freeze:?} (the \
             other client held it from before {held_ns})"
        );
        guard.release().await.unwrap();
    })
    .await;
}

/// The database restarted (a fast shutdown, then an immediate one, a crash) under a
/// watchdog holder, a fixed-lease holder and a waiter: the watchdog lease survives a
/// restart shorter than it, the waiter is still woken by the release (not at the fixed
/// lease's end, 30 s away), and tokens keep growing.
#[tokio::test]
async fn holds_a_database_restart_under_holders_and_waiters() {
    let mut pg = Pg::start(&["synchronous_commit=on"]).await;
    let url = pg.url();
    let holder = client_at(&url, Duration::from_secs(4)).await;
    let waiter = client_at(&url, Duration::from_secs(4)).await;
    let outcome = bounded(LIMIT, async {
        let mut last_token = 0;
        let mut report = Vec::new();
        for how in ["INT", "QUIT"] {
            let kept = holder.lock("pg:kept").unwrap().lock().await.unwrap();
            let kept_lost = kept.lost_token();
            let fixed = holder
                .lock("pg:fixed")
                .unwrap()
                .with_lease(Duration::from_secs(30))
                .lock()
                .await
                .unwrap();
            assert!(fixed.fencing_token() > last_token);
            let lock = waiter.lock("pg:fixed").unwrap();
            let waiting = tokio::spawn(async move {
                let guard = lock.lock().await.unwrap();
                (Instant::now(), guard)
            });
            tokio::time::sleep(Duration::from_millis(300)).await;
            let down = Instant::now();
            pg.stop(how);
            pg.start_again().await;
            let up = down.elapsed();
            // Long enough for a renewal or two after the restart.
            tokio::time::sleep(Duration::from_millis(2000)).await;
            assert!(
                !kept_lost.is_cancelled(),
                "a {how} restart of {up:?} lost a 4 s lease"
            );
            let released_at = Instant::now();
            // A fixed lease: the release may have to be retried on a fresh connection.
            assert_eq!(fixed.release().await.unwrap(), ReleaseOutcome::Released);
            let (acquired_at, taken) = waiting.await.unwrap();
            let handoff = acquired_at.duration_since(released_at);
            assert!(
                handoff < Duration::from_secs(3),
                "after a {how} restart: {handoff:?}"
            );
            last_token = taken.fencing_token();
            report.push(format!("{how}: down {up:?}, handoff {handoff:?}"));
            taken.release().await.unwrap();
            kept.release().await.unwrap();
        }
        report
    })
    .await;
    println!("restarts: {outcome:?}");
}

/// pg_terminate_backend on every connection of two clients (the pool and the LISTEN
/// connection), three times: the watchdog holder keeps its lock, and a waiter is still
/// woken by the release.
#[tokio::test]
async fn holds_terminated_backends_of_holder_and_waiter() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let holder = client_at(
        &format!("{}?application_name=r31holder", pg.url()),
        Duration::from_millis(1500),
    )
    .await;
    let waiter = client_at(
        &format!("{}?application_name=r31waiter", pg.url()),
        Duration::from_millis(1500),
    )
    .await;
    bounded(LIMIT, async {
        let kept = holder.lock("pg:kept").unwrap().lock().await.unwrap();
        let kept_lost = kept.lost_token();
        let mut handoffs = Vec::new();
        for round in 0..3 {
            let fixed = holder
                .lock("pg:fixed")
                .unwrap()
                .with_lease(Duration::from_secs(30))
                .lock()
                .await
                .unwrap();
            let lock = waiter.lock("pg:fixed").unwrap();
            let waiting = tokio::spawn(async move {
                let guard = lock.lock().await.unwrap();
                let at = Instant::now();
                guard.release().await.unwrap();
                at
            });
            tokio::time::sleep(Duration::from_millis(300)).await;
            let killed: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name IN ('r31holder', 'r31waiter')) AS t",
            )
            .fetch_one(&admin)
            .await
            .unwrap();
            assert!(killed >= 2, "round {round}: {killed} backends");
            tokio::time::sleep(Duration::from_millis(1600)).await;
            assert!(
                !kept_lost.is_cancelled(),
                "round {round}: the watchdog lock was lost"
            );
            let released_at = Instant::now();
            assert_eq!(fixed.release().await.unwrap(), ReleaseOutcome::Released);
            let handoff = waiting.await.unwrap().duration_since(released_at);
            assert!(
                handoff < Duration::from_secs(2),
                "round {round}: {handoff:?}"
            );
            handoffs.push(handoff);
        }
        println!("handoffs after pg_terminate_backend: {handoffs:?}");
        kept.release().await.unwrap();
    })
    .await;
}

/// Server settings a DBA sets for every session: idle sessions closed after 300 ms (the
/// LISTEN connection among them), statement_timeout and lock_timeout, and an
/// idle-in-transaction timeout. Locks are still held, renewed and handed over.
#[tokio::test]
async fn holds_idle_session_statement_and_lock_timeouts() {
    let pg = Pg::start(&[
        "idle_session_timeout=300ms",
        "statement_timeout=200ms",
        "lock_timeout=100ms",
        "idle_in_transaction_session_timeout=100ms",
    ])
    .await;
    let holder = client_at(&pg.url(), Duration::from_millis(1500)).await;
    let waiter = client_at(&pg.url(), Duration::from_millis(1500)).await;
    bounded(LIMIT, async {
        let kept = holder.lock("pg:kept").unwrap().lock().await.unwrap();
        let kept_lost = kept.lost_token();
        let mut handoffs = Vec::new();
        for _ in 0..3 {
            let fixed = holder
                .lock("pg:fixed")
                .unwrap()
                .with_lease(Duration::from_secs(30))
                .lock()
                .await
                .unwrap();
            let lock = waiter.lock("pg:fixed").unwrap();
            let waiting = tokio::spawn(async move {
                let guard = lock.lock().await.unwrap();
                let at = Instant::now();
                guard.release().await.unwrap();
                at
            });
            // Idle well past idle_session_timeout.
            tokio::time::sleep(Duration::from_millis(1200)).await;
            let released_at = Instant::now();
            assert_eq!(fixed.release().await.unwrap(), ReleaseOutcome::Released);
            handoffs.push(waiting.await.unwrap().duration_since(released_at));
        }
        assert!(!kept_lost.is_cancelled());
        let floor = holder
            .lock("pg:kept")
            .unwrap()
            .last_fencing_token()
            .await
            .unwrap()
            + 10;
        assert!(
            holder
                .lock("pg:kept")
                .unwrap()
                .advance_fencing_counter(floor)
                .await
                .unwrap()
                >= floor
        );
        kept.release().await.unwrap();
        let log = std::fs::read_to_string(pg.dir().join("log")).unwrap_or_default();
        println!(
            "handoffs with idle_session_timeout=300ms: {handoffs:?}; {} sessions closed idle",
            log.matches("idle-session timeout").count()
        );
        assert!(
            handoffs.iter().all(|h| *h < Duration::from_secs(1)),
            "{handoffs:?}"
        );
    })
    .await;
}

/// 2 clients × 4 tasks take one lock 25 times each while a fifth task raises the token
/// counter over and over: tokens strictly grow across holders, and every acquisition
/// asked for after `advance_fencing_counter(floor)` returned has a token above `floor`.
/// (Asked for, not recorded: an acquisition whose statement ran before the raise may
/// see its reply after it.)
#[tokio::test]
async fn holds_tokens_grow_under_concurrency_and_racing_advances() {
    let pg = Pg::start(&[]).await;
    let clients = [
        client_at(&pg.url(), Duration::from_secs(5)).await,
        client_at(&pg.url(), Duration::from_secs(5)).await,
    ];
    bounded(LIMIT, async {
        let checker = ExclusionChecker::new();
        let asked = Arc::new(Mutex::new(Vec::<(u64, u64)>::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for (c, client) in clients.iter().enumerate() {
            for t in 0..4 {
                let lock = client.lock("pg:tokens").unwrap();
                let checker = checker.clone();
                let asked = Arc::clone(&asked);
                tasks.push(tokio::spawn(async move {
                    for _ in 0..25 {
                        let asked_at = monotonic_ns();
                        let guard = lock.lock().await.unwrap();
                        asked
                            .lock()
                            .unwrap()
                            .push((asked_at, guard.fencing_token()));
                        let hold = checker.enter(guard.fencing_token(), format!("{c}/{t}"));
                        tokio::task::yield_now().await;
                        hold.finish();
                        guard.release().await.unwrap();
                    }
                }));
            }
        }
        let advancer = {
            let lock = clients[0].lock("pg:tokens").unwrap();
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                let mut raised = Vec::new();
                let mut floor = 1_000;
                while !stop.load(Ordering::Relaxed) {
                    let counter = lock.advance_fencing_counter(floor).await.unwrap();
                    assert!(counter >= floor);
                    raised.push((monotonic_ns(), floor));
                    floor = counter + 1_000;
                    tokio::time::sleep(Duration::from_millis(3)).await;
                }
                raised
            })
        };
        join_bounded(LIMIT, tasks).await;
        stop.store(true, Ordering::Relaxed);
        let raised = advancer.await.unwrap();
        let report = checker.report();
        assert!(report.is_clean(), "{report}");
        let mut below = Vec::new();
        for (asked_at, token) in asked.lock().unwrap().iter() {
            for (at, floor) in &raised {
                if asked_at > at && token <= floor {
                    below.push((*token, *floor));
                }
            }
        }
        println!(
            "{} holds, {} advances racing them: {report}; holds under a floor: {}",
            report.holds,
            raised.len(),
            below.len()
        );
        assert!(below.is_empty(), "{below:?}");
    })
    .await;
}

/// One task's async patterns: join! of two locks, select! against a timer, timeouts that
/// drop lock(), release() and reenter() mid-call, a guard dropped on a current-thread
/// runtime that then ends, spawn_blocking + block_on. Afterwards nothing is held.
#[tokio::test]
async fn holds_async_patterns_and_dropped_calls() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let client = client_at(&pg.url(), Duration::from_secs(5)).await;
    let held_rows = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM distlock_locks WHERE expires_at > clock_timestamp()",
        )
        .fetch_one(&admin)
        .await
        .unwrap()
    };
    bounded(LIMIT, async {
        // join! and select! in one task.
        let (a, b) = (client.lock("pg:a").unwrap(), client.lock("pg:b").unwrap());
        let (ga, gb) = tokio::join!(a.lock(), b.lock());
        let (ga, gb) = (ga.unwrap(), gb.unwrap());
        tokio::select! {
            _ = a.lock() => panic!("a held lock was taken again"),
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
        let (ra, rb) = tokio::join!(ga.release(), gb.release());
        assert_eq!(
            (ra.unwrap(), rb.unwrap()),
            (ReleaseOutcome::Released, ReleaseOutcome::Released)
        );

        // lock() dropped at every point of its life: on a free lock and a busy one.
        for micros in [0, 50, 200, 500, 1000, 2000, 5000] {
            let _ = tokio::time::timeout(Duration::from_micros(micros), a.lock()).await;
        }
        let busy = b.lock().await.unwrap();
        for micros in [0, 50, 200, 500, 1000, 2000, 5000] {
            assert!(
                tokio::time::timeout(Duration::from_micros(micros), b.lock())
                    .await
                    .is_err()
            );
        }
        busy.release().await.unwrap();
        common::eventually(
            Duration::from_secs(3),
            "dropped acquisitions give back",
            || async { held_rows().await == 0 },
        )
        .await;

        // release() dropped mid-call: the lock is still freed (the statement runs on).
        for micros in [0, 100, 500, 2000] {
            let guard = a.lock().await.unwrap();
            let _ = tokio::time::timeout(Duration::from_micros(micros), guard.release()).await;
            common::eventually(
                Duration::from_secs(3),
                "a dropped release frees",
                || async { !a.is_locked().await.unwrap() },
            )
            .await;
        }

        // reenter() dropped mid-call, then the holds given back.
        for micros in [0, 100, 500, 2000] {
            let guard = a.lock().await.unwrap();
            let again = tokio::time::timeout(Duration::from_micros(micros), guard.reenter()).await;
            if let Ok(again) = again {
                again.unwrap().release().await.unwrap();
            }
            assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
            // A re-entry that completed as its caller went away is a hold whose guard
            // was dropped: it is given back in the background, so the release above may
            // have been a partial one, and the lock is free a moment later.
            common::eventually(
                Duration::from_secs(2),
                "a re-entry dropped mid-call is given back",
                || async { !a.is_locked().await.unwrap() },
            )
            .await;
        }

        // A client made on a current-thread runtime that then ends, its guard dropped
        // there: the lock is freed at once, and the client still works here.
        let url = pg.url();
        let (other, token) = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let (client, token) = runtime.block_on(async {
                let client = client_at(&url, Duration::from_secs(5)).await;
                let guard = client.lock("pg:rt").unwrap().lock().await.unwrap();
                let token = guard.fencing_token();
                drop(guard);
                (client, token)
            });
            drop(runtime);
            (client, token)
        })
        .join()
        .unwrap();
        let rt = other.lock("pg:rt").unwrap();
        common::eventually(
            Duration::from_secs(2),
            "the guard dropped on an ended runtime frees",
            || async { !rt.is_locked().await.unwrap() },
        )
        .await;
        let again = rt.lock().await.unwrap();
        assert!(again.fencing_token() > token);
        again.release().await.unwrap();

        // spawn_blocking + block_on, and a plain thread with a runtime of its own.
        let lock = client.lock("pg:blocking").unwrap();
        let tokens = {
            let lock = lock.clone();
            tokio::task::spawn_blocking(move || {
                let handle = tokio::runtime::Handle::current();
                (0..5)
                    .map(|_| {
                        handle.block_on(async {
                            let guard = lock.lock().await.unwrap();
                            let token = guard.fencing_token();
                            guard.release().await.unwrap();
                            token
                        })
                    })
                    .collect::<Vec<_>>()
            })
            .await
            .unwrap()
        };
        assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
        assert_eq!(held_rows().await, 0);
    })
    .await;
}

/// Names a user may pick: SQL-looking quotes, backslashes, unicode, the 2048-byte limit
/// (with and without a key prefix), empty names; and two prefixes on one database.
#[tokio::test]
async fn holds_odd_names_and_prefixes() {
    let pg = Pg::start(&[]).await;
    let client = client_at(&pg.url(), Duration::from_secs(5)).await;
    let prefixed = Client::builder()
        .key_prefix("billing:")
        .connect(&pg.url())
        .await
        .unwrap();
    let other_prefix = Client::builder()
        .key_prefix("orders:")
        .connect(&pg.url())
        .await
        .unwrap();
    bounded(LIMIT, async {
        // Printable, varied, not compressible: an index entry of the full size.
        let long: String = (0..2048u32)
            .map(|i| char::from(b'!' + ((i * 7919 + i / 94) % 94) as u8))
            .collect();
        let unicode_long = "é".repeat(1024);
        let names = [
            "it's \"quoted\"; DROP TABLE distlock_locks; --".to_owned(),
            "back\\slash\\\\".to_owned(),
            "日本語のロック 🔒 مرحبا".to_owned(),
            "e\u{301}".to_owned(),
            "\u{e9}".to_owned(),
            "tab\tnew\nline".to_owned(),
            " ".to_owned(),
            long.clone(),
            unicode_long.clone(),
        ];
        for name in &names {
            let guard = client
                .lock(name.clone())
                .unwrap()
                .try_lock()
                .await
                .unwrap()
                .unwrap();
            assert!(client
                .lock(name.clone())
                .unwrap()
                .try_lock()
                .await
                .unwrap()
                .is_none());
            guard.release().await.unwrap();
        }
        // NFC and NFD spellings are two locks (bytes compared), as on Redis.
        let nfd = client
            .lock("e\u{301}")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .unwrap();
        assert!(client
            .lock("\u{e9}")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some());
        nfd.release().await.unwrap();
        // Over the limit, empty, NUL: typed errors, nothing sent.
        let refused = [
            client.lock(format!("{long}x")).err(),
            prefixed.lock(long.clone()).err(),
            client.lock("").err(),
            prefixed.lock("").err(),
            client.lock("a\0b").err(),
        ];
        for (i, err) in refused.iter().enumerate() {
            assert!(
                matches!(err, Some(Error::InvalidName { .. })),
                "{i}: {err:?}"
            );
        }
        // Prefixes keep names apart; one prefix is one namespace across clients.
        let billing = prefixed
            .lock("job")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .unwrap();
        let orders = other_prefix
            .lock("job")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .unwrap();
        assert!(client
            .lock("billing:job")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none());
        assert_eq!(billing.name(), "job");
        billing.release().await.unwrap();
        orders.release().await.unwrap();
    })
    .await;
}

/// URLs with odd options and databases set up in odd ways: each either works or fails
/// with a typed error that names the cause.
#[tokio::test]
async fn holds_odd_urls_and_schemas_give_typed_errors() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    bounded(LIMIT, async {
        let mut seen = Vec::new();
        // TLS required of a server without it.
        let err = Client::connect(&format!("{}?sslmode=require", pg.url()))
            .await
            .err();
        assert!(matches!(err, Some(Error::Store { .. })), "{err:?}");
        seen.push(format!("sslmode=require, no TLS: {}", err.unwrap()));
        // A schema that does not exist.
        let err = Client::connect(&format!("{}?distlock_schema=missing", pg.url()))
            .await
            .err();
        assert!(
            matches!(
                err,
                Some(Error::Store {
                    failure: StoreFailure::Request,
                    ..
                })
            ),
            "{err:?}"
        );
        seen.push(format!("distlock_schema=missing: {}", err.unwrap()));
        // A unix socket.
        let socket = format!(
            "postgres://postgres@localhost:{}/postgres?host={}",
            pg.port,
            pg.dir().display()
        );
        let over_socket = client_at(&socket, Duration::from_secs(5)).await;
        let guard = over_socket.lock("sock").unwrap().lock().await.unwrap();
        guard.release().await.unwrap();
        seen.push("unix socket: works".into());
        // A user with SELECT only.
        for statement in [
            "CREATE ROLE reader LOGIN",
            "GRANT SELECT ON distlock_locks TO reader",
            "GRANT CREATE ON SCHEMA public TO reader",
        ] {
            admin.execute(statement).await.unwrap();
        }
        // Refused at connect (the check reads the sequence) or at the first lock.
        let err = match Client::connect(&pg.url_as("reader")).await {
            Ok(reader) => reader.lock("r").unwrap().try_lock().await.err(),
            Err(err) => Some(err),
        };
        assert!(
            matches!(
                err,
                Some(Error::Store {
                    failure: StoreFailure::PermissionDenied,
                    ..
                })
            ),
            "{err:?}"
        );
        seen.push(format!("SELECT only: {}", err.unwrap()));
        // A table someone else made with a column missing.
        admin.execute("CREATE SCHEMA legacy").await.unwrap();
        admin
            .execute(
                "CREATE TABLE legacy.distlock_locks (name text PRIMARY KEY, owner text NOT NULL, \
                 holds integer NOT NULL, token bigint NOT NULL, expires_at timestamptz NOT NULL)",
            )
            .await
            .unwrap();
        let legacy = Client::connect(&format!("{}?distlock_schema=legacy", pg.url())).await;
        let err = match legacy {
            Ok(legacy) => legacy.lock("l").unwrap().try_lock().await.err(),
            Err(err) => Some(err),
        };
        assert!(
            matches!(
                err,
                Some(Error::Store {
                    failure: StoreFailure::Request,
                    ..
                })
            ),
            "{err:?}"
        );
        seen.push(format!("missing column: {}", err.unwrap()));
        for line in seen {
            println!("{line}");
        }
    })
    .await;
}

/// An operator deletes a held lock's row, or truncates the table, under watchdog
/// holders: each holder's lost signal fires by the next renewal, before anyone could
/// rely on the lock, and the next acquisition's token is larger.
#[tokio::test]
async fn holds_rows_deleted_or_truncated_under_holders() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let holder = client_at(&pg.url(), Duration::from_millis(1500)).await;
    let other = client_at(&pg.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        for how in [
            "DELETE FROM distlock_locks WHERE name = 'pg:ops'",
            "TRUNCATE distlock_locks",
            "TRUNCATE distlock_locks RESTART IDENTITY",
        ] {
            let guard = holder.lock("pg:ops").unwrap().lock().await.unwrap();
            let token = guard.fencing_token();
            let lost = guard.lost_token();
            tokio::time::sleep(Duration::from_millis(100)).await;
            let at = Instant::now();
            admin.execute(how).await.unwrap();
            bounded(Duration::from_secs(2), lost.cancelled()).await;
            let noticed = at.elapsed();
            let next = other.lock("pg:ops").unwrap().lock().await.unwrap();
            assert!(next.fencing_token() > token, "{how}");
            println!("{how}: lost noticed after {noticed:?}");
            next.release().await.unwrap();
            assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
        }
    })
    .await;
}

/// One client holds 1,000 locks on a 1.5 s watchdog for 10 s (about 20 renewal rounds,
/// 5 statements each at the default batch of 200) while another client probes them:
/// none is lost, none is taken.
#[tokio::test]
async fn holds_a_thousand_locks_renewed_in_batches() {
    let pg = Pg::start(&[]).await;
    // Hundreds of calls at once queue for the pool's 8 connections; on a loaded machine
    // (this suite in parallel) the queue alone outlasted a 500 ms response timeout and
    // lock() failed with "no answer" (see break_a_busy_client_…): give it 5 s here.
    let holder = Client::builder()
        .watchdog_timeout(Duration::from_millis(1500))
        .response_timeout(Duration::from_secs(5))
        .connect(&pg.url())
        .await
        .unwrap();
    let prober = client_at(&pg.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let started = Instant::now();
        let mut guards = Vec::new();
        let mut taking = Vec::new();
        for i in 0..1000 {
            let lock = holder.lock(format!("pg:many:{i}")).unwrap();
            taking.push(tokio::spawn(async move { lock.lock().await.unwrap() }));
        }
        for task in taking {
            guards.push(task.await.unwrap());
        }
        let took = started.elapsed();
        let lost: Vec<_> = guards.iter().map(|g| g.lost_token()).collect();
        let until_at = Instant::now() + Duration::from_secs(10);
        let mut probes = 0;
        while Instant::now() < until_at {
            let i = probes % 1000;
            assert!(prober
                .lock(format!("pg:many:{i}"))
                .unwrap()
                .try_lock()
                .await
                .unwrap()
                .is_none());
            probes += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let lost_count = lost.iter().filter(|t| t.is_cancelled()).count();
        println!(
            "1000 locks taken in {took:?}, held 10 s: {lost_count} lost, {probes} probes refused"
        );
        assert_eq!(lost_count, 0);
        let releasing: Vec<_> = guards
            .into_iter()
            .map(|g| tokio::spawn(g.release()))
            .collect();
        for outcome in join_bounded(LIMIT, releasing).await {
            assert_eq!(outcome.unwrap(), ReleaseOutcome::Released);
        }
    })
    .await;
}

/// 200 waiters on one lock (100 tasks on each of two clients) take it in turn, each
/// woken by the NOTIFY of the release before it: all 200 within the bound, no overlap.
#[tokio::test]
async fn holds_two_hundred_waiters_on_one_lock() {
    let pg = Pg::start(&[]).await;
    let clients = [
        client_at(&pg.url(), Duration::from_secs(30)).await,
        client_at(&pg.url(), Duration::from_secs(30)).await,
    ];
    bounded(LIMIT, async {
        let first = clients[0].lock("pg:queue").unwrap().lock().await.unwrap();
        let checker = ExclusionChecker::new();
        let mut tasks = Vec::new();
        for (c, client) in clients.iter().enumerate() {
            for t in 0..100 {
                let lock = client.lock("pg:queue").unwrap();
                let checker = checker.clone();
                tasks.push(tokio::spawn(async move {
                    let guard = lock.lock().await.unwrap();
                    let hold = checker.enter(guard.fencing_token(), format!("{c}/{t}"));
                    tokio::task::yield_now().await;
                    hold.finish();
                    guard.release().await.unwrap();
                }));
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let started = Instant::now();
        first.release().await.unwrap();
        join_bounded(LIMIT, tasks).await;
        let report = checker.report();
        println!(
            "200 waiters on one lock served in {:?}: {report}",
            started.elapsed()
        );
        assert!(report.is_clean(), "{report}");
        assert_eq!(report.holds, 200);
    })
    .await;
}

/// One client waits on 400 different locks (400 channels LISTENed), each held by another
/// client on a 30 s fixed lease; all are released at once. Every waiter gets its lock by
/// a NOTIFY (well before the lease's end), and afterwards the client still waits and
/// wakes on a lock of a name it had used.
#[tokio::test]
async fn holds_waiters_on_four_hundred_names() {
    let pg = Pg::start(&[]).await;
    let holder = client_at(&pg.url(), Duration::from_secs(30)).await;
    // As above: 400 lock() calls at once, a response timeout that covers the pool's queue.
    let waiter = Client::builder()
        .response_timeout(Duration::from_secs(5))
        .connect(&pg.url())
        .await
        .unwrap();
    bounded(LIMIT, async {
        let mut held = Vec::new();
        for i in 0..400 {
            held.push(
                holder
                    .lock(format!("pg:name:{i}"))
                    .unwrap()
                    .with_lease(Duration::from_secs(30))
                    .lock()
                    .await
                    .unwrap(),
            );
        }
        let mut tasks = Vec::new();
        for i in 0..400 {
            let lock = waiter.lock(format!("pg:name:{i}")).unwrap();
            tasks.push(tokio::spawn(async move {
                let guard = lock.lock().await.unwrap();
                let at = Instant::now();
                guard.release().await.unwrap();
                at
            }));
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let released_at = Instant::now();
        let releasing: Vec<_> = held
            .into_iter()
            .map(|g| tokio::spawn(g.release()))
            .collect();
        join_bounded(LIMIT, releasing).await;
        let slowest = join_bounded(LIMIT, tasks)
            .await
            .into_iter()
            .map(|at| at.duration_since(released_at))
            .max()
            .unwrap();
        println!("400 names: the last waiter held {slowest:?} after the releases began");
        assert!(slowest < Duration::from_secs(5), "{slowest:?}");
        // The channels were UNLISTENed and can be LISTENed again.
        let again = holder.lock("pg:name:7").unwrap().lock().await.unwrap();
        let lock = waiter.lock("pg:name:7").unwrap();
        let waiting = tokio::spawn(async move { lock.lock().await.map(|_| Instant::now()) });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let released_at = Instant::now();
        again.release().await.unwrap();
        let handoff = waiting.await.unwrap().unwrap().duration_since(released_at);
        assert!(handoff < Duration::from_secs(1), "{handoff:?}");
    })
    .await;
}

/// A client busy with its own lock attempts over a link with some latency (a database
/// in another zone) loses a lock it holds, though the database answers every statement
/// within a round trip: the watchdog's renewal waits for one of the pool's 8 connections
/// (one of which the LISTEN connection keeps) behind the application's attempts, and
/// the wait for a pooled connection counts against the response timeout, so renewals
/// (and the attempts themselves) fail as "no answer within 1s". On Redis the same
/// attempts share one multiplexed connection and a renewal waits one round trip.
///
/// Measured on 5fdff6c: 60 tasks at 50 ms RTT lose a 3 s watchdog lease after 2.8 s
/// (96 of 158 attempts failed); 300 tasks at 10 ms RTT after 2.9 s (416 of 808); 20
/// tasks at 50 ms RTT keep it.
#[tokio::test]
async fn break_a_busy_client_loses_its_held_lock_to_its_own_attempts() {
    let pg = Pg::start(&[]).await;
    let proxy = FaultProxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], pg.port)))
        .await
        .unwrap();
    proxy.set_delay_in(Direction::Both, Duration::from_millis(25));
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port());
    let watchdog = Duration::from_secs(3);
    // Default timeouts (response 1 s, connection 2 s); a 3 s watchdog to keep it short.
    let busy = Client::builder()
        .watchdog_timeout(watchdog)
        .connect(&url)
        .await
        .unwrap();
    let other = client_at(&pg.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let mut held = Vec::new();
        for i in 0..50 {
            held.push(
                other
                    .lock(format!("pg:busy:{i}"))
                    .unwrap()
                    .with_lease(Duration::from_secs(60))
                    .lock()
                    .await
                    .unwrap(),
            );
        }
        let kept = busy.lock("pg:kept").unwrap().lock().await.unwrap();
        let lost = kept.lost_token();
        let stop = Arc::new(AtomicBool::new(false));
        let (errors, attempts) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let mut workers = Vec::new();
        for t in 0..60 {
            let lock = busy.lock(format!("pg:busy:{}", t % 50)).unwrap();
            let (stop, errors, attempts) = (
                Arc::clone(&stop),
                Arc::clone(&errors),
                Arc::clone(&attempts),
            );
            workers.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    attempts.fetch_add(1, Ordering::Relaxed);
                    if lock.try_lock().await.is_err() {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        let started = Instant::now();
        let lost_after = tokio::select! {
            _ = lost.cancelled() => Some(started.elapsed()),
            _ = tokio::time::sleep(watchdog * 3) => None,
        };
        stop.store(true, Ordering::Relaxed);
        join_bounded(LIMIT, workers).await;
        let (attempts, errors) = (
            attempts.load(Ordering::Relaxed),
            errors.load(Ordering::Relaxed),
        );
        // The held lock must never be lost: renewals have connections of their own. No
        // attempt may fail either: the wait for one of the 8 connections is bounded by
        // the connection timeout, and the response timeout starts once one is free.
        assert!(
            lost_after.is_none() && errors == 0,
            "60 tasks trying busy locks over a 50 ms round trip: the held lock was lost \
             after {lost_after:?} (3 s watchdog), and {errors} of {attempts} attempts \
             failed as if the database did not answer"
        );
    })
    .await;
}

/// A client waiting on many different locks over a link with some latency never gets
/// its LISTENs confirmed: the hub sends one LISTEN per channel, one round trip each,
/// and gives the whole batch the connection timeout (2 s); past it the hub drops the
/// connection and starts over with the same batch. With 200 names at a 20 ms round trip
/// (4 s of LISTENs) it never converges: every waiter falls back to polling every 250 ms,
/// a stream of statements while nothing changes (1036 commits in 8 s for 150 names on
/// 5fdff6c, against 0 once LISTEN works), and a release is noticed only at the next poll.
#[tokio::test]
async fn break_waiting_on_many_names_over_latency_never_listens() {
    let pg = Pg::start(&[]).await;
    let proxy = FaultProxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], pg.port)))
        .await
        .unwrap();
    proxy.set_delay_in(Direction::Both, Duration::from_millis(10));
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port());
    let waiter = Client::connect(&url).await.unwrap();
    let holder = client_at(&pg.url(), Duration::from_secs(30)).await;
    let admin = pg.admin().await;
    let commits = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = 'postgres'",
        )
        .fetch_one(&admin)
        .await
        .unwrap()
    };
    bounded(LIMIT, async {
        let mut held = Vec::new();
        for i in 0..200 {
            held.push(
                holder
                    .lock(format!("pg:n:{i}"))
                    .unwrap()
                    .with_lease(Duration::from_secs(60))
                    .lock()
                    .await
                    .unwrap(),
            );
        }
        let mut tasks = Vec::new();
        for i in 0..200 {
            let lock = waiter.lock(format!("pg:n:{i}")).unwrap();
            tasks.push(tokio::spawn(async move {
                lock.lock().await.map(|_| Instant::now())
            }));
        }
        // Every waiter has found its lock busy and waits; nothing changes from here on.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let before = commits().await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        let polled = commits().await - before;
        let released_at = Instant::now();
        held.remove(0).release().await.unwrap();
        let handoff = tasks
            .remove(0)
            .await
            .unwrap()
            .unwrap()
            .duration_since(released_at);
        assert!(
            polled < 100,
            "200 waiters on locks nobody releases sent {polled} statements in 5 s: they \
             poll because LISTEN never took (a release was noticed after {handoff:?})"
        );
    })
    .await;
}

/// Clients that come and go (each took a lock, waited on one, and asked for a lost
/// signal, so its pool and its LISTEN connection were open) leave no connection behind
/// once shut down and dropped; and a saturated client keeps at most 8 connections.
#[tokio::test]
async fn holds_clients_that_come_and_go_leave_no_connections() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let backends = |app: &'static str| {
        let admin = admin.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            )
            .bind(app)
            .fetch_one(&admin)
            .await
            .unwrap()
        }
    };
    let holder = client_at(&pg.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let busy = holder.lock("pg:busy").unwrap().lock().await.unwrap();
        let url = format!("{}?application_name=r31gone", pg.url());
        for _ in 0..20 {
            let client = client_at(&url, Duration::from_secs(5)).await;
            let guard = client.lock("pg:mine").unwrap().lock().await.unwrap();
            let _lost = guard.lost_token();
            let _ = client
                .lock("pg:busy")
                .unwrap()
                .try_lock_for(Duration::from_millis(50))
                .await
                .unwrap();
            guard.release().await.unwrap();
            client.shutdown().await;
        }
        common::eventually(
            Duration::from_secs(5),
            "the clients' connections close",
            || async { backends("r31gone").await == 0 },
        )
        .await;
        // One client, saturated: 40 tasks waiting on a row another transaction holds.
        let url = format!("{}?application_name=r31full", pg.url());
        let full = Client::builder()
            .response_timeout(Duration::from_secs(3))
            .connect(&url)
            .await
            .unwrap();
        let waiting = full.lock("pg:busy").unwrap();
        let _w = tokio::spawn(async move { waiting.lock().await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut blocking = admin.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM distlock_locks WHERE name = 'pg:x' FOR UPDATE")
            .execute(&mut *blocking)
            .await
            .unwrap();
        let mut tries = Vec::new();
        for _ in 0..40 {
            let lock = full.lock("pg:x").unwrap();
            tries.push(tokio::spawn(async move {
                lock.try_lock().await.map(|g| g.is_some())
            }));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let open = backends("r31full").await;
        blocking.rollback().await.unwrap();
        for task in tries {
            let _ = task.await;
        }
        println!(
            "20 clients came and went: 0 connections left; a saturated client: {open} connections"
        );
        // 8 for lock calls, 2 for renewals and releases, 1 that LISTENs.
        assert!(open <= 11, "{open}");
        busy.release().await.unwrap();
    })
    .await;
}

/// A role or URL with `lock_timeout` (a common DBA guard, `ALTER ROLE app SET
/// lock_timeout = '100ms'`): an attempt that waits on the lock's row longer than that
/// (another transaction touching the row) is cancelled with SQLSTATE 55P03, and
/// distlock reports it as a failed request: `lock()`, which should wait, returns the
/// error, and `try_lock()` errs where it should answer "busy". Under heavy contention
/// with a few-ms lock_timeout the same happens between distlock's own clients (7 of
/// 1,920 `lock()` calls failed with lock_timeout=2ms, 64 tasks on 2 clients).
#[tokio::test]
async fn break_lock_timeout_turns_a_wait_into_an_error() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let url = format!("{}?options=-c%20lock_timeout%3D100ms", pg.url());
    let client = client_at(&url, Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let lock = client.lock("pg:guarded").unwrap();
        lock.lock().await.unwrap().release().await.unwrap();
        let mut blocking = admin.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM distlock_locks WHERE name = 'pg:guarded' FOR UPDATE")
            .execute(&mut *blocking)
            .await
            .unwrap();
        let waiting = {
            let lock = lock.clone();
            tokio::spawn(async move { lock.try_lock_for(Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_millis(400)).await;
        blocking.commit().await.unwrap();
        let outcome = waiting.await.unwrap();
        assert!(
            matches!(outcome, Ok(Some(_))),
            "try_lock_for(5 s) on a lock whose row was busy for 400 ms: {:?}",
            outcome.map(|g| g.is_some())
        );
    })
    .await;
}

/// The holder's link is cut (connections reset, new ones refused) rather than
/// blackholed: its lost signal still fires before another client holds the lock.
#[tokio::test]
async fn holds_a_cut_link_fires_the_lost_signal_before_anyone_else_holds() {
    let pg = Pg::start(&[]).await;
    let proxy = FaultProxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], pg.port)))
        .await
        .unwrap();
    let through_proxy = format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port());
    let holder = client_at(&through_proxy, Duration::from_millis(1500)).await;
    let other = client_at(&pg.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let guard = holder.lock("pg:cut").unwrap().lock().await.unwrap();
        let lost = guard.lost_token();
        proxy.cut().await;
        let lock = other.lock("pg:cut").unwrap();
        let other_holds = tokio::spawn(async move {
            let guard = lock.lock().await.unwrap();
            (Instant::now(), guard)
        });
        lost.cancelled().await;
        let lost_at = Instant::now();
        let (other_at, taken) = other_holds.await.unwrap();
        println!(
            "cut: the other held {:?} after the loss",
            other_at.duration_since(lost_at)
        );
        assert!(lost_at < other_at);
        assert!(taken.fencing_token() > guard.fencing_token());
        proxy.heal();
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
    })
    .await;
}

/// A database (or role) whose default isolation is REPEATABLE READ or SERIALIZABLE
/// (`ALTER DATABASE … SET default_transaction_isolation`, chosen by shops that want
/// serializable by default): an acquisition that meets a row another transaction just
/// updated fails with 40001 "could not serialize access", which distlock classifies as
/// a connection failure, and `lock()` (no deadline: "hears it now") returns it. Under
/// plain contention between distlock's own clients this happens too: 4 of 480 `lock()`
/// calls failed at SERIALIZABLE, 1 of 480 at REPEATABLE READ (16 tasks on 2 clients);
/// no overlap. The statement was rolled back: it could simply be sent again.
#[tokio::test]
async fn break_a_serialization_conflict_fails_lock_instead_of_waiting() {
    let pg = Pg::start(&[]).await;
    let admin = pg.admin().await;
    let url = format!(
        "{}?options=-c%20default_transaction_isolation%3Drepeatable%5C%20read",
        pg.url()
    );
    let client = client_at(&url, Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let lock = client.lock("pg:iso").unwrap();
        lock.lock().await.unwrap().release().await.unwrap();
        let mut other = admin.begin().await.unwrap();
        sqlx::query("UPDATE distlock_locks SET holds = holds WHERE name = 'pg:iso'")
            .execute(&mut *other)
            .await
            .unwrap();
        let waiting = {
            let lock = lock.clone();
            tokio::spawn(async move { lock.lock().await })
        };

        common::eventually(
            Duration::from_secs(5),
            "the attempt waits on the row",
            || async { lock_waiters(&admin).await == 1 },
        )
        .await;
        other.commit().await.unwrap();
        let outcome = waiting.await.unwrap();
        assert!(
            outcome.is_ok(),
            "lock() on a free lock whose row another transaction had just updated: {:?}",
            outcome.err()
        );
    })
    .await;
}
