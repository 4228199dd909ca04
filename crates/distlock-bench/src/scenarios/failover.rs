//! Failover: the time from killing the master that holds a lock's slot to the first
//! successful acquisition after it, through a Sentinel failover and a cluster failover,
//! each repeated on fresh deployments and reported as medians.
//!
//! Both are dominated by the deployments' own detection settings, which the testkit sets
//! short (Sentinel `down-after-milliseconds` 1000, cluster `cluster-node-timeout` 1500):
//! what the client adds is how fast it finds the new master once there is one.

use std::time::{Duration, Instant};

use distlock::Client;
use distlock_testkit::{RedisCluster, SentinelGroup};

use super::BenchResult;
use crate::report::{figure, Report};
use crate::stats::median;

const REPEATS: usize = 3;
const LIMIT: Duration = Duration::from_secs(60);

pub async fn run() -> BenchResult<Report> {
    let mut sentinel = Vec::new();
    let mut cluster = Vec::new();
    for _ in 0..REPEATS {
        sentinel.push(sentinel_failover().await?.as_secs_f64() * 1000.0);
        cluster.push(cluster_failover().await?.as_secs_f64() * 1000.0);
    }
    Ok(Report {
        scenario: "failover",
        result: figure(
            "Sentinel: kill → first acquisition",
            median(&sentinel),
            "ms",
        ),
        baseline: figure("Sentinel down-after =", 1000.0, "ms"),
        ratio: median(&sentinel) / 1000.0,
        target: "reported".to_owned(),
        met: true,
        details: vec![
            figure("cluster: kill → first acquisition", median(&cluster), "ms"),
            figure("cluster-node-timeout", 1500.0, "ms"),
            figure("repeats (medians above)", REPEATS as f64, ""),
        ],
    })
}

/// Tries `name` until an attempt is not refused by a connection error.
async fn first_acquisition(client: &Client, name: &str, since: Instant) -> BenchResult<Duration> {
    loop {
        match client.lock(name)?.try_lock().await {
            Ok(Some(guard)) => {
                let took = since.elapsed();
                guard.release().await?;
                return Ok(took);
            }
            Ok(None) => return Err(format!("{name} was held").into()),
            Err(err) if err.is_connection_error() && since.elapsed() < LIMIT => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(err) => return Err(err.into()),
        }
    }
}

async fn sentinel_failover() -> BenchResult<Duration> {
    let mut group = SentinelGroup::start().await?;
    let client = Client::builder()
        .response_timeout(Duration::from_millis(500))
        .connect(&group.sentinel_url())
        .await?;
    client
        .lock("failover:warm")?
        .lock()
        .await?
        .release()
        .await?;
    let killed = Instant::now();
    group.kill_master().await?;
    first_acquisition(&client, "failover:after", killed).await
}

async fn cluster_failover() -> BenchResult<Duration> {
    let mut cluster = RedisCluster::start().await?;
    let client = Client::connect(&cluster.url()).await?;
    let name = "failover:after";
    client.lock(name)?.lock().await?.release().await?;
    let slot = cluster.key_slot(name).await?;
    let master = cluster.master_for_slot(slot).await?;
    let killed = Instant::now();
    cluster.kill(master).await?;
    first_acquisition(&client, name, killed).await
}
