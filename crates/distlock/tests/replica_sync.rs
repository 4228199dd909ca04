//! Replica sync on a plain master with a replica: when it turns itself on, what an
//! unacknowledged acquisition does, and a server that refuses WAIT.

mod common;

use std::time::Duration;

use common::bounded;
use distlock::{Client, Error, ReplicaSync};
use distlock_testkit::RedisServer;

const LIMIT: Duration = Duration::from_secs(20);

/// A master and a replica that is online.
async fn replicated() -> (RedisServer, RedisServer) {
    let master = RedisServer::start().await.expect("master");
    let port = master.port().to_string();
    let replica = RedisServer::start_with_args(&["--replicaof", "127.0.0.1", &port])
        .await
        .expect("replica");
    let mut conn = master.connection().await.expect("connection");
    common::eventually(Duration::from_secs(10), "replica online", || {
        let mut conn = conn.clone();
        async move {
            redis::cmd("INFO")
                .arg("replication")
                .query_async::<String>(&mut conn)
                .await
                .is_ok_and(|info| info.contains("state=online"))
        }
    })
    .await;
    let _: () = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    (master, replica)
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_acquisition_retries_until_a_replica_acknowledges() {
    let (master, replica) = replicated().await;
    let client = connect(
        &master.url(),
        ReplicaSync::Replicas {
            count: 1,
            timeout: Duration::from_millis(100),
        },
    )
    .await;
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
    let client = connect(
        &url,
        ReplicaSync::Replicas {
            count: 1,
            timeout: Duration::from_millis(100),
        },
    )
    .await;
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
