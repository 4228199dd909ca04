//! MultiLock: several locks taken as one, all or nothing.
//!
//! The members are acquired one after another in a stable order (by name, then by the
//! deployment they live on), each through the ordinary engine with what is left of the
//! caller's patience. Because every MultiLock takes its members in the same order, two
//! MultiLocks over overlapping sets cannot deadlock: whoever holds the first shared member
//! gets the rest before the other can. If a member cannot be had in time, the members
//! already taken are given back, and the call reports that it got nothing.
//!
//! While the set is being collected every member is held in watchdog mode, so no member
//! runs out while a later one is awaited. Once all are held, members with a fixed lease
//! have it set, counted from that moment (Redisson's MultiLock does the same). A member
//! found lost before the set is complete makes the attempt start over: a guard is never
//! handed out with a member it does not hold.
//!
//! The guard's lease is the set of the members' leases with a quorum of all of them
//! ([`LeaseSet`]): the set is lost as soon as any member is.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use futures_util::future::join_all;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::duration::to_millis;
use crate::engine::lease_set::LeaseSet;
use crate::engine::session::Session;
use crate::error::{Error, Result};
use crate::primitives::fair_lock::FairLock;
use crate::primitives::lock::{lease_set, listen_for_unlock};
use crate::primitives::lock::{Lock, LockGuard, ReleaseOutcome};
use crate::primitives::rw_lock::RwLock;

/// A member of a [`MultiLock`]: any lock whose guard is one holding with a lease. A
/// [`Lock`] or a [`FairLock`] converts into one; a read-write lock joins for reading or
/// for writing.
#[derive(Clone, Debug)]
pub enum MultiLockMember {
    /// A lease lock.
    Lock(Lock),
    /// A fair lock: the member waits in its queue like any other waiter.
    Fair(FairLock),
    /// A read hold of a read-write lock.
    Read(RwLock),
    /// The write hold of a read-write lock.
    Write(RwLock),
}

impl From<Lock> for MultiLockMember {
    fn from(lock: Lock) -> Self {
        MultiLockMember::Lock(lock)
    }
}

impl From<FairLock> for MultiLockMember {
    fn from(lock: FairLock) -> Self {
        MultiLockMember::Fair(lock)
    }
}

impl MultiLockMember {
    /// A read hold of `lock`.
    pub fn read(lock: &RwLock) -> Self {
        MultiLockMember::Read(lock.clone())
    }

    /// The write hold of `lock`.
    pub fn write(lock: &RwLock) -> Self {
        MultiLockMember::Write(lock.clone())
    }

    /// The member's Redis key.
    pub fn key(&self) -> &str {
        match self {
            MultiLockMember::Lock(lock) => lock.key(),
            MultiLockMember::Fair(lock) => lock.key(),
            MultiLockMember::Read(lock) | MultiLockMember::Write(lock) => lock.key(),
        }
    }

    fn session(&self) -> &Session {
        match self {
            MultiLockMember::Lock(lock) => lock.session(),
            MultiLockMember::Fair(lock) => lock.session(),
            MultiLockMember::Read(lock) | MultiLockMember::Write(lock) => lock.session(),
        }
    }

    fn fixed_lease(&self) -> Option<Duration> {
        match self {
            MultiLockMember::Lock(lock) => lock.fixed_lease(),
            MultiLockMember::Fair(lock) => lock.fixed_lease(),
            MultiLockMember::Read(lock) | MultiLockMember::Write(lock) => lock.fixed_lease(),
        }
    }

    fn with_watchdog(&self) -> Self {
        match self {
            MultiLockMember::Lock(lock) => MultiLockMember::Lock(lock.with_watchdog()),
            MultiLockMember::Fair(lock) => MultiLockMember::Fair(lock.with_watchdog()),
            MultiLockMember::Read(lock) => MultiLockMember::Read(lock.with_watchdog()),
            MultiLockMember::Write(lock) => MultiLockMember::Write(lock.with_watchdog()),
        }
    }

    async fn lock(&self) -> Result<LockGuard> {
        Ok(match self {
            MultiLockMember::Lock(lock) => lock.lock().await?,
            MultiLockMember::Fair(lock) => lock.lock().await?,
            MultiLockMember::Read(lock) => lock.read().await?.into_lock_guard(),
            MultiLockMember::Write(lock) => lock.write().await?,
        })
    }

    async fn try_lock(&self) -> Result<Option<LockGuard>> {
        Ok(match self {
            MultiLockMember::Lock(lock) => lock.try_lock().await?,
            MultiLockMember::Fair(lock) => lock.try_lock().await?,
            MultiLockMember::Read(lock) => lock
                .try_read()
                .await?
                .map(crate::primitives::rw_lock::RwReadGuard::into_lock_guard),
            MultiLockMember::Write(lock) => lock.try_write().await?,
        })
    }

    async fn try_lock_for(&self, timeout: Duration) -> Result<Option<LockGuard>> {
        Ok(match self {
            MultiLockMember::Lock(lock) => lock.try_lock_for(timeout).await?,
            MultiLockMember::Fair(lock) => lock.try_lock_for(timeout).await?,
            MultiLockMember::Read(lock) => lock
                .try_read_for(timeout)
                .await?
                .map(crate::primitives::rw_lock::RwReadGuard::into_lock_guard),
            MultiLockMember::Write(lock) => lock.try_write_for(timeout).await?,
        })
    }
}

/// A set of locks acquired together: all of them, or none.
///
/// The members may live on one client or on several (different Redis deployments).
/// Each is held in its own mode (watchdog or fixed lease, as the [`Lock`] handle says)
/// and renewed by its own client's watchdog. A fixed lease counts from the moment the
/// whole set is held, however long the earlier members waited for the later ones.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = distlock_testkit::RedisServer::start().await?;
/// # let client = distlock::Client::connect(&server.url()).await?;
/// use std::time::Duration;
/// use distlock::MultiLock;
///
/// // A transfer locks both accounts, whatever order the caller names them in.
/// let transfer = MultiLock::new([client.lock("account:7")?, client.lock("account:3")?])?;
/// let guard = transfer
///     .try_lock_for(Duration::from_secs(1))
///     .await?
///     .expect("nobody else holds the accounts");
/// assert_eq!(guard.names(), ["account:3", "account:7"]);
/// // Either account alone is now taken.
/// assert!(client.lock("account:3")?.try_lock().await?.is_none());
/// guard.release().await?;
/// # client.shutdown().await;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct MultiLock {
    /// As the caller gave them, in acquisition order.
    members: Vec<MultiLockMember>,
    /// The same locks in watchdog mode: how each is held while the set is collected.
    collecting: Vec<MultiLockMember>,
}

impl fmt::Debug for MultiLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiLock")
            .field("members", &self.members)
            .finish()
    }
}

/// How one pass over the members ended.
enum Collected {
    /// Every member is held, each with its own lease.
    All(MultiLockGuard),
    /// A member could not be had (held elsewhere, or the patience ran out).
    Busy,
    /// A member taken earlier was found lost before the set was complete.
    MemberLost,
}

impl MultiLock {
    /// A MultiLock over `locks`: [`Lock`]s, [`FairLock`]s, or read or write holds of
    /// [`RwLock`]s ([`MultiLockMember`]). Fails with [`Error::InvalidConfig`] if there are
    /// none, or if one key is named twice on the same deployment (it would wait for
    /// itself).
    pub fn new(locks: impl IntoIterator<Item = impl Into<MultiLockMember>>) -> Result<Self> {
        let mut members: Vec<MultiLockMember> = locks.into_iter().map(Into::into).collect();
        if members.is_empty() {
            return Err(Error::InvalidConfig {
                what: "multi-lock members",
                reason: "needs at least one lock".into(),
            });
        }
        members.sort_by(|a, b| order_key(a).cmp(&order_key(b)));
        if let Some(pair) = members
            .windows(2)
            .find(|pair| order_key(&pair[0]) == order_key(&pair[1]))
        {
            return Err(Error::InvalidConfig {
                what: "multi-lock members",
                reason: format!(
                    "the key {:?} is named twice on the same deployment",
                    pair[0].key()
                ),
            });
        }
        let collecting = members
            .iter()
            .map(|member| member.with_watchdog())
            .collect();
        Ok(Self {
            members,
            collecting,
        })
    }

    /// The members, in the order they are acquired.
    pub fn members(&self) -> &[MultiLockMember] {
        &self.members
    }

    /// Waits until every member is held.
    ///
    /// Cancel-safe: dropping the future gives back the members taken so far.
    pub async fn lock(&self) -> Result<MultiLockGuard> {
        loop {
            let collected = self
                .collect(|member| async move { member.lock().await.map(Some) })
                .await?;
            if let Collected::All(guard) = collected {
                return Ok(guard);
            }
        }
    }

    /// Tries each member once; `Ok(None)` (having given back what it took) if any is held.
    pub async fn try_lock(&self) -> Result<Option<MultiLockGuard>> {
        match self.collect(|member| member.try_lock()).await? {
            Collected::All(guard) => Ok(Some(guard)),
            Collected::Busy | Collected::MemberLost => Ok(None),
        }
    }

    /// Waits up to `timeout` in all for every member; `Ok(None)` (having given back what
    /// it took) if one could not be had in that time.
    pub async fn try_lock_for(&self, timeout: Duration) -> Result<Option<MultiLockGuard>> {
        let deadline =
            Instant::now()
                .checked_add(timeout)
                .ok_or_else(|| Error::InvalidDuration {
                    what: "wait timeout",
                    reason: format!("{timeout:?} overflows the clock"),
                })?;
        loop {
            let collected = self
                .collect(|member| {
                    let left = deadline.saturating_duration_since(Instant::now());
                    member.try_lock_for(left)
                })
                .await?;
            match collected {
                Collected::All(guard) => return Ok(Some(guard)),
                Collected::Busy => return Ok(None),
                Collected::MemberLost if Instant::now() >= deadline => return Ok(None),
                Collected::MemberLost => {}
            }
        }
    }

    /// One pass: acquires the members in order with `acquire`, each in watchdog mode, then
    /// gives the members with a fixed lease that lease, from now. The first member that is
    /// not had ends the pass, and the guards taken so far are dropped, which gives them
    /// back.
    async fn collect<'a, F, Fut>(&'a self, acquire: F) -> Result<Collected>
    where
        F: Fn(&'a MultiLockMember) -> Fut,
        Fut: Future<Output = Result<Option<LockGuard>>>,
    {
        // Checked before anything is taken: a bad lease must not cost a whole pass.
        for lease in self.members.iter().filter_map(MultiLockMember::fixed_lease) {
            to_millis("lease", lease)?;
        }
        let mut guards = Vec::with_capacity(self.collecting.len());
        for member in &self.collecting {
            match acquire(member).await? {
                Some(guard) => guards.push(guard),
                None => return Ok(Collected::Busy),
            }
        }
        let guard = MultiLockGuard { guards };
        if guard.is_lost() {
            // Lost while later members were awaited (deleted, evicted, or not renewed in
            // time): never hand out a set that is not held.
            return Ok(Collected::MemberLost);
        }
        // Checked before the fixed leases are set, not after: a lease shorter than a round
        // trip is already running out once set, and is handed out as a plain Lock with
        // that lease would be, instead of failing every pass.
        for (member_guard, member) in guard.guards.iter().zip(&self.members) {
            if let Some(lease) = member.fixed_lease() {
                match member_guard.fix_lease(lease).await {
                    Ok(()) => {}
                    Err(Error::NotHeld { .. }) => return Ok(Collected::MemberLost),
                    Err(other) => return Err(other),
                }
            }
        }
        Ok(Collected::All(guard))
    }
}

/// The order every MultiLock acquires in: by key, then by deployment.
fn order_key(member: &MultiLockMember) -> (&str, &str) {
    (member.key(), member.session().core().target())
}

/// Proof that every member of a [`MultiLock`] is held. Dropping it releases them all in
/// the background; [`MultiLockGuard::release`] does it and reports the outcome.
#[must_use = "dropping the guard releases every lock at once"]
pub struct MultiLockGuard {
    guards: Vec<LockGuard>,
}

impl fmt::Debug for MultiLockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiLockGuard")
            .field("members", &self.guards)
            .finish()
    }
}

impl MultiLockGuard {
    fn leases(&self) -> LeaseSet<'_> {
        lease_set(&self.guards, self.guards.len())
    }

    /// The members' names, in acquisition order.
    pub fn names(&self) -> Vec<&str> {
        self.guards.iter().map(LockGuard::name).collect()
    }

    /// The members' guards, in acquisition order: each has its own fencing token.
    pub fn members(&self) -> &[LockGuard] {
        &self.guards
    }

    /// True once any member can no longer be trusted to be held.
    pub fn is_lost(&self) -> bool {
        !self.leases().is_trusted()
    }

    /// How long every member is sure to last, by the local clock: zero once one is lost.
    pub fn lease_remaining(&self) -> Duration {
        self.leases().remaining()
    }

    /// Completes as soon as any member is lost; never after a normal release.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        listen_for_unlock(&self.guards);
        self.leases().lost()
    }

    /// The same signal as [`MultiLockGuard::lost`], as a token to hand to other tasks.
    /// Each call gives a new token, watched by one small task on the first member's
    /// client until the set is lost or released.
    pub fn lost_token(&self) -> CancellationToken {
        listen_for_unlock(&self.guards);
        self.leases().lost_token()
    }

    /// Releases every member, all at once. Each is released even if another fails; the
    /// first failure is returned. [`ReleaseOutcome::AlreadyLost`] says at least one
    /// member's lease had been lost (the set was no longer held).
    pub async fn release(self) -> Result<ReleaseOutcome> {
        let outcomes = join_all(self.guards.into_iter().map(LockGuard::release)).await;
        let mut set = ReleaseOutcome::Released;
        for outcome in outcomes {
            if outcome?.was_lost() {
                set = ReleaseOutcome::AlreadyLost;
            }
        }
        Ok(set)
    }
}
