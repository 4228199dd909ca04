//! Test support for `distlock`.
//!
//! Everything here runs against *real* infrastructure: [`RedisServer`] spawns
//! an actual `redis-server` process on a private loopback port, so tests
//! exercise the same wire protocol, scripting engine and failure modes
//! (pauses, crashes, restarts) that production code meets.
//!
//! Alongside the server harness the crate provides:
//!
//! * [`monotonic_ns`]: a clock whose readings are comparable across the
//!   processes of one machine, so lock holds recorded by different test
//!   processes can be merged.
//! * [`ExclusionChecker`] / [`analyze`]: record every lock hold as an
//!   [`Interval`] and verify afterwards that no two holds overlapped and that
//!   fencing tokens only ever increased.
//! * [`FaultProxy`]: a TCP proxy in front of one server that adds latency,
//!   cuts connections or blackholes traffic on command, to model the network
//!   between a lock client and each of its Redis masters.
//! * [`FencedResource`]: a Redis-backed "storage system" that rejects writes
//!   carrying a stale fencing token, to demonstrate why fencing matters.
//! * [`RedisCluster`]: a six-node Redis Cluster (three masters, three replicas)
//!   with failovers, frozen or crashed nodes, and slot migrations on demand.
//! * [`SentinelGroup`]: a master, two replicas and three Sentinels, with the
//!   means to lose an acknowledged write in a failover deliberately.
//! * [`EtcdCluster`]: N etcd members (1, 3, …) whose leader can be found, killed,
//!   frozen and restarted.
//! * [`ZkEnsemble`]: a standalone ZooKeeper server or an ensemble of three, with a short
//!   tick so that sessions in tests can expire in a second, and the same faults.
//!
//! ```no_run
//! use distlock_testkit::{ExclusionChecker, FencedResource, RedisServer, TestkitError};
//!
//! # async fn demo() -> Result<(), TestkitError> {
//! let server = RedisServer::start().await?;
//! let resource = FencedResource::new(server.connection().await?, "doc");
//! let checker = ExclusionChecker::new();
//!
//! let hold = checker.enter(7, "worker-1");
//! assert!(resource.write(7, "written under token 7").await?);
//! hold.finish();
//!
//! // A holder with an older token is refused by the storage.
//! assert!(!resource.write(6, "stale").await?);
//! assert!(checker.report().is_clean());
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod certificates;
pub mod clock;
pub mod cluster;
pub mod error;
pub mod etcd_cluster;
mod etcd_gateway;
pub mod exclusion;
pub mod fault_proxy;
pub mod fenced;
pub mod postgres_server;
mod probe;
pub mod redis_server;
pub mod sentinel;
mod store_process;
pub mod zk_ensemble;

pub use certificates::{write_test_certificates, TestCertificates};
pub use clock::monotonic_ns;
pub use cluster::{ClusterNodeInfo, ClusterRole, RedisCluster, SlotMigration};
pub use error::TestkitError;
pub use etcd_cluster::EtcdCluster;
pub use exclusion::{analyze, read_jsonl, ExclusionChecker, ExclusionReport, HoldRecord, Interval};
pub use fault_proxy::{Direction, FaultProxy};
pub use fenced::FencedResource;
pub use postgres_server::PostgresServer;
pub use redis_server::{pick_free_port, RedisServer};
pub use sentinel::SentinelGroup;
pub use zk_ensemble::ZkEnsemble;
