//! The command connection a [`Client`](crate::Client) sends its scripts on.
//!
//! A redis-rs connection is driven by a task on the runtime that opened it (and a
//! `ConnectionManager` reopens it on whichever runtime the failing call came from). A
//! client used from several runtimes would therefore depend on each of them. This type
//! keeps two connections and routes every call:
//!
//! - calls made in a task of the *home* runtime (the multi-thread runtime that called
//!   `connect`) use the home connection, driven right there: the fastest path, one local
//!   hop each way;
//! - every other call (the client's own background work, callers on any other runtime,
//!   and futures polled by a `block_on` of the home runtime, which its workers do not
//!   poll) goes to the *background* connection, which lives on the client's own runtime
//!   and never depends on the caller's. A call from elsewhere is handed over as a task,
//!   so even a reconnect happens on the client's runtime.
//!
//! Measured on the 2-core test VM: a PING from a worker thread over a connection driven on
//! the same runtime took 28 µs (p50); over one driven on a separate thread, 46 µs. Hence
//! the fast home path rather than routing everything through the background thread.

use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
#[cfg(feature = "cluster")]
use redis::cluster_async::ClusterConnection;

#[cfg(feature = "cluster")]
use crate::transport::cluster::link::ClusterLink;
#[cfg(feature = "cluster")]
pub(crate) use crate::transport::cluster::link::WaitFor;
/// Gives the WAIT to send behind a synced write (see the cluster link's own).
#[cfg(not(feature = "cluster"))]
pub(crate) type WaitFor = dyn Fn(Option<u32>) -> Option<(Cmd, u32)> + Send + Sync;
#[cfg(feature = "sentinel")]
use crate::transport::sentinel::FailoverLink;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, Value};
use std::sync::Arc;
use tokio::runtime::{Handle, Id};
use tokio_util::sync::CancellationToken;

/// A redis-rs connection: one the client opened, or one the caller brought to
/// [`ClientBuilder::with_connection`](crate::ClientBuilder::with_connection).
#[derive(Clone)]
pub enum RedisConnection {
    /// Reconnects by itself after a failure.
    Manager(ConnectionManager),
    /// Does not reconnect: after it breaks, calls routed to it fail.
    Multiplexed(MultiplexedConnection),
    /// A Redis Cluster: routes each command by its first key, follows MOVED and ASK,
    /// retries TRYAGAIN, and reconnects to nodes by itself.
    #[cfg(feature = "cluster")]
    Cluster(ClusterConnection),
}

impl From<ConnectionManager> for RedisConnection {
    fn from(conn: ConnectionManager) -> Self {
        Self::Manager(conn)
    }
}

impl From<MultiplexedConnection> for RedisConnection {
    fn from(conn: MultiplexedConnection) -> Self {
        Self::Multiplexed(conn)
    }
}

#[cfg(feature = "cluster")]
impl From<ClusterConnection> for RedisConnection {
    fn from(conn: ClusterConnection) -> Self {
        Self::Cluster(conn)
    }
}

/// A connection as the client holds it: one of the public kinds, or one that follows
/// the master the sentinels name.
#[derive(Clone)]
pub(crate) enum Link {
    Redis(RedisConnection),
    #[cfg(feature = "sentinel")]
    Sentinel(FailoverLink),
    #[cfg(feature = "cluster")]
    Cluster(ClusterLink),
    /// No Redis at all: the client is on another store, and every command fails.
    #[cfg(any(feature = "postgres", feature = "etcd", feature = "zk"))]
    Absent(NoRedis),
}

/// The command connection of a client on a store other than Redis: every call fails,
/// naming the store, so a Redis-only call reached by mistake says why instead of panicking.
#[cfg(any(feature = "postgres", feature = "etcd", feature = "zk"))]
#[derive(Clone, Copy)]
pub(crate) struct NoRedis {
    pub(crate) store: &'static str,
}

#[cfg(any(feature = "postgres", feature = "etcd", feature = "zk"))]
impl NoRedis {
    fn refusal(self) -> RedisError {
        RedisError::from((
            redis::ErrorKind::InvalidClientConfig,
            "this distlock client is not connected to Redis",
            format!(
                "it is connected to {}; Redis commands are not available",
                self.store
            ),
        ))
    }
}

#[cfg(any(feature = "postgres", feature = "etcd", feature = "zk"))]
impl ConnectionLike for NoRedis {
    fn req_packed_command<'a>(&'a mut self, _cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let refusal = self.refusal();
        Box::pin(std::future::ready(Err(refusal)))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        _pipeline: &'a Pipeline,
        _offset: usize,
        _count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let refusal = self.refusal();
        Box::pin(std::future::ready(Err(refusal)))
    }

    fn get_db(&self) -> i64 {
        0
    }
}

impl From<RedisConnection> for Link {
    fn from(conn: RedisConnection) -> Self {
        Link::Redis(conn)
    }
}

impl Link {
    /// Sends one command. A plain connection (the common case) is called directly: its
    /// `ConnectionLike` method boxes the call's future, an allocation per command that
    /// the lock's cycle does not need to pay.
    async fn send(&mut self, cmd: &Cmd) -> redis::RedisResult<Value> {
        match self {
            Link::Redis(RedisConnection::Manager(conn)) => conn.send_packed_command(cmd).await,
            Link::Redis(RedisConnection::Multiplexed(conn)) => conn.send_packed_command(cmd).await,
            // Built without Cluster, Sentinel and the other stores, the two arms above are
            // every kind of link.
            #[allow(unreachable_patterns)]
            other => other.as_dyn().req_packed_command(cmd).await,
        }
    }

    fn as_dyn(&mut self) -> &mut (dyn ConnectionLike + Send) {
        match self {
            Link::Redis(RedisConnection::Manager(conn)) => conn,
            Link::Redis(RedisConnection::Multiplexed(conn)) => conn,
            #[cfg(feature = "cluster")]
            Link::Redis(RedisConnection::Cluster(conn)) => conn,
            #[cfg(feature = "sentinel")]
            Link::Sentinel(conn) => conn,
            #[cfg(feature = "cluster")]
            Link::Cluster(conn) => conn,
            #[cfg(any(feature = "postgres", feature = "etcd", feature = "zk"))]
            Link::Absent(conn) => conn,
        }
    }
}

/// A cheap-to-clone, multiplexed command connection that works from any tokio runtime.
#[derive(Clone)]
pub struct Connection {
    /// The runtime that connected, and the connection driven on it.
    home: Option<(Id, Link)>,
    /// Driven on the client's own runtime.
    background: Link,
    background_runtime: Handle,
    /// For the clones handed to users: once this is cancelled (the client shut down),
    /// every route fails alike. The client's own clone never refuses, because giving a
    /// lock back must work even after a shutdown.
    refuse_after: Option<CancellationToken>,
}

impl Connection {
    pub(crate) fn new(
        home: Option<(Id, Link)>,
        background: Link,
        background_runtime: Handle,
    ) -> Self {
        Self {
            home,
            background,
            background_runtime,
            refuse_after: None,
        }
    }

    /// This connection with `home` as its home link (the caller's runtime's connection).
    #[cfg(feature = "cluster")]
    pub(crate) fn with_home(self, home: Option<(Id, Link)>) -> Self {
        Self { home, ..self }
    }

    /// A clone that fails every call once `closing` is cancelled.
    pub(crate) fn refusing_after(&self, closing: &CancellationToken) -> Self {
        Self {
            refuse_after: Some(closing.clone()),
            ..self.clone()
        }
    }

    fn refused(&self) -> bool {
        self.refuse_after
            .as_ref()
            .is_some_and(CancellationToken::is_cancelled)
    }

    /// Where a call from the current context should go.
    fn route(&self) -> Route {
        let Ok(current) = Handle::try_current() else {
            return Route::Foreign;
        };
        let current = current.id();
        match &self.home {
            // Only from a task: a task is polled by the home runtime's workers, which also
            // drive the home link. A future polled by `block_on` (a thread outside the
            // pool, `spawn_blocking` included) could wait forever on a link nothing
            // drives while every worker is busy.
            Some((home, _)) if *home == current && tokio::task::try_id().is_some() => Route::Home,
            _ if current == self.background_runtime.id() => Route::Background,
            _ => Route::Foreign,
        }
    }

    /// True if a call made here goes over the connection driven by the caller's runtime,
    /// whose reply then depends on that runtime being driven.
    pub(crate) fn routes_home(&self) -> bool {
        matches!(self.route(), Route::Home)
    }

    /// On a cluster, false if this connection is busy with a synced write to the master
    /// of `write`'s slot (see [`ClusterLink::turn_looks_free`]); true elsewhere.
    pub(crate) fn turn_looks_free(&self, write: &Cmd) -> bool {
        match &self.background {
            #[cfg(feature = "cluster")]
            Link::Cluster(link) => link.turn_looks_free(write),
            _ => {
                let _ = write;
                true
            }
        }
    }

    /// On a cluster: `write`, then the WAIT `wait` gives for the replicas of the master
    /// it reaches, on one connection (see [`ClusterLink::write_then_wait`]), sent from the
    /// client's runtime like every call from elsewhere. `None` if this is not a cluster.
    pub(crate) async fn write_then_wait(
        &self,
        write: &Cmd,
        wait: Arc<WaitFor>,
    ) -> Option<redis::RedisResult<(Value, Option<(Value, u32)>)>> {
        #[cfg(not(feature = "cluster"))]
        {
            let _ = (write, wait);
            None
        }
        #[cfg(feature = "cluster")]
        {
            let Link::Cluster(link) = &self.background else {
                return None;
            };
            if matches!(self.route(), Route::Background) {
                return Some(link.write_then_wait(write, &*wait).await);
            }
            let (link, write) = (link.clone(), write.clone());
            let sent = self
                .background_runtime
                .spawn(async move { link.write_then_wait(&write, &*wait).await })
                .await;
            Some(sent.map_err(handed_over_failed).and_then(|sent| sent))
        }
    }

    /// Sends one command and reads its reply, as `req_packed_command` does, without
    /// boxing the call when it stays on this thread's runtime (see [`Link::send`]).
    pub(crate) async fn send(&mut self, cmd: &Cmd) -> redis::RedisResult<Value> {
        if self.refused() {
            return Err(client_stopped());
        }
        match self.route() {
            Route::Home => self.home_link().send(cmd).await,
            Route::Background => self.background.send(cmd).await,
            Route::Foreign => self.req_packed_command(cmd).await,
        }
    }

    /// The home link (present whenever `route` says `Home`), or else the background one.
    fn home_link(&mut self) -> &mut Link {
        match &mut self.home {
            Some((_, link)) => link,
            None => &mut self.background,
        }
    }
}

enum Route {
    Home,
    Background,
    Foreign,
}

fn client_stopped() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::NotConnected,
        "the distlock client was shut down",
    ))
}

fn handed_over_failed(err: tokio::task::JoinError) -> RedisError {
    RedisError::from(std::io::Error::other(format!(
        "the client's runtime did not run the command (was the client shut down?): {err}"
    )))
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        if self.refused() {
            return Box::pin(std::future::ready(Err(client_stopped())));
        }
        match self.route() {
            Route::Home => return self.home_link().as_dyn().req_packed_command(cmd),
            Route::Background => return self.background.as_dyn().req_packed_command(cmd),
            Route::Foreign => {}
        }
        let cmd = cmd.clone();
        let mut link = self.background.clone();
        let runtime = self.background_runtime.clone();
        Box::pin(async move {
            runtime
                .spawn(async move { link.as_dyn().req_packed_command(&cmd).await })
                .await
                .map_err(handed_over_failed)?
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        if self.refused() {
            return Box::pin(std::future::ready(Err(client_stopped())));
        }
        match self.route() {
            Route::Home => {
                return self
                    .home_link()
                    .as_dyn()
                    .req_packed_commands(pipeline, offset, count)
            }
            Route::Background => {
                return self
                    .background
                    .as_dyn()
                    .req_packed_commands(pipeline, offset, count)
            }
            Route::Foreign => {}
        }
        let pipeline = pipeline.clone();
        let mut link = self.background.clone();
        let runtime = self.background_runtime.clone();
        Box::pin(async move {
            runtime
                .spawn(async move {
                    link.as_dyn()
                        .req_packed_commands(&pipeline, offset, count)
                        .await
                })
                .await
                .map_err(handed_over_failed)?
        })
    }

    fn get_db(&self) -> i64 {
        match &self.background {
            Link::Redis(RedisConnection::Manager(conn)) => conn.get_db(),
            Link::Redis(RedisConnection::Multiplexed(conn)) => conn.get_db(),
            #[cfg(feature = "cluster")]
            Link::Redis(RedisConnection::Cluster(conn)) => conn.get_db(),
            #[cfg(feature = "sentinel")]
            Link::Sentinel(conn) => conn.get_db(),
            #[cfg(feature = "cluster")]
            Link::Cluster(conn) => conn.get_db(),
            #[cfg(any(feature = "postgres", feature = "etcd", feature = "zk"))]
            Link::Absent(conn) => conn.get_db(),
        }
    }
}
