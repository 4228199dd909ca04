//! Tests of the consensus-store servers: an etcd cluster and a ZooKeeper ensemble, made of
//! real `etcd` and ZooKeeper processes. Each starts its servers, kills or freezes the
//! leader, sees another elected, and brings the old one back.

use std::error::Error;
use std::future::Future;
use std::time::{Duration, Instant};

use distlock_testkit::{EtcdCluster, ZkEnsemble};

type TestResult = Result<(), Box<dyn Error>>;

/// Upper bound for any single test, so a wedged cluster fails the test instead of
/// hanging the suite. Each takes a few seconds alone; the bound is generous because the
/// tests run in parallel with others on a two-core machine.
const TEST_LIMIT: Duration = Duration::from_secs(90);

async fn bounded(test: impl Future<Output = TestResult>) -> TestResult {
    tokio::time::timeout(TEST_LIMIT, test)
        .await
        .map_err(|_| format!("test did not finish within {TEST_LIMIT:?}"))?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_cluster_elects_a_new_leader_when_the_leader_dies_and_takes_it_back() -> TestResult {
    bounded(async {
        let started = Instant::now();
        let mut cluster = EtcdCluster::start(3).await?;
        eprintln!("etcd: 3 members ready in {:?}", started.elapsed());
        assert_eq!(cluster.endpoints().len(), 3);
        let url = cluster.url();
        assert!(url.starts_with("etcd://127.0.0.1:"), "{url}");
        assert_eq!(url.matches(',').count(), 2, "{url}");

        cluster.put(0, "before", "the kill").await?;
        let old = cluster.leader().await?;
        cluster.kill(old).await?;
        assert_eq!(cluster.pid(old), None);
        let killed = Instant::now();
        let new = cluster.leader().await?;
        eprintln!(
            "etcd: member {new} leads {:?} after member {old} was killed",
            killed.elapsed()
        );
        assert_ne!(new, old);

        // The quorum of two serves writes; the data written before the kill survived.
        let other = (0..3)
            .find(|&i| i != old && i != new)
            .ok_or("no third member")?;
        cluster.put(other, "during", "the outage").await?;
        assert_eq!(
            cluster.get(new, "before").await?.as_deref(),
            Some("the kill")
        );

        let restarting = Instant::now();
        cluster.restart(old).await?;
        eprintln!(
            "etcd: member {old} serving {:?} after its restart",
            restarting.elapsed()
        );
        // Back with its data, and what was written while it was down.
        assert_eq!(
            cluster.get(old, "during").await?.as_deref(),
            Some("the outage")
        );
        assert_eq!(
            cluster.get(old, "before").await?.as_deref(),
            Some("the kill")
        );
        // A restarted member does not depose a healthy leader.
        assert_eq!(cluster.leader().await?, new);
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_cluster_replaces_a_frozen_leader_which_follows_when_resumed() -> TestResult {
    bounded(async {
        let cluster = EtcdCluster::start(3).await?;
        let old = cluster.leader().await?;
        cluster.stop(old)?;
        let new = cluster.leader().await?;
        assert_ne!(new, old);
        cluster.resume(old)?;
        // Every member, the thawed one included, agrees on the new leader.
        assert_eq!(cluster.leader().await?, new);
        cluster.put(old, "after", "the thaw").await?;
        assert_eq!(
            cluster.get(new, "after").await?.as_deref(),
            Some("the thaw")
        );
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_member_etcd_serves_and_comes_back_with_its_data() -> TestResult {
    bounded(async {
        let started = Instant::now();
        let mut cluster = EtcdCluster::start(1).await?;
        eprintln!("etcd: 1 member ready in {:?}", started.elapsed());
        assert_eq!(cluster.leader().await?, 0);
        assert_eq!(cluster.url(), format!("etcd://{}", cluster.endpoints()[0]));
        cluster.put(0, "k", "v").await?;
        cluster.restart(0).await?;
        assert_eq!(cluster.get(0, "k").await?.as_deref(), Some("v"));
        assert_eq!(cluster.get(0, "absent").await?, None);
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zk_ensemble_elects_a_new_leader_when_the_leader_dies_and_takes_it_back() -> TestResult {
    bounded(async {
        let started = Instant::now();
        let mut ensemble = ZkEnsemble::start(3).await?;
        eprintln!("zk: 3 servers serving in {:?}", started.elapsed());
        let url = ensemble.url();
        assert_eq!(url, format!("zk://{}", ensemble.connect_string()));
        assert_eq!(ensemble.connect_string().matches(',').count(), 2, "{url}");

        let old = ensemble.leader().await?;
        let srvr = ensemble.four_letter_word(old, "srvr").await?;
        assert!(srvr.contains("Mode: leader"), "{srvr}");
        ensemble.kill(old).await?;
        assert_eq!(ensemble.pid(old), None);
        let killed = Instant::now();
        let new = ensemble.leader().await?;
        eprintln!(
            "zk: server {new} leads {:?} after server {old} was killed",
            killed.elapsed()
        );
        assert_ne!(new, old);

        let restarting = Instant::now();
        ensemble.restart(old).await?;
        eprintln!(
            "zk: server {old} serving {:?} after its restart",
            restarting.elapsed()
        );
        let srvr = ensemble.four_letter_word(old, "srvr").await?;
        assert!(srvr.contains("Mode: follower"), "{srvr}");
        // An election favours the highest server id, but a running leader keeps its
        // place when a server (re)joins.
        assert_eq!(ensemble.leader().await?, new);
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zk_ensemble_replaces_a_frozen_leader_which_follows_when_resumed() -> TestResult {
    bounded(async {
        let ensemble = ZkEnsemble::start(3).await?;
        let old = ensemble.leader().await?;
        ensemble.stop(old)?;
        let new = ensemble.leader().await?;
        assert_ne!(new, old);
        ensemble.resume(old)?;
        // The thawed server learns it lost its leadership and follows.
        assert_eq!(ensemble.leader().await?, new);
        let srvr = ensemble.four_letter_word(old, "srvr").await?;
        assert!(srvr.contains("Mode: follower"), "{srvr}");
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_zk_server_serves_and_restarts() -> TestResult {
    bounded(async {
        let started = Instant::now();
        let mut ensemble = ZkEnsemble::start(1).await?;
        eprintln!("zk: standalone server serving in {:?}", started.elapsed());
        assert_eq!(ensemble.leader().await?, 0);
        assert_eq!(ensemble.four_letter_word(0, "ruok").await?, "imok");
        ensemble.restart(0).await?;
        let srvr = ensemble.four_letter_word(0, "srvr").await?;
        assert!(srvr.contains("Mode: standalone"), "{srvr}");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn an_ensemble_of_two_is_refused() {
    let result = ZkEnsemble::start(2).await;
    assert!(result.is_err(), "{result:?}");
    let result = EtcdCluster::start(0).await;
    assert!(result.is_err(), "{result:?}");
}
