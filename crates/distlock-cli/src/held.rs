//! What `run` and `elect` hold while the command runs: a lock (plain or fair), or a
//! semaphore's permit, behind one face.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use distlock::{Client, LeasedPermits, LockGuard, ReleaseOutcome};

use crate::args::Hold;
use crate::exit::{self, Failure};

/// A lock guard or a permit.
pub enum Held {
    Lock(LockGuard),
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
        // The first holder sets the count; later ones must ask for the same.
        if !semaphore
            .try_set_permits(i64::from(permits))
            .await?
            .is_set()
        {
            let total = permits_in(client, &semaphore, &hold.name).await?;
            if total != i64::from(permits) {
                return Err(Failure::new(
                    exit::USAGE,
                    format!(
                        "{} has {total} permits, not {permits}: every run of one name must give \
                         the same -n (to change it, delete {} and {} while nothing holds a permit)",
                        hold.name,
                        semaphore.key(),
                        crate::mark::tagged(&hold.name, "timeout")
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
    let taken = if hold.fair {
        take_lock!(client.fair_lock(hold.name.clone())?)
    } else {
        take_lock!(client.lock(hold.name.clone())?)
    };
    Ok(taken.map(Held::Lock))
}

/// How many permits the semaphore has in all: the free ones and the ones held now, read
/// in one transaction (an acquisition between two reads would move a permit from one
/// count to the other).
async fn permits_in(
    client: &Client,
    semaphore: &distlock::PermitSemaphore,
    name: &str,
) -> Result<i64, Failure> {
    let mut connection = client.connection();
    let (free, held): (Option<i64>, i64) = redis::pipe()
        .atomic()
        .get(semaphore.key())
        // Permits whose lease ran out count as free: the next acquisition reclaims them.
        .cmd("ZCOUNT")
        .arg(crate::mark::tagged(name, "timeout"))
        .arg(format!("({}", unix_ms()))
        .arg("+inf")
        .query_async(&mut connection)
        .await?;
    Ok(free.unwrap_or(0) + held)
}

/// Now, in milliseconds since the epoch, by this machine's clock. (The permits' leases
/// are counted by the server's; a clock apart by more than the lease would miscount
/// permits whose lease is just running out, which only matters for the -n check.)
fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |now| now.as_millis())
}

impl Held {
    /// The fencing token, for a lock.
    pub fn token(&self) -> Option<u64> {
        match self {
            Held::Lock(guard) => Some(guard.fencing_token()),
            Held::Permit(_) => None,
        }
    }

    /// The holder's id: the lock's owner field, or the permit's id.
    pub fn owner(&self) -> String {
        match self {
            Held::Lock(guard) => guard.owner().to_owned(),
            Held::Permit(permit) => permit.ids().next().unwrap_or_default().to_owned(),
        }
    }

    /// Whether only one may hold it (a lock, not a permit).
    pub fn is_exclusive(&self) -> bool {
        matches!(self, Held::Lock(_))
    }

    pub fn lease_remaining(&self) -> Duration {
        match self {
            Held::Lock(guard) => guard.lease_remaining(),
            Held::Permit(permit) => permit.lease_remaining(),
        }
    }

    /// Completes when it is lost (at the latest at its deadline, less a safety margin).
    pub fn lost(&self) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>> {
        match self {
            Held::Lock(guard) => Box::pin(guard.lost()),
            Held::Permit(permit) => Box::pin(permit.lost()),
        }
    }

    /// Asks the server whether it is still held.
    pub async fn verify(&self) -> Result<bool, Failure> {
        match self {
            Held::Lock(guard) => Ok(guard.verify().await?),
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
            Held::Permit(permit) => drop(permit),
        }
    }

    pub async fn release(self) -> Result<ReleaseOutcome, Failure> {
        Ok(match self {
            Held::Lock(guard) => guard.release().await?,
            Held::Permit(permit) => permit.release().await?,
        })
    }
}
