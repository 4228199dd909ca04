//! The mark a running command leaves beside its lock, so that the next holder's command
//! never starts while it still runs.
//!
//! A lock can be taken away from a holder whose command is still running: a force-unlock,
//! or a lease that ran out while Redis was unreachable. The holder's distlock then stops
//! its command, but that takes until the command exits (up to `--kill-grace`), and
//! meanwhile the next `distlock run` may already hold the lock. So every `run` and `elect`
//! of a lock (not of a semaphore) marks the lock while its command runs: a key beside
//! the lock, holding the owner id, expiring a little after the holder's lease (its
//! distlock refreshes it while the lock is confirmed), and deleted once the command has
//! exited. A new holder waits for a mark of another owner to go before it starts its
//! command. A holder whose distlock died (kill -9) took its command with it (the parent
//! death signal), and its mark runs out with its lease.

use std::time::Duration;

use tokio::time::Instant;

use crate::exit::Failure;

/// How much longer than the holder's lease a mark lives: the time a command killed at
/// the lease's end takes to exit, and the mark's own round trip.
const SLACK: Duration = Duration::from_secs(1);

/// How often a new holder looks whether the previous command's mark is gone.
const POLL: Duration = Duration::from_millis(20);

/// The mark of one lock.
pub struct Mark {
    place: Place,
    key: String,
    /// When the mark set last expires, by the local clock (counted from before the SET
    /// was sent, so never later than the server's).
    expires_at: Option<Instant>,
    /// Whether the mark may be set: a claim succeeded, or its outcome is unknown (the
    /// connection failed under it). A mark never set is not cleared.
    may_exist: bool,
    /// A shared (read) holder's: it waits for a writer's mark to go, and never sets one
    /// (readers run beside each other; see docs/cli.md for what that leaves open).
    shared: bool,
}

/// Where the mark is kept.
enum Place {
    /// On Redis: a string key holding the owner, with an expiry (`running_claim.lua`),
    /// which every distlock of a mixed fleet reads alike.
    Redis(distlock::Connection),
    /// On another store (PostgreSQL): a lock of the store at the mark's name, held with a
    /// fixed lease while the command runs. `None` when the mark's name is one the store
    /// cannot hold (refused before anything is taken: see `held::preflight`).
    Lease {
        lock: Option<distlock::Lock>,
        guard: Option<distlock::LockGuard>,
        /// On ZooKeeper: the mark is a lock held in watchdog mode, alive as long as the
        /// holder's session (a distlock that dies takes its mark with it when the
        /// session ends), and trusted (its expiry, by the local clock) as long as the
        /// guard says.
        session: bool,
    },
}

/// How long a stop may spend extending the mark over its grace before it gives up (a
/// Redis that does not answer).
const COVER_LIMIT: Duration = Duration::from_millis(300);

/// The mark of lock `name`, in the lock's cluster slot: `distlock_running:{<name>}`, or
/// `<name>:distlock_running` for a name with a hash tag of its own (which keeps it). The
/// two shapes never meet: `q` and `{q}` are different locks with different marks.
pub fn key(name: &str) -> String {
    if name.contains('{') {
        format!("{name}:distlock_running")
    } else {
        format!("distlock_running:{{{name}}}")
    }
}

/// `{<name>}:<suffix>`, Redisson's helper keys after the name (`<name>:<suffix>` when the
/// name has a hash tag of its own).
pub fn tagged(name: &str, suffix: &str) -> String {
    if name.contains('{') {
        format!("{name}:{suffix}")
    } else {
        format!("{{{name}}}:{suffix}")
    }
}

impl Mark {
    pub fn new(client: &distlock::Client, name: &str) -> Mark {
        let key = key(name);
        let place = match client.store() {
            distlock::StoreKind::Redis => Place::Redis(client.connection()),
            store => Place::Lease {
                lock: client.lock(key.clone()).ok(),
                guard: None,
                session: store == distlock::StoreKind::Zk,
            },
        };
        Mark {
            place,
            key,
            expires_at: None,
            may_exist: false,
            shared: false,
        }
    }

    /// The mark of a shared holder of lock `name` (`--shared`): it waits for another
    /// holder's mark, and sets none.
    pub fn shared(client: &distlock::Client, name: &str) -> Mark {
        Mark {
            shared: true,
            ..Mark::new(client, name)
        }
    }

    /// Claims the mark for `owner` while `lease_left` remains of its lease, waiting while
    /// another holder's command is marked as running (at most until `deadline`, and never
    /// longer than that holder's mark lives). False when the deadline came first.
    pub async fn claim(
        &mut self,
        owner: &str,
        lease_left: Duration,
        deadline: Option<Instant>,
    ) -> Result<bool, Failure> {
        let mut told = false;
        loop {
            let others_left = self.claim_once(owner, lease_left + SLACK).await?;
            let Some(others_left) = others_left else {
                return Ok(true);
            };
            if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                return Ok(false);
            }
            if !told {
                crate::out::say("waiting for the previous holder's command to stop");
                told = true;
            }
            let mut pause = POLL.min(others_left);
            if let Some(deadline) = deadline {
                pause = pause.min(deadline.saturating_duration_since(Instant::now()));
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// Keeps the mark `owner`'s while `lease_left` remains of its lease. Another holder's
    /// mark is left alone.
    pub async fn set(&mut self, owner: &str, lease_left: Duration) -> Result<(), Failure> {
        self.claim_once(owner, lease_left + SLACK).await.map(drop)
    }

    /// Keeps the mark until `until` if Redis answers in time (a command being stopped
    /// after a loss must stay marked until it is gone), and returns when the mark
    /// expires: the time by which the command must be gone.
    pub async fn cover(&mut self, owner: &str, until: Instant) -> Option<Instant> {
        let wanted = until.saturating_duration_since(Instant::now()) + SLACK;
        let _ = tokio::time::timeout(COVER_LIMIT, self.claim_once(owner, wanted)).await;
        self.expires_at
    }

    /// The mark's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// When the mark this holder set last expires, by the local clock.
    pub fn expires_at(&self) -> Option<Instant> {
        self.expires_at
    }

    /// Sets the mark to `owner` for `ttl` unless another holder's mark is there; `Some`
    /// of how long that one has left when it is.
    async fn claim_once(
        &mut self,
        owner: &str,
        ttl: Duration,
    ) -> Result<Option<Duration>, Failure> {
        let connection = match &mut self.place {
            Place::Redis(connection) => connection,
            Place::Lease {
                lock,
                guard,
                session,
            } => {
                let Some(lock) = lock else {
                    return Err(Failure::new(
                        crate::exit::USAGE,
                        format!(
                            "the running mark {} cannot be kept",
                            crate::out::shown(&self.key)
                        ),
                    ));
                };
                let sent_at = Instant::now();
                let claimed = if *session {
                    session_claim(lock, guard, self.shared).await
                } else {
                    lease_claim(lock, guard, self.shared, ttl).await
                };
                if claimed.as_ref().is_ok_and(Option::is_none) && !self.shared {
                    self.expires_at = Some(match guard {
                        Some(held) if *session => Instant::now() + held.lease_remaining(),
                        _ => sent_at + ttl,
                    });
                    self.may_exist = true;
                }
                return claimed.map_err(|err| self.failure(err.into()));
            }
        };
        if self.shared {
            let left: i64 = redis::cmd("PTTL")
                .arg(&self.key)
                .query_async(connection)
                .await
                .map_err(|err| self.failure(err.into()))?;
            return Ok(u64::try_from(left)
                .ok()
                .filter(|left| *left > 0)
                .map(Duration::from_millis));
        }
        static CLAIM: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
            redis::Script::new(include_str!("scripts/running_claim.lua"))
        });
        let sent_at = Instant::now();
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        let others_left: u64 = match CLAIM
            .key(&self.key)
            .arg(owner)
            .arg(ttl_ms)
            .invoke_async(connection)
            .await
        {
            Ok(left) => left,
            Err(err) => {
                // A refusal changed nothing; a broken connection may have set it.
                if err.is_io_error() || err.is_timeout() || err.is_connection_dropped() {
                    self.may_exist = true;
                }
                return Err(self.failure(err.into()));
            }
        };
        if others_left > 0 {
            return Ok(Some(Duration::from_millis(others_left)));
        }
        self.expires_at = Some(sent_at + ttl);
        self.may_exist = true;
        Ok(None)
    }

    /// Removes the mark, if it is still `owner`'s.
    pub async fn clear(&mut self, owner: &str) -> Result<(), Failure> {
        if !self.may_exist {
            return Ok(());
        }
        let connection = match &mut self.place {
            Place::Redis(connection) => connection,
            Place::Lease { guard, .. } => {
                let Some(guard) = guard.take() else {
                    return Ok(());
                };
                return guard
                    .release()
                    .await
                    .map(drop)
                    .map_err(|err| self.failure(err.into()));
            }
        };
        static CLEAR: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
            redis::Script::new(include_str!("scripts/running_clear.lua"))
        });
        CLEAR
            .key(&self.key)
            .arg(owner)
            .invoke_async::<i64>(connection)
            .await
            .map(drop)
            .map_err(|err| self.failure(err.into()))
    }
}

impl Mark {
    /// A failure on the mark, naming its key (an ACL that does not cover it is the
    /// likely cause: docs/cli.md lists the patterns).
    fn failure(&self, mut failure: Failure) -> Failure {
        failure.message = format!(
            "the running mark {}: {}",
            crate::out::shown(&self.key),
            failure.message
        );
        failure
    }
}

/// [`Mark::claim_once`] on a store other than Redis: the mark is a lock held with a fixed
/// lease of `ttl`. A holder extends the lease it holds, or takes the lock if free; `Some`
/// of how long another holder's mark has left when it is taken. A shared holder only
/// looks.
async fn lease_claim(
    lock: &distlock::Lock,
    guard: &mut Option<distlock::LockGuard>,
    shared: bool,
    ttl: Duration,
) -> Result<Option<Duration>, distlock::Error> {
    if shared {
        return Ok(lock.remaining_ttl().await?.filter(|left| !left.is_zero()));
    }
    if let Some(held) = guard {
        if held.extend(ttl).await.is_ok() {
            return Ok(None);
        }
        // Lost (its lease ran out while this holder could not reach the store): take it
        // again below, unless another holder's command is marked meanwhile.
        *guard = None;
    }
    match lock.with_lease(ttl).try_lock().await? {
        Some(taken) => {
            *guard = Some(taken);
            Ok(None)
        }
        // Taken just now and released at once: look again soon.
        None => Ok(Some(
            lock.remaining_ttl()
                .await?
                .unwrap_or(Duration::from_millis(1)),
        )),
    }
}

/// [`Mark::claim_once`] on ZooKeeper: the mark is a lock held in watchdog mode (a node
/// of the holder's session, gone with it), kept while it is not lost, or
/// taken if free; `Some` of how long another holder's mark may live (its session
/// timeout) when it is taken. A shared holder only looks.
async fn session_claim(
    lock: &distlock::Lock,
    guard: &mut Option<distlock::LockGuard>,
    shared: bool,
) -> Result<Option<Duration>, distlock::Error> {
    if shared {
        return Ok(lock.remaining_ttl().await?.filter(|left| !left.is_zero()));
    }
    if guard.as_ref().is_some_and(|held| !held.is_lost()) {
        return Ok(None);
    }
    *guard = None;
    match lock.try_lock().await? {
        Some(taken) => {
            *guard = Some(taken);
            Ok(None)
        }
        None => Ok(Some(
            lock.remaining_ttl()
                .await?
                .unwrap_or(Duration::from_millis(1)),
        )),
    }
}

/// The key that says distlock created the semaphore `name` (`run -n`): beside it, in
/// its slot.
pub fn semaphore_mark(name: &str) -> String {
    tagged(name, "distlock_semaphore")
}

/// Whether `mark`, the value of a semaphore's mark, says distlock created the semaphore
/// `name` (the mark holds the name whose `run -n` created it).
pub fn marks(mark: Option<&[u8]>, name: &str) -> bool {
    mark == Some(name.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_shares_its_locks_slot_and_no_other_lock_has_it() {
        assert_eq!(key("jobs"), "distlock_running:{jobs}");
        assert_eq!(key("a{b}c"), "a{b}c:distlock_running");
        assert_ne!(key("q"), key("{q}"));
    }
}
