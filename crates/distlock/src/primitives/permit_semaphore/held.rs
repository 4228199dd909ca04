//! Taking leased permits, as the engine tries it, and the permits while they are held:
//! each a lease the renewal scheduler renews and watches, given back by id.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::scripts::{PERMIT_ACQUIRE, PERMIT_RELEASE, PERMIT_RENEWAL};
use super::PermitKeys;
use crate::engine::acquire::{Acquire, Attempt, AttemptFuture};
use crate::engine::renewal::lease::Lease;
use crate::engine::session::Core;
use crate::engine::subscriptions::WakeRule;
use crate::error::Result;
use crate::transport::script::ScriptCall;

/// One acquisition of `permits` leased permits.
pub(crate) struct PermitAttempt {
    pub(super) core: Arc<Core>,
    pub(super) keys: Arc<PermitKeys>,
    pub(super) permits: u32,
    pub(super) lease: Duration,
    pub(super) lease_ms: u64,
    pub(super) renew: bool,
}

impl PermitAttempt {
    pub(crate) fn core(&self) -> &Core {
        &self.core
    }
}

impl Acquire for PermitAttempt {
    type Guard = Held;

    fn kind(&self) -> &'static str {
        "permit_semaphore"
    }

    fn attempt(&self) -> AttemptFuture<Held> {
        // Fresh ids for every attempt: an attempt whose reply is lost gives back exactly
        // the permits it may have taken, and nothing of another.
        let ids: Vec<Arc<str>> = (0..self.permits)
            .map(|_| uuid::Uuid::new_v4().simple().to_string().into())
            .collect();
        let keys = &self.keys;
        let mut call = ScriptCall::new(
            &PERMIT_ACQUIRE,
            &[&keys.count, &keys.timeouts, &keys.channel],
            2 + ids.len(),
        );
        call.arg(self.lease_ms)
            .arg(self.core.deployment().publish_command());
        for id in &ids {
            call.arg(&**id);
        }
        let (core, keys) = (Arc::clone(&self.core), Arc::clone(&self.keys));
        let (lease, renew) = (self.lease, self.renew);
        let sent_at = Instant::now();
        Box::pin(async move {
            // Permits whose reply was lost, or that no replica acknowledged, are given
            // back by id: exactly the ones this attempt may have taken.
            let reply: i64 = core
                .take(
                    &call,
                    &keys.count,
                    |reply| *reply == 1,
                    |_| {
                        let giving_back = give_back(&core, &keys, &ids);
                        async move {
                            if let Err(err) = giving_back.await {
                                tracing::warn!(error = %err, "could not give back permits that cannot be trusted; their leases run out");
                            }
                        }
                    },
                )
                .await?;
            Ok(match reply {
                1 => Attempt::Acquired(Held::new(core, keys, ids, sent_at, lease, renew)),
                0 => Attempt::Busy { retry_after: None },
                nearest => Attempt::Busy {
                    retry_after: Some(Duration::from_millis((-1 - nearest).unsigned_abs())),
                },
            })
        })
    }

    fn channel(&self) -> &str {
        &self.keys.channel
    }

    fn queue(&self) -> &str {
        &self.keys.count
    }

    fn wake_rule(&self) -> WakeRule {
        WakeRule::UpTo
    }

    fn ask(&self) -> u64 {
        u64::from(self.permits)
    }
}

/// Leased permits while held: one renewal-scheduler entry per permit. Dropping them gives
/// them back, in the background on the client's own runtime.
pub(crate) struct Held {
    /// `None` once given back.
    core: Option<Arc<Core>>,
    keys: Arc<PermitKeys>,
    ids: Vec<Arc<str>>,
    leases: Vec<Lease>,
}

impl Held {
    fn new(
        core: Arc<Core>,
        keys: Arc<PermitKeys>,
        ids: Vec<Arc<str>>,
        sent_at: Instant,
        lease: Duration,
        renew: bool,
    ) -> Self {
        let leases = ids
            .iter()
            .map(|id| {
                core.watchdog()
                    .track(&PERMIT_RENEWAL, &keys.timeouts, id, sent_at, lease, renew)
            })
            .collect();
        Self {
            core: Some(core),
            keys,
            ids,
            leases,
        }
    }

    /// Asks the server whether every permit is still in the semaphore's set with a
    /// deadline ahead of the server's time (TIME and ZMSCORE, one round trip). A permit
    /// that is gone or expired marks them all lost.
    pub(crate) async fn verify(&self) -> Result<bool> {
        let Some(core) = &self.core else {
            return Ok(false);
        };
        // An expired permit stays in the set until the next acquisition reclaims it: a
        // permit is held while its deadline (server clock, ms) is ahead of the server's
        // time, read just before.
        let mut read = redis::pipe();
        read.cmd("TIME").cmd("ZMSCORE").arg(&*self.keys.timeouts);
        for id in &self.ids {
            read.arg(&**id);
        }
        let ((seconds, micros), scores): ((u64, u64), Vec<Option<f64>>) = core
            .request(|mut connection| {
                let read = &read;
                async move { read.query_async(&mut connection).await }
            })
            .await?;
        let now_ms = (seconds * 1000 + micros / 1000) as f64;
        let held = scores
            .iter()
            .all(|deadline| deadline.is_some_and(|deadline| deadline > now_ms));
        if !held {
            for lease in &self.leases {
                lease.mark_lost();
            }
        }
        Ok(held)
    }

    pub(crate) fn ids(&self) -> &[Arc<str>] {
        &self.ids
    }

    pub(crate) fn leases(&self) -> &[Lease] {
        &self.leases
    }

    pub(crate) fn key(&self) -> &str {
        &self.keys.count
    }

    pub(crate) fn core(&self) -> Option<&Arc<Core>> {
        self.core.as_ref()
    }

    /// Gives every permit back now. Returns how many were still held (a permit whose
    /// lease ran out was reclaimed already); their leases are marked lost.
    pub(crate) async fn give_back(mut self) -> Result<usize> {
        let Some(core) = self.core.take() else {
            return Ok(self.ids.len());
        };
        for lease in &self.leases {
            lease.closing();
        }
        let giving_back = give_back(&core, &self.keys, &self.ids);
        let back = crate::engine::detach::Detached::new(core.background(), giving_back).await?;
        if back < self.ids.len() {
            for lease in &self.leases {
                lease.mark_lost();
            }
        }
        Ok(back)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let Some(core) = self.core.take() else {
            return;
        };
        for lease in &self.leases {
            lease.closing();
        }
        let giving_back = give_back(&core, &self.keys, &self.ids);
        let key = Arc::clone(&self.keys.count);
        core.background().spawn(async move {
            if let Err(err) = giving_back.await {
                tracing::warn!(semaphore = %key, error = %err, "could not give back the permits of a dropped guard; their leases run out");
            }
        });
    }
}

/// Gives the permits `ids` back, if still taken. Returns how many were.
fn give_back(
    core: &Arc<Core>,
    keys: &Arc<PermitKeys>,
    ids: &[Arc<str>],
) -> impl std::future::Future<Output = Result<usize>> + Send + 'static {
    let mut call = ScriptCall::new(
        &PERMIT_RELEASE,
        &[&keys.count, &keys.timeouts, &keys.channel],
        1 + ids.len(),
    );
    call.arg(core.deployment().publish_command());
    for id in ids {
        call.arg(&**id);
    }
    let core = Arc::clone(core);
    async move {
        let mut connection = core.connection();
        let back: i64 = call.invoke(&mut connection).await?;
        Ok(usize::try_from(back).unwrap_or(0))
    }
}
