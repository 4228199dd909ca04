//! The stores scenario's servers, and the baselines measured on them: each store's floor
//! (one request that is one round trip and nothing else), and beside it what a driver's
//! pool adds to a statement and what distlock's own statements or scripts cost sent raw.

use std::time::Duration;

use distlock_testkit::{EtcdCluster, PostgresServer, ZkEnsemble};
use tokio::time::Instant;

#[cfg(feature = "etcd")]
use super::etcd_floor::{self, EtcdRaw};
use super::subject::{Store, WATCHDOG_LEASE};
#[cfg(feature = "zk")]
use super::zk_floor::{self, ZkRaw};
use crate::baseline::{self, Raw};
use crate::scenarios::BenchResult;
use crate::stats::Latencies;

static ACQUIRE_SQL: &str = include_str!("../../../../distlock/src/primitives/lock/sql/acquire.sql");
static RELEASE_SQL: &str = include_str!("../../../../distlock/src/primitives/lock/sql/release.sql");

/// What a probe sends, back to back, from one task.
enum Floor {
    /// A no-op EVALSHA (`lock_scripts` false) or distlock's acquire and release scripts
    /// (true) on distlock's connection. The client is kept: its connection ends with it.
    Redis {
        connection: distlock::Connection,
        lock_scripts: bool,
        _client: distlock::Client,
    },
    /// `SELECT 1` on one connection taken from the pool for the whole slice.
    PgConnection(sqlx::PgPool),
    /// `SELECT 1` on the pool itself: a connection taken and given back per statement.
    PgPooled(sqlx::PgPool),
    /// distlock's acquire.sql then release.sql, on one connection for the whole slice.
    PgLockStatements(sqlx::PgPool),
    /// A raw request through etcd-client, on a client of the first member
    /// (etcd-client's `Client` is 3.5 KB: boxed, as the other variants are a few words.)
    #[cfg(feature = "etcd")]
    Etcd(Box<etcd_client::Client>, EtcdRaw),
    /// A raw request through zookeeper-client, on a session of the server the subjects
    /// are connected to, under the given node.
    #[cfg(feature = "zk")]
    Zk(Box<zookeeper_client::Client>, String, ZkRaw),
}

impl Floor {
    /// One caller sends the request back to back for `length`, in a task (as the cycles
    /// run). Returns requests (or raw cycles) per second and their latencies.
    async fn measure(&self, length: Duration) -> BenchResult<(f64, Latencies)> {
        let (pool, kind) = match self {
            Floor::Redis {
                connection,
                lock_scripts,
                ..
            } => {
                let raw = if *lock_scripts {
                    Raw::LockScripts
                } else {
                    Raw::Noop
                };
                return Ok(baseline::run(raw, connection, 1, length).await?);
            }
            Floor::PgConnection(pool) => (pool.clone(), Pg::Select),
            Floor::PgPooled(pool) => (pool.clone(), Pg::PooledSelect),
            Floor::PgLockStatements(pool) => (pool.clone(), Pg::LockStatements),
            #[cfg(feature = "etcd")]
            Floor::Etcd(client, raw) => return etcd_floor::measure(client, *raw, length).await,
            #[cfg(feature = "zk")]
            Floor::Zk(client, root, raw) => {
                return zk_floor::measure(client, root, *raw, length).await
            }
        };
        tokio::spawn(pg_probe(pool, kind, length)).await?
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Pg {
    Select,
    PooledSelect,
    LockStatements,
}

async fn pg_probe(pool: sqlx::PgPool, kind: Pg, length: Duration) -> BenchResult<(f64, Latencies)> {
    let mut held = match kind {
        Pg::PooledSelect => None,
        Pg::Select | Pg::LockStatements => Some(pool.acquire().await?),
    };
    let lease_ms = WATCHDOG_LEASE.as_secs_f64() * 1e3;
    let started = Instant::now();
    let until = started + length;
    let mut latencies = Latencies::new();
    let mut request = 0u64;
    while Instant::now() < until {
        let sent = Instant::now();
        match (kind, held.as_mut()) {
            (Pg::LockStatements, Some(connection)) => {
                request += 1;
                let owner = "bench:raw:1";
                let taken: Option<(Option<i64>, Option<i64>)> = sqlx::query_as(ACQUIRE_SQL)
                    .bind("bench:stores:raw")
                    .bind(owner)
                    .bind(lease_ms)
                    .fetch_optional(&mut **connection)
                    .await?;
                if !matches!(taken, Some((Some(_), _))) {
                    return Err("the raw acquire found its lock busy".into());
                }
                sqlx::query(RELEASE_SQL)
                    .bind("bench:stores:raw")
                    .bind(owner)
                    .bind(format!("bench:raw:release:{request}"))
                    .bind("distlock_bench_raw")
                    .execute(&mut **connection)
                    .await?;
            }
            (_, Some(connection)) => {
                sqlx::query_scalar::<_, i32>("SELECT 1")
                    .fetch_one(&mut **connection)
                    .await?;
            }
            (_, None) => {
                sqlx::query_scalar::<_, i32>("SELECT 1")
                    .fetch_one(&pool)
                    .await?;
            }
        }
        latencies.record(sent.elapsed());
    }
    let rate = latencies.len() as f64 / started.elapsed().as_secs_f64();
    Ok((rate, latencies))
}

/// A baseline, and what the rounds measured of it.
pub(super) struct Probe {
    pub(super) label: &'static str,
    floor: Floor,
    pub(super) rate: Vec<f64>,
    pub(super) latency: Latencies,
    /// Per round: this probe's latency p50 over the floor's (the floor: 1).
    pub(super) p50_ratio: Vec<f64>,
}

impl Probe {
    fn new(label: &'static str, floor: Floor) -> Probe {
        Probe {
            label,
            floor,
            rate: Vec::new(),
            latency: Latencies::new(),
            p50_ratio: Vec::new(),
        }
    }

    /// Measures one slice; returns its rate and its p50 in µs.
    pub(super) async fn measure(&mut self, length: Duration) -> BenchResult<(f64, f64)> {
        let (rate, latency) = self.floor.measure(length).await?;
        self.rate.push(rate);
        self.latency.merge(&latency);
        Ok((rate, latency.micros(0.5)))
    }
}

/// A store's private server, as the scenario reaches it.
pub(super) struct Deployed {
    pub(super) store: Store,
    pub(super) url: String,
    /// The floor first, then the other baselines.
    pub(super) probes: Vec<Probe>,
    /// Keeps a private PostgreSQL running; stopped when dropped.
    _postgres: Option<PostgresServer>,
    /// Keeps a private etcd cluster running; stopped when dropped.
    _etcd: Option<EtcdCluster>,
    /// Keeps a private ZooKeeper ensemble running; stopped when dropped.
    _zk: Option<ZkEnsemble>,
}

pub(super) const POOLED: &str =
    "SELECT 1 on sqlx's default pool (a connection per statement, pinged first)";
pub(super) const UNPINGED: &str = "SELECT 1 on a pool without the ping (test_before_acquire false)";
pub(super) const RAW_SCRIPTS: &str = "distlock's acquire + release scripts, raw (a cycle)";
pub(super) const RAW_STATEMENTS: &str =
    "distlock's acquire.sql + release.sql, raw on one connection (a cycle)";
pub(super) const RAW_PLACEMENT: &str = "distlock's placement Txn alone, raw (one Raft write)";
pub(super) const RAW_TXNS: &str = "distlock's placement + release Txns, raw (a cycle)";
pub(super) const ZK_GET: &str = "raw get_data of one node (a read, the connected server alone)";
pub(super) const ZK_PAIR: &str = "raw create + delete of an ephemeral sequential node";
pub(super) const ZK_CYCLE: &str = "distlock's create + list + delete, raw (a cycle)";

pub(super) async fn deploy(store: Store, redis_url: &str) -> BenchResult<Deployed> {
    match store {
        Store::Redis => {
            let client = distlock::Client::connect(redis_url).await?;
            let floor = |lock_scripts| Floor::Redis {
                connection: client.connection(),
                lock_scripts,
                _client: client.clone(),
            };
            Ok(Deployed {
                store,
                url: redis_url.to_owned(),
                probes: vec![
                    Probe::new(store.floor_label(), floor(false)),
                    Probe::new(RAW_SCRIPTS, floor(true)),
                ],
                _postgres: None,
                _etcd: None,
                _zk: None,
            })
        }
        Store::Postgres => {
            let server = PostgresServer::start().await?;
            // sqlx's defaults, as distlock's pool and the peer's have them: a connection
            // taken from the pool is pinged first (a round trip of its own).
            let pool = sqlx::PgPool::connect(&server.url()).await?;
            let unpinged = sqlx::postgres::PgPoolOptions::new()
                .test_before_acquire(false)
                .connect(&server.url())
                .await?;
            let version: String = sqlx::query_scalar("SHOW server_version")
                .fetch_one(&pool)
                .await?;
            eprintln!(
                "postgres {version} on loopback (private: fsync, synchronous_commit and full_page_writes off)"
            );
            Ok(Deployed {
                store,
                url: server.url(),
                probes: vec![
                    Probe::new(store.floor_label(), Floor::PgConnection(unpinged.clone())),
                    Probe::new(POOLED, Floor::PgPooled(pool)),
                    Probe::new(UNPINGED, Floor::PgPooled(unpinged.clone())),
                    Probe::new(RAW_STATEMENTS, Floor::PgLockStatements(unpinged)),
                ],
                _postgres: Some(server),
                _etcd: None,
                _zk: None,
            })
        }
        Store::Etcd => deploy_etcd().await,
        Store::Zk => deploy_zk().await,
    }
}

/// A private 3-member etcd cluster on loopback, and its baselines through a client of the
/// first member (the one distlock and the peer send to).
#[cfg(feature = "etcd")]
async fn deploy_etcd() -> BenchResult<Deployed> {
    let cluster = EtcdCluster::start(3).await?;
    let client = super::peer_etcd::first_member(&cluster.url()).await?;
    let version = client
        .clone()
        .status()
        .await
        .map(|status| status.version().to_owned())
        .unwrap_or_default();
    eprintln!(
        "etcd {version}: 3 members on loopback (private; heartbeat 100 ms, election 1 s; requests to the first member)"
    );
    let probe = |label, raw| Probe::new(label, Floor::Etcd(Box::new(client.clone()), raw));
    Ok(Deployed {
        store: Store::Etcd,
        url: cluster.url(),
        probes: vec![
            probe(Store::Etcd.floor_label(), EtcdRaw::Get),
            probe(RAW_PLACEMENT, EtcdRaw::Place),
            probe(RAW_TXNS, EtcdRaw::Cycle),
        ],
        _postgres: None,
        _etcd: Some(cluster),
        _zk: None,
    })
}

/// Not reached: the scenario lists the etcd columns as not built before it deploys.
#[cfg(not(feature = "etcd"))]
async fn deploy_etcd() -> BenchResult<Deployed> {
    Err("the etcd store is not built: rebuild distlock-bench with --features etcd".into())
}

/// The node distlock's locks live under in the scenario (the URL's path); the peer's and
/// the raw probes' nodes are beside it.
#[cfg(feature = "zk")]
const ZK_PREFIX: &str = "/distlock-bench";
/// How long each ZooKeeper baseline runs once, unmeasured, before the rounds.
#[cfg(feature = "zk")]
const ZK_WARM_UP: Duration = Duration::from_secs(1);

/// A private 3-server ZooKeeper ensemble on loopback, reached through one of its
/// followers: the URL every subject connects with names that server alone, and so does
/// the baselines' session. zookeeper-client picks a server of a list at random for each
/// session, and a session on the leader skips the forwarding hop a follower's writes
/// take, so with the whole list each process (the parent, every worker) would take its
/// own path at random; a follower is where two sessions in three land with the list.
#[cfg(feature = "zk")]
async fn deploy_zk() -> BenchResult<Deployed> {
    let ensemble = ZkEnsemble::start(3).await?;
    let leader = ensemble.leader().await?;
    let follower = (0..ensemble.size())
        .find(|&index| index != leader)
        .ok_or("a ZooKeeper ensemble of 3 with no follower")?;
    let port = ensemble
        .client_ports()
        .get(follower)
        .copied()
        .ok_or("no client port for the follower")?;
    let url = format!("zk://127.0.0.1:{port}{ZK_PREFIX}");
    let version = ensemble
        .four_letter_word(follower, "srvr")
        .await
        .ok()
        .and_then(|answer| {
            answer
                .lines()
                .next()
                .and_then(|line| line.strip_prefix("Zookeeper version: "))
                .map(|version| {
                    version
                        .split(['-', ','])
                        .next()
                        .unwrap_or(version)
                        .to_owned()
                })
        })
        .unwrap_or_default();
    eprintln!(
        "ZooKeeper {version}: 3 servers on loopback (private; tick {} ms; every session on follower {follower}, the leader is {leader})",
        distlock_testkit::zk_ensemble::ZK_TICK.as_millis()
    );
    let client = Box::new(super::peer_zk::session(&url, WATCHDOG_LEASE).await?);
    let root = zk_floor::raw_root(ZK_PREFIX);
    let probe = |label, raw| Probe::new(label, Floor::Zk(client.clone(), root.clone(), raw));
    let probes = vec![
        probe(Store::Zk.floor_label(), ZkRaw::Set),
        probe(ZK_GET, ZkRaw::Get),
        probe(ZK_PAIR, ZkRaw::Pair),
        probe(ZK_CYCLE, ZkRaw::Cycle),
    ];
    // The servers are JVMs that start with their code interpreted: a first pass of every
    // request, unmeasured, so that the first round does not pay for their compiling it.
    for probe in &probes {
        probe.floor.measure(ZK_WARM_UP).await?;
    }
    Ok(Deployed {
        store: Store::Zk,
        url,
        probes,
        _postgres: None,
        _etcd: None,
        _zk: Some(ensemble),
    })
}

/// Not reached: the scenario lists the ZooKeeper columns as not built before it deploys.
#[cfg(not(feature = "zk"))]
async fn deploy_zk() -> BenchResult<Deployed> {
    Err("the zk store is not built: rebuild distlock-bench with --features zk".into())
}
