//! The transport layer: how a client reaches its Redis deployment. Connections, the
//! standalone / Sentinel / Cluster links, pub/sub connections, replica sync, the checks a
//! server gets at connect (is it Redis, which version, may it evict keys), and running Lua
//! scripts. It knows nothing about locks: it moves commands, replies and messages.
//!
//! - [`endpoint`]: the URLs that name a deployment;
//! - [`probe`]: the first PING and INFO, and what they say about the server;
//! - [`servers`]: how to reach the servers again, and the connections opened on them;
//! - [`connection`]: the command connection every caller shares, from any runtime;
//! - [`sentinel`], [`cluster`]: the links that follow a Sentinel master or a Cluster;
//! - [`pubsub`]: pub/sub connections, for the engine's subscription hub;
//! - [`replica_sync`]: writes that wait for replicas (WAIT);
//! - [`script`]: EVALSHA, with EVAL when the server lost the script;
//! - [`eviction`]: the eviction-policy check;
//! - [`deployment`]: what differs between deployments for the protocol above;
//! - [`tls`]: TLS set-up.

#[cfg(feature = "cluster")]
pub(crate) mod cluster;
pub(crate) mod connection;
pub(crate) mod deployment;
pub(crate) mod endpoint;
pub(crate) mod eviction;
pub(crate) mod probe;
pub(crate) mod pubsub;
pub(crate) mod replica_sync;
pub(crate) mod script;
#[cfg(feature = "sentinel")]
pub(crate) mod sentinel;
pub(crate) mod servers;
pub(crate) mod tls;
