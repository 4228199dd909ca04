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

use super::scripts::{LOCK_REENTER, LOCK_RELEASE, LOCK_RENEW, LOCK_RENEWAL, RELEASE_MESSAGE};
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

    /// The holding is over, and the store answered every call it made, each on its
    /// first try: nothing it sent can land later. A fair lock may then give its owner id
    /// to another acquisition (`fair_lock/owners.rs`).
    fn settled(&self) {}

    /// A call of the holding may land later than its answer, or its outcome is unknown
    /// (an error, a retry), or its lease was changed: its owner id serves nothing else.
    fn unsettled(&self) {}

    /// How the renewal scheduler renews the holding, and the owner it renews it as.
    fn renewal(&self, owner: &Arc<str>) -> (&'static RenewalKind, Arc<str>);

    /// The channel that announces the lock's releases and force-unlocks. A holding whose
    /// lost signal is asked for listens there, and asks the store whether it still holds
    /// the lock at each message; `None`: it does not listen.
    fn unlock_channel(&self) -> Option<&str>;

    /// The Redis scripts behind these calls, if that is what they are: this module's
    /// `release` function then sends the release script itself, without the boxed future
    /// of [`HoldOps::release`] (an allocation on every release of every Redis primitive).
    fn scripts(&self) -> Option<&dyn HoldScripts> {
        None
    }
}

/// Gives back one hold through `ops` (as [`HoldOps::release`] does): a Redis holding's
/// release script is sent from here, without a box around the call.
pub(crate) async fn release(
    ops: &dyn HoldOps,
    core: &Core,
    name: &str,
    owner: &str,
    latch: &str,
    args: &ReleaseArgs<'_>,
) -> Result<i64> {
    match ops.scripts() {
        Some(scripts) => release_by_script(scripts, core, name, owner, latch, args).await,
        None => ops.release(core, name, owner, latch, args).await,
    }
}

/// Sends the release script of `scripts`: over the client's connection, or with a WAIT
/// under replica sync.
async fn release_by_script(
    scripts: &(impl HoldScripts + ?Sized),
    core: &Core,
    name: &str,
    owner: &str,
    latch: &str,
    args: &ReleaseArgs<'_>,
) -> Result<i64> {
    let call = scripts.release(name, owner, latch, args);
    match core.synced() {
        None => send(core, &call).await,
        Some(synced) => {
            let (reply, acks) = call.invoke_synced::<i64>(synced).await?;
            if !acks.enough() {
                // Done on the master. A failover before a replica gets it brings the lock
                // back until its lease runs out: the next holder waits longer, but no two
                // hold it.
                tracing::warn!(lock = %name, acknowledged = acks.acknowledged, "no replica acknowledged a release in time");
            }
            Ok(reply)
        }
    }
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
        Box::pin(release_by_script(self, core, name, owner, latch, args))
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

    fn settled(&self) {
        HoldScripts::settled(self);
    }

    fn unsettled(&self) {
        HoldScripts::unsettled(self);
    }

    fn renewal(&self, owner: &Arc<str>) -> (&'static RenewalKind, Arc<str>) {
        HoldScripts::renewal(self, owner)
    }

    fn unlock_channel(&self) -> Option<&str> {
        HoldScripts::unlock_channel(self)
    }

    fn scripts(&self) -> Option<&dyn HoldScripts> {
        Some(self)
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

/// The scripts a Redis holding's calls send, given its key and owner: the lease lock's by
/// default; a fair lock's release hands the lock to the head of its queue, and a
/// read-write lock's read holds have scripts of their own. Every release takes the same
/// arguments and answers alike: the holds left, or -1 when the owner no longer holds it.
/// (Sent by the blanket [`HoldOps`] impl below.)
pub(crate) trait HoldScripts: Send + Sync {
    /// Gives back one hold (`args.left` are left).
    fn release(&self, name: &str, owner: &str, latch: &str, args: &ReleaseArgs<'_>) -> ScriptCall;

    /// Sets the hold count to `holds` (a re-entry); answers 1 while held, 0 if not.
    fn reenter(&self, name: &str, owner: &str, holds: u32, lease_ms: u64) -> ScriptCall {
        let _ = lease_ms;
        let mut call = ScriptCall::new(&LOCK_REENTER, &[name], 2);
        call.arg(owner).arg(holds);
        call
    }

    /// Sets the lease to `lease_ms` from now (an extension); answers `[1]` while held,
    /// `[0]` if not.
    fn extend(&self, name: &str, owner: &str, lease_ms: u64) -> ScriptCall {
        let mut call = ScriptCall::new(&LOCK_RENEW, &[name], 2);
        call.arg(lease_ms).arg(owner);
        call
    }

    /// A script that answers whether the owner still holds it (1 or 0), when a hash
    /// field is not the whole answer; `None`: HEXISTS on the field.
    fn verify(&self, name: &str, owner: &str) -> Option<ScriptCall> {
        let _ = (name, owner);
        None
    }

    /// How the renewal scheduler renews the holding, and the owner argument it renews
    /// it with.
    fn renewal(&self, owner: &Arc<str>) -> (&'static RenewalKind, Arc<str>) {
        (&LOCK_RENEWAL, Arc::clone(owner))
    }

    /// As [`HoldOps::settled`].
    fn settled(&self) {}

    /// As [`HoldOps::unsettled`].
    fn unsettled(&self) {}

    /// The channel that announces the lock's releases and force-unlocks. A holding whose
    /// lost signal is asked for listens there, and asks the server whether it still
    /// holds the lock at each message; `None`: it does not listen.
    fn unlock_channel(&self) -> Option<&str> {
        None
    }
}

/// The arguments every release script takes.
pub(crate) struct ReleaseArgs<'a> {
    /// The holds left after this release (0: give the lock up).
    pub(crate) left: u32,
    /// The lease a partial release sets again; 0 leaves a fixed lease's deadline.
    pub(crate) lease_ms: u64,
    /// How long the unlock latch is kept; 0 for none (a partial release).
    pub(crate) latch_ttl_ms: u64,
    /// A retry of a request whose latch may hold its answer.
    pub(crate) retry: bool,
    pub(crate) publish: &'a str,
}

/// The lease lock's release: `lock_release.lua`, waking one waiter on `channel`.
pub(crate) struct PlainRelease {
    pub(crate) channel: Arc<str>,
}

impl HoldScripts for PlainRelease {
    fn release(&self, name: &str, owner: &str, latch: &str, args: &ReleaseArgs<'_>) -> ScriptCall {
        let mut call = ScriptCall::new(&LOCK_RELEASE, &[name, &self.channel, latch], 7);
        call.arg(owner)
            .arg(args.left)
            .arg(args.lease_ms)
            .arg(RELEASE_MESSAGE)
            .arg(args.latch_ttl_ms)
            .arg(if args.retry { "1" } else { "0" })
            .arg(args.publish);
        call
    }

    fn unlock_channel(&self) -> Option<&str> {
        Some(&self.channel)
    }
}
