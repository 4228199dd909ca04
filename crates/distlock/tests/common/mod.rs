//! Shared fixtures: a private redis-server per test and clients on it.
#![allow(dead_code)]

pub mod etcd;
pub mod examples;
// The reviews' PostgreSQL harness: sqlx speaks PostgreSQL only with the feature.
pub mod permits;
#[cfg(feature = "postgres")]
pub mod pg;
pub mod redisson_fair;
pub mod rw;

use std::future::Future;
use std::time::{Duration, Instant};

use distlock::{Client, ReleaseOutcome};
use distlock_testkit::{ExclusionChecker, ExclusionReport, FaultProxy, RedisServer};

/// The switch the shared cut-off scenarios take: `true` swallows everything every proxy
/// carries, `false` lets it through again.
pub fn cut_switch(proxies: &[FaultProxy]) -> impl Fn(bool) + '_ {
    move |cut| {
        for proxy in proxies {
            if cut {
                proxy.blackhole();
            } else {
                proxy.heal();
            }
        }
    }
}

/// Fails the test, instead of hanging it, when `future` does not finish in `limit`.
pub async fn bounded<T>(limit: Duration, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, future).await {
        Ok(value) => value,
        Err(_) => panic!("test step did not finish within {limit:?}"),
    }
}

/// Waits for every task, failing the test if one panicked or they take longer than
/// `limit` in all.
pub async fn join_bounded<T>(limit: Duration, tasks: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    bounded(limit, async {
        let mut outputs = Vec::with_capacity(tasks.len());
        for task in tasks {
            outputs.push(task.await.expect("a task panicked"));
        }
        outputs
    })
    .await
}

/// A fresh redis-server on a free loopback port.
pub async fn server() -> RedisServer {
    RedisServer::start().await.expect("start redis-server")
}

/// A client with default settings.
pub async fn client(server: &RedisServer) -> Client {
    Client::connect(&server.url()).await.expect("connect")
}

/// A client whose watchdog lease is `watchdog`, so lease behaviour shows within a test.
pub async fn client_with_watchdog(server: &RedisServer, watchdog: Duration) -> Client {
    Client::builder()
        .watchdog_timeout(watchdog)
        .response_timeout(Duration::from_millis(200))
        .connection_timeout(Duration::from_millis(500))
        .connect(&server.url())
        .await
        .expect("connect")
}

/// A raw connection for checking what is in Redis.
pub async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    server.connection().await.expect("raw connection")
}

/// Waits until `check` is true, looking again every few milliseconds, for state that
/// changes in the background with no event to await (a server-side unsubscribe).
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let give_up = tokio::time::Instant::now() + limit;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < give_up,
            "{what}: still false after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// How many subscribers the server counts on `channel`.
pub async fn subscribers(conn: &mut redis::aio::MultiplexedConnection, channel: &str) -> i64 {
    let reply: (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query_async(conn)
        .await
        .expect("PUBSUB NUMSUB");
    reply.1
}

/// Waits until the server counts `count` subscribers on `channel`.
pub async fn until_subscribers(
    conn: &redis::aio::MultiplexedConnection,
    channel: &str,
    count: i64,
) {
    let what = format!("{count} subscriber(s) on {channel}");
    eventually(Duration::from_secs(5), &what, || {
        let mut conn = conn.clone();
        let channel = channel.to_owned();
        async move { subscribers(&mut conn, &channel).await == count }
    })
    .await;
}

/// Waits until nobody holds `lock` (background releases finish on their own time).
pub async fn until_free(lock: &distlock::Lock) {
    eventually(Duration::from_secs(10), "the lock is free", || {
        let lock = lock.clone();
        async move { matches!(lock.is_locked().await, Ok(false)) }
    })
    .await;
}

/// Whether the server still has `guard`'s owner in its lock hash.
pub async fn holds(
    conn: &mut redis::aio::MultiplexedConnection,
    guard: &distlock::LockGuard,
) -> bool {
    redis::cmd("HEXISTS")
        .arg(guard.name())
        .arg(guard.owner())
        .query_async::<i64>(conn)
        .await
        .expect("HEXISTS")
        == 1
}

/// The values of every per-slot fencing counter on the server.
pub async fn fencing_counters(conn: &mut redis::aio::MultiplexedConnection) -> Vec<u64> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("distlock_fence:*")
        .query_async(conn)
        .await
        .expect("KEYS");
    let mut values = Vec::new();
    for key in keys {
        let value: u64 = redis::cmd("GET")
            .arg(&key)
            .query_async(conn)
            .await
            .expect("GET counter");
        values.push(value);
    }
    values
}

/// Takes `name` once through `client` and releases it: proof the client works.
pub async fn lock_once(client: &Client, name: &str) {
    let guard = client.lock(name).unwrap().lock().await.unwrap();
    guard.release().await.unwrap();
}

/// A runtime of the given flavour; `workers` applies to a multi-thread one.
pub fn runtime_with(multi_thread: bool, workers: usize) -> tokio::runtime::Runtime {
    let mut builder = if multi_thread {
        tokio::runtime::Builder::new_multi_thread()
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    builder
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap()
}

/// A synchronous connection, usable from a thread whose runtime is blocked.
pub fn sync_connection(server: &RedisServer) -> redis::Connection {
    server.client().unwrap().get_connection().unwrap()
}

/// Polls `key` from the calling thread, with no runtime, until `present` says what it
/// should; true if it did within `limit`.
pub fn key_becomes(
    conn: &mut redis::Connection,
    key: &str,
    present: bool,
    limit: Duration,
) -> bool {
    let give_up = Instant::now() + limit;
    loop {
        let exists: i64 = redis::cmd("EXISTS").arg(key).query(conn).unwrap();
        if (exists == 1) == present {
            return true;
        }
        if Instant::now() >= give_up {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Polls `future` exactly once, as a `select!` whose other branch is ready at once does,
/// and drops it. (On a current-thread runtime a network call cannot finish in one poll;
/// on a multi-thread one, another worker may rarely answer it within that poll.)
pub async fn cancel_after_first_poll<F: std::future::Future>(future: F) {
    let mut future = std::pin::pin!(future);
    let _ = futures_util::poll!(future.as_mut());
}

/// Occupies every worker of a multi-thread runtime with synchronous work for `busy`, and
/// returns once all of them are inside it.
pub fn block_every_worker(runtime: &tokio::runtime::Runtime, workers: usize, busy: Duration) {
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    for _ in 0..workers {
        let started = started_tx.clone();
        runtime.spawn(async move {
            let _ = started.send(());
            std::thread::sleep(busy);
        });
    }
    for _ in 0..workers {
        started_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("a worker started its synchronous work");
    }
}

/// Whether `key` exists on `server`, asked on a raw connection.
pub async fn key_exists(server: &RedisServer, key: &str) -> bool {
    let mut conn = server.connection().await.expect("raw connection");
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<i64>(&mut conn)
        .await
        .expect("EXISTS")
        == 1
}

/// The first half of a lossy failover: `client` tries each of `names` once, while no
/// replica can receive the writes. Returns the guards it got; every refusal must be
/// `NotReplicated` with no acknowledgement (replica sync refusing the grant).
pub async fn take_while_unreplicated(
    client: &Client,
    names: &[String],
) -> Vec<distlock::LockGuard> {
    let attempts = names.iter().map(|name| {
        let lock = client.lock(name.clone()).unwrap();
        async move { lock.try_lock().await }
    });
    let outcomes = bounded(
        Duration::from_secs(60),
        futures_util::future::join_all(attempts),
    )
    .await;
    let mut held = Vec::new();
    for outcome in outcomes {
        match outcome {
            Ok(Some(guard)) => held.push(guard),
            Ok(None) => panic!("a trial lock was busy"),
            Err(distlock::Error::NotReplicated { acknowledged, .. }) => assert_eq!(acknowledged, 0),
            Err(err) => panic!("unexpected: {err}"),
        }
    }
    held
}

/// The second half: after the failover, `other` asks for each of `names` (for up to 2 s
/// each). Returns how many it got, and how many of those while a guard of `held` still
/// trusted the same lock: the double grants.
pub async fn double_grants(
    other: &Client,
    names: &[String],
    held: &[distlock::LockGuard],
) -> (usize, usize) {
    let (mut got_any, mut double) = (0, 0);
    for name in names {
        let got = bounded(
            Duration::from_secs(60),
            other
                .lock(name.clone())
                .unwrap()
                .try_lock_for(Duration::from_secs(2)),
        )
        .await
        .unwrap();
        if got.is_some() {
            got_any += 1;
            if held
                .iter()
                .any(|guard| guard.name() == name && !guard.is_lost())
            {
                double += 1;
            }
        }
    }
    (got_any, double)
}

/// How many WAITs `server` has run (each synced write sends one).
pub async fn waits(server: &RedisServer) -> u64 {
    server
        .info_commandstats()
        .await
        .expect("INFO commandstats")
        .get("wait")
        .copied()
        .unwrap_or(0)
}

/// Waits until `server` has run at least `count` WAITs.
pub async fn until_waits(server: &RedisServer, count: u64) {
    eventually(Duration::from_secs(10), "refused synced writes", || async {
        waits(server).await >= count
    })
    .await;
}

/// Sets `server`'s `maxmemory-policy` (an evicting one makes distlock refuse to lock).
pub async fn set_eviction_policy(conn: &mut redis::aio::MultiplexedConnection, policy: &str) {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg(policy)
        .query_async(conn)
        .await
        .expect("CONFIG SET maxmemory-policy");
}

/// A waiter that was still waiting while `replica` was away (`why` says what it must
/// not have done): once the replica is back, it gets a guard it can trust.
pub async fn acquired_once_the_replica_is_back(
    replica: &RedisServer,
    waiter: tokio::task::JoinHandle<distlock::Result<Option<distlock::LockGuard>>>,
    why: &str,
) {
    assert!(!waiter.is_finished(), "{why}");
    replica.resume().expect("resume the replica");
    let guard = bounded(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter's task")
        .expect("acquired once the replica answered")
        .expect("within the wait");
    assert!(!guard.is_lost());
    guard.release().await.expect("release");
}

/// `tasks` tasks on each client take lock `name` `rounds` times each, doing a
/// read-modify-write with a yield in the middle under it (a second holder would lose an
/// update) and recording each hold. Returns what the holds showed and the count the
/// updates reached (`clients × tasks × rounds` when none was lost).
pub async fn contend(
    clients: &[Client],
    name: &str,
    tasks: usize,
    rounds: usize,
) -> (ExclusionReport, u64) {
    let checker = std::sync::Arc::new(ExclusionChecker::new());
    let counter = std::sync::Arc::new(std::sync::Mutex::new(0_u64));
    let mut running = Vec::new();
    for (c, client) in clients.iter().enumerate() {
        for t in 0..tasks {
            let lock = client.lock(name).expect("a valid name");
            let (checker, counter) = (checker.clone(), counter.clone());
            running.push(tokio::spawn(async move {
                for _ in 0..rounds {
                    let guard = lock.lock().await.expect("lock");
                    let hold = checker.enter(guard.fencing_token(), format!("{c}/{t}"));
                    let read = *counter.lock().expect("counter");
                    tokio::task::yield_now().await;
                    *counter.lock().expect("counter") = read + 1;
                    hold.finish();
                    assert_eq!(
                        guard.release().await.expect("release"),
                        ReleaseOutcome::Released
                    );
                }
            }));
        }
    }
    join_bounded(Duration::from_secs(60), running).await;
    let count = *counter.lock().expect("counter");
    (checker.report(), count)
}

/// Runs this test binary's ignored test `child` as a child process (killed when the
/// returned handle is dropped), with `variable` set to `url`, and waits until it says it
/// holds its lock: `HELD <token>` on its stdout. Returns the process and the token.
pub async fn child_holding(child: &str, variable: &str, url: &str) -> (tokio::process::Child, u64) {
    use tokio::io::AsyncBufReadExt;
    let mut process = tokio::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            child,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(variable, url)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("child process");
    let stdout = process.stdout.take().expect("piped stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let token = loop {
        let line = lines
            .next_line()
            .await
            .expect("child's stdout")
            .expect("the child says it holds its lock");
        // The test harness may have written the test's name on the same line.
        if let Some((_, token)) = line.split_once("HELD ") {
            break token.trim().parse::<u64>().expect("a token");
        }
    };
    (process, token)
}

/// Waits for a holder's lost signal (`lost`) while `other` (the same lock, on a client
/// that still reaches the store) waits to take it, and asserts the holder learned of its
/// loss first: the promise of `lost()`. Answers when the loss was signalled.
pub async fn lost_before_another_holds(
    lost: tokio_util::sync::CancellationToken,
    other: distlock::Lock,
) -> Instant {
    let other_holds = tokio::spawn(async move {
        let guard = other.lock().await.expect("the other client takes the lock");
        let at = Instant::now();
        guard.release().await.expect("the other client releases it");
        at
    });
    lost.cancelled().await;
    let lost_at = Instant::now();
    let other_at = other_holds.await.expect("the other client's task");
    assert!(
        lost_at < other_at,
        "the holder learned of its loss {:?} after another client held the lock",
        lost_at.duration_since(other_at)
    );
    lost_at
}
