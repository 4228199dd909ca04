//! Replica sync on a plain master with a replica: when it turns itself on, what an
//! unacknowledged acquisition does, and a server that refuses WAIT.

mod common;

use std::time::{Duration, Instant};

use common::bounded;
use distlock::{Client, Error, ReplicaSync};
use distlock_testkit::RedisServer;

const LIMIT: Duration = Duration::from_secs(20);

/// One replica within 100 ms: a replica that is away is noticed quickly.
const FAST_SYNC: ReplicaSync = ReplicaSync::Replicas {
    count: 1,
    timeout: Duration::from_millis(100),
};

/// A master and a replica that is online.
async fn replicated() -> (RedisServer, RedisServer) {
    let master = RedisServer::start().await.expect("master");
    let port = master.port().to_string();
    let replica = RedisServer::start_with_args(&["--replicaof", "127.0.0.1", &port])
        .await
        .expect("replica");
    let mut conn = master.connection().await.expect("connection");
    until_replication_shows(&conn, "state=online").await;
    let _: () = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    (master, replica)
}

/// Waits until the master's `INFO replication` contains `text`.
async fn until_replication_shows(conn: &redis::aio::MultiplexedConnection, text: &str) {
    common::eventually(Duration::from_secs(10), text, || {
        let mut conn = conn.clone();
        async move {
            redis::cmd("INFO")
                .arg("replication")
                .query_async::<String>(&mut conn)
                .await
                .is_ok_and(|info| info.contains(text))
        }
    })
    .await;
}

async fn connect(url: &str, sync: ReplicaSync) -> Client {
    Client::builder()
        .replica_sync(sync)
        .connect(url)
        .await
        .expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_sync_turns_on_with_a_replica_and_refuses_what_it_did_not_get() {
    let (master, replica) = replicated().await;
    let client = connect(&master.url(), ReplicaSync::Auto).await;
    let guard = client
        .lock("synced")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("free");
    guard.release().await.unwrap();

    // The replica stops answering: an acquisition waits for it (1 s by default), then is
    // given back.
    replica.pause().unwrap();
    let outcome = bounded(LIMIT, client.lock("synced").unwrap().try_lock()).await;
    replica.resume().unwrap();
    match outcome {
        Err(Error::NotReplicated {
            acknowledged: 0,
            required: 1,
            timeout,
            ..
        }) => assert_eq!(timeout, Duration::from_secs(1)),
        other => panic!("expected NotReplicated, got {other:?}"),
    }
    assert!(!client.lock("synced").unwrap().is_locked().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_sync_stays_off_without_replicas() {
    let master = RedisServer::start().await.expect("master");
    let client = connect(&master.url(), ReplicaSync::Auto).await;
    let guard = client
        .lock("alone")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("free");
    guard.release().await.unwrap();
    let stats = master.info_commandstats().await.unwrap();
    // The connect-time probe sends `WAIT 0 0` only when sync would be on.
    assert_eq!(stats.get("wait"), None, "{stats:?}");
}

/// Services often start before their replicas do. A client that connected to a master
/// with no replica must not stay unsynced for its whole life once one attaches: Auto
/// asks again every 5 s and turns sync on, after which an acquisition no replica
/// acknowledged fails as it would have had the replica been there at connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_sync_turns_on_when_a_replica_attaches_after_connect() {
    let master = RedisServer::start().await.expect("master");
    let client = connect(&master.url(), ReplicaSync::Auto).await;
    let lock = client.lock("late-replica").unwrap();
    lock.try_lock()
        .await
        .unwrap()
        .expect("free")
        .release()
        .await
        .unwrap();
    let stats = master.info_commandstats().await.unwrap();
    assert_eq!(
        stats.get("wait"),
        None,
        "no replica yet, no sync: {stats:?}"
    );

    let port = master.port().to_string();
    let replica = RedisServer::start_with_args(&["--replicaof", "127.0.0.1", &port])
        .await
        .expect("replica");
    // Sync is on once a lock write is followed by a WAIT: within one recheck (5 s) of
    // the replica coming online, plus the time it takes to come online.
    common::eventually(
        Duration::from_secs(15),
        "lock writes followed by WAIT",
        || {
            let (lock, master) = (lock.clone(), &master);
            async move {
                if let Ok(Some(guard)) = lock.try_lock().await {
                    let _ = guard.release().await;
                }
                let waits = master
                    .info_commandstats()
                    .await
                    .unwrap()
                    .get("wait")
                    .copied();
                // The probe sends one `WAIT 0 0`; a synced acquisition and release send two more.
                waits.unwrap_or(0) >= 3
            }
        },
    )
    .await;

    replica.pause().unwrap();
    let outcome = bounded(LIMIT, lock.try_lock()).await;
    replica.resume().unwrap();
    assert!(
        matches!(
            outcome,
            Err(Error::NotReplicated {
                acknowledged: 0,
                required: 1,
                ..
            })
        ),
        "expected NotReplicated, got {outcome:?}"
    );
    assert!(!lock.is_locked().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_acquisition_retries_until_a_replica_acknowledges() {
    let (master, replica) = replicated().await;
    let client = connect(&master.url(), FAST_SYNC).await;
    // Held by another client first (one without sync: its own acquisition must not
    // depend on how fast a loaded machine's replica acknowledges), so the call below is
    // already waiting when the replica goes away.
    let other = connect(&master.url(), ReplicaSync::Off).await;
    let holder = other.lock("retried").unwrap().lock().await.unwrap();
    let waiter = {
        let lock = client.lock("retried").unwrap();
        tokio::spawn(async move { lock.try_lock_for(Duration::from_secs(10)).await })
    };
    // Waiting: its first attempt found the lock held, and it subscribed to releases.
    let mut conn = master.connection().await.unwrap();
    common::eventually(Duration::from_secs(10), "the waiter subscribed", || {
        let mut conn = conn.clone();
        async move {
            let counts: Vec<(String, i64)> = redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg("redisson_lock__channel:{retried}")
                .query_async(&mut conn)
                .await
                .unwrap_or_default();
            counts.first().is_some_and(|(_, count)| *count >= 1)
        }
    })
    .await;
    let _: () = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    replica.pause().unwrap();
    holder.release().await.unwrap();
    // Attempts fail NotReplicated while the replica is away, and are retried.
    tokio::time::sleep(Duration::from_millis(500)).await;
    replica.resume().unwrap();
    let guard = bounded(LIMIT, waiter)
        .await
        .unwrap()
        .unwrap()
        .expect("acquired once the replica was back");
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_refuses_wait_turns_sync_off() {
    let (master, replica) = replicated().await;
    let mut admin = master.connection().await.unwrap();
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER", "nowait", "on", ">pw", "~*", "&*", "+@all", "-wait",
        ])
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!("redis://nowait:pw@127.0.0.1:{}/", master.port());
    let client = connect(&url, FAST_SYNC).await;
    // Sync is off: with the replica away, acquisitions still succeed (and a failover now
    // could lose them; docs/deployment.md says so).
    replica.pause().unwrap();
    let outcome = bounded(LIMIT, client.lock("unsynced").unwrap().try_lock()).await;
    replica.resume().unwrap();
    outcome
        .unwrap()
        .expect("acquired without sync")
        .release()
        .await
        .unwrap();
}

/// A WAIT refused after connect (here an ACL change; a WAITAOF on a master promoted
/// without AOF is another way) counts as no acknowledgement: the acquisition fails with
/// `NotReplicated` and is given back. (It used to fail with the server's error and leave
/// the lock granted on the master until its lease ran out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_refused_after_connect_gives_the_lock_back() {
    let (master, _replica) = replicated().await;
    let mut admin = master.connection().await.unwrap();
    let setuser = |rules: &'static [&'static str]| {
        let mut cmd = redis::cmd("ACL");
        cmd.arg("SETUSER").arg("app").arg(rules);
        cmd
    };
    let _: () = setuser(&["on", ">pw", "~*", "&*", "+@all"])
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!("redis://app:pw@127.0.0.1:{}/", master.port());
    let client = connect(&url, FAST_SYNC).await;
    let _: () = setuser(&["-wait"]).query_async(&mut admin).await.unwrap();
    let outcome = bounded(LIMIT, client.lock("refused-wait").unwrap().try_lock()).await;
    assert!(
        matches!(
            outcome,
            Err(Error::NotReplicated {
                acknowledged: 0,
                ..
            })
        ),
        "{outcome:?}"
    );
    let lock = client.lock("refused-wait").unwrap();
    common::eventually(
        Duration::from_secs(5),
        "the grant is given back",
        || async { !lock.is_locked().await.unwrap_or(true) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_sync_is_refused_when_it_cannot_be_met_or_is_nonsense() {
    let master = RedisServer::start().await.expect("master");
    let zero = Client::builder()
        .replica_sync(ReplicaSync::Replicas {
            count: 0,
            timeout: Duration::from_secs(1),
        })
        .connect(&master.url())
        .await;
    assert!(matches!(zero, Err(Error::InvalidConfig { .. })), "{zero:?}");
}

/// A paused replica: an acquisition fails with NotReplicated and leaves no key behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_replica_fails_the_acquisition_and_leaves_no_key() {
    let (master, replica) = replicated().await;
    let client = Client::builder()
        .replica_sync(ReplicaSync::Replicas {
            count: 1,
            timeout: Duration::from_millis(200),
        })
        .connect(&master.url())
        .await
        .expect("connect");
    replica.pause().expect("pause");
    let outcome = bounded(LIMIT, client.lock("synced").expect("lock").try_lock()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let left = common::key_exists(&master, "synced").await;
    replica.resume().expect("resume");
    assert!(
        matches!(outcome, Err(Error::NotReplicated { .. })),
        "{outcome:?}"
    );
    assert!(!left, "the unreplicated lock key was left on the master");
}

/// "No acknowledgement, no lock, then retried per the retry policy": a caller that is
/// willing to wait (`lock`, `try_lock_for`) waits through a replica that is briefly
/// away, as it would wait for a holder, instead of failing on its first attempt. Only
/// `try_lock` reports the refusal at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patient_acquisition_waits_through_a_replica_stall() {
    let (master, replica) = replicated().await;
    let client = connect(&master.url(), FAST_SYNC).await;
    replica.pause().unwrap();
    let waiter = {
        let lock = client.lock("stalled").unwrap();
        tokio::spawn(async move { lock.try_lock_for(Duration::from_secs(20)).await })
    };
    // Refused at least twice while the replica is away (each refusal is one WAIT that
    // timed out), then the replica comes back.
    common::until_waits(&master, 3).await;
    common::acquired_once_the_replica_is_back(
        &replica,
        waiter,
        "the waiter gave up while the replica was away",
    )
    .await;
}

/// A lost signal is final: once a renewal no replica acknowledged let the lease run out,
/// the guard is never trusted again, even when the replica comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_signal_is_final_when_the_replica_comes_back() {
    let (master, replica) = replicated().await;
    let client = Client::builder()
        .watchdog_timeout(Duration::from_millis(600))
        .response_timeout(Duration::from_millis(300))
        .replica_sync(FAST_SYNC)
        .connect(&master.url())
        .await
        .expect("connect");
    let guard = bounded(LIMIT, client.lock("renewed").expect("lock").lock())
        .await
        .expect("lock");
    let lost = guard.lost();
    replica.pause().expect("pause");
    bounded(Duration::from_secs(3), lost).await;
    assert!(guard.is_lost());
    replica.resume().expect("resume");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (is_lost, remaining) = (guard.is_lost(), guard.lease_remaining());
    let key_still_there = common::key_exists(&master, "renewed").await;
    drop(guard);
    assert!(
        is_lost,
        "lost() completed, then the guard was trusted again: is_lost()=false, \
         lease_remaining()={remaining:?}, key on master={key_still_there}"
    );
}

/// Asking for more replicas than there are: every acquisition fails with NotReplicated
/// and leaves no key behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_replicas_than_there_are_fails_every_acquisition() {
    let (master, _replica) = replicated().await;
    let connected = bounded(
        LIMIT,
        Client::builder()
            .replica_sync(ReplicaSync::Replicas {
                count: 5,
                timeout: Duration::from_millis(200),
            })
            .connect(&master.url()),
    )
    .await;
    let client = match connected {
        Err(err) => {
            eprintln!("refused at connect: {err}");
            return;
        }
        Ok(client) => client,
    };
    let started = Instant::now();
    let outcome = bounded(LIMIT, client.lock("five").expect("lock").try_lock()).await;
    eprintln!("try_lock: {outcome:?} after {:?}", started.elapsed());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !common::key_exists(&master, "five").await,
        "key left behind"
    );
    assert!(
        matches!(outcome, Err(Error::NotReplicated { .. })),
        "{outcome:?}"
    );
}

/// An acquisition cancelled while its WAIT is pending (a `select!` whose timer fires
/// first) is finished on the client's runtime: whether the replica acknowledged or not,
/// nothing stays held afterwards, and the lock is free for the next caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquisition_cancelled_during_its_wait_leaves_nothing_held() {
    let (master, replica) = replicated().await;
    let client = connect(
        &master.url(),
        ReplicaSync::Replicas {
            count: 1,
            timeout: Duration::from_millis(500),
        },
    )
    .await;
    let lock = client.lock("cancelled-mid-wait").unwrap();
    for round in 0..5 {
        replica.pause().unwrap();
        tokio::select! {
            outcome = lock.lock() => panic!("round {round}: finished with the replica paused: {outcome:?}"),
            _ = tokio::time::sleep(Duration::from_millis(50 + 40 * round)) => {}
        }
        replica.resume().unwrap();
        common::eventually(
            Duration::from_secs(5),
            "the cancelled grant given back",
            || async { !common::key_exists(&master, "cancelled-mid-wait").await },
        )
        .await;
        let other = connect(&master.url(), ReplicaSync::Off).await;
        let guard = bounded(LIMIT, other.lock("cancelled-mid-wait").unwrap().try_lock())
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("round {round}: still held after the cancellation"));
        guard.release().await.unwrap();
    }
}

/// Review: a backup taken with `redis-cli --rdb` is listed as a connected replica while
/// it downloads (`state=wait_bgsave`), which turned `Auto` on for good; once the backup
/// had gone, every lock write failed with `NotReplicated`. Only online replicas count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_download_does_not_turn_auto_sync_on() {
    // Diskless sync with a long delay keeps the backup listed as a replica for the test.
    let master = RedisServer::start_with_args(&[
        "--repl-diskless-sync",
        "yes",
        "--repl-diskless-sync-delay",
        "30",
    ])
    .await
    .expect("master");
    let client = connect(&master.url(), ReplicaSync::Auto).await;
    let backup_file = tempfile::NamedTempFile::new().unwrap();
    let mut backup = std::process::Command::new("redis-cli")
        .args(["-p", &master.port().to_string(), "--rdb"])
        .arg(backup_file.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("redis-cli is installed with redis-server");
    let conn = master.connection().await.unwrap();
    until_replication_shows(&conn, "connected_slaves:1").await;
    // Past one of Auto's rechecks (every 5 s) with the backup listed.
    tokio::time::sleep(Duration::from_millis(5_500)).await;
    let _ = backup.kill();
    let _ = backup.wait();
    let lock = client.lock("backed-up").unwrap();
    for _ in 0..3 {
        let guard = bounded(LIMIT, lock.try_lock()).await;
        let guard = guard
            .unwrap_or_else(|err| panic!("a lock write after a backup: {err}"))
            .expect("free");
        guard.release().await.unwrap();
    }
    let stats = master.info_commandstats().await.unwrap();
    assert_eq!(
        stats.get("wait"),
        None,
        "sync turned on for a backup: {stats:?}"
    );
}
