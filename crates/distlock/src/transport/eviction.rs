//! The eviction-policy seatbelt: a server that may evict keys breaks locks (an evicted
//! lock key hands the lock to another client while its holder trusts it; an evicted
//! fencing counter restarts tokens), so a client refuses one unless told otherwise.
//!
//! The policy is read when the client connects, which refuses an evicting server, and again
//! every few seconds for as long as the client runs: a `CONFIG SET maxmemory-policy` made
//! later is treated the way connect treats it. While the server may evict, acquisitions
//! fail with [`Error::EvictionPolicy`] and the client logs an error; locks already held
//! are left to their holders (they may or may not be evicted), and acquisitions work again
//! once the policy is `noeviction`.
//!
//! A server that will not say (CONFIG is often renamed or forbidden on managed Redis and
//! for ACL users) is accepted with one warning at connect: the check is a seatbelt, not a
//! gate.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::runtime::Background;
use crate::transport::connection::Connection;

/// How often a running client reads the policy again.
const RECHECK_EVERY: Duration = Duration::from_secs(2);

/// What a client knows of its server's eviction policy.
pub(crate) struct EvictionWatch {
    target: String,
    allowed: bool,
    /// The evicting policy the last check found, while it is in force.
    refused: Mutex<Option<String>>,
}

impl EvictionWatch {
    /// Reads the policy once, refusing an evicting server unless `allowed`.
    pub(crate) async fn check_at_connect(
        connection: &Connection,
        target: &str,
        allowed: bool,
    ) -> Result<Self> {
        let watch = Self {
            target: target.to_owned(),
            allowed,
            refused: Mutex::new(None),
        };
        match read_policy(connection).await {
            Ok(Some(policy)) if policy == "noeviction" => {}
            Ok(Some(policy)) if allowed => {
                tracing::warn!(%target, %policy, "the server may evict lock keys; allowed by allow_eviction(true)");
            }
            Ok(Some(policy)) => {
                return Err(Error::EvictionPolicy {
                    target: target.to_owned(),
                    policy,
                })
            }
            Ok(None) => {
                tracing::warn!(%target, "the server did not report its maxmemory-policy; make sure it is noeviction");
            }
            Err(err) => {
                tracing::warn!(
                    %target,
                    error = %err,
                    "cannot read maxmemory-policy (CONFIG unavailable); make sure it is noeviction"
                );
            }
        }
        Ok(watch)
    }

    /// For a store that never evicts what it was told to keep (PostgreSQL, etcd): every
    /// acquisition may go ahead.
    #[cfg(any(feature = "postgres", feature = "etcd", feature = "zk"))]
    pub(crate) fn not_applicable(target: &str) -> Self {
        Self {
            target: target.to_owned(),
            allowed: true,
            refused: Mutex::new(None),
        }
    }

    /// Reads the policy again every few seconds on the client's runtime, until the client
    /// stops. Nothing is started when eviction is allowed.
    pub(crate) fn keep_checking(self: &Arc<Self>, connection: Connection, background: &Background) {
        if self.allowed {
            return;
        }
        let watch = Arc::clone(self);
        background.spawn_service(async move {
            loop {
                tokio::time::sleep(RECHECK_EVERY).await;
                // A server that stopped answering CONFIG keeps the last verdict: the
                // warning at connect said the check may not be possible.
                if let Ok(Some(policy)) = read_policy(&connection).await {
                    watch.update(policy);
                }
            }
        });
    }

    fn update(&self, policy: String) {
        let mut refused = self.refused();
        if policy == "noeviction" {
            if let Some(old) = refused.take() {
                tracing::info!(target = %self.target, %old, "the server no longer evicts keys; acquisitions work again");
            }
            return;
        }
        if refused.as_deref() != Some(policy.as_str()) {
            tracing::error!(
                target = %self.target,
                %policy,
                "the server's maxmemory-policy now evicts keys, which breaks mutual exclusion; \
                 new acquisitions fail until it is noeviction (or allow_eviction(true))"
            );
            *refused = Some(policy);
        }
    }

    /// Fails with [`Error::EvictionPolicy`] while the server is known to evict keys.
    pub(crate) fn ensure_safe(&self) -> Result<()> {
        match &*self.refused() {
            None => Ok(()),
            Some(policy) => Err(Error::EvictionPolicy {
                target: self.target.clone(),
                policy: policy.clone(),
            }),
        }
    }

    fn refused(&self) -> MutexGuard<'_, Option<String>> {
        // Only ever replaced whole: a poisoned lock still holds a consistent value.
        self.refused
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The server's `maxmemory-policy`, `None` if it did not report one.
async fn read_policy(connection: &Connection) -> redis::RedisResult<Option<String>> {
    let mut connection = connection.clone();
    // A map: RESP2 answers with a [name, value] list and RESP3 with a map; both read as one.
    let mut settings: HashMap<String, String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(&mut connection)
        .await?;
    Ok(settings.remove("maxmemory-policy"))
}
