//! Read and write holdings of a read-write lock: the scripts their calls send, and the
//! attempts that take them, as the engine tries them.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::scripts::{
    RW_READ_ACQUIRE, RW_READ_REENTER, RW_READ_RELEASE, RW_READ_RENEW, RW_READ_RENEWAL,
    RW_READ_VERIFY, RW_WRITE_ACQUIRE, RW_WRITE_RELEASE,
};
use super::RwKeys;
use crate::engine::acquire::{AbandonFuture, Acquire, Attempt, AttemptFuture};
use crate::engine::renewal::registry::RenewalKind;
use crate::engine::session::Core;
use crate::engine::subscriptions::WakeRule;
use crate::error::Result;
use crate::primitives::lock::{Acquired, Hold, HoldOps, HoldScripts, ReleaseArgs};
use crate::transport::script::ScriptCall;

/// A write holding's scripts: the lease lock's, with the write field as the owner, but
/// a release that publishes `1` (wake all) and leaves the lock to the writer's own read
/// holds, if it took any.
pub(crate) struct WriteScripts(pub(crate) Arc<RwKeys>);

impl HoldScripts for WriteScripts {
    fn release(&self, name: &str, owner: &str, latch: &str, args: &ReleaseArgs<'_>) -> ScriptCall {
        release_call(&RW_WRITE_RELEASE, &self.0, name, owner, latch, args)
    }
}

/// A read holding's scripts: each hold has a key of its own whose expiry is its lease.
pub(crate) struct ReadScripts(pub(crate) Arc<RwKeys>);

impl HoldScripts for ReadScripts {
    fn release(&self, name: &str, owner: &str, latch: &str, args: &ReleaseArgs<'_>) -> ScriptCall {
        release_call(&RW_READ_RELEASE, &self.0, name, owner, latch, args)
    }

    fn reenter(&self, name: &str, owner: &str, holds: u32, lease_ms: u64) -> ScriptCall {
        let mut call = ScriptCall::new(&RW_READ_REENTER, &[name], 4);
        call.arg(owner).arg(holds).arg(lease_ms).arg(&*self.0.base);
        call
    }

    fn extend(&self, name: &str, owner: &str, lease_ms: u64) -> ScriptCall {
        let mut call = ScriptCall::new(&RW_READ_RENEW, &[name], 2);
        call.arg(lease_ms).arg(format!("{owner}|{}", self.0.base));
        call
    }

    fn verify(&self, name: &str, owner: &str) -> Option<ScriptCall> {
        let mut call = ScriptCall::new(&RW_READ_VERIFY, &[name], 2);
        call.arg(owner).arg(&*self.0.base);
        Some(call)
    }

    fn renewal(&self, owner: &Arc<str>) -> (&'static RenewalKind, Arc<str>) {
        (&RW_READ_RENEWAL, format!("{owner}|{}", self.0.base).into())
    }
}

fn release_call(
    script: &'static crate::transport::script::LuaScript,
    keys: &RwKeys,
    name: &str,
    owner: &str,
    latch: &str,
    args: &ReleaseArgs<'_>,
) -> ScriptCall {
    let mut call = ScriptCall::new(script, &[name, &keys.channel, latch], 7);
    call.arg(owner)
        .arg(args.left)
        .arg(args.lease_ms)
        .arg(args.latch_ttl_ms)
        .arg(if args.retry { "1" } else { "0" })
        .arg(args.publish)
        .arg(&*keys.base);
    call
}

/// What both kinds of attempt share.
pub(crate) struct RwAttempt {
    pub(super) core: Arc<Core>,
    pub(super) keys: Arc<RwKeys>,
    pub(super) lease: Duration,
    pub(super) lease_ms: u64,
    pub(super) renew: bool,
    pub(super) prefer_writers: bool,
    /// A writer that will wait: it lists itself as waiting, so that readers with writer
    /// preference queue behind it.
    pub(super) waits: bool,
    /// A writer's id among the writers waiting: one per acquisition.
    pub(super) waiter: Arc<str>,
    /// How long a waiting writer stays listed without another attempt; it looks again at
    /// least every third of it.
    pub(super) alive: Duration,
}

/// Taking a read hold.
pub(crate) struct ReadAttempt(pub(super) RwAttempt);

/// Taking the write hold.
pub(crate) struct WriteAttempt(pub(super) RwAttempt);

impl RwAttempt {
    pub(crate) fn core(&self) -> &Core {
        &self.core
    }

    fn acquired(&self, owner: Arc<str>, token: u64, sent_at: Instant, write: bool) -> Hold {
        let scripts: Arc<dyn HoldOps> = if write {
            Arc::new(WriteScripts(Arc::clone(&self.keys)))
        } else {
            Arc::new(ReadScripts(Arc::clone(&self.keys)))
        };
        Acquired {
            core: Arc::clone(&self.core),
            name: Arc::clone(&self.keys.lock),
            owner,
            release: scripts,
            token,
            sent_at,
            lease: self.lease,
            lease_ms: self.lease_ms,
            renew: self.renew,
        }
        .into_hold()
    }
}

impl RwAttempt {
    /// Sends an acquisition `call` made for `owner` (`write`: for the write hold). A hold
    /// whose reply was lost, or that no replica acknowledged, is given up.
    async fn send(&self, call: ScriptCall, owner: &Arc<str>, write: bool) -> Result<i64> {
        let scripts: Arc<dyn HoldScripts> = if write {
            Arc::new(WriteScripts(Arc::clone(&self.keys)))
        } else {
            Arc::new(ReadScripts(Arc::clone(&self.keys)))
        };
        // A write hold answers its token, a read hold 1.
        self.core
            .take(
                &call,
                &self.keys.lock,
                |reply: &i64| *reply >= 1,
                |_| {
                    give_up(
                        Arc::clone(&self.core),
                        scripts,
                        Arc::clone(&self.keys.lock),
                        Arc::clone(owner),
                    )
                },
            )
            .await
    }
}

/// Gives up whatever `owner` may hold (an attempt whose reply was lost, or that no
/// replica acknowledged): harmless if it holds nothing.
async fn give_up(core: Arc<Core>, scripts: Arc<dyn HoldScripts>, name: Arc<str>, owner: Arc<str>) {
    let mut connection = core.connection();
    let args = ReleaseArgs {
        left: 0,
        lease_ms: 0,
        latch_ttl_ms: 0,
        retry: false,
        publish: core.deployment().publish_command(),
    };
    let outcome = scripts
        .release(&name, &owner, &name, &args)
        .invoke::<i64>(&mut connection)
        .await;
    if let Err(err) = outcome {
        tracing::warn!(lock = %name, error = %err, "could not give up a read-write hold whose reply was lost; it expires with its lease");
    }
}

impl Acquire for ReadAttempt {
    type Guard = Hold;

    fn kind(&self) -> &'static str {
        "read_lock"
    }

    fn attempt(&self) -> AttemptFuture<Hold> {
        let rw = &self.0;
        let owner = rw.core.next_owner();
        let keys = &rw.keys;
        let mut call = ScriptCall::new(&RW_READ_ACQUIRE, &[&keys.lock, &keys.writers], 5);
        call.arg(rw.lease_ms)
            .arg(&*owner)
            .arg(format!("{}:{owner}:rwlock_timeout", keys.base))
            .arg(if rw.prefer_writers { "1" } else { "0" })
            .arg("0");
        let sent_at = Instant::now();
        let made = ReadAttempt(rw.shallow_clone());
        Box::pin(async move {
            let rw = &made.0;
            let reply = rw.send(call, &owner, false).await?;
            Ok(match reply {
                1 => Attempt::Acquired(rw.acquired(owner, 0, sent_at, false)),
                // A writer waits first (writer preference), whose release wakes us, or
                // the lock has no expiry: look again at the fallback interval.
                0 => Attempt::Busy { retry_after: None },
                negative => Attempt::Busy {
                    retry_after: Some(Duration::from_millis((-1 - negative).unsigned_abs())),
                },
            })
        })
    }

    fn channel(&self) -> &str {
        &self.0.keys.channel
    }

    fn queue(&self) -> &str {
        &self.0.keys.lock
    }

    fn wake_rule(&self) -> WakeRule {
        // Any release may let this waiter in, and Redisson's read release wakes one
        // waiter per client: missing it left a Redisson writer waiting out the readers'
        // lease. Every message wakes every local waiter; each looks again.
        WakeRule::All
    }
}

impl RwAttempt {
    fn shallow_clone(&self) -> RwAttempt {
        RwAttempt {
            core: Arc::clone(&self.core),
            keys: Arc::clone(&self.keys),
            lease: self.lease,
            lease_ms: self.lease_ms,
            renew: self.renew,
            prefer_writers: self.prefer_writers,
            waits: self.waits,
            waiter: Arc::clone(&self.waiter),
            alive: self.alive,
        }
    }
}

impl Acquire for WriteAttempt {
    type Guard = Hold;

    fn kind(&self) -> &'static str {
        "write_lock"
    }

    fn token(&self, guard: &Hold) -> Option<u64> {
        Some(guard.token())
    }

    fn attempt(&self) -> AttemptFuture<Hold> {
        let rw = &self.0;
        let owner = rw.core.next_owner();
        let field: Arc<str> = format!("{owner}:write").into();
        let keys = &rw.keys;
        let mut call = ScriptCall::new(
            &RW_WRITE_ACQUIRE,
            &[&keys.lock, &keys.token_key, &keys.writers],
            5,
        );
        let listed_for = if rw.waits {
            u64::try_from(rw.alive.as_millis()).unwrap_or(u64::MAX)
        } else {
            0
        };
        call.arg(rw.lease_ms)
            .arg(&*owner)
            .arg(&*keys.other_token_key)
            .arg(listed_for)
            .arg(&*rw.waiter);
        let sent_at = Instant::now();
        let made = WriteAttempt(rw.shallow_clone());
        Box::pin(async move {
            let rw = &made.0;
            let reply = rw.send(call, &field, true).await?;
            Ok(match reply {
                token @ 1.. => {
                    Attempt::Acquired(rw.acquired(field, token.unsigned_abs(), sent_at, true))
                }
                0 => Attempt::Busy {
                    // Held with no expiry: look again at the fallback interval.
                    retry_after: if rw.waits { Some(rw.alive / 3) } else { None },
                },
                busy => {
                    let lease_left = Duration::from_millis((-1 - busy).unsigned_abs());
                    // A listed writer looks again before its listing runs out.
                    let retry_after = if rw.waits {
                        lease_left.min(rw.alive / 3)
                    } else {
                        lease_left
                    };
                    Attempt::Busy {
                        retry_after: Some(retry_after),
                    }
                }
            })
        })
    }

    fn channel(&self) -> &str {
        &self.0.keys.channel
    }

    fn queue(&self) -> &str {
        &self.0.keys.lock
    }

    fn wake_rule(&self) -> WakeRule {
        WakeRule::All
    }

    fn abandon(&self) -> Option<AbandonFuture> {
        if !self.0.waits {
            return None;
        }
        let rw = &self.0;
        let remove = redis::cmd("ZREM")
            .arg(&*rw.keys.writers)
            .arg(&*rw.waiter)
            .clone();
        let core = Arc::clone(&rw.core);
        Some(Box::pin(async move {
            let mut connection = core.connection();
            let _: i64 = remove.query_async(&mut connection).await?;
            Ok(())
        }))
    }
}
