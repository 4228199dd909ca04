//! The lease lock on PostgreSQL (feature `postgres`): the same `Client` and `Lock` API as
//! on Redis, on a private PostgreSQL cluster each test starts (initdb in a temp dir).
//!
//! Each test asserts an outcome that could fail: overlaps and token regressions counted
//! and asserted zero, a waiter woken well before the holder's lease ends, a lost signal
//! that fires before anyone else can hold the lock, typed errors for bad input.

mod common;
// The permit semaphore.
mod postgres_permits;
// The read-write lock.
mod postgres_rw;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use common::{bounded, child_holding, contend, join_bounded};
use distlock::{Client, Error, ReleaseOutcome, StoreFailure};
use distlock_testkit::{FaultProxy, PostgresServer};

const LIMIT: Duration = Duration::from_secs(60);

async fn database() -> PostgresServer {
    PostgresServer::start().await.expect("start postgres")
}

async fn client_at(url: &str, watchdog: Duration) -> Client {
    Client::builder()
        .watchdog_timeout(watchdog)
        .response_timeout(Duration::from_millis(500))
        .connection_timeout(Duration::from_secs(2))
        .connect(url)
        .await
        .expect("connect to postgres")
}

/// A fault proxy in front of the database, and the URL that goes through it.
async fn behind_proxy(server: &PostgresServer) -> (FaultProxy, String) {
    let proxy = FaultProxy::start(SocketAddr::from((Ipv4Addr::LOCALHOST, server.port())))
        .await
        .expect("start a fault proxy");
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port());
    (proxy, url)
}

/// A raw pool on the test database, to look at and change what distlock keeps.
async fn raw(server: &PostgresServer) -> sqlx::PgPool {
    sqlx::PgPool::connect(&server.url())
        .await
        .expect("raw postgres connection")
}

#[tokio::test]
async fn holders_on_two_clients_never_overlap_and_their_tokens_grow() {
    let server = database().await;
    let clients = [
        client_at(&server.url(), Duration::from_secs(5)).await,
        client_at(&server.url(), Duration::from_secs(5)).await,
    ];
    let (report, count) = contend(&clients, "pg:contended", 4, 12).await;
    assert_eq!(report.holds, 96);
    assert!(report.overlaps.is_empty(), "{:?}", report.overlaps);
    assert!(
        report.token_regressions.is_empty(),
        "{:?}",
        report.token_regressions
    );
    assert_eq!(count, 96, "an update was lost");
}

#[tokio::test]
async fn a_release_wakes_a_waiter_at_once_rather_than_at_the_lease_end() {
    let server = database().await;
    let holder = client_at(&server.url(), Duration::from_secs(30)).await;
    let waiter = client_at(&server.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let lease = Duration::from_secs(20);
        let guard = holder
            .lock("pg:handoff")
            .unwrap()
            .with_lease(lease)
            .lock()
            .await
            .unwrap();
        let lock = waiter.lock("pg:handoff").unwrap();
        let waiting = tokio::spawn(async move {
            let guard = lock.lock().await.unwrap();
            let acquired_at = Instant::now();
            guard.release().await.unwrap();
            acquired_at
        });
        // Let the waiter find the lock busy and LISTEN (a missed NOTIFY would leave it
        // asleep until the lease's end, 20 s away).
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished());
        let released_at = Instant::now();
        guard.release().await.unwrap();
        let acquired_at = waiting.await.unwrap();
        let handoff = acquired_at.duration_since(released_at);
        assert!(
            handoff < Duration::from_secs(2),
            "the waiter took {handoff:?} after the release: not woken by NOTIFY"
        );
    })
    .await;
}

#[tokio::test]
async fn the_watchdog_keeps_a_lock_past_its_lease_and_a_release_frees_it() {
    let server = database().await;
    let holder = client_at(&server.url(), Duration::from_millis(600)).await;
    let other = client_at(&server.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let guard = holder.lock("pg:renewed").unwrap().lock().await.unwrap();
        let lock = other.lock("pg:renewed").unwrap();
        // Four leases long: renewed every 200 ms, never lost.
        tokio::select! {
            _ = guard.lost() => panic!("a renewed lock was reported lost"),
            _ = tokio::time::sleep(Duration::from_millis(2400)) => {}
        }
        assert!(lock.try_lock().await.unwrap().is_none());
        assert!(lock.is_locked().await.unwrap());
        let left = lock.remaining_ttl().await.unwrap().expect("held");
        assert!(left <= Duration::from_millis(600), "{left:?}");
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
        assert!(!lock.is_locked().await.unwrap());
        assert!(lock.try_lock().await.unwrap().is_some());
    })
    .await;
}

#[tokio::test]
async fn reentry_a_fixed_lease_and_the_token_counter() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let lock = client.lock("pg:reentered").unwrap();
        let first = lock.lock().await.unwrap();
        let second = first.reenter().await.unwrap();
        assert_eq!(first.hold_count(), 2);
        assert_eq!(second.release().await.unwrap(), ReleaseOutcome::Released);
        assert!(
            lock.is_locked().await.unwrap(),
            "a partial release freed it"
        );
        let token = first.fencing_token();
        assert!(lock.last_fencing_token().await.unwrap() >= token);
        first.release().await.unwrap();
        assert!(!lock.is_locked().await.unwrap());

        let fixed = lock
            .with_lease(Duration::from_secs(2))
            .lock()
            .await
            .unwrap();
        assert!(fixed.fencing_token() > token);
        fixed.extend(Duration::from_secs(10)).await.unwrap();
        let left = lock.remaining_ttl().await.unwrap().expect("held");
        assert!(left > Duration::from_secs(5), "{left:?}");
        fixed.release().await.unwrap();

        assert!(lock.advance_fencing_counter(1_000_000).await.unwrap() >= 1_000_000);
        let after = lock.lock().await.unwrap();
        assert!(
            after.fencing_token() > 1_000_000,
            "{}",
            after.fencing_token()
        );
        after.release().await.unwrap();
        // Never lowered.
        assert!(lock.advance_fencing_counter(5).await.unwrap() > 1_000_000);
    })
    .await;
}

#[tokio::test]
async fn a_force_unlock_fires_the_lost_signal_at_its_notification() {
    let server = database().await;
    let holder = client_at(&server.url(), Duration::from_secs(30)).await;
    let operator = client_at(&server.url(), Duration::from_secs(30)).await;
    bounded(LIMIT, async {
        let guard = holder.lock("pg:forced").unwrap().lock().await.unwrap();
        let lost = guard.lost_token();
        // Asking for the signal starts the holding's listener; let it LISTEN.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let forced_at = Instant::now();
        assert!(operator
            .lock("pg:forced")
            .unwrap()
            .force_unlock()
            .await
            .unwrap());
        bounded(Duration::from_secs(5), lost.cancelled()).await;
        let noticed = forced_at.elapsed();
        assert!(noticed < Duration::from_secs(2), "{noticed:?}");
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::AlreadyLost);
    })
    .await;
}

/// The client reaches the database through a proxy that then swallows everything: the
/// holder cannot renew, and its lost signal must fire before another client, on a
/// direct connection, can take the lock.
#[tokio::test]
async fn a_database_out_of_reach_fires_the_lost_signal_before_anyone_else_holds() {
    let server = database().await;
    let (proxy, through_proxy) = behind_proxy(&server).await;
    let lease = Duration::from_millis(1500);
    let holder = client_at(&through_proxy, lease).await;
    let other = client_at(&server.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let guard = holder.lock("pg:cut-off").unwrap().lock().await.unwrap();
        let taken_at = Instant::now();
        proxy.blackhole();
        let lost = guard.lost_token();
        let lost_at =
            common::lost_before_another_holds(lost, other.lock("pg:cut-off").unwrap()).await;
        assert!(lost_at.duration_since(taken_at) < lease + Duration::from_millis(200));
        proxy.heal();
        drop(guard);
    })
    .await;
}

/// Entry point of the child process below; skipped in a normal run.
#[tokio::test]
#[ignore = "run as a child process by a_killed_holders_lock_is_free_when_its_lease_ends"]
async fn pg_child_holder() {
    let Ok(url) = std::env::var("DISTLOCK_PG_CHILD_URL") else {
        panic!("pg_child_holder runs only as a child process");
    };
    let client = client_at(&url, Duration::from_millis(900)).await;
    let guard = client.lock("pg:orphaned").unwrap().lock().await.unwrap();
    println!("HELD {}", guard.fencing_token());
    std::future::pending::<()>().await;
}

#[tokio::test]
async fn a_killed_holders_lock_is_free_when_its_lease_ends() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        let (mut child, token) =
            child_holding("pg_child_holder", "DISTLOCK_PG_CHILD_URL", &server.url()).await;
        let lock = client.lock("pg:orphaned").unwrap();
        assert!(lock.is_locked().await.unwrap());
        child.kill().await.unwrap();
        let killed_at = Instant::now();
        let guard = lock.lock().await.unwrap();
        let freed_after = killed_at.elapsed();
        assert!(
            freed_after <= Duration::from_millis(900 + 400),
            "{freed_after:?}"
        );
        assert!(guard.fencing_token() > token);
        guard.release().await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn an_acquisition_dropped_mid_wait_leaves_nothing_behind() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_secs(5)).await;
    let pool = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("pg:dropped").unwrap();
        let guard = lock.lock().await.unwrap();
        for _ in 0..5 {
            let waiter = lock.clone();
            let outcome = tokio::time::timeout(Duration::from_millis(50), waiter.lock()).await;
            assert!(outcome.is_err(), "a held lock was acquired");
        }
        guard.release().await.unwrap();
        // Every attempt is over; none left a holding.
        let held: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM distlock_locks WHERE expires_at > clock_timestamp()",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(held, 0);
        assert!(lock.try_lock().await.unwrap().is_some());
    })
    .await;
}

#[tokio::test]
async fn clients_starting_together_on_an_empty_database_all_connect() {
    let server = database().await;
    let url = server.url();
    let connecting = (0..6).map(|_| {
        let url = url.clone();
        tokio::spawn(async move { Client::connect(&url).await.map(|_| ()) })
    });
    for connected in join_bounded(LIMIT, connecting.collect()).await {
        connected.expect("a client starting beside others failed");
    }
}

#[tokio::test]
async fn bad_input_and_missing_rights_are_typed_errors() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_secs(5)).await;
    let pool = raw(&server).await;
    bounded(LIMIT, async {
        // What PostgreSQL cannot keep, refused before anything is sent.
        assert!(matches!(
            client.lock("nul\0name"),
            Err(Error::InvalidName { .. })
        ));
        assert!(matches!(
            client.lock("x".repeat(3000)),
            Err(Error::InvalidName { .. })
        ));
        // What only Redis has so far.
        assert!(matches!(
            client.fair_lock("f"),
            Err(Error::Unsupported {
                store: "PostgreSQL",
                ..
            })
        ));
        assert!(matches!(
            client.semaphore("s"),
            Err(Error::Unsupported { .. })
        ));
        assert!(matches!(
            client.dedicated_connection(Duration::from_secs(1)).await,
            Err(Error::Unsupported { .. })
        ));
        // A Redis command on the client's connection fails, naming the store.
        let mut connection = client.connection();
        let refused: redis::RedisResult<String> =
            redis::cmd("PING").query_async(&mut connection).await;
        let refused = refused.expect_err("no Redis behind a PostgreSQL client");
        assert!(refused.to_string().contains("PostgreSQL"), "{refused}");

        // A user without rights on the lock table.
        sqlx::query("CREATE ROLE visitor LOGIN")
            .execute(&pool)
            .await
            .unwrap();
        let visitor = format!("postgres://visitor@127.0.0.1:{}/postgres", server.port());
        match Client::connect(&visitor).await {
            Err(Error::Store {
                failure: StoreFailure::PermissionDenied,
                detail,
                ..
            }) => assert!(detail.contains("docs/safety.md"), "{detail}"),
            Ok(visitor) => match visitor.lock("x").unwrap().try_lock().await {
                Err(Error::Store {
                    failure: StoreFailure::PermissionDenied,
                    ..
                }) => {}
                other => panic!("a user without rights: {other:?}"),
            },
            Err(other) => panic!("a user without rights: {other:?}"),
        }
        // A role that does not exist, a database that does not exist, a closed port.
        let nobody = format!("postgres://nobody@127.0.0.1:{}/postgres", server.port());
        assert!(matches!(
            Client::connect(&nobody).await,
            Err(Error::Store {
                failure: StoreFailure::PermissionDenied,
                ..
            })
        ));
        let missing = format!("postgres://postgres@127.0.0.1:{}/missing", server.port());
        assert!(matches!(
            Client::connect(&missing).await,
            Err(Error::Store {
                failure: StoreFailure::Request,
                ..
            })
        ));
        let closed = format!("postgres://postgres@127.0.0.1:{}/postgres", free_port());
        match Client::connect(&closed).await {
            Err(err) => assert!(err.is_connection_error(), "{err:?}"),
            Ok(_) => panic!("connected to a closed port"),
        }
        assert!(matches!(
            Client::connect("postgres://[::1").await,
            Err(Error::InvalidUrl { .. })
        ));
    })
    .await;
}

/// A loopback port nothing listens on.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    listener.local_addr().unwrap().port()
}

/// A release whose reply is lost is sent again; the database ran the first one, and the
/// retry must still answer "released" (the row keeps the release's request id), not
/// "already lost".
#[tokio::test]
async fn a_release_retried_after_a_lost_reply_gets_the_first_answer() {
    let server = database().await;
    // Replies wait at most 500 ms (client_at).
    let client = client_at(&server.url(), Duration::from_secs(30)).await;
    let pool = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("pg:retried").unwrap();
        let guard = lock.lock().await.unwrap();
        // Another transaction holds the row, so the release's statement waits in the
        // database: the client gives up on its reply after 500 ms and sends it again.
        let mut blocking = pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM distlock_locks WHERE name = $1 FOR UPDATE")
            .bind("pg:retried")
            .execute(&mut *blocking)
            .await
            .unwrap();
        let release = tokio::spawn(guard.release());
        tokio::time::sleep(Duration::from_millis(750)).await;
        // Both statements now run, the first one first: it frees the lock, and the retry
        // finds the lock freed by its own request.
        blocking.commit().await.unwrap();
        let outcome = release.await.unwrap();
        assert_eq!(
            outcome.expect("the retried release failed"),
            ReleaseOutcome::Released
        );
        assert!(!lock.is_locked().await.unwrap());
    })
    .await;
}

/// The programs in examples/ run on PostgreSQL unchanged but for the URL (they read it
/// from REDIS_URL, as on Redis). `./dev test` builds them with the `postgres` feature
/// first; `cargo test -p distlock --features postgres` does too.
#[tokio::test]
async fn the_examples_run_unchanged_on_postgres() {
    let server = database().await;
    common::examples::all_run_unchanged(&server.url(), Some("postgres"));
}

/// A burst of calls larger than the client's pool waits for a free connection (at most
/// the connection timeout) before its response timeout starts: 48 try_locks at once
/// over a 40 ms round trip queue for about 240 ms behind the 8 connections, longer than
/// the 150 ms response timeout, and none fails.
#[tokio::test]
async fn a_burst_larger_than_the_pool_waits_for_a_connection_not_for_its_timeout() {
    let server = database().await;
    let (proxy, url) = behind_proxy(&server).await;
    proxy.set_delay_in(distlock_testkit::Direction::Both, Duration::from_millis(20));
    let client = Client::builder()
        .response_timeout(Duration::from_millis(150))
        .connection_timeout(Duration::from_secs(5))
        .connect(&url)
        .await
        .unwrap();
    let tries = (0..48).map(|n| {
        let lock = client.lock(format!("pg:burst:{n}")).unwrap();
        tokio::spawn(async move {
            let guard = lock.try_lock().await?;
            if let Some(guard) = guard {
                guard.release().await?;
            }
            Ok::<_, Error>(())
        })
    });
    let failed: Vec<String> = join_bounded(LIMIT, tries.collect())
        .await
        .into_iter()
        .filter_map(|outcome| outcome.err().map(|err| err.to_string()))
        .collect();
    assert!(
        failed.is_empty(),
        "{} of 48 failed: {:?}",
        failed.len(),
        failed.first()
    );
}
