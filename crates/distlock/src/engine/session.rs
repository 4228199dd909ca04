//! A client's session: what the engine and every primitive share (the connection, the
//! subscriptions, the renewal scheduler, owner ids, the client's runtime), and the handle
//! that keeps it open.
//!
//! [`Session`] is what user-facing handles hold (the `Client`, each lock handle, each
//! guard): when the last one is gone, the session shuts down, after the releases already
//! started have been sent. Background tasks hold the [`Core`] instead, so that they never
//! keep a session open by themselves.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::engine::latches::Latches;
use crate::engine::renewal::scheduler::Watchdog;
use crate::engine::subscriptions::Subscriptions;
use crate::error::{Error, Result};
use crate::runtime::Background;
use crate::transport::connection::Connection;
use crate::transport::deployment::Deployment;
use crate::transport::eviction::EvictionWatch;
use crate::transport::replica_sync::{SyncSlot, SyncedWrites};
use crate::transport::servers::Servers;
use crate::transport::Store;

/// A counted handle on a client's session. Cheap to clone; the last clone dropped shuts
/// the session down.
#[derive(Clone)]
pub(crate) struct Session {
    inner: Arc<SessionInner>,
}

struct SessionInner {
    core: Arc<Core>,
}

impl Drop for SessionInner {
    fn drop(&mut self) {
        self.core.close();
        self.core
            .parts
            .background
            .shutdown_blocking(self.core.parts.config.release_window());
    }
}

impl Session {
    pub(crate) fn new(core: Core) -> Self {
        Self {
            inner: Arc::new(SessionInner {
                core: Arc::new(core),
            }),
        }
    }

    pub(crate) fn core(&self) -> &Arc<Core> {
        &self.inner.core
    }

    /// Starts shutting down, and waits (a bounded time) for the work in flight.
    pub(crate) async fn shutdown(&self) {
        let core = &self.inner.core;
        core.close();
        core.parts
            .background
            .shutdown(core.parts.config.release_window())
            .await;
    }
}

/// The parts a session is made of, assembled by the client once it is connected.
pub(crate) struct Parts {
    pub(crate) connection: Connection,
    pub(crate) config: Config,
    pub(crate) subscriptions: Subscriptions,
    pub(crate) watchdog: Watchdog,
    pub(crate) latches: Latches,
    pub(crate) background: Background,
    pub(crate) deployment: Deployment,
    /// Where the client connected (`host:port` of the server or first cluster seed):
    /// names the node in errors, and orders locks of one name on different deployments.
    pub(crate) target: String,
    /// Where lock writes go when they wait for replicas (empty while replica sync is off).
    pub(crate) synced: SyncSlot,
    /// How to reach the Redis servers again, for connections of their own (`None` on
    /// another store).
    pub(crate) servers: Option<Servers>,
    /// Whether the server may evict keys, as last checked.
    pub(crate) eviction: Arc<EvictionWatch>,
    /// The store the primitives talk to. On a store other than Redis, `connection` is
    /// one whose every call fails, saying which store the client is on.
    pub(crate) store: Store,
}

/// What the engine and the background work need. Background tasks hold this, never a
/// [`Session`], so that they do not keep the client's runtime from stopping.
pub(crate) struct Core {
    id: String,
    /// Numbers owners: each acquisition is `"<client id>:<n>"`, n never reused.
    owners: AtomicU64,
    /// Numbers release requests; with the client id it names their unlock latches.
    requests: AtomicU64,
    /// What the client assembled at connect.
    parts: Parts,
    /// Cancelled when the client starts shutting down: new calls fail, waiters stop.
    closing: CancellationToken,
    /// State every handle of one name shares ([`Core::shared_by_name`]).
    by_name: Mutex<ByName>,
}

/// State shared by the handles of one name, by its type and the name, held weakly.
#[derive(Default)]
struct ByName {
    entries: HashMap<TypeId, HashMap<String, Weak<dyn Any + Send + Sync>>>,
    /// The entry count at which gone entries are swept out next.
    sweep_at: usize,
}

/// The fewest entries worth a sweep for gone ones.
const BY_NAME_SWEEP_FROM: usize = 64;

/// `"<client id>:r<n>"`, written wherever it is displayed.
struct RequestId<'a> {
    client: &'a str,
    n: u64,
}

impl fmt::Display for RequestId<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:r{}", self.client, self.n)
    }
}

/// Room for an owner id on the stack: a 36-character UUID, a colon and a `u64`.
struct OwnerBuf {
    bytes: [u8; 64],
    len: usize,
}

impl Default for OwnerBuf {
    fn default() -> Self {
        Self {
            bytes: [0; 64],
            len: 0,
        }
    }
}

impl OwnerBuf {
    fn filled(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl fmt::Write for OwnerBuf {
    fn write_str(&mut self, text: &str) -> fmt::Result {
        let end = self.len + text.len();
        let room = self.bytes.get_mut(self.len..end).ok_or(fmt::Error)?;
        room.copy_from_slice(text.as_bytes());
        self.len = end;
        Ok(())
    }
}

impl Core {
    pub(crate) fn new(parts: Parts) -> Self {
        Self {
            id: uuid::Uuid::new_v4().to_string(),
            owners: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            parts,
            closing: CancellationToken::new(),
            by_name: Mutex::default(),
        }
    }

    /// The `T` that every handle of `name` on this client shares, made by `make` when
    /// no handle holds one: a fair lock's owner ids kept between waits, whichever handle
    /// of the lock made them. Held weakly here, so it goes with the last handle.
    pub(crate) fn shared_by_name<T: Send + Sync + 'static>(
        &self,
        name: &str,
        make: impl FnOnce() -> T,
    ) -> Arc<T> {
        // Only inserts and removes whole entries: a poisoned lock still holds a sound map.
        let mut by_name = self
            .by_name
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let kind = by_name.entries.entry(TypeId::of::<T>()).or_default();
        let alive = kind
            .get(name)
            .and_then(Weak::upgrade)
            .and_then(|shared| shared.downcast::<T>().ok());
        if let Some(shared) = alive {
            return shared;
        }
        let shared = Arc::new(make());
        let weak: Weak<dyn Any + Send + Sync> =
            Arc::downgrade(&shared) as Weak<dyn Any + Send + Sync>;
        kind.insert(name.to_owned(), weak);
        let entries = kind.len();
        if entries >= by_name.sweep_at.max(BY_NAME_SWEEP_FROM) {
            // Names no handle holds any more: swept at doubling sizes, so a client that
            // makes handles for ever new names keeps a map the size of the live ones.
            for kind in by_name.entries.values_mut() {
                kind.retain(|_, shared| shared.strong_count() > 0);
            }
            let live: usize = by_name.entries.values().map(HashMap::len).sum();
            by_name.sweep_at = live * 2;
        }
        shared
    }

    /// This client's random id, the first half of every owner it writes.
    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    /// How to reach the Redis servers again, for connections of their own; `None` on
    /// another store.
    pub(crate) fn servers(&self) -> Option<&Servers> {
        self.parts.servers.as_ref()
    }

    /// The store the primitives talk to.
    pub(crate) fn store(&self) -> &Store {
        &self.parts.store
    }

    /// A new owner, never used before by any client: this client's id and a number. (A
    /// fair lock may use one again for a later wait of its own, once nothing sent as it
    /// can still land: `fair_lock/owners.rs`.)
    pub(crate) fn next_owner(&self) -> Arc<str> {
        // Starts at 1 and stays far below i64::MAX, which Redisson parses thread ids as.
        let n = self.owners.fetch_add(1, Ordering::Relaxed) + 1;
        // Formatted on the stack and copied once into the Arc: one allocation per
        // acquisition attempt instead of two.
        let mut owner = OwnerBuf::default();
        let formatted = fmt::write(&mut owner, format_args!("{}:{n}", self.id));
        match (formatted, std::str::from_utf8(owner.filled())) {
            (Ok(()), Ok(owner)) => Arc::from(owner),
            _ => format!("{}:{n}", self.id).into(),
        }
    }

    /// A request id unique across all clients: this client's id and a sequence number.
    /// Displayed, not allocated: it is written straight into the key that carries it.
    pub(crate) fn next_request_id(&self) -> impl fmt::Display + '_ {
        let n = self.requests.fetch_add(1, Ordering::Relaxed);
        RequestId {
            client: &self.id,
            n,
        }
    }

    /// Fails once the client is shut down: its background work no longer runs, so a new
    /// holding would never be renewed.
    pub(crate) fn ensure_open(&self) -> Result<()> {
        if self.closing.is_cancelled() {
            return Err(Error::Shutdown);
        }
        Ok(())
    }

    /// Fails while the server is known to evict keys (see [`EvictionWatch`]): nothing new
    /// is acquired where its key could be evicted.
    pub(crate) fn ensure_keys_stay(&self) -> Result<()> {
        self.parts.eviction.ensure_safe()
    }

    /// Cancelled once the client starts shutting down.
    pub(crate) fn closing(&self) -> &CancellationToken {
        &self.closing
    }

    /// Starts shutting down: every new call fails with [`Error::Shutdown`], waiters stop
    /// waiting, and every live holding is marked lost, because nothing will renew it.
    pub(crate) fn close(&self) {
        self.closing.cancel();
        self.parts.watchdog.close();
    }

    pub(crate) fn connection(&self) -> Connection {
        self.parts.connection.clone()
    }

    /// [`Core::request`] for a single command.
    pub(crate) async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T> {
        self.request(|mut connection| async move { cmd.query_async(&mut connection).await })
            .await
    }

    /// Sends one request for a caller, through `send`, once more if the connection was
    /// found dropped: a server restarted since the connection's last use fails the first
    /// request on it, and that failure is what reopens it. Only for requests that are
    /// harmless to repeat.
    pub(crate) async fn request<T, F, Fut>(&self, send: F) -> Result<T>
    where
        F: Fn(Connection) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        self.ensure_open()?;
        match send(self.connection()).await {
            Err(err) if err.is_connection_dropped() => {
                tracing::debug!(error = %err, "connection was dropped; sending once more");
                Ok(send(self.connection()).await?)
            }
            other => Ok(other?),
        }
    }

    pub(crate) fn config(&self) -> &Config {
        &self.parts.config
    }

    pub(crate) fn subscriptions(&self) -> &Subscriptions {
        &self.parts.subscriptions
    }

    pub(crate) fn watchdog(&self) -> &Watchdog {
        &self.parts.watchdog
    }

    pub(crate) fn latches(&self) -> &Latches {
        &self.parts.latches
    }

    pub(crate) fn background(&self) -> &Background {
        &self.parts.background
    }

    pub(crate) fn deployment(&self) -> Deployment {
        self.parts.deployment
    }

    pub(crate) fn target(&self) -> &str {
        &self.parts.target
    }

    /// The synced-write connections and policy, when replica sync is on.
    pub(crate) fn synced(&self) -> Option<&SyncedWrites> {
        self.parts.synced.get()
    }
}
