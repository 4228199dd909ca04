//! RedLock: one lock name over N independent Redis masters, held while a majority of them
//! grant it.
//!
//! One attempt sends the ordinary lock script to every master at once, from the caller's
//! task, each call bounded by a per-node timeout, and succeeds only if a majority
//! granted it with validity left: `lease − elapsed − drift > 0`, where elapsed is measured
//! on the monotonic clock from before the first call and drift is `lease / 100 + 2 ms`.
//! Otherwise every grant is given back at once (including late ones: a call that outlives
//! its timeout releases what it took when it completes), and the engine waits for a release
//! message from any master, or a short random pause when nobody holds it (a split vote),
//! before trying again.
//!
//! Each master's hold is an ordinary holding of its client: renewed by that client's
//! watchdog, with its own lost signal. The RedLock's lease is the set of them with a
//! majority quorum ([`LeaseSet`]), so an extension holds only while a majority renewed in
//! time.
//!
//! A master whose server may evict keys refuses its part of every attempt, as a client
//! refuses such a server for a plain lock, and counts as a failed master: a majority of
//! healthy masters outvotes it. The first master is the exception: the RedLock waits on
//! its client, so its refusal fails the whole attempt with [`Error::EvictionPolicy`].
//!
//! There is no fencing token. Each master's counter increases on its own, so the tokens a
//! majority hands out are not ordered across holders: a larger token on one master says
//! nothing about another. See docs/deployment.md for when RedLock is still the right tool.

use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::engine::acquire::{acquire, Acquire, Attempt, AttemptFuture, Patience};
use crate::engine::detach::Detached;
use crate::engine::lease_set::LeaseSet;
use crate::engine::renewal::registry::safety_margin;
use crate::engine::session::Core;
use crate::error::{Error, NodeFailure, Result};
use crate::primitives::lock::{lease_set, listen_for_unlock};
use crate::primitives::lock::{Lock, LockAttempt, LockGuard, ReleaseOutcome};

/// The longest default per-node timeout: a master that takes longer is counted as down.
const MAX_DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(250);

/// The shortest default per-node timeout: a tenth of a very short lease (under a
/// millisecond, or a few) failed healthy masters on a busy machine. Leases too short for
/// it are refused.
const MIN_DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(10);

/// After a split vote (no majority, nobody holding it), contenders pause a random time
/// below this before trying again, so that they do not split again in lockstep.
const SPLIT_VOTE_JITTER: Duration = Duration::from_millis(50);

/// A lock held on a majority of N independent Redis masters (N odd, at least 3).
///
/// Build it from one [`Client`] per master. The lock is named the same on every master,
/// with the same layout as [`Lock`], so a master on its own is an ordinary distlock lock.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let servers = [
/// #     distlock_testkit::RedisServer::start().await?,
/// #     distlock_testkit::RedisServer::start().await?,
/// #     distlock_testkit::RedisServer::start().await?,
/// # ];
/// # let urls: Vec<String> = servers.iter().map(|server| server.url()).collect();
/// use std::time::Duration;
/// use distlock::{Client, RedLock};
///
/// let mut masters = Vec::new();
/// for url in &urls {
///     masters.push(Client::connect(url).await?);
/// }
/// let lock = RedLock::new("nightly-report", &masters)?.with_lease(Duration::from_secs(10));
/// let guard = lock.try_lock().await?.expect("nobody holds it");
/// assert!(guard.granted_by() >= 2);
/// assert!(!guard.is_lost());
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedLock {
    name: Arc<str>,
    masters: Vec<Lock>,
    lease: Option<Duration>,
    node_timeout: Option<Duration>,
}

impl fmt::Debug for RedLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedLock")
            .field("name", &self.name)
            .field("masters", &self.masters.len())
            .field("lease", &self.lease)
            .field("node_timeout", &self.node_timeout)
            .finish()
    }
}

impl RedLock {
    /// The lock `name` on each master, one [`Lock`] handle per master (made by the client
    /// layer's `RedLock::new`, which takes the clients). Fails with
    /// [`Error::InvalidConfig`] unless there are an odd number of at least 3, each on a
    /// different server.
    pub(crate) fn on_masters(name: String, masters: Vec<Lock>) -> Result<Self> {
        if masters.len() < 3 || masters.len().is_multiple_of(2) {
            return Err(Error::InvalidConfig {
                what: "RedLock masters",
                reason: format!(
                    "needs an odd number of at least 3 independent masters, not {}",
                    masters.len()
                ),
            });
        }
        let mut targets: Vec<&str> = masters
            .iter()
            .map(|lock| lock.session().core().target())
            .collect();
        targets.sort_unstable();
        if let Some(pair) = targets.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(Error::InvalidConfig {
                what: "RedLock masters",
                reason: format!(
                    "{} is given twice; the masters must be independent",
                    pair[0]
                ),
            });
        }
        Ok(Self {
            name: name.into(),
            masters,
            lease: None,
            node_timeout: None,
        })
    }

    /// The same RedLock with a fixed lease of `lease` on every master, with no watchdog.
    /// `self` is left as it was, as with [`Lock::with_lease`].
    pub fn with_lease(&self, lease: Duration) -> RedLock {
        RedLock {
            lease: Some(lease),
            ..self.clone()
        }
    }

    /// The same RedLock in watchdog mode (the default): each master's client renews its
    /// hold; the lease is each client's watchdog timeout.
    pub fn with_watchdog(&self) -> RedLock {
        RedLock {
            lease: None,
            ..self.clone()
        }
    }

    /// How long one master may take to answer one attempt before it counts as failed.
    /// Keep it small next to the lease: every millisecond spent waiting is taken from the
    /// validity. Default a tenth of the lease, at least 10 ms and at most 250 ms. A lease no longer than
    /// the node timeout plus 1 % + 5 ms is refused ([`Error::InvalidDuration`]).
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.node_timeout = Some(timeout);
        self
    }

    /// The lock's name on every master.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A majority: how many masters must grant the lock.
    pub fn quorum(&self) -> usize {
        self.masters.len() / 2 + 1
    }

    /// Waits until a majority grants the lock. Fails at once with
    /// [`Error::QuorumUnavailable`] if the first attempt finds too few masters answering;
    /// once waiting, such failures are retried like connection errors.
    pub async fn lock(&self) -> Result<RedLockGuard> {
        let attempt = self.attempt()?;
        loop {
            let acquired = acquire(&attempt.home, &attempt, Patience::Forever);
            if let Some(guard) = acquired.await? {
                return Ok(guard);
            }
        }
    }

    /// Tries once; `Ok(None)` if a majority could not be had.
    pub async fn try_lock(&self) -> Result<Option<RedLockGuard>> {
        let attempt = self.attempt()?;
        acquire(&attempt.home, &attempt, Patience::None).await
    }

    /// Waits up to `timeout`; `Ok(None)` if a majority could not be had in that time.
    pub async fn try_lock_for(&self, timeout: Duration) -> Result<Option<RedLockGuard>> {
        let patience = Patience::within(timeout)?;
        let attempt = self.attempt()?;
        acquire(&attempt.home, &attempt, patience).await
    }

    fn attempt(&self) -> Result<RedLockAttempt> {
        let masters = self
            .masters
            .iter()
            .map(|master| {
                let master = match self.lease {
                    Some(lease) => master.with_lease(lease),
                    None => master.with_watchdog(),
                };
                let attempt = master.attempt()?;
                Ok((master, attempt))
            })
            .collect::<Result<Vec<_>>>()?;
        // In watchdog mode each client has its own timeout: the shortest bounds the lock.
        let lease = masters
            .iter()
            .map(|(_, attempt)| attempt.lease())
            .min()
            .unwrap_or_default();
        let node_timeout = match self.node_timeout {
            Some(timeout) if timeout.is_zero() => {
                return Err(Error::InvalidDuration {
                    what: "RedLock node timeout",
                    reason: "must not be zero".into(),
                })
            }
            Some(timeout) => timeout,
            None => (lease / 10).clamp(MIN_DEFAULT_NODE_TIMEOUT, MAX_DEFAULT_NODE_TIMEOUT),
        };
        // Each master's lease is trusted until its deadline less the safety margin (which
        // covers the validity rule's drift), and an attempt may take the default node
        // timeout: a lease no longer than both together could only make guards that are
        // lost as they are handed out, or none at all. (A node timeout set by the caller
        // is the caller's choice, longer than the lease even.)
        let needed = match self.node_timeout {
            Some(_) => safety_margin(lease),
            None => safety_margin(lease) + node_timeout,
        };
        if lease <= needed {
            return Err(Error::InvalidDuration {
                what: "RedLock lease",
                reason: format!(
                    "{lease:?} leaves no validity after the clock-drift and timer margin of \
                     {:?} and the default node timeout of {node_timeout:?}",
                    safety_margin(lease)
                ),
            });
        }
        let Some((first, _)) = masters.first() else {
            return Err(Error::InvalidConfig {
                what: "RedLock masters",
                reason: "needs at least 3 masters".into(),
            });
        };
        let home = Arc::clone(first.session().core());
        let others = masters
            .iter()
            .skip(1)
            .map(|(master, attempt)| {
                (
                    Arc::clone(master.session().core()),
                    Arc::clone(attempt.channel_arc()),
                )
            })
            .collect();
        Ok(RedLockAttempt {
            name: Arc::clone(&self.name),
            home,
            masters: masters.into(),
            others,
            quorum: self.quorum(),
            lease,
            node_timeout,
        })
    }
}

/// One acquisition over all masters, for the engine to try as often as it needs.
struct RedLockAttempt {
    name: Arc<str>,
    /// The first master's client: the engine's clock, queue and shutdown come from it.
    home: Arc<Core>,
    masters: Arc<[(Lock, LockAttempt)]>,
    /// The release channels of the other masters, which wake waiters too.
    others: Vec<(Arc<Core>, Arc<str>)>,
    quorum: usize,
    lease: Duration,
    node_timeout: Duration,
}

/// What one master answered.
enum Answer {
    Granted(LockGuard),
    Busy(Option<Duration>),
    Failed(NodeFailure),
}

impl Acquire for RedLockAttempt {
    type Guard = RedLockGuard;

    fn kind(&self) -> &'static str {
        "red_lock"
    }

    fn attempt(&self) -> AttemptFuture<RedLockGuard> {
        let masters = Arc::clone(&self.masters);
        let home = Arc::clone(&self.home);
        let (name, quorum, lease, node_timeout) = (
            Arc::clone(&self.name),
            self.quorum,
            self.lease,
            self.node_timeout,
        );
        Box::pin(async move {
            let started = Instant::now();
            // Every master is asked at once, from this task. A call still pending at the
            // node timeout is dropped here, and `Detached` finishes it on its master's
            // runtime, where whatever it took is dropped again: given back.
            let mut calls: FuturesUnordered<_> = masters
                .iter()
                .enumerate()
                .map(|(index, (master, attempt))| {
                    let background = master.session().core().background();
                    let call = Detached::from_boxed(background, attempt.attempt());
                    async move { (index, call.await) }
                })
                .collect();
            let mut answers: Vec<Option<Answer>> = (0..masters.len()).map(|_| None).collect();
            let deadline = home.background().sleep_until(started + node_timeout);
            tokio::pin!(deadline);
            loop {
                tokio::select! {
                    answer = calls.next() => match answer {
                        Some((index, reply)) => {
                            let node = || masters[index].0.session().core().target().to_owned();
                            answers[index] = Some(match reply {
                                Ok(Attempt::Acquired(hold)) => {
                                    Answer::Granted(masters[index].0.guard(hold))
                                }
                                Ok(Attempt::Busy { retry_after }) => Answer::Busy(retry_after),
                                Err(err) => Answer::Failed(NodeFailure {
                                    node: node(),
                                    transient: err.is_connection_error(),
                                    reason: err.to_string(),
                                }),
                            });
                        }
                        None => break,
                    },
                    _ = &mut deadline => break,
                }
            }
            drop(calls);
            let answers = answers.into_iter().enumerate().map(|(index, answer)| {
                answer.unwrap_or_else(|| {
                    Answer::Failed(NodeFailure {
                        node: masters[index].0.session().core().target().to_owned(),
                        transient: true,
                        reason: format!("no answer within the node timeout ({node_timeout:?})"),
                    })
                })
            });
            let elapsed = started.elapsed();
            let mut granted = Vec::new();
            let mut failures = Vec::new();
            let mut holder_left: Option<Duration> = None;
            for answer in answers {
                match answer {
                    Answer::Granted(guard) => granted.push(guard),
                    Answer::Busy(left) => {
                        if let Some(left) = left {
                            holder_left = Some(holder_left.map_or(left, |min| min.min(left)));
                        }
                    }
                    Answer::Failed(failure) => failures.push(failure),
                }
            }
            let validity = lease
                .checked_sub(elapsed)
                .and_then(|left| left.checked_sub(drift(lease)))
                .filter(|left| !left.is_zero());
            if granted.len() >= quorum && validity.is_some() {
                let guard = RedLockGuard {
                    name: Arc::clone(&name),
                    quorum,
                    masters: masters.len(),
                    guards: std::mem::take(&mut granted),
                    home: Arc::clone(&home),
                    node_timeout,
                };
                // The members' own margins may leave nothing of a lease that short: a guard
                // that is lost as it is handed out protects nothing.
                if !guard.is_lost() {
                    return Ok(Attempt::Acquired(guard));
                }
                tracing::debug!(lock = %name, ?elapsed, ?lease, "RedLock majority has no validity left; giving it back");
                drop(guard);
            } else if granted.len() >= quorum {
                tracing::debug!(lock = %name, ?elapsed, ?lease, "RedLock majority came too late; giving it back");
            }
            // Dropping the grants gives each back on its master's runtime, all at once.
            drop(granted);
            if failures.len() > masters.len() - quorum {
                return Err(Error::QuorumUnavailable {
                    name: name.to_string(),
                    needed: quorum,
                    nodes: masters.len(),
                    failures,
                });
            }
            let pause = jitter(SPLIT_VOTE_JITTER);
            Ok(Attempt::Busy {
                retry_after: Some(holder_left.map_or(pause, |left| left + pause)),
            })
        })
    }

    fn channel(&self) -> &str {
        self.masters
            .first()
            .map(|(_, attempt)| attempt.channel_arc().as_ref())
            .unwrap_or_default()
    }

    fn queue(&self) -> &str {
        &self.name
    }

    fn other_channels(&self) -> &[(Arc<Core>, Arc<str>)] {
        &self.others
    }
}

/// The clock drift a RedLock allows for: 1 % of the lease plus 2 ms.
fn drift(lease: Duration) -> Duration {
    lease / 100 + Duration::from_millis(2)
}

/// A random pause below `max`, from the standard library's per-process random keys.
fn jitter(max: Duration) -> Duration {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(Instant::now().elapsed().as_nanos());
    let millis = u64::try_from(max.as_millis()).unwrap_or(u64::MAX).max(1);
    Duration::from_millis(hasher.finish() % millis)
}

/// Proof that a majority of a [`RedLock`]'s masters grant the lock. Dropping it releases
/// on every master in the background; [`RedLockGuard::release`] does it and reports.
///
/// It has no fencing token: independent masters cannot give one that orders holders.
#[must_use = "dropping the guard releases the lock at once"]
pub struct RedLockGuard {
    name: Arc<str>,
    quorum: usize,
    masters: usize,
    /// One per master that granted the lock.
    guards: Vec<LockGuard>,
    /// The first master's client, whose clock bounds a release.
    home: Arc<Core>,
    /// How long a release waits for the last masters once a majority has released.
    node_timeout: Duration,
}

impl fmt::Debug for RedLockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedLockGuard")
            .field("name", &self.name)
            .field("granted_by", &self.guards.len())
            .field("masters", &self.masters)
            .finish()
    }
}

impl RedLockGuard {
    fn leases(&self) -> LeaseSet<'_> {
        lease_set(&self.guards, self.quorum)
    }

    /// The lock's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many masters granted this holding (at least a majority).
    pub fn granted_by(&self) -> usize {
        self.guards.len()
    }

    /// True once fewer than a majority of masters can be trusted to hold it.
    pub fn is_lost(&self) -> bool {
        !self.leases().is_trusted()
    }

    /// How long a majority is sure to hold it, by the local clock: zero once lost. Each
    /// master's lease is counted from before the attempt was sent, less the clock-drift
    /// allowance, so this never exceeds the RedLock validity (lease − elapsed − drift).
    pub fn lease_remaining(&self) -> Duration {
        self.leases().remaining()
    }

    /// Completes as soon as a majority can no longer be trusted to hold the lock; never
    /// after a normal release.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        listen_for_unlock(&self.guards);
        self.leases().lost()
    }

    /// The same signal as [`RedLockGuard::lost`], as a token for other tasks.
    pub fn lost_token(&self) -> CancellationToken {
        listen_for_unlock(&self.guards);
        self.leases().lost_token()
    }

    /// Releases on every master that granted it, all at once.
    /// [`ReleaseOutcome::AlreadyLost`] says fewer than a majority still held it; an error,
    /// that too few masters answered to tell.
    ///
    /// Once a majority has released, the rest get at most the node timeout: a master that
    /// stalls does not hold up the caller for its whole retry window. Its release goes on
    /// in the background, and its client's shutdown waits for it.
    pub async fn release(self) -> Result<ReleaseOutcome> {
        let RedLockGuard {
            quorum,
            guards,
            home,
            node_timeout,
            ..
        } = self;
        let started = Instant::now();
        // Each release runs to completion even when this future stops polling it.
        let mut releases: FuturesUnordered<_> =
            guards.into_iter().map(LockGuard::release).collect();
        let stragglers_deadline = home.background().sleep_until(started + node_timeout);
        tokio::pin!(stragglers_deadline);
        let (mut released, mut failed, mut failure) = (0, 0, None);
        loop {
            tokio::select! {
                outcome = releases.next() => match outcome {
                    Some(Ok(ReleaseOutcome::Released)) => released += 1,
                    Some(Ok(ReleaseOutcome::AlreadyLost)) => {}
                    Some(Err(err)) => {
                        failed += 1;
                        failure.get_or_insert(err);
                    }
                    None => break,
                },
                _ = &mut stragglers_deadline, if released >= quorum => break,
            }
        }
        if released >= quorum {
            return Ok(ReleaseOutcome::Released);
        }
        match failure {
            // The masters that failed to answer could have made up a majority.
            Some(err) if released + failed >= quorum => Err(err),
            _ => Ok(ReleaseOutcome::AlreadyLost),
        }
    }
}
