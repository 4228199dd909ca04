//! The reentrant lease lock (Redisson's `RLock`, with a fencing token per acquisition).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::client::Client;
use crate::duration::to_millis;
use crate::engine::acquire::{acquire, Acquire, Attempt, AttemptFuture, Patience};
use crate::engine::detach::Detached;
use crate::engine::watchdog::{Acquired, LeaseTicket};
use crate::error::{is_connection_failure, Error, Result};
use crate::holder::HolderId;
use crate::keys::{release_channel, token_key, unlock_latch};
use crate::scripts::{LOCK_ACQUIRE, LOCK_FORCE_UNLOCK, LOCK_RELEASE};

/// The message Redisson publishes when a lock is freed.
const RELEASE_MESSAGE: &str = "0";

/// How many times a release is sent when the reply is lost to a broken connection or a
/// timeout. The unlock latch makes the repeats safe.
const RELEASE_ATTEMPTS: u32 = 3;

/// Pause before repeating a release, times the attempt number.
const RELEASE_RETRY_PAUSE: Duration = Duration::from_millis(25);

/// A handle on one named lock. Cheap to clone; holds no lock by itself.
///
/// By default an acquisition runs in *watchdog mode*: the lease is the client's watchdog
/// timeout, and the client's watchdog keeps renewing it until the guard is released or
/// dropped. [`Lock::with_lease`] takes a fixed lease instead, which simply expires.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = distlock_testkit::RedisServer::start().await?;
/// # let client = distlock::Client::connect(&server.url()).await?;
/// use std::time::Duration;
///
/// let lock = client.lock("reports:nightly")?;
///
/// // Wait at most 5 s; hold for at most 10 s, with no renewal.
/// let fixed = lock.clone().with_lease(Duration::from_secs(10));
/// if let Some(guard) = fixed.try_lock_for(Duration::from_secs(5)).await? {
///     // Another task cannot have it meanwhile...
///     let other = lock.clone();
///     let taken = tokio::spawn(async move { other.try_lock().await }).await??;
///     assert!(taken.is_none());
///     // ...and work stops as soon as the lease can no longer be trusted.
///     tokio::select! {
///         _ = guard.lost() => eprintln!("lease lost: stop writing"),
///         _ = tokio::time::sleep(Duration::from_millis(10)) => {}
///     }
///     guard.release().await?;
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Lock {
    client: Client,
    name: Arc<str>,
    lease: Option<Duration>,
    holder: Option<HolderId>,
}

impl fmt::Debug for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("name", &self.name)
            .field("lease", &self.lease)
            .field("holder", &self.holder)
            .finish()
    }
}

impl Lock {
    pub(crate) fn new(client: Client, name: String) -> Self {
        Self {
            client,
            name: name.into(),
            lease: None,
            holder: None,
        }
    }

    /// The lock's name, which is also its Redis key.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Acquire with a fixed lease of `lease`, with no watchdog: the lock frees itself when
    /// the lease runs out, released or not. Checked (non-zero, representable in
    /// milliseconds) when an acquisition starts.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Acquire in watchdog mode (the default).
    pub fn with_watchdog(mut self) -> Self {
        self.lease = None;
        self
    }

    /// Acquire, check and release as `holder` instead of the current task.
    pub fn with_holder(mut self, holder: HolderId) -> Self {
        self.holder = Some(holder);
        self
    }

    /// The owner string this handle acquires as, from the calling task.
    pub fn owner(&self) -> String {
        let holder = self.holder.unwrap_or_else(HolderId::current);
        format!("{}:{holder}", self.client.id())
    }

    /// Waits until the lock is acquired.
    ///
    /// An error of the first attempt is returned at once (a dead server fails fast). Once
    /// waiting, connection errors (a restart, a failover) are retried with backoff for as
    /// long as it waits; bound the wait with [`Lock::try_lock_for`] or a timeout.
    ///
    /// Cancel-safe: dropping the future leaves no subscription and no lock behind.
    pub async fn lock(&self) -> Result<LockGuard> {
        let attempt = self.attempt()?;
        loop {
            // Waiting forever ends only with the lock; the loop is for the type's sake.
            let acquired = acquire(self.client.subscriptions(), &attempt, Patience::Forever);
            if let Some(guard) = acquired.await? {
                return Ok(guard);
            }
        }
    }

    /// Tries once; `Ok(None)` if another owner holds the lock.
    pub async fn try_lock(&self) -> Result<Option<LockGuard>> {
        let attempt = self.attempt()?;
        acquire(self.client.subscriptions(), &attempt, Patience::None).await
    }

    /// Waits up to `timeout`; `Ok(None)` if the lock could not be had in that time. A zero
    /// timeout tries once.
    pub async fn try_lock_for(&self, timeout: Duration) -> Result<Option<LockGuard>> {
        let patience = Patience::within(timeout)?;
        let attempt = self.attempt()?;
        acquire(self.client.subscriptions(), &attempt, patience).await
    }

    /// True if anyone holds the lock.
    pub async fn is_locked(&self) -> Result<bool> {
        let mut connection = self.client.connection();
        Ok(redis::cmd("EXISTS")
            .arg(&*self.name)
            .query_async::<i64>(&mut connection)
            .await?
            == 1)
    }

    /// True if this handle's holder (by default the calling task) holds the lock.
    pub async fn is_held(&self) -> Result<bool> {
        Ok(self.hold_count().await? > 0)
    }

    /// How many times this handle's holder holds the lock (0 if not at all).
    pub async fn hold_count(&self) -> Result<u32> {
        let mut connection = self.client.connection();
        let count: Option<i64> = redis::cmd("HGET")
            .arg(&*self.name)
            .arg(self.owner())
            .query_async(&mut connection)
            .await?;
        u32::try_from(count.unwrap_or(0)).map_err(|_| Error::UnexpectedReply {
            script: "HGET hold count",
            detail: format!("{count:?} is not a hold count"),
        })
    }

    /// How long the current lease has left on the server, or `None` if the lock is free.
    pub async fn remaining_ttl(&self) -> Result<Option<Duration>> {
        let mut connection = self.client.connection();
        let pttl: i64 = redis::cmd("PTTL")
            .arg(&*self.name)
            .query_async(&mut connection)
            .await?;
        Ok(match pttl {
            -2 => None,
            // A key without expiry: not written by distlock or Redisson.
            -1 => Some(Duration::MAX),
            millis => Some(Duration::from_millis(millis.unsigned_abs())),
        })
    }

    /// Deletes the lock whoever holds it and wakes a waiter. Returns whether a lock was
    /// deleted. For operators: the holder is not told, beyond its lost signal firing at its
    /// next renewal.
    pub async fn force_unlock(&self) -> Result<bool> {
        let mut connection = self.client.connection();
        let deleted: i64 = LOCK_FORCE_UNLOCK
            .key(&*self.name)
            .arg(release_channel(&self.name))
            .arg(RELEASE_MESSAGE)
            .invoke_async(&mut connection)
            .await?;
        Ok(deleted == 1)
    }

    fn attempt(&self) -> Result<LockAttempt> {
        let (lease, renew) = match self.lease {
            Some(lease) => (lease, false),
            None => (self.client.config().watchdog_timeout, true),
        };
        Ok(LockAttempt {
            client: self.client.clone(),
            name: Arc::clone(&self.name),
            token_key: token_key(&self.name).into(),
            channel: release_channel(&self.name),
            owner: self.owner().into(),
            lease,
            lease_ms: to_millis("lease", lease)?,
            renew,
        })
    }
}

/// One acquisition, ready to be tried as often as the engine needs.
struct LockAttempt {
    client: Client,
    name: Arc<str>,
    token_key: Arc<str>,
    channel: String,
    owner: Arc<str>,
    lease: Duration,
    lease_ms: u64,
    renew: bool,
}

impl Acquire for LockAttempt {
    type Guard = LockGuard;

    fn attempt(&self) -> AttemptFuture<LockGuard> {
        let client = self.client.clone();
        let name = Arc::clone(&self.name);
        let token_key = Arc::clone(&self.token_key);
        let owner = Arc::clone(&self.owner);
        let (lease, lease_ms, renew) = (self.lease, self.lease_ms, self.renew);
        Box::pin(async move {
            let mut connection = client.connection();
            let reentering = client.watchdog().holds(&name, &owner);
            let sent_at = Instant::now();
            let reply: Vec<i64> = LOCK_ACQUIRE
                .key(&*name)
                .key(&*token_key)
                .arg(lease_ms)
                .arg(&*owner)
                .arg(if reentering { "1" } else { "0" })
                .invoke_async(&mut connection)
                .await?;
            match reply[..] {
                [1, token, holds] => {
                    let unexpected = |detail: String| Error::UnexpectedReply {
                        script: "lock_acquire",
                        detail,
                    };
                    let token = u64::try_from(token)
                        .map_err(|_| unexpected(format!("negative fencing token {token}")))?;
                    let holds = u32::try_from(holds)
                        .map_err(|_| unexpected(format!("hold count {holds}")))?;
                    let ticket = client.watchdog().track(
                        &name,
                        &owner,
                        Acquired {
                            sent_at,
                            lease,
                            holds,
                            renew,
                        },
                    );
                    Ok(Attempt::Acquired(LockGuard {
                        client,
                        name,
                        owner,
                        token,
                        holds,
                        ticket: Some(ticket),
                    }))
                }
                [0, pttl] => Ok(Attempt::Busy {
                    retry_after: u64::try_from(pttl).ok().map(Duration::from_millis),
                }),
                _ => Err(Error::UnexpectedReply {
                    script: "lock_acquire",
                    detail: format!("{reply:?}"),
                }),
            }
        })
    }

    fn channel(&self) -> &str {
        &self.channel
    }
}

/// Proof of one acquisition of a [`Lock`].
///
/// Release it with [`LockGuard::release`] to learn whether the release worked; dropping
/// it releases in the background instead (never blocking, never panicking). A guard may
/// be moved to another task and released there: it carries its owner with it.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = distlock_testkit::RedisServer::start().await?;
/// # let client = distlock::Client::connect(&server.url()).await?;
/// let guard = client.lock("ledger")?.lock().await?;
/// let token = guard.fencing_token(); // hand this to the store you write
///
/// // Hand the lost signal to a worker; it stops when the lease is lost.
/// let lost = guard.lost_token();
/// let worker = tokio::spawn(async move {
///     tokio::select! {
///         _ = lost.cancelled() => "stopped: lease lost",
///         _ = tokio::time::sleep(std::time::Duration::from_millis(10)) => "finished",
///     }
/// });
/// assert_eq!(worker.await?, "finished");
///
/// // Released from another task than the one that acquired it.
/// tokio::spawn(guard.release()).await??;
/// # let _ = token;
/// # Ok(())
/// # }
/// ```
#[must_use = "dropping the guard releases the lock at once"]
pub struct LockGuard {
    client: Client,
    name: Arc<str>,
    owner: Arc<str>,
    token: u64,
    holds: u32,
    /// `None` once released.
    ticket: Option<LeaseTicket>,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("name", &self.name)
            .field("owner", &self.owner)
            .field("token", &self.token)
            .field("holds", &self.holds)
            .finish()
    }
}

impl LockGuard {
    /// The fencing token of this acquisition: larger than that of every earlier
    /// acquisition of the same lock name (reentrant ones included). Pass it to the
    /// resource you write, and have the resource refuse writes with a smaller token.
    pub fn fencing_token(&self) -> u64 {
        self.token
    }

    /// The owner's hold count right after this acquisition (1 for a first acquisition).
    pub fn hold_count(&self) -> u32 {
        self.holds
    }

    /// The lock's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The owner, `"<client id>:<holder id>"`.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// How long the lease is sure to last, by the local clock: zero once it is lost.
    pub fn lease_remaining(&self) -> Duration {
        self.ticket
            .as_ref()
            .and_then(LeaseTicket::deadline)
            .map(|deadline| deadline.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::ZERO)
    }

    /// True once the lock can no longer be trusted to be held.
    pub fn is_lost(&self) -> bool {
        self.ticket
            .as_ref()
            .is_none_or(|ticket| !ticket.is_trusted())
    }

    /// Completes as soon as the lock can no longer be trusted to be held: a renewal found
    /// the key gone or owned by another, or the lease deadline came without a successful
    /// renewal. It completes no later than the deadline the local clock computes. It never
    /// completes after a normal release.
    ///
    /// The future watches the local clock itself, so the promise holds even if the
    /// client's background tasks cannot run.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let watch = self.ticket.as_ref().map(LeaseTicket::watch);
        async move {
            let lost = match watch {
                Some(watch) => watch.await,
                // Already released: this guard no longer exists to lose anything.
                None => false,
            };
            if !lost {
                // A normal release is not a loss: never complete.
                std::future::pending::<()>().await;
            }
        }
    }

    /// The same signal as [`LockGuard::lost`], as a token to hand to other tasks.
    ///
    /// Besides the client's watchdog, a small task on the calling runtime cancels it when
    /// the local deadline comes, so it fires on time even if the watchdog cannot run.
    pub fn lost_token(&self) -> CancellationToken {
        let Some(ticket) = &self.ticket else {
            let released = CancellationToken::new();
            released.cancel();
            return released;
        };
        let token = ticket.lost_token();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let watch = ticket.watch();
            let backstop = token.clone();
            runtime.spawn(async move {
                if watch.await {
                    backstop.cancel();
                }
            });
        }
        token
    }

    /// Releases this acquisition: one hold fewer; the last hold frees the lock and wakes
    /// one waiter. Fails with [`Error::NotHeld`] if the lease was lost in the meantime.
    ///
    /// Cancel-safe: once started, the release completes even if this future is dropped.
    pub async fn release(mut self) -> Result<()> {
        let Some(ticket) = self.ticket.take() else {
            return Ok(());
        };
        Detached::new(release(
            self.client.clone(),
            Arc::clone(&self.name),
            Arc::clone(&self.owner),
            ticket,
        ))
        .await
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let release = release(
                    self.client.clone(),
                    Arc::clone(&self.name),
                    Arc::clone(&self.owner),
                    ticket,
                );
                runtime.spawn(async move {
                    if let Err(err) = release.await {
                        tracing::warn!(error = %err, "background release of a dropped guard failed");
                    }
                });
            }
            Err(_) => {
                // No runtime to send the release on: stop renewing so the lease runs out.
                tracing::warn!(
                    lock = %self.name,
                    "guard dropped outside a tokio runtime; the lock frees itself when its lease ends"
                );
                ticket.close(false);
            }
        }
    }
}

async fn release(
    client: Client,
    name: Arc<str>,
    owner: Arc<str>,
    ticket: LeaseTicket,
) -> Result<()> {
    let not_held = || Error::NotHeld {
        name: name.to_string(),
        owner: owner.to_string(),
    };
    if !ticket.is_current() {
        // The lease was lost, or the owner has taken the lock again since: the hold on the
        // server, if any, belongs to the newer guard and must not be released by this one.
        ticket.close(false);
        return Err(not_held());
    }
    let latch = unlock_latch(&name, &client.next_request_id());
    let channel = release_channel(&name);
    let mut connection = client.connection();
    let mut attempt = 1;
    let outcome = loop {
        let reply = LOCK_RELEASE
            .key(&*name)
            .key(&latch)
            .arg(&*owner)
            .arg(&channel)
            .arg(RELEASE_MESSAGE)
            .arg(client.config().unlock_latch_ttl_ms)
            .arg(if attempt > 1 { "1" } else { "0" })
            .invoke_async::<i64>(&mut connection)
            .await;
        match reply {
            Err(err) if attempt < RELEASE_ATTEMPTS && is_connection_failure(&err) => {
                tracing::debug!(error = %err, attempt, "release reply lost; asking again");
                // Give a reconnecting connection a moment; the latch keeps repeats safe.
                tokio::time::sleep(RELEASE_RETRY_PAUSE * attempt).await;
                attempt += 1;
            }
            other => break other,
        }
    };
    // Stop renewing whatever happened: after a failed release the lease must be left to
    // run out, not kept alive by this process.
    let remaining = outcome.as_ref().ok().copied();
    ticket.close(remaining.is_some_and(|n| n <= 0));
    match outcome? {
        -1 => Err(not_held()),
        _ => Ok(()),
    }
}
