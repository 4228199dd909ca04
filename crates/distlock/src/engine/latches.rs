//! Deleting unlock latches once their answer has been read.
//!
//! A final release leaves its answer in a short-lived key, so that a retry after a lost
//! reply reads the first answer. Once the reply is read the key is garbage: it is queued
//! here and deleted by a task on the client's own runtime, many per command when releases
//! come fast, off the caller's critical path. A crash loses the queue; the keys then expire
//! with their TTL.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use futures_util::future::join_all;
use redis::cluster_routing::Slot;

use crate::runtime::Background;
use crate::transport::connection::Connection;

/// At most this many keys per UNLINK, so one command never blocks Redis for long.
const MAX_PER_COMMAND: usize = 500;

/// How long a drain collects latches before its first UNLINK. Without it, back-to-back
/// cycles pay a wake-up of the client's thread and an UNLINK each; measured on the 2-core
/// VM, that was most of the library's overhead over its raw scripts. A latch then lives
/// this much longer after its reply was read, well inside its own TTL.
const LINGER: std::time::Duration = std::time::Duration::from_millis(10);

pub(crate) struct Latches {
    shared: Arc<Shared>,
}

struct Shared {
    pending: Mutex<Vec<String>>,
    connection: Connection,
    /// On a cluster one UNLINK may only name keys of one slot: latches are deleted by
    /// slot, each UNLINK sent straight to its slot's master.
    cluster: bool,
}

impl Shared {
    fn pending(&self) -> MutexGuard<'_, Vec<String>> {
        // A push or a take cannot be left half-done by a panic.
        self.pending
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Latches {
    pub(crate) fn new(connection: Connection, cluster: bool) -> Self {
        Self {
            shared: Arc::new(Shared {
                pending: Mutex::new(Vec::new()),
                connection,
                cluster,
            }),
        }
    }

    /// Queues `latch` for deletion. The first key of an empty queue starts a drain; the
    /// client's shutdown waits for it.
    pub(crate) fn discard(&self, background: &Background, latch: String) {
        let first = {
            let mut pending = self.shared.pending();
            pending.push(latch);
            pending.len() == 1
        };
        if first {
            background.spawn(drain(Arc::clone(&self.shared), background.draining()));
        }
    }
}

async fn drain(shared: Arc<Shared>, shutting_down: tokio_util::sync::CancellationToken) {
    // Runs on the client's runtime, so this timer is its own. A shutdown does not wait
    // for the batch to fill: a command-line tool exits right after its release.
    tokio::select! {
        () = tokio::time::sleep(LINGER) => {}
        () = shutting_down.cancelled() => {}
    }
    loop {
        let batch: Vec<String> = {
            let mut pending = shared.pending();
            let keep = pending.len().saturating_sub(MAX_PER_COMMAND);
            pending.split_off(keep)
        };
        if batch.is_empty() {
            return;
        }
        if shared.cluster {
            let mut by_slot: HashMap<Slot, Vec<String>> = HashMap::new();
            for latch in batch {
                by_slot
                    .entry(Slot::for_key(&latch))
                    .or_default()
                    .push(latch);
            }
            join_all(
                by_slot
                    .into_values()
                    .map(|keys| unlink(&shared.connection, keys)),
            )
            .await;
        } else {
            unlink(&shared.connection, batch).await;
        }
    }
}

async fn unlink(connection: &Connection, keys: Vec<String>) {
    let mut connection = connection.clone();
    let deleted = redis::cmd("UNLINK")
        .arg(&keys)
        .query_async::<i64>(&mut connection)
        .await;
    if let Err(err) = deleted {
        tracing::debug!(error = %err, keys = keys.len(), "could not delete unlock latches; they expire by themselves");
    }
}
