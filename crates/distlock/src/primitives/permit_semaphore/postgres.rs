//! The permit semaphore on PostgreSQL: a semaphore is a row of `distlock_semaphores` with
//! its total, and each acquisition of N permits is one row of `distlock_permits` with N
//! and its own expiry on the database's clock (see `sql/schema.sql` for why every
//! decision is made under the semaphore's row). The free count is the total less the
//! live rows' permits; every change notifies the semaphore's channel with it, which wakes
//! the local waiters whose asks fit, in arrival order, as on Redis.
//!
//! An acquisition is a holding of the lease lock's kind ([`Hold`]): the watchdog renews it
//! in one statement per batch, and its lost signal, release and cancel-safety are the
//! lease lock's. Permits have no re-entry and no fencing token.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::engine::acquire::{Acquire, Attempt, AttemptFuture};
use crate::engine::renewal::registry::{Renewal, RenewalKind};
use crate::engine::session::Core;
use crate::engine::subscriptions::WakeRule;
use crate::error::Result;
use crate::primitives::lock::postgres::channel_of;
use crate::primitives::lock::postgres_rows::{release_row, RowHold, RowStatements};
use crate::primitives::lock::{Acquired, Hold};
use crate::transport::postgres::PgLink;

/// What a client creates at connect when missing, after the read-write lock's part.
pub(crate) const SCHEMA: &str = include_str!("sql/schema.sql");

/// What a client checks at connect, whoever created it.
pub(crate) const SCHEMA_CHECK: &str = include_str!("sql/schema_check.sql");

const ACQUIRE: &str = include_str!("sql/acquire.sql");
const ADD_PERMITS: &str = include_str!("sql/add_permits.sql");
const SET_PERMITS: &str = include_str!("sql/set_permits.sql");
const COUNTS: &str = include_str!("sql/counts.sql");

/// An acquisition's calls: a row of `distlock_permits`, renewed by `sql/renew.sql`. It
/// has one hold, and no force-unlock to listen for (a renewal or `verify` finds it gone).
static PERMITS: RowStatements = RowStatements {
    release: include_str!("sql/release.sql"),
    extend: include_str!("sql/extend.sql"),
    verify: include_str!("sql/verify.sql"),
    set_holds: None,
    renewal: &RenewalKind {
        name: "permits",
        renew: Renewal::Statement(include_str!("sql/renew.sql")),
    },
    listens: false,
    reentry: "re-entering permits",
};

/// The semaphore's notification channel: the lock channel's hash of a name no lock can
/// share by accident, so a lock of the same name is not woken by permit counts.
pub(crate) fn permit_channel(name: &str) -> String {
    channel_of(&format!("{name}\u{1}permits"))
}

/// One acquisition of `permits` permits of semaphore `name`, tried as often as the
/// engine needs, each try as a new owner.
pub(crate) struct PgPermitAttempt {
    core: Arc<Core>,
    link: PgLink,
    name: Arc<str>,
    channel: Arc<str>,
    permits: u32,
    lease: Duration,
    lease_ms: u64,
    renew: bool,
}

impl PgPermitAttempt {
    /// An acquisition of `permits` (checked by the caller) for `lease` (`lease_ms`),
    /// renewed by the watchdog if `renew`.
    pub(crate) fn new(
        core: Arc<Core>,
        link: PgLink,
        name: Arc<str>,
        permits: u32,
        (lease, lease_ms, renew): (Duration, u64, bool),
    ) -> Self {
        PgPermitAttempt {
            channel: permit_channel(&name).into(),
            core,
            link,
            name,
            permits,
            lease,
            lease_ms,
            renew,
        }
    }

    pub(crate) fn core(&self) -> &Core {
        &self.core
    }
}

impl Acquire for PgPermitAttempt {
    type Guard = Hold;

    fn kind(&self) -> &'static str {
        "permit_semaphore"
    }

    fn attempt(&self) -> AttemptFuture<Hold> {
        let owner = self.core.next_owner();
        let sent_at = Instant::now();
        let (core, link, name, channel) = (
            Arc::clone(&self.core),
            self.link.clone(),
            Arc::clone(&self.name),
            Arc::clone(&self.channel),
        );
        let (permits, lease, lease_ms, renew) =
            (self.permits, self.lease, self.lease_ms, self.renew);
        Box::pin(async move {
            let reply = {
                let (name, owner) = (name.to_string(), owner.to_string());
                link.run(move |mut conn| async move {
                    sqlx::query_as::<_, (bool, Option<i64>)>(ACQUIRE)
                        .bind(name)
                        .bind(owner)
                        .bind(i32::try_from(permits).unwrap_or(i32::MAX))
                        .bind(lease_ms as f64)
                        .fetch_one(&mut *conn)
                        .await
                })
                .await
            };
            let (held, left_ms) = match reply {
                Ok(reply) => reply,
                Err(err) => {
                    if err.is_connection_error() {
                        // The permits may have been taken: give back exactly this
                        // attempt's, if any, before the error returns.
                        let forgetting = forget(link, name, channel, owner);
                        core.given_back(forgetting).await;
                    }
                    return Err(err);
                }
            };
            if !held {
                return Ok(Attempt::Busy {
                    retry_after: left_ms.map(|left| Duration::from_millis(left.unsigned_abs())),
                });
            }
            Ok(Attempt::Acquired(
                Acquired {
                    core,
                    name,
                    owner,
                    release: Arc::new(RowHold {
                        link,
                        channel,
                        statements: &PERMITS,
                    }),
                    token: 0,
                    sent_at,
                    lease,
                    lease_ms,
                    renew,
                }
                .into_hold(),
            ))
        })
    }

    fn channel(&self) -> &str {
        &self.channel
    }

    fn queue(&self) -> &str {
        &self.name
    }

    fn wake_rule(&self) -> WakeRule {
        WakeRule::UpTo
    }

    fn ask(&self) -> u64 {
        u64::from(self.permits)
    }
}

/// Gives back whatever `owner` may hold (an attempt whose reply was lost). Harmless if
/// nothing.
async fn forget(link: PgLink, name: Arc<str>, channel: Arc<str>, owner: Arc<str>) {
    let request = format!("forget:{owner}");
    if let Err(err) = release_row(&link, PERMITS.release, (&name, &owner), &request, &channel).await
    {
        tracing::warn!(
            error = %err,
            semaphore = %name,
            "could not give back permits whose reply was lost; their lease runs out"
        );
    }
}

/// Adds `delta` permits to semaphore `name`'s total (creating it), and wakes waiters:
/// the free count after it.
pub(crate) async fn add_permits(link: &PgLink, name: &str, delta: i64) -> Result<i64> {
    let (name, channel) = (name.to_owned(), permit_channel(name));
    link.run(move |mut conn| async move {
        sqlx::query_scalar::<_, i64>(ADD_PERMITS)
            .bind(name)
            .bind(delta)
            .bind(channel)
            .fetch_one(&mut *conn)
            .await
    })
    .await
}

/// Sets semaphore `name`'s total to `total` if it has none: `None` when this call set
/// it, or the total it found.
pub(crate) async fn set_permits(link: &PgLink, name: &str, total: i64) -> Result<Option<i64>> {
    let (name, channel) = (name.to_owned(), permit_channel(name));
    link.run(move |mut conn| async move {
        sqlx::query_scalar::<_, Option<i64>>(SET_PERMITS)
            .bind(name)
            .bind(total)
            .bind(channel)
            .fetch_one(&mut *conn)
            .await
    })
    .await
}

/// Semaphore `name`'s total and the permits its live holders hold, read at one moment.
pub(crate) async fn counts(link: &PgLink, name: &str) -> Result<(i64, i64)> {
    let name = name.to_owned();
    link.run(move |mut conn| async move {
        sqlx::query_as::<_, (i64, i64)>(COUNTS)
            .bind(name)
            .fetch_one(&mut *conn)
            .await
    })
    .await
}
