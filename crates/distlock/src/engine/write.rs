//! Writes that take something on the server (a hold, a place, permits), sent the one way
//! every primitive needs: followed by a WAIT when replica sync is on, and given back when
//! what they took cannot be trusted.
//!
//! Two outcomes leave an acquisition that must not be kept:
//! - its reply was lost to a connection failure: the script may have run, and nobody
//!   knows the hold is there;
//! - too few replicas acknowledged it: a failover now would hand the same thing to
//!   someone else while this caller trusts it.
//!
//! In both, the primitive's give-back runs on the client's runtime, so it finishes even if
//! the caller's future is dropped, and the call waits for it before it returns, so that
//! the next attempt of the same acquisition (a fair lock keeps its owner for the whole
//! wait) never races its own give-back.
//!
//! Writes that take nothing (a count-down, a new count) go through [`Core::write`]: a
//! write no replica acknowledged is done on the master and cannot be undone, so it is
//! logged.

use std::future::Future;

use redis::FromRedisValue;

use crate::engine::session::Core;
use crate::error::{is_connection_failure, Error, Result};
use crate::transport::replica_sync::Acks;
use crate::transport::script::ScriptCall;

impl Core {
    /// Sends `call`, an acquisition of `name`, and returns its reply once replicas have
    /// it (when replica sync is on).
    ///
    /// `took` says whether a reply means something was taken. When the reply was lost to
    /// a connection failure, or it took something too few replicas acknowledged,
    /// `give_back` runs first, given the reply (`None` when it was lost: the write may or
    /// may not have run, and a give-back that cannot tell, as a plain semaphore's permits
    /// have no owner, must do nothing); the call then fails ([`Error::NotReplicated`] when
    /// replicas were missing).
    pub(crate) async fn take<T, G>(
        &self,
        call: &ScriptCall,
        name: &str,
        took: impl FnOnce(&T) -> bool,
        give_back: impl FnOnce(Option<&T>) -> G,
    ) -> Result<T>
    where
        T: FromRedisValue,
        G: Future<Output = ()> + Send + 'static,
    {
        let sent = match self.synced() {
            None => call.invoke::<T>(&mut self.connection()).await,
            Some(synced) => match call.invoke_synced::<T>(synced).await {
                Ok((reply, acks)) => {
                    if took(&reply) && !acks.enough() {
                        self.given_back(give_back(Some(&reply))).await;
                        return Err(not_replicated(name, acks, synced.policy().timeout));
                    }
                    Ok(reply)
                }
                // Never sent: the cluster link gave up its turn on the master waiting for
                // replicas. Nothing was taken.
                #[cfg(feature = "cluster")]
                Err(err) if crate::transport::cluster::link::never_sent(&err) => {
                    let acks = Acks {
                        acknowledged: 0,
                        required: synced.policy().replicas,
                    };
                    return Err(not_replicated(name, acks, synced.policy().timeout));
                }
                Err(err) => Err(err),
            },
        };
        match sent {
            Ok(reply) => Ok(reply),
            Err(err) => {
                if is_connection_failure(&err) {
                    self.given_back(give_back(None)).await;
                }
                Err(err.into())
            }
        }
    }

    /// Sends `call`, a write of `name` that takes nothing, followed by a WAIT when replica
    /// sync is on. A write too few replicas acknowledged stands on the master; it is
    /// logged, since a failover before a replica gets it would undo it.
    ///
    /// `repeatable`: the write is harmless to send twice, so it is sent once more when its
    /// connection was found dropped (a restarted server fails the first request on an old
    /// connection). A write that is not (a count-down) is sent once.
    pub(crate) async fn write<T: FromRedisValue>(
        &self,
        call: &ScriptCall,
        name: &str,
        repeatable: bool,
    ) -> Result<T> {
        self.ensure_open()?;
        match self.write_once(call, name).await {
            Err(err) if repeatable && err.is_connection_dropped() => {
                tracing::debug!(error = %err, "connection was dropped; sending once more");
                Ok(self.write_once(call, name).await?)
            }
            other => Ok(other?),
        }
    }

    async fn write_once<T: FromRedisValue>(
        &self,
        call: &ScriptCall,
        name: &str,
    ) -> redis::RedisResult<T> {
        match self.synced() {
            None => call.invoke::<T>(&mut self.connection()).await,
            Some(synced) => {
                let (reply, acks) = call.invoke_synced::<T>(synced).await?;
                if !acks.enough() {
                    tracing::warn!(key = %name, acknowledged = acks.acknowledged, required = acks.required, "no replica acknowledged a write in time");
                }
                Ok(reply)
            }
        }
    }

    /// Runs a give-back on the client's runtime, and waits for it unless the caller goes
    /// first.
    pub(crate) async fn given_back<G: Future<Output = ()> + Send + 'static>(&self, give_back: G) {
        let (done, finished) = tokio::sync::oneshot::channel::<()>();
        self.background().spawn(async move {
            give_back.await;
            let _ = done.send(());
        });
        // An error only says the task ended without sending: it ended either way.
        let _ = finished.await;
    }
}

fn not_replicated(name: &str, acks: Acks, timeout: std::time::Duration) -> Error {
    Error::NotReplicated {
        name: name.to_string(),
        acknowledged: acks.acknowledged,
        required: acks.required,
        timeout,
    }
}
