//! Replica sync for the lock family: the acquisitions of the fair lock, the read-write
//! lock and both semaphores wait for replicas as the lease lock's do. What no replica
//! acknowledged is given back, and the call fails with `NotReplicated`; a caller willing
//! to wait waits through the replica's absence.

mod common;

use std::time::Duration;

use common::bounded;
use distlock::{Client, Error, ReplicaSync};
use distlock_testkit::RedisServer;

const LIMIT: Duration = Duration::from_secs(30);

/// One replica within a second: long enough that a replica on a busy machine (tests run
/// in parallel) acknowledges the acquisitions meant to succeed.
const SYNC: ReplicaSync = ReplicaSync::Replicas {
    count: 1,
    timeout: Duration::from_secs(1),
};

/// A master with a replica that is online, and a client that syncs with it.
async fn replicated() -> (RedisServer, RedisServer, Client) {
    let master = RedisServer::start().await.expect("master");
    let port = master.port().to_string();
    let replica = RedisServer::start_with_args(&["--replicaof", "127.0.0.1", &port])
        .await
        .expect("replica");
    let conn = master.connection().await.expect("connection");
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
    let client = Client::builder()
        .replica_sync(SYNC)
        .connect(&master.url())
        .await
        .expect("connect");
    (master, replica, client)
}

fn refused<T: std::fmt::Debug>(what: &str, outcome: distlock::Result<T>) {
    assert!(
        matches!(
            outcome,
            Err(Error::NotReplicated {
                acknowledged: 0,
                required: 1,
                ..
            })
        ),
        "{what}: {outcome:?}"
    );
}

/// Every acquisition of the family fails while the replica is away, and leaves nothing
/// taken on the master: no hold, no queue entry, every permit free. Once the replica is
/// back, each succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreplicated_acquisitions_of_every_primitive_are_given_back() {
    let (master, replica, client) = replicated().await;
    let semaphore = client.semaphore("sem").unwrap();
    assert!(semaphore.try_set_permits(3).await.unwrap().is_set());
    let permits = client.permit_semaphore("permits").unwrap();
    assert!(permits.try_set_permits(2).await.unwrap().is_set());
    let fair = client.fair_lock("fair").unwrap();
    let rw = client.rw_lock("rw").unwrap();

    replica.pause().expect("pause");
    refused("fair try_lock", bounded(LIMIT, fair.try_lock()).await);
    // A wait that ends during the absence reports the refusal, never "busy".
    refused(
        "fair try_lock_for",
        bounded(LIMIT, fair.try_lock_for(Duration::from_millis(300))).await,
    );
    refused("write", bounded(LIMIT, rw.try_write()).await);
    refused("read", bounded(LIMIT, rw.try_read()).await);
    refused("semaphore", bounded(LIMIT, semaphore.try_acquire(2)).await);
    refused("drain", bounded(LIMIT, semaphore.drain_permits()).await);
    refused("permits", bounded(LIMIT, permits.try_acquire(1)).await);
    // Writes that take nothing stand on the master, and say nothing.
    let latch = client.count_down_latch("latch").unwrap();
    assert!(bounded(LIMIT, latch.try_set_count(2)).await.unwrap());
    assert_eq!(bounded(LIMIT, latch.count_down()).await.unwrap(), 1);

    // Read before the replica is back: the give-backs ran before the calls returned.
    let mut raw = master.connection().await.unwrap();
    for key in [
        "fair",
        "redisson_lock_queue:{fair}",
        "redisson_lock_timeout:{fair}",
        "distlock_fair_waiters:{fair}",
        "rw",
    ] {
        let exists: i64 = redis::cmd("EXISTS")
            .arg(key)
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(exists, 0, "{key} was left behind");
    }
    assert_eq!(semaphore.available_permits().await.unwrap(), 3);
    assert_eq!(permits.available_permits().await.unwrap(), 2);
    replica.resume().expect("resume");

    let fair_guard = bounded(LIMIT, fair.try_lock())
        .await
        .unwrap()
        .expect("free");
    fair_guard.release().await.unwrap();
    let writer = bounded(LIMIT, rw.try_write()).await.unwrap().expect("free");
    writer.release().await.unwrap();
    let reader = bounded(LIMIT, rw.try_read()).await.unwrap().expect("free");
    reader.release().await.unwrap();
    let taken = bounded(LIMIT, semaphore.try_acquire(2))
        .await
        .unwrap()
        .expect("free");
    assert_eq!(semaphore.available_permits().await.unwrap(), 1);
    taken.release().await.unwrap();
    let leased = bounded(LIMIT, permits.try_acquire(1))
        .await
        .unwrap()
        .expect("free");
    leased.release().await.unwrap();
    assert_eq!(bounded(LIMIT, semaphore.drain_permits()).await.unwrap(), 3);
}

/// A fair waiter willing to wait waits through the replica's absence (its refused grants
/// are given on), and gets the lock once the replica is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patient_fair_waiter_waits_through_a_replica_stall() {
    let (master, replica, client) = replicated().await;
    let fair = client.fair_lock("stalled").unwrap();
    let holder = fair.try_lock().await.unwrap().expect("free");
    replica.pause().unwrap();
    let waiter = {
        let fair = fair.clone();
        tokio::spawn(async move { fair.try_lock_for(Duration::from_secs(20)).await })
    };
    // The holder's release is handed on to the waiter; that grant no replica has is
    // refused and given on, and the waiter tries again.
    common::eventually(Duration::from_secs(10), "the waiter queued", || async {
        fair.queued().await.unwrap() == 1
    })
    .await;
    holder.release().await.unwrap();
    common::until_waits(&master, 4).await;
    common::acquired_once_the_replica_is_back(
        &replica,
        waiter,
        "the waiter gave up while the replica was away",
    )
    .await;
    assert!(!common::key_exists(&master, "redisson_lock_queue:{stalled}").await);
}

/// Review: a release hands a fair lock to the next waiter inside its own script, which
/// no WAIT follows on the waiter's side. With replica sync on, the waiter takes such a
/// grant only through an attempt of its own that replicas acknowledged: while the replica
/// is away it holds nothing, and once the replica is back it gets the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_fair_grant_waits_for_replicas_too() {
    let (master, replica, holder_client) = replicated().await;
    let waiter_client = Client::builder()
        .replica_sync(SYNC)
        .connect(&master.url())
        .await
        .expect("connect");
    let holder = holder_client
        .fair_lock("handed")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("free");
    let fair = waiter_client.fair_lock("handed").unwrap();
    let waiter = {
        let fair = fair.clone();
        tokio::spawn(async move { fair.try_lock_for(Duration::from_secs(20)).await })
    };
    common::eventually(Duration::from_secs(10), "the waiter queued", || async {
        fair.queued().await.unwrap() == 1
    })
    .await;
    replica.pause().unwrap();
    let waits_before = common::waits(&master).await;
    holder.release().await.unwrap();
    // The waiter's own attempts on the grant are refused while the replica is away.
    common::until_waits(&master, waits_before + 3).await;
    common::acquired_once_the_replica_is_back(
        &replica,
        waiter,
        "the waiter took a grant no replica had",
    )
    .await;
}

/// Review of issue 32: under replica sync a fair handle never takes up the owner id of a
/// past wait (a leave or release the master answered may be lost in a failover, bringing
/// the id's old entry back): each contended wait queues under a new owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synced_fair_handle_never_reuses_an_owner() {
    let (master, _replica, holder_client) = replicated().await;
    let waiter_client = Client::builder()
        .replica_sync(SYNC)
        .connect(&master.url())
        .await
        .expect("connect");
    let mut conn = master.connection().await.expect("connection");
    let (holder, fair) = (
        holder_client.fair_lock("synced-owners").unwrap(),
        waiter_client.fair_lock("synced-owners").unwrap(),
    );
    let mut owners = Vec::new();
    bounded(LIMIT, async {
        for _ in 0..2 {
            let held = holder.lock().await.unwrap();
            let waiter = {
                let fair = fair.clone();
                tokio::spawn(async move { fair.lock().await })
            };
            common::eventually(Duration::from_secs(10), "the waiter queued", || async {
                fair.queued().await.unwrap() == 1
            })
            .await;
            let queued: Vec<String> = redis::cmd("LRANGE")
                .arg("redisson_lock_queue:{synced-owners}")
                .arg(0)
                .arg(-1)
                .query_async(&mut conn)
                .await
                .unwrap();
            owners.extend(queued);
            held.release().await.unwrap();
            waiter.await.unwrap().unwrap().release().await.unwrap();
        }
    })
    .await;
    assert_eq!(owners.len(), 2);
    assert_ne!(
        owners[0], owners[1],
        "an owner id was taken up again under replica sync"
    );
}
