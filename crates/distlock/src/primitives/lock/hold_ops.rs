//! How a holding's calls reach its store ([`HoldOps`]): the seam between the holding's
//! logic (hold counts, retries, the lease and its lost signal, in `holding.rs`) and the
//! store the lock lives on.
//!
//! On Redis, a primitive only states its scripts ([`HoldScripts`]) and the one
//! implementation here sends them: over the client's connection, or with a WAIT under
//! replica sync. Another store implements [`HoldOps`] itself (`postgres.rs`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use super::holding::{HoldScripts, ReleaseArgs};
use crate::engine::renewal::registry::RenewalKind;
use crate::engine::session::Core;
use crate::error::{Error, Result};
use crate::transport::script::ScriptCall;

/// What one holding call returns, owned by the call.
pub(crate) type OpFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// The calls a holding makes on its store. Each answers as the lease lock's Redis scripts
/// do, whatever the store:
pub(crate) trait HoldOps: Send + Sync {
    /// Gives back one hold (`args.left` are left): the holds left, or -1 when the owner
    /// no longer holds it. `latch` is unique to this release (the same on a retry).
    fn release<'a>(
        &'a self,
        core: &'a Core,
        name: &'a str,
        owner: &'a str,
        latch: &'a str,
        args: &'a ReleaseArgs<'a>,
    ) -> OpFuture<'a, i64>;

    /// Sets the hold count to `holds` (a re-entry): 1 while held, 0 if not.
    fn reenter<'a>(
        &'a self,
        core: &'a Core,
        name: &'a str,
        owner: &'a str,
        holds: u32,
        lease_ms: u64,
    ) -> OpFuture<'a, i64>;

    /// Sets the lease to `lease_ms` from now: true while held.
    fn extend<'a>(
        &'a self,
        core: &'a Core,
        name: &'a str,
        owner: &'a str,
        lease_ms: u64,
    ) -> OpFuture<'a, bool>;

    /// Whether the owner holds it right now.
    fn verify<'a>(&'a self, core: &'a Core, name: &'a str, owner: &'a str) -> OpFuture<'a, bool>;

    /// Whether a partial release sets a watchdog-mode lease again (the Redis scripts and
    /// PostgreSQL's statement do), so that the holding may be trusted a lease from then.
    fn partial_release_renews(&self) -> bool {
        true
    }

    /// After a final release freed the lock: lets go of what the release left to answer
    /// a retry (Redis's unlock latch).
    fn released(&self, core: &Core, latch: String) {
        let _ = (core, latch);
    }

    /// How the renewal scheduler renews the holding, and the owner it renews it as.
    fn renewal(&self, owner: &Arc<str>) -> (&'static RenewalKind, Arc<str>);

    /// The channel that announces the lock's releases and force-unlocks. A holding whose
    /// lost signal is asked for listens there, and asks the store whether it still holds
    /// the lock at each message; `None`: it does not listen.
    fn unlock_channel(&self) -> Option<&str>;
}

/// Every Redis primitive's holdings: its scripts, sent over the client's connection.
impl<S: HoldScripts> HoldOps for S {
    fn release<'a>(
        &'a self,
        core: &'a Core,
        name: &'a str,
        owner: &'a str,
        latch: &'a str,
        args: &'a ReleaseArgs<'a>,
    ) -> OpFuture<'a, i64> {
        Box::pin(async move {
            let call = HoldScripts::release(self, name, owner, latch, args);
            match core.synced() {
                None => send(core, &call).await,
                Some(synced) => {
                    let (reply, acks) = call.invoke_synced::<i64>(synced).await?;
                    if !acks.enough() {
                        // Done on the master. A failover before a replica gets it brings
                        // the lock back until its lease runs out: the next holder waits
                        // longer, but no two hold it.
                        tracing::warn!(lock = %name, acknowledged = acks.acknowledged, "no replica acknowledged a release in time");
                    }
                    Ok(reply)
                }
            }
        })
    }

    fn reenter<'a>(
        &'a self,
        core: &'a Core,
        name: &'a str,
        owner: &'a str,
        holds: u32,
        lease_ms: u64,
    ) -> OpFuture<'a, i64> {
        Box::pin(async move {
            let call = HoldScripts::reenter(self, name, owner, holds, lease_ms);
            send(core, &call).await
        })
    }

    fn extend<'a>(
        &'a self,
        core: &'a Core,
        name: &'a str,
        owner: &'a str,
        lease_ms: u64,
    ) -> OpFuture<'a, bool> {
        Box::pin(async move {
            let call = HoldScripts::extend(self, name, owner, lease_ms);
            let renewed: Vec<i64> = send(core, &call).await?;
            Ok(renewed.first() == Some(&1))
        })
    }

    fn verify<'a>(&'a self, core: &'a Core, name: &'a str, owner: &'a str) -> OpFuture<'a, bool> {
        Box::pin(async move {
            let answer = match HoldScripts::verify(self, name, owner) {
                Some(call) => {
                    core.request(|mut connection| {
                        let call = &call;
                        async move { call.invoke::<bool>(&mut connection).await }
                    })
                    .await
                }
                None => {
                    let exists = redis::cmd("HEXISTS").arg(name).arg(owner).clone();
                    core.query::<bool>(&exists).await
                }
            };
            match answer {
                // Another kind of key at the lock's name: certainly not this holding's.
                Err(Error::Redis(err)) if err.code() == Some("WRONGTYPE") => Ok(false),
                other => other,
            }
        })
    }

    fn released(&self, core: &Core, latch: String) {
        core.latches().discard(core.background(), latch);
    }

    fn renewal(&self, owner: &Arc<str>) -> (&'static RenewalKind, Arc<str>) {
        HoldScripts::renewal(self, owner)
    }

    fn unlock_channel(&self) -> Option<&str> {
        HoldScripts::unlock_channel(self)
    }
}

/// Sends `call` on the client's connection. A reply the caller's runtime would deliver
/// is not waited for there once the caller is gone (see `reply_unless_stalled`).
async fn send<T: redis::FromRedisValue>(core: &Core, call: &ScriptCall) -> Result<T> {
    let mut connection = core.connection();
    let sent_on_home = connection.routes_home();
    Ok(core
        .background()
        .reply_unless_stalled(sent_on_home, call.invoke::<T>(&mut connection))
        .await?)
}
