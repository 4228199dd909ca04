//! The peer on ZooKeeper: the lock recipe of `zookeeper-client` itself (the client crate
//! distlock's `zk` feature uses), `Client::lock` with `LockPrefix::new_curator`: Apache
//! Curator's `InterProcessMutex` layout, an ephemeral sequential node
//! `<dir>/_c_<uuid>-lock-<sequence>` per acquisition, held by the lowest sequence, each
//! waiter watching its predecessor's node. Called as its users call it: one client (one
//! session) per process, shared by the process's tasks (each `lock` call makes a node of
//! its own, so tasks of one session do not mix up their acquisitions).
//!
//! Its session timeout is the scenario's watchdog lease (2 s), as distlock asks of the
//! ensemble: a holder that dies holds its lock until the ensemble expires its session.
//!
//! Two things differ from distlock's lock, and the docs say so beside the figures:
//!
//! - **Release is a drop.** `LockClient` (here `OwnedLockClient`) has no release call:
//!   dropping it spawns a task that deletes the node in the background, so a release
//!   returns before the ensemble answered (nor does the caller learn whether it still
//!   held the lock). The session's next request is sent after that delete only if the
//!   task ran first; ZooKeeper answers one session's requests in order.
//! - **No fencing token.** The node's sequence number stands in: it grows from holder to
//!   holder of one lock (ZooKeeper takes it from the parent node's child version, which
//!   every create and delete of a child raises, and the parent is a persistent node
//!   here), but it is local to that lock, not comparable across locks.

use std::time::Duration;

use zookeeper_client::{Acls, Client, CreateMode, LockOptions, LockPrefix, OwnedLockClient};

use crate::scenarios::BenchResult;

/// The `host:port,…` connect string and the path of a `zk://host:port,…[/path]` URL
/// (`/distlock`, distlock's default, without one).
pub fn parse_url(url: &str) -> BenchResult<(String, String)> {
    let rest = url
        .strip_prefix("zk://")
        .ok_or_else(|| format!("{url:?} is not a zk:// URL"))?;
    let (hosts, path) = match rest.find('/') {
        Some(slash) => (&rest[..slash], rest[slash..].trim_end_matches('/')),
        None => (rest, ""),
    };
    if hosts.split(',').any(str::is_empty) {
        return Err(format!("{url:?} names an empty ZooKeeper server").into());
    }
    let path = if path.is_empty() { "/distlock" } else { path };
    Ok((hosts.to_owned(), path.to_owned()))
}

/// A session on the servers of `url`, asking for `timeout` as its session timeout.
pub async fn session(url: &str, timeout: Duration) -> BenchResult<Client> {
    let (hosts, _) = parse_url(url)?;
    let client = Client::connector()
        .with_session_timeout(timeout)
        .connect(&hosts)
        .await?;
    Ok(client)
}

/// Where the peer's locks live: beside distlock's prefix, not under it.
fn peer_root(url: &str) -> BenchResult<String> {
    Ok(format!("{}-peer", parse_url(url)?.1))
}

/// One process's session, for the peer.
pub struct Locker {
    client: Client,
    root: String,
}

impl Locker {
    pub async fn connect(url: &str, timeout: Duration) -> BenchResult<Locker> {
        Ok(Locker {
            client: session(url, timeout).await?,
            root: peer_root(url)?,
        })
    }

    /// The lock `name` (a node name: the scenario's names have no `/`).
    pub fn lock(&self, name: &str) -> OneLock {
        OneLock {
            client: self.client.clone(),
            dir: format!("{}/{name}", self.root),
        }
    }
}

/// One lock name on the process's session; a clone is one more contender.
#[derive(Clone)]
pub struct OneLock {
    client: Client,
    /// The lock's node, which the recipe's nodes are made in.
    dir: String,
}

impl OneLock {
    /// Waits until this acquisition's node is the lowest (the recipe's own wait).
    pub async fn acquire(&self) -> BenchResult<Held> {
        let prefix = LockPrefix::new_curator(&self.dir, "lock-")?;
        // The lock's node and its ancestors are made when missing, as persistent nodes:
        // the sequence numbers (the stand-in token) keep growing across rounds.
        let options = LockOptions::new(Acls::anyone_all())
            .with_ancestor_options(CreateMode::Persistent.with_acls(Acls::anyone_all()))?;
        let lock = self.client.lock(prefix, b"", options).await?.into_owned();
        let sequence = lock
            .lock_path()
            .rsplit('-')
            .next()
            .and_then(|digits| digits.parse::<u64>().ok())
            .ok_or_else(|| format!("no sequence number in {:?}", lock.lock_path()))?;
        Ok(Held { lock, sequence })
    }
}

/// A hold: the recipe's node, deleted in the background once dropped.
pub struct Held {
    lock: OwnedLockClient,
    sequence: u64,
}

impl Held {
    /// The node's sequence number (see the module's doc).
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// Drops the hold, the recipe's only release: its node is deleted by a task the drop
    /// spawns, not awaited here.
    pub fn release(self) {
        drop(self.lock);
    }
}
