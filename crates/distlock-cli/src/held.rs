//! What `run` and `elect` hold while the command runs: a lock (plain or fair), or a
//! semaphore's permit, behind one face.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use distlock::{Client, LeasedPermits, LockGuard, PermitsSet, ReleaseOutcome, RwReadGuard};

use crate::args::Hold;
use crate::exit::{self, Failure};

/// A lock guard (a lock's, a fair lock's, or a read-write lock's write side), a read
/// hold of a read-write lock (`--shared`), or a permit.
pub enum Held {
    Lock(LockGuard),
    Read(RwReadGuard),
    Permit(LeasedPermits),
}

/// How long a caller is prepared to wait for the lock.
#[derive(Debug, Clone, Copy)]
pub enum Patience {
    /// Not at all.
    None,
    /// At most this long.
    Within(Duration),
    /// As long as it takes.
    Forever,
}

/// Takes what `hold` names, waiting as `patience` allows; `None` when someone else holds
/// it.
pub async fn take(
    client: &Client,
    hold: &Hold,
    patience: Patience,
) -> Result<Option<Held>, Failure> {
    if let Some(permits) = hold.permits {
        let semaphore = client.permit_semaphore(hold.name.clone())?;
        let semaphore = match hold.lease {
            Some(lease) => semaphore.with_lease(lease),
            None => semaphore.with_watchdog(),
        };
        // A count distlock did not create may be another application's number: never
        // written unless the operator names it a semaphore.
        if !hold.adopt_semaphore {
            match claim_semaphore(client, &hold.name, semaphore.key()).await? {
                Claim::Ours => {}
                Claim::NotOurs => {
                    return Err(Failure::new(
                        exit::USAGE,
                        format!(
                            "{} holds a number distlock did not create as a semaphore (another \
                             application's counter?); not run. If it is a semaphore (Redisson's \
                             RPermitExpirableSemaphore), pass --adopt-semaphore",
                            crate::out::shown(&hold.name)
                        ),
                    ));
                }
                Claim::AnotherNames(other) => {
                    return Err(Failure::new(
                        exit::USAGE,
                        format!(
                            "{} cannot be a semaphore: its mark {} (and its permits {}) are \
                             those of the semaphore {}, whose keys are the same; not run",
                            crate::out::shown(&hold.name),
                            crate::out::shown(&crate::mark::semaphore_mark(&hold.name)),
                            crate::out::shown(&crate::mark::tagged(&hold.name, "timeout")),
                            crate::out::shown(&other)
                        ),
                    ));
                }
            }
        }
        // The first holder sets the count; later ones must ask for the same. The total
        // counts permits whose holder died and whose lease ran out, not reclaimed yet:
        // they are still the semaphore's.
        if let PermitsSet::Kept { found } = semaphore.try_set_permits(i64::from(permits)).await? {
            if found != i64::from(permits) {
                return Err(Failure::new(
                    exit::USAGE,
                    format!(
                        "{} has {found} permits, not {permits}: every run of one name must give \
                         the same -n (to change it, delete {}, {} and {} while nothing holds a \
                         permit)",
                        crate::out::shown(&hold.name),
                        crate::out::shown(semaphore.key()),
                        crate::out::shown(&crate::mark::tagged(&hold.name, "timeout")),
                        crate::out::shown(&crate::mark::semaphore_mark(&hold.name))
                    ),
                ));
            }
        }
        let taken = match patience {
            Patience::None => semaphore.try_acquire(1).await?,
            Patience::Within(wait) => semaphore.try_acquire_for(1, wait).await?,
            Patience::Forever => Some(semaphore.acquire(1).await?),
        };
        return Ok(taken.map(Held::Permit));
    }
    take_lock(client, hold, patience)
        .await
        .map_err(|err| exit::lock_failure(err, &hold.name))
}

/// Takes the lock `hold` names (plain, fair, or a side of a read-write lock); the
/// library's error as it is, for [`exit::lock_failure`] to tell a refused fencing
/// counter from the rest.
async fn take_lock(
    client: &Client,
    hold: &Hold,
    patience: Patience,
) -> Result<Option<Held>, distlock::Error> {
    // A fair lock and a plain one answer the same calls.
    macro_rules! take_lock {
        ($lock:expr) => {{
            let lock = match hold.lease {
                Some(lease) => $lock.with_lease(lease),
                None => $lock.with_watchdog(),
            };
            match patience {
                Patience::None => lock.try_lock().await?,
                Patience::Within(wait) => lock.try_lock_for(wait).await?,
                Patience::Forever => Some(lock.lock().await?),
            }
        }};
    }
    if hold.shared || hold.exclusive {
        // Writers are preferred: no new reader while a writer waits (docs/cli.md).
        let rw = client.rw_lock(hold.name.clone())?.prefer_writers(true);
        let rw = match hold.lease {
            Some(lease) => rw.with_lease(lease),
            None => rw.with_watchdog(),
        };
        if hold.shared {
            let taken = match patience {
                Patience::None => rw.try_read().await?,
                Patience::Within(wait) => rw.try_read_for(wait).await?,
                Patience::Forever => Some(rw.read().await?),
            };
            return Ok(taken.map(Held::Read));
        }
        let taken = match patience {
            Patience::None => rw.try_write().await?,
            Patience::Within(wait) => rw.try_write_for(wait).await?,
            Patience::Forever => Some(rw.write().await?),
        };
        return Ok(taken.map(Held::Lock));
    }
    let taken = if hold.fair {
        take_lock!(client.fair_lock(hold.name.clone())?)
    } else {
        take_lock!(client.lock(hold.name.clone())?)
    };
    Ok(taken.map(Held::Lock))
}

/// Whose the count at a semaphore's key is, as far as distlock can tell.
enum Claim {
    /// A semaphore `run -n` of this name created (marked now, when there was no count).
    Ours,
    /// A count without this name's mark.
    NotOurs,
    /// No count, but the mark (one key for `q` and `{q}`) is this other name's.
    AnotherNames(String),
}

/// Whether the count at `key` is a semaphore distlock created for `name`, marking it as
/// one when there is no count yet (see scripts/semaphore_claim.lua).
async fn claim_semaphore(client: &Client, name: &str, key: &str) -> Result<Claim, Failure> {
    static CLAIM: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
        redis::Script::new(include_str!("scripts/semaphore_claim.lua"))
    });
    let mut connection = client.connection();
    let mark = crate::mark::semaphore_mark(name);
    let claimed: i64 = CLAIM
        .key(key)
        .key(&mark)
        .arg(name)
        .invoke_async(&mut connection)
        .await?;
    Ok(match claimed {
        1 => Claim::Ours,
        2 => {
            let other: Option<Vec<u8>> = redis::cmd("GET")
                .arg(&mark)
                .query_async(&mut connection)
                .await?;
            Claim::AnotherNames(String::from_utf8_lossy(&other.unwrap_or_default()).into_owned())
        }
        _ => Claim::NotOurs,
    })
}

/// Checks, before anything is taken, that what `hold` names can be held by this user:
/// the name holds nothing, or what the command takes (a lock, a fair lock, a semaphore),
/// never another application's key; and the ACL user may publish and subscribe on its
/// channels (a release that cannot be published fails, and leaves the lock held until its
/// lease ends).
pub async fn preflight(client: &Client, hold: &Hold) -> Result<(), Failure> {
    let shown = crate::out::shown(&hold.name);
    if client.store() != distlock::StoreKind::Redis {
        // Only locks live there, in distlock's own table: no other kind of value can
        // hold the name, and there is no ACL on channels to check.
        // Every store has the read-write lock (--shared, --exclusive).
        let other = if hold.permits.is_some() {
            Some("-n (a semaphore)")
        } else if hold.fair {
            Some("--fair")
        } else {
            None
        };
        if let Some(what) = other {
            return Err(Failure::new(
                exit::USAGE,
                format!("{what} is available on Redis only so far; {shown} was not run"),
            ));
        }
        // The running mark is a lock of its own beside this one (src/mark.rs).
        return client
            .lock(crate::mark::key(&hold.name))
            .map(drop)
            .map_err(|err| {
                Failure::new(
                    exit::USAGE,
                    format!("{shown} cannot have a running mark beside it ({err}); not run"),
                )
            });
    }
    let kind = crate::shape::kind_of(client, &hold.name).await?;
    let read_write = hold.shared || hold.exclusive;
    let fits = match kind.as_str() {
        "none" => true,
        "number" => hold.permits.is_some(),
        "lock" | "fair lock" => hold.permits.is_none() && !read_write,
        "read-write lock" => read_write,
        _ => false,
    };
    if !fits {
        let message = match (hold.permits.is_some(), kind.as_str()) {
            (_, "not a lock") => format!(
                "{shown} is not a lock or a semaphore (another application's key?); not run"
            ),
            (true, kind) => format!(
                "{shown} is a {kind}, not a semaphore: a lock and a semaphore cannot share a \
                 name; not run"
            ),
            (false, "number") => format!(
                "{shown} is a semaphore (or another application's number), not a lock: give \
                 -n to take one of its permits; not run"
            ),
            (false, "read-write lock") => format!(
                "{shown} is a read-write lock: take it with --shared (its read side) or \
                 --exclusive (its write side); not run"
            ),
            (false, kind) if read_write => format!(
                "{shown} is a {kind}, not a read-write lock: take it without --shared or \
                 --exclusive; not run"
            ),
            (false, kind) => format!("{shown} is a {kind}, not a lock; not run"),
        };
        return Err(Failure::new(exit::USAGE, message));
    }
    check_channels(client, hold).await
}

/// Refuses (77) an ACL user that may not publish or subscribe on the channels what
/// `hold` names uses.
async fn check_channels(client: &Client, hold: &Hold) -> Result<(), Failure> {
    static CHECK: std::sync::LazyLock<redis::Script> =
        std::sync::LazyLock::new(|| redis::Script::new(include_str!("scripts/channels_check.lua")));
    let before = |prefix: &str| {
        if hold.name.contains('{') {
            format!("{prefix}:{}", hold.name)
        } else {
            format!("{prefix}:{{{}}}", hold.name)
        }
    };
    let channels = if hold.permits.is_some() {
        vec![before("redisson_sc")]
    } else if hold.shared || hold.exclusive {
        vec![before("redisson_rwlock")]
    } else if hold.fair {
        // A fair waiter is told on a channel of its own, after the lock's.
        let channel = before("redisson_lock__channel");
        vec![format!("{channel}:0"), channel]
    } else {
        vec![before("redisson_lock__channel")]
    };
    let mut connection = client.connection();
    let mut invocation = CHECK.key(&hold.name);
    for channel in &channels {
        invocation.arg(channel);
    }
    let refused: String = invocation.invoke_async(&mut connection).await?;
    if refused.is_empty() {
        return Ok(());
    }
    // The refusal quotes the channel, which holds the name.
    let refused = crate::out::shown(&refused);
    Err(Failure::new(
        exit::REFUSED,
        format!(
            "the Redis user may not {refused} (its ACL lacks the channel): a release could \
             not be published, and would leave the lock held until its lease ends; not run. \
             Add &redisson_* to the user's ACL (docs/cli.md)"
        ),
    ))
}

impl Held {
    /// The fencing token, for a lock.
    pub fn token(&self) -> Option<u64> {
        match self {
            Held::Lock(guard) => Some(guard.fencing_token()),
            Held::Read(_) | Held::Permit(_) => None,
        }
    }

    /// The holder's id: the lock's owner field, or the permit's id.
    pub fn owner(&self) -> String {
        match self {
            Held::Lock(guard) => guard.owner().to_owned(),
            Held::Read(guard) => guard.owner().to_owned(),
            Held::Permit(permit) => permit.ids().next().unwrap_or_default().to_owned(),
        }
    }

    pub fn lease_remaining(&self) -> Duration {
        match self {
            Held::Lock(guard) => guard.lease_remaining(),
            Held::Read(guard) => guard.lease_remaining(),
            Held::Permit(permit) => permit.lease_remaining(),
        }
    }

    /// Completes when it is lost (at the latest at its deadline, less a safety margin).
    pub fn lost(&self) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>> {
        match self {
            Held::Lock(guard) => Box::pin(guard.lost()),
            Held::Read(guard) => Box::pin(guard.lost()),
            Held::Permit(permit) => Box::pin(permit.lost()),
        }
    }

    /// Asks the server whether it is still held.
    pub async fn verify(&self) -> Result<bool, Failure> {
        match self {
            Held::Lock(guard) => Ok(guard.verify().await?),
            Held::Read(guard) => Ok(guard.verify().await?),
            Held::Permit(permit) => Ok(permit.verify().await?),
        }
    }

    /// Lets go of a holding that was lost: nothing is sent (the lock is another's now, or
    /// Redis is unreachable); a permit's give-back goes in the background.
    pub fn abandon(self) {
        match self {
            Held::Lock(guard) => {
                guard.leave_to_expire();
            }
            // Its give-back goes in the background, as a permit's.
            Held::Read(guard) => drop(guard),
            Held::Permit(permit) => drop(permit),
        }
    }

    pub async fn release(self) -> Result<ReleaseOutcome, Failure> {
        Ok(match self {
            Held::Lock(guard) => guard.release().await?,
            Held::Read(guard) => guard.release().await?,
            Held::Permit(permit) => permit.release().await?,
        })
    }
}
