//! One acquisition of a lease lock, as the engine tries it: the acquire script as a new
//! owner, and the give-back of an attempt whose reply was lost.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::hold_ops::PlainRelease;
use super::holding::{Acquired, Hold};
use super::scripts::{LOCK_ACQUIRE, LOCK_RELEASE, RELEASE_MESSAGE};
use crate::engine::acquire::{Acquire, Attempt, AttemptFuture};
use crate::engine::session::Core;
use crate::transport::script::ScriptCall;

/// One acquisition, ready to be tried as often as the engine needs.
pub(crate) struct LockAttempt {
    pub(super) core: Arc<Core>,
    pub(super) name: Arc<str>,
    pub(super) token_key: Arc<str>,
    pub(super) other_token_key: Arc<str>,
    /// The lock's release (its channel), shared by every holding the lock's attempts make.
    pub(super) release: Arc<PlainRelease>,
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
        &self.release.channel
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
        let release = Arc::clone(&self.release);
        let (lease, lease_ms, renew) = (self.lease, self.lease_ms, self.renew);
        // The lease is counted from when the attempt was made, not from when it ran: a
        // RedLock makes its masters' attempts right after it starts its clock, and their
        // deadlines must not run past the validity it computes from that clock.
        let sent_at = Instant::now();
        #[cfg(feature = "postgres")]
        if let crate::transport::Store::Postgres(link) = core.store() {
            let link = link.clone();
            let owner = core.next_owner();
            return Box::pin(super::postgres::attempt(
                core,
                link,
                name,
                Arc::clone(&release.channel),
                owner,
                (lease, lease_ms, renew),
                sent_at,
            ));
        }
        Box::pin(async move {
            // Checked here too, for composites that try a lock on several servers (a
            // RedLock's masters) without the engine: each server's own policy counts.
            core.ensure_keys_stay()?;
            let owner = core.next_owner();
            let mut call = ScriptCall::new(&LOCK_ACQUIRE, &[&name, &token_key], 3);
            call.arg(lease_ms).arg(&*owner).arg(&*other_token_key);
            // Given back when its reply is lost or no replica has it: this owner is new to
            // this attempt, so no later attempt can be what the give-back releases.
            let reply = core
                .take::<i64, _>(
                    &call,
                    &name,
                    |token| *token >= 1,
                    |_| {
                        give_up(
                            Arc::clone(&core),
                            Arc::clone(&name),
                            Arc::clone(&release.channel),
                            Arc::clone(&owner),
                        )
                    },
                )
                .await?;
            match reply {
                token @ 1.. => Ok(Attempt::Acquired(
                    Acquired {
                        core,
                        name,
                        owner,
                        release,
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
        &self.release.channel
    }

    fn queue(&self) -> &str {
        &self.name
    }

    fn token(&self, guard: &Hold) -> Option<u64> {
        Some(guard.token())
    }
}

/// Releases whatever `owner` may hold (an attempt whose reply was lost, or that no
/// replica acknowledged). Harmless if it holds nothing.
async fn give_up(core: Arc<Core>, name: Arc<str>, channel: Arc<str>, owner: Arc<str>) {
    let mut connection = core.connection();
    let outcome = ScriptCall::new(&LOCK_RELEASE, &[&name, &channel, &name], 7)
        .arg(&*owner)
        .arg(0)
        .arg(1)
        .arg(RELEASE_MESSAGE)
        .arg(0)
        .arg(0)
        .arg(core.deployment().publish_command())
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
}
