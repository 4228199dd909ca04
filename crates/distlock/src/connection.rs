//! The command connection a [`Client`](crate::Client) sends its scripts on.
//!
//! Every primitive talks to Redis through this one enum, so adding a topology (a cluster
//! connection, a sentinel-managed one) means adding a variant here rather than changing
//! the lock API. (On Redis Cluster the watchdog must also group its renewal batches by
//! slot; that is the engine's concern, not the primitives'.)

use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::{Cmd, Pipeline, RedisFuture, Value};

/// A cheap-to-clone, multiplexed command connection.
#[derive(Clone)]
pub enum Connection {
    /// A connection that reconnects by itself; what [`Client::connect`](crate::Client::connect)
    /// creates.
    Manager(ConnectionManager),
    /// A plain multiplexed connection the caller already had. It does not reconnect: after
    /// it breaks, every call fails until the caller builds a new client.
    Multiplexed(MultiplexedConnection),
}

impl From<ConnectionManager> for Connection {
    fn from(conn: ConnectionManager) -> Self {
        Self::Manager(conn)
    }
}

impl From<MultiplexedConnection> for Connection {
    fn from(conn: MultiplexedConnection) -> Self {
        Self::Multiplexed(conn)
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Manager(conn) => conn.req_packed_command(cmd),
            Self::Multiplexed(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Manager(conn) => conn.req_packed_commands(pipeline, offset, count),
            Self::Multiplexed(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Manager(conn) => conn.get_db(),
            Self::Multiplexed(conn) => conn.get_db(),
        }
    }
}
