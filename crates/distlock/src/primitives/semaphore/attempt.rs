//! Taking permits, as the engine tries it, and giving them back.

use std::sync::Arc;

use super::scripts::{SEMAPHORE_ACQUIRE, SEMAPHORE_ADD};
use super::SemaphoreKeys;
use crate::config::{RELEASE_ATTEMPTS, RELEASE_RETRY_PAUSE};
use crate::engine::acquire::{Acquire, Attempt, AttemptFuture};
use crate::engine::detach::Detached;
use crate::engine::session::Core;
use crate::engine::subscriptions::WakeRule;
use crate::error::{is_connection_failure, Result};
use crate::primitives::keys::unlock_latch;
use crate::transport::script::ScriptCall;

/// One acquisition of `permits` permits.
pub(crate) struct SemaphoreAttempt {
    pub(super) core: Arc<Core>,
    pub(super) keys: Arc<SemaphoreKeys>,
    /// At least 1 (checked by the handle).
    pub(super) permits: i64,
}

impl SemaphoreAttempt {
    pub(crate) fn core(&self) -> &Core {
        &self.core
    }
}

impl Acquire for SemaphoreAttempt {
    type Guard = Taken;

    fn kind(&self) -> &'static str {
        "semaphore"
    }

    fn attempt(&self) -> AttemptFuture<Taken> {
        let mut call = ScriptCall::new(&SEMAPHORE_ACQUIRE, &[&self.keys.key], 1);
        call.arg(self.permits);
        let (core, keys, permits) = (Arc::clone(&self.core), Arc::clone(&self.keys), self.permits);
        Box::pin(async move {
            let taken: i64 = core
                .take(
                    &call,
                    &keys.key,
                    |taken| *taken == 1,
                    // After a lost reply (`None`) nobody can tell whether the permits
                    // were taken: adding them back could make more permits than there
                    // are, so they stay taken (docs/safety.md says so).
                    |reply| add_back(&core, &keys, reply.map(|_| permits)),
                )
                .await?;
            Ok(if taken == 1 {
                Attempt::Acquired(Taken {
                    core: Some(core),
                    keys,
                    permits,
                })
            } else {
                // Every release publishes the free count: no lease to wait out.
                Attempt::Busy { retry_after: None }
            })
        })
    }

    fn channel(&self) -> &str {
        &self.keys.channel
    }

    fn queue(&self) -> &str {
        &self.keys.key
    }

    fn wake_rule(&self) -> WakeRule {
        WakeRule::UpTo
    }

    fn ask(&self) -> u64 {
        self.permits.unsigned_abs()
    }
}

/// Permits taken from a semaphore; dropping them gives them back, in the background on
/// the client's own runtime.
pub(crate) struct Taken {
    /// `None` once given back or forgotten.
    core: Option<Arc<Core>>,
    keys: Arc<SemaphoreKeys>,
    permits: i64,
}

impl Taken {
    pub(crate) fn permits(&self) -> i64 {
        self.permits
    }

    pub(crate) fn key(&self) -> &str {
        &self.keys.key
    }

    /// Gives the permits back now.
    pub(crate) async fn give_back(mut self) -> Result<()> {
        let Some(core) = self.core.take() else {
            return Ok(());
        };
        let add = add_permits(&core, &self.keys, self.permits);
        Detached::new(core.background(), add).await?;
        Ok(())
    }

    /// Keeps the permits taken: nothing is given back.
    pub(crate) fn forget(mut self) {
        self.core = None;
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        let Some(core) = self.core.take() else {
            return;
        };
        let add = add_permits(&core, &self.keys, self.permits);
        let semaphore = Arc::clone(&self.keys);
        core.background().spawn(async move {
            if let Err(err) = add.await {
                tracing::warn!(semaphore = %semaphore.key, error = %err, "could not give back the permits of a dropped guard; they stay taken");
            }
        });
    }
}

/// Adds back `permits` that were taken but no replica acknowledged (none when `None`).
pub(crate) fn add_back(
    core: &Arc<Core>,
    keys: &Arc<SemaphoreKeys>,
    permits: Option<i64>,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let adding = permits.map(|permits| add_permits(core, keys, permits));
    async move {
        let Some(adding) = adding else { return };
        if let Err(err) = adding.await {
            tracing::warn!(error = %err, "could not give back permits no replica acknowledged; they stay taken");
        }
    }
}

/// Adds `permits` (taken away when negative) and publishes the new free count. Returns it.
///
/// Sent again after a lost reply (a connection dropped under it, a timeout), as a release
/// of a lock is: the call's latch keeps its answer, so the permits are added once.
pub(crate) fn add_permits(
    core: &Arc<Core>,
    keys: &Arc<SemaphoreKeys>,
    permits: i64,
) -> impl std::future::Future<Output = Result<i64>> + Send + 'static {
    let prefix = &core.config().key_prefix;
    let latch = unlock_latch(prefix, &keys.key, core.next_request_id());
    let (core, keys) = (Arc::clone(core), Arc::clone(keys));
    async move {
        let mut connection = core.connection();
        let mut attempt = 1;
        let outcome = loop {
            let mut call = ScriptCall::new(&SEMAPHORE_ADD, &[&keys.key, &keys.channel, &latch], 4);
            call.arg(permits)
                .arg(core.deployment().publish_command())
                .arg(core.config().unlock_latch_ttl_ms)
                .arg(if attempt > 1 { "1" } else { "0" });
            match call.invoke::<i64>(&mut connection).await {
                Err(err) if attempt < RELEASE_ATTEMPTS && is_connection_failure(&err) => {
                    tracing::debug!(error = %err, attempt, "permits' reply lost; asking again");
                    core.background().pause(RELEASE_RETRY_PAUSE * attempt).await;
                    attempt += 1;
                }
                other => break other,
            }
        };
        let free = outcome?;
        core.latches().discard(core.background(), latch);
        Ok(free)
    }
}
