//! The peer on etcd: etcd's own lock service (the v3lock `Lock`/`Unlock` RPC), called
//! through `etcd-client`, the client crate distlock's `etcd` feature uses, as its users
//! call it: a lease granted and kept alive by a task (what Go's `concurrency.Session`
//! does), each lock taken with that lease, released by deleting the key the RPC answered.
//!
//! etcd treats two `Lock` calls with the same lease as one acquisition (the lock's key is
//! `<name>/<lease id>`), so a lease is one holder: every [`OneLock`] (one per task, as the
//! harness clones them) has a lease of its own, granted at its first acquisition and
//! revoked when the last clone of that one is dropped.
//!
//! The server does the waiting (it watches the previous key's deletion, as distlock does
//! from the client side); the answer's header revision grows from holder to holder (a
//! release is a write between two acquisitions), so it stands in for a fencing token.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, LockOptions};
use tokio::sync::OnceCell;
use tokio::task::JoinHandle;

use crate::scenarios::BenchResult;

/// The endpoints of an `etcd://host:port,host:port[/prefix]` URL, first one first.
pub fn endpoints(url: &str) -> BenchResult<Vec<String>> {
    let rest = url
        .strip_prefix("etcd://")
        .ok_or_else(|| format!("{url:?} is not an etcd:// URL"))?;
    let hosts = rest.split('/').next().unwrap_or_default();
    let endpoints: Vec<String> = hosts
        .split(',')
        .filter(|host| !host.is_empty())
        .map(|host| format!("http://{host}"))
        .collect();
    if endpoints.is_empty() {
        return Err(format!("{url:?} names no etcd member").into());
    }
    Ok(endpoints)
}

/// A client of the first member only: distlock sends every request to one preferred
/// member (the first, while it answers), so the peer and the floors do too, and the
/// columns compare the same path through the cluster.
pub async fn first_member(url: &str) -> BenchResult<Client> {
    let first = endpoints(url)?.swap_remove(0);
    Ok(Client::connect([first], None).await?)
}

/// etcd-client's `Client` is 3.5 KB (a client per gRPC service); boxed where it sits in
/// the scenario's enums beside distlock's handles, which are a few words.
type Boxed = Box<Client>;

/// One process's connection to etcd, for the peer.
pub struct Locker {
    client: Boxed,
    ttl: Duration,
}

impl Locker {
    /// `ttl` is the lease of every holder (etcd rounds it up to whole seconds, and to its
    /// minimum, 2 s with the default Raft timing).
    pub async fn connect(url: &str, ttl: Duration) -> BenchResult<Locker> {
        Ok(Locker {
            client: Box::new(first_member(url).await?),
            ttl,
        })
    }

    pub fn lock(&self, name: &str) -> OneLock {
        OneLock {
            client: self.client.clone(),
            name: name.to_owned(),
            ttl: self.ttl,
            lease: Arc::new(OnceCell::new()),
        }
    }

    /// Nothing to flush: each lease is revoked when its last lock is dropped.
    pub async fn shutdown(&self) {}
}

/// A lease kept alive by a task until dropped, then revoked.
struct Lease {
    id: i64,
    client: Client,
    keeper: JoinHandle<()>,
}

impl Lease {
    async fn grant(client: &Client, ttl: Duration) -> BenchResult<Lease> {
        let mut client = client.clone();
        let seconds = i64::try_from(ttl.as_secs().max(1))?;
        let granted = client.lease_grant(seconds, None).await?;
        let id = granted.id();
        let (mut keeper, mut answers) = client.lease_keep_alive(id).await?;
        // A third of the granted TTL between keepalives, as etcd's own clients renew.
        let every = Duration::from_secs(u64::try_from(granted.ttl().max(1))?) / 3;
        let keeper = tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if keeper.keep_alive().await.is_err() {
                    return;
                }
                match answers.message().await {
                    Ok(Some(_)) => {}
                    // The stream ended or failed: the lease runs out, and the next lock
                    // call on it fails with a typed error.
                    _ => return,
                }
            }
        });
        Ok(Lease { id, client, keeper })
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.keeper.abort();
        // Revoked so the next round's holders do not queue behind a dead lease's key;
        // without a runtime (at exit) it runs out by itself.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (mut client, id) = (self.client.clone(), self.id);
            runtime.spawn(async move {
                let _ = client.lease_revoke(id).await;
            });
        }
    }
}

/// One lock name for one holder.
pub struct OneLock {
    client: Boxed,
    name: String,
    ttl: Duration,
    lease: Arc<OnceCell<Lease>>,
}

/// A clone is another holder: it gets a lease of its own (see the module's doc).
impl Clone for OneLock {
    fn clone(&self) -> OneLock {
        OneLock {
            client: self.client.clone(),
            name: self.name.clone(),
            ttl: self.ttl,
            lease: Arc::new(OnceCell::new()),
        }
    }
}

impl OneLock {
    /// Waits (on the server) until the lock is held with this holder's lease.
    pub async fn acquire(&self) -> BenchResult<Held> {
        let lease = self
            .lease
            .get_or_try_init(|| Lease::grant(&self.client, self.ttl))
            .await?;
        let mut client = self.client.clone();
        let answer = client
            .lock(
                self.name.as_bytes(),
                Some(LockOptions::new().with_lease(lease.id)),
            )
            .await?;
        let revision = answer.header().map_or(0, |header| header.revision());
        Ok(Held {
            client,
            key: answer.key().to_vec(),
            revision: revision.unsigned_abs(),
            _lease: Arc::clone(&self.lease),
        })
    }
}

/// A hold: the key etcd's lock service answered.
pub struct Held {
    client: Boxed,
    key: Vec<u8>,
    revision: u64,
    /// A hold keeps its lease alive, even past the lock it came from.
    _lease: Arc<OnceCell<Lease>>,
}

impl Held {
    pub fn revision(&self) -> u64 {
        self.revision
    }

    pub async fn release(mut self) -> BenchResult<()> {
        self.client.unlock(self.key).await?;
        Ok(())
    }
}
