//! The lease lock on PostgreSQL: a row per lock in `distlock_locks`, whose expiry is kept
//! on the database's clock, a token from the `distlock_tokens` sequence on every
//! acquisition, and a NOTIFY on the lock's channel at each release, which the client's
//! hub LISTENs for. Each statement is a file in `sql/`, with its parameters and answer in
//! its header.
//!
//! Everything above the statements is the lease lock's, shared with Redis: the engine's
//! acquisition loop and its cancellation safety, the watchdog (which renews every held
//! lock of the client in one statement), the guard, the lost signal and its deadline.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::hold_ops::{HoldOps, OpFuture, ReleaseArgs};
use super::holding::{Acquired, Hold};
use crate::engine::acquire::Attempt;
use crate::engine::renewal::registry::{Renewal, RenewalKind};
use crate::engine::session::Core;
use crate::error::{Error, Result};
use crate::transport::postgres::PgLink;

/// What a client creates at connect when missing.
pub(crate) const SCHEMA: &str = include_str!("sql/schema.sql");

/// What a client checks at connect, whoever created the table.
pub(crate) const SCHEMA_CHECK: &str = include_str!("sql/schema_check.sql");

const ACQUIRE: &str = include_str!("sql/acquire.sql");
const RELEASE: &str = include_str!("sql/release.sql");
const SET_HOLDS: &str = include_str!("sql/set_holds.sql");
const EXTEND: &str = include_str!("sql/extend.sql");
const VERIFY: &str = include_str!("sql/verify.sql");
const FORCE_UNLOCK: &str = include_str!("sql/force_unlock.sql");
const FORCE_UNLOCK_READERS: &str = include_str!("sql/force_unlock_readers.sql");
const LEASE_LEFT: &str = include_str!("sql/lease_left.sql");
const OWNERS: &str = include_str!("sql/owners.sql");
const LAST_TOKEN: &str = include_str!("sql/last_token.sql");
const ADVANCE_TOKENS: &str = include_str!("sql/advance_tokens.sql");

/// A lock hold on PostgreSQL, renewed by `sql/renew.sql`.
pub(crate) static PG_LOCK_RENEWAL: RenewalKind = RenewalKind {
    name: "lock hold",
    renew: Renewal::Statement(include_str!("sql/renew.sql")),
};

/// The longest name PostgreSQL can index as a key (a btree entry must fit a third of a
/// page), with room to spare.
const MAX_NAME_BYTES: usize = 2048;

/// The lock's notification channel: a hash of its name, because a channel is an
/// identifier of at most 63 bytes and a lock name may be anything. Two names that share a
/// channel only wake each other's waiters, who look and wait again.
pub(crate) fn channel_of(name: &str) -> String {
    // FNV-1a, 64 bits: the same on every client, with no dependency.
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("distlock_{hash:016x}")
}

/// Refuses a name PostgreSQL cannot keep: a NUL byte (text cannot hold one), or one too
/// long to be a key.
pub(crate) fn validate_name(name: &str) -> Result<()> {
    if name.contains('\0') {
        return Err(Error::InvalidName {
            name: name.replace('\0', "\\0"),
            reason: "PostgreSQL text cannot hold a NUL character",
        });
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(Error::InvalidName {
            name: format!("{}…", name.chars().take(32).collect::<String>()),
            reason: "longer than 2048 bytes, more than PostgreSQL can index",
        });
    }
    Ok(())
}

/// One acquisition attempt as a new owner (see [`super::LockAttempt`]). Its reply lost
/// to a connection failure, the owner's hold, if the statement ran, is ended before the
/// attempt returns.
/// `owner` is new to this attempt; `(lease, lease_ms, renew)` is what it takes.
pub(crate) async fn attempt(
    core: Arc<Core>,
    link: PgLink,
    name: Arc<str>,
    channel: Arc<str>,
    owner: Arc<str>,
    (lease, lease_ms, renew): (Duration, u64, bool),
    sent_at: Instant,
) -> Result<Attempt<Hold>> {
    let reply = {
        let (name, owner) = (name.to_string(), owner.to_string());
        link.run(move |mut conn| async move {
            sqlx::query_as::<_, (Option<i64>, Option<i64>)>(ACQUIRE)
                .bind(name)
                .bind(owner)
                .bind(lease_ms as f64)
                .fetch_optional(&mut *conn)
                .await
        })
        .await
    };
    let reply = match reply {
        Ok(reply) => reply,
        Err(err) => {
            if err.is_connection_error() {
                let forgetting = forget(link, Arc::clone(&name), channel, owner);
                core.given_back(forgetting).await;
            }
            return Err(err);
        }
    };
    Ok(match reply {
        Some((Some(token), _)) => Attempt::Acquired(
            Acquired {
                core,
                name,
                owner,
                release: Arc::new(PgHold { link, channel }),
                token: token.unsigned_abs(),
                sent_at,
                lease,
                lease_ms,
                renew,
            }
            .into_hold(),
        ),
        Some((None, Some(left))) => Attempt::Busy {
            retry_after: Some(Duration::from_millis(left.unsigned_abs())),
        },
        _ => Attempt::Busy { retry_after: None },
    })
}

/// Ends whatever `owner` may hold (an attempt whose reply was lost). Harmless if nothing.
async fn forget(link: PgLink, name: Arc<str>, channel: Arc<str>, owner: Arc<str>) {
    match force_unlock(&link, &name, &owner, &channel).await {
        Ok(true) => tracing::debug!(lock = %name, "gave up a hold whose reply was lost"),
        Ok(false) => {}
        Err(err) => tracing::warn!(
            error = %err,
            lock = %name,
            "could not give up an acquisition whose reply was lost; it expires with its lease"
        ),
    }
}

/// A holding's calls on PostgreSQL.
pub(crate) struct PgHold {
    link: PgLink,
    channel: Arc<str>,
}

impl HoldOps for PgHold {
    fn release<'a>(
        &'a self,
        _core: &'a Core,
        name: &'a str,
        owner: &'a str,
        latch: &'a str,
        args: &'a ReleaseArgs<'a>,
    ) -> OpFuture<'a, i64> {
        let (name, owner) = (name.to_owned(), owner.to_owned());
        let left = args.left;
        if left > 0 {
            let lease_ms = args.lease_ms as f64;
            return Box::pin(async move {
                let holds = set_holds(&self.link, name, owner, left, lease_ms).await?;
                Ok(holds.map_or(-1, i64::from))
            });
        }
        // The latch is unique to this release and the same on its retries: the request
        // id the row keeps.
        let (request, channel) = (latch.to_owned(), self.channel.to_string());
        Box::pin(async move {
            let freed = self
                .link
                .run_upkeep(move |mut conn| async move {
                    let rows = sqlx::query(RELEASE)
                        .bind(name)
                        .bind(owner)
                        .bind(request)
                        .bind(channel)
                        .fetch_all(&mut *conn)
                        .await?;
                    Ok(rows.len())
                })
                .await?;
            Ok(if freed > 0 { 0 } else { -1 })
        })
    }

    fn reenter<'a>(
        &'a self,
        _core: &'a Core,
        name: &'a str,
        owner: &'a str,
        holds: u32,
        _lease_ms: u64,
    ) -> OpFuture<'a, i64> {
        let (name, owner) = (name.to_owned(), owner.to_owned());
        Box::pin(async move {
            let set = set_holds(&self.link, name, owner, holds, 0.0).await?;
            Ok(i64::from(set.is_some()))
        })
    }

    fn extend<'a>(
        &'a self,
        _core: &'a Core,
        name: &'a str,
        owner: &'a str,
        lease_ms: u64,
    ) -> OpFuture<'a, bool> {
        let (name, owner) = (name.to_owned(), owner.to_owned());
        Box::pin(async move {
            let extended = self
                .link
                .run_upkeep(move |mut conn| async move {
                    sqlx::query_scalar::<_, i32>(EXTEND)
                        .bind(name)
                        .bind(owner)
                        .bind(lease_ms as f64)
                        .fetch_optional(&mut *conn)
                        .await
                })
                .await?;
            Ok(extended.is_some())
        })
    }

    fn verify<'a>(&'a self, _core: &'a Core, name: &'a str, owner: &'a str) -> OpFuture<'a, bool> {
        let (name, owner) = (name.to_owned(), owner.to_owned());
        Box::pin(async move {
            self.link
                .run_upkeep(move |mut conn| async move {
                    sqlx::query_scalar::<_, bool>(VERIFY)
                        .bind(name)
                        .bind(owner)
                        .fetch_one(&mut *conn)
                        .await
                })
                .await
        })
    }

    fn renewal(&self, owner: &Arc<str>) -> (&'static RenewalKind, Arc<str>) {
        (&PG_LOCK_RENEWAL, Arc::clone(owner))
    }

    fn unlock_channel(&self) -> Option<&str> {
        Some(&self.channel)
    }
}

/// Sets the hold count (and the lease, unless `lease_ms` is 0): the count now, or `None`
/// when the owner no longer holds the lock.
async fn set_holds(
    link: &PgLink,
    name: String,
    owner: String,
    holds: u32,
    lease_ms: f64,
) -> Result<Option<i32>> {
    set_hold_count(link, SET_HOLDS, (&name, &owner), holds, Some(lease_ms)).await
}

/// Runs `statement`, which sets a holding's hold count (`$1` name, `$2` owner, `$3` the
/// count, and `$4` a lease in milliseconds when given), and answers the count it set, or
/// `None` when the owner no longer holds it. Shared by the lock's and the readers'.
pub(crate) async fn set_hold_count(
    link: &PgLink,
    statement: &'static str,
    (name, owner): (&str, &str),
    holds: u32,
    lease_ms: Option<f64>,
) -> Result<Option<i32>> {
    let holds = i32::try_from(holds).map_err(|_| Error::InvalidArgument {
        what: "hold count",
        reason: format!("{holds} is more than PostgreSQL's integer holds"),
    })?;
    let (name, owner) = (name.to_owned(), owner.to_owned());
    link.run_upkeep(move |mut conn| async move {
        let query = sqlx::query_scalar::<_, i32>(statement)
            .bind(name)
            .bind(owner)
            .bind(holds);
        let query = match lease_ms {
            Some(lease_ms) => query.bind(lease_ms),
            None => query,
        };
        query.fetch_optional(&mut *conn).await
    })
    .await
}

/// How long the lock's lease has left, `None` while it is free.
pub(crate) async fn lease_left(link: &PgLink, name: &str) -> Result<Option<Duration>> {
    let name = name.to_owned();
    let left = link
        .run(move |mut conn| async move {
            sqlx::query_scalar::<_, i64>(LEASE_LEFT)
                .bind(name)
                .fetch_optional(&mut *conn)
                .await
        })
        .await?;
    Ok(left.map(|millis| Duration::from_millis(millis.unsigned_abs())))
}

/// Who holds the lock right now (at most one owner).
pub(crate) async fn owners(link: &PgLink, name: &str) -> Result<Vec<String>> {
    let name = name.to_owned();
    link.run(move |mut conn| async move {
        sqlx::query_scalar::<_, String>(OWNERS)
            .bind(name)
            .fetch_all(&mut *conn)
            .await
    })
    .await
}

/// The highest token handed out so far, by any lock of the database.
pub(crate) async fn last_token(link: &PgLink) -> Result<u64> {
    let token = link
        .run(|mut conn| async move {
            sqlx::query_scalar::<_, i64>(LAST_TOKEN)
                .fetch_one(&mut *conn)
                .await
        })
        .await?;
    Ok(token.unsigned_abs())
}

/// Ends the lock's holding (only `owner`'s, unless it is empty) and wakes a waiter.
pub(crate) async fn force_unlock(
    link: &PgLink,
    name: &str,
    owner: &str,
    channel: &str,
) -> Result<bool> {
    let (name, owner, channel) = (name.to_owned(), owner.to_owned(), channel.to_owned());
    let ended = link
        .run(move |mut conn| async move {
            let rows = sqlx::query(FORCE_UNLOCK)
                .bind(name)
                .bind(owner)
                .bind(channel)
                .fetch_all(&mut *conn)
                .await?;
            Ok(rows.len())
        })
        .await?;
    Ok(ended > 0)
}

/// Ends the read holdings of the read-write lock of the name (only `owner`'s, unless it
/// is empty), whoever holds them: an operator's force-unlock. Whether any ended.
pub(crate) async fn force_unlock_readers(
    link: &PgLink,
    name: &str,
    owner: &str,
    channel: &str,
) -> Result<bool> {
    let (name, owner, channel) = (name.to_owned(), owner.to_owned(), channel.to_owned());
    let ended = link
        .run(move |mut conn| async move {
            sqlx::query_scalar::<_, i32>(FORCE_UNLOCK_READERS)
                .bind(name)
                .bind(owner)
                .bind(channel)
                .fetch_one(&mut *conn)
                .await
        })
        .await?;
    Ok(ended > 0)
}

/// Raises the token sequence to at least `floor` (below `i64::MAX`, checked by the
/// caller): see `sql/advance_tokens.sql`.
pub(crate) async fn advance_tokens(link: &PgLink, floor: i64) -> Result<u64> {
    let counter = link
        .run(move |mut conn| async move {
            let mut raising = sqlx::Connection::begin(&mut *conn).await?;
            sqlx::query("LOCK TABLE distlock_locks IN SHARE ROW EXCLUSIVE MODE")
                .execute(&mut *raising)
                .await?;
            let counter = sqlx::query_scalar::<_, i64>(ADVANCE_TOKENS)
                .bind(floor)
                .fetch_one(&mut *raising)
                .await?;
            raising.commit().await?;
            Ok(counter)
        })
        .await?;
    Ok(counter.unsigned_abs())
}
