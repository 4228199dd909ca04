//! One acquisition of a lease lock, as the engine tries it: the acquire script as a new
//! owner, and the give-back of an attempt whose reply was lost.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::holding::{Acquired, Hold, PlainRelease};
use super::scripts::{LOCK_ACQUIRE, LOCK_RELEASE, RELEASE_MESSAGE};
use crate::engine::acquire::{Acquire, Attempt, AttemptFuture};
use crate::engine::session::Core;
use crate::error::{is_connection_failure, Error};
use crate::transport::script::ScriptCall;

/// One acquisition, ready to be tried as often as the engine needs.
pub(crate) struct LockAttempt {
    pub(super) core: Arc<Core>,
    pub(super) name: Arc<str>,
    pub(super) token_key: Arc<str>,
    pub(super) other_token_key: Arc<str>,
    pub(super) channel: Arc<str>,
    pub(super) lease: Duration,
    pub(super) lease_ms: u64,
    pub(super) renew: bool,
}

impl LockAttempt {
    /// The session the attempt runs in.
    pub(crate) fn core(&self) -> &Core {
        &self.core
    }

    /// The lease each acquisition sets.
    pub(crate) fn lease(&self) -> Duration {
        self.lease
    }

    /// The lock's release channel.
    pub(crate) fn channel_arc(&self) -> &Arc<str> {
        &self.channel
    }
}

impl Acquire for LockAttempt {
    type Guard = Hold;

    fn kind(&self) -> &'static str {
        "lock"
    }

    fn attempt(&self) -> AttemptFuture<Hold> {
        let core = Arc::clone(&self.core);
        let name = Arc::clone(&self.name);
        let token_key = Arc::clone(&self.token_key);
        let other_token_key = Arc::clone(&self.other_token_key);
        let channel = Arc::clone(&self.channel);
        let (lease, lease_ms, renew) = (self.lease, self.lease_ms, self.renew);
        // The lease is counted from when the attempt was made, not from when it ran: a
        // RedLock makes its masters' attempts right after it starts its clock, and their
        // deadlines must not run past the validity it computes from that clock.
        let sent_at = Instant::now();
        Box::pin(async move {
            // Checked here too, for composites that try a lock on several servers (a
            // RedLock's masters) without the engine: each server's own policy counts.
            core.ensure_keys_stay()?;
            let owner = core.next_owner();
            let mut connection = core.connection();
            let mut call = ScriptCall::new(&LOCK_ACQUIRE, &[&name, &token_key], 3);
            call.arg(lease_ms).arg(&*owner).arg(&*other_token_key);
            let reply = match core.synced() {
                None => call.invoke::<i64>(&mut connection).await,
                Some(synced) => match call.invoke_synced::<i64>(synced).await {
                    Ok((token, acks)) if token >= 1 && !acks.enough() => {
                        // No replica has it: a failover now would hand the lock to
                        // someone else while this owner trusts it. Give it back.
                        abandon(&core, &name, &channel, &owner);
                        return Err(Error::NotReplicated {
                            name: name.to_string(),
                            acknowledged: acks.acknowledged,
                            required: acks.required,
                            timeout: synced.policy().timeout,
                        });
                    }
                    #[cfg(feature = "cluster")]
                    Err(err) if crate::transport::cluster::link::never_sent(&err) => {
                        return Err(Error::NotReplicated {
                            name: name.to_string(),
                            acknowledged: 0,
                            required: synced.policy().replicas,
                            timeout: synced.policy().timeout,
                        });
                    }
                    other => other.map(|(reply, _)| reply),
                },
            };
            let reply = match reply {
                Ok(reply) => reply,
                Err(err) => {
                    if is_connection_failure(&err) {
                        // The script may have run: give up whatever this owner took.
                        abandon(&core, &name, &channel, &owner);
                    }
                    return Err(err.into());
                }
            };
            match reply {
                token @ 1.. => Ok(Attempt::Acquired(
                    Acquired {
                        core,
                        name,
                        owner,
                        release: Arc::new(PlainRelease { channel }),
                        token: token.unsigned_abs(),
                        sent_at,
                        lease,
                        lease_ms,
                        renew,
                    }
                    .into_hold(),
                )),
                0 => Ok(Attempt::Busy { retry_after: None }),
                negative => Ok(Attempt::Busy {
                    retry_after: Some(Duration::from_millis((-1 - negative).unsigned_abs())),
                }),
            }
        })
    }

    fn channel(&self) -> &str {
        &self.channel
    }

    fn queue(&self) -> &str {
        &self.name
    }
}

/// Sends, in the background, a release for an owner that may or may not hold the lock (an
/// attempt whose reply was lost). Harmless if it holds nothing.
fn abandon(core: &Arc<Core>, name: &Arc<str>, channel: &Arc<str>, owner: &Arc<str>) {
    let (core_for_task, name, channel, owner) = (
        Arc::clone(core),
        Arc::clone(name),
        Arc::clone(channel),
        Arc::clone(owner),
    );
    core.background().spawn(async move {
        let mut connection = core_for_task.connection();
        let outcome = ScriptCall::new(&LOCK_RELEASE, &[&name, &channel, &name], 7)
            .arg(&*owner)
            .arg(0)
            .arg(1)
            .arg(RELEASE_MESSAGE)
            .arg(0)
            .arg(0)
            .arg(core_for_task.deployment().publish_command())
            .invoke::<i64>(&mut connection)
            .await;
        match outcome {
            Ok(0..) => tracing::debug!(lock = %name, "gave up a hold whose reply was lost"),
            Ok(_) => {}
            Err(err) => tracing::warn!(
                error = %err,
                lock = %name,
                "could not give up an acquisition whose reply was lost; it expires with its lease"
            ),
        }
    });
}
