//! The read-write lock on PostgreSQL: a writer is the lease lock's row at the name (a
//! [`Lock`](crate::Lock) of the same name is a writer too), a reader a row of
//! `distlock_readers`, and the lock's row keeps `readers_until`, which a writer waits to
//! pass (see `sql/schema.sql` for why every decision is made on that one row). Waiters
//! are woken by the lock's NOTIFY channel, as the lease lock's are: a writer's release
//! and the last reader's wake every waiter of a client, and each looks again.
//!
//! Everything above the statements is shared with the other stores: the engine's
//! acquisition loop, the watchdog (read holdings renewed in one statement per batch), the
//! guard and the lost signal.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::engine::acquire::{Acquire, Attempt, AttemptFuture};
use crate::engine::renewal::registry::{Renewal, RenewalKind};
use crate::engine::session::Core;
use crate::engine::subscriptions::WakeRule;
use crate::error::Result;
use crate::primitives::lock::postgres::{attempt as write_attempt, channel_of, set_hold_count};
use crate::primitives::lock::{Acquired, Hold, HoldOps, OpFuture, ReleaseArgs};
use crate::transport::postgres::PgLink;

/// What a client creates at connect when missing, after the lease lock's table.
pub(crate) const SCHEMA: &str = include_str!("sql/schema.sql");

/// What a client checks at connect, whoever created it.
pub(crate) const SCHEMA_CHECK: &str = include_str!("sql/schema_check.sql");

const READ_ACQUIRE: &str = include_str!("sql/read_acquire.sql");
const READ_DOWNGRADE: &str = include_str!("sql/read_downgrade.sql");
const READ_RELEASE: &str = include_str!("sql/read_release.sql");
const READ_EXTEND: &str = include_str!("sql/read_extend.sql");
const READ_SET_HOLDS: &str = include_str!("sql/read_set_holds.sql");
const READ_VERIFY: &str = include_str!("sql/read_verify.sql");
const IS_LOCKED: &str = include_str!("sql/is_locked.sql");

/// A read holding on PostgreSQL, renewed by `sql/read_renew.sql`.
static PG_READ_RENEWAL: RenewalKind = RenewalKind {
    name: "read hold",
    renew: Renewal::Statement(include_str!("sql/read_renew.sql")),
};

/// One acquisition of a read or the write holding, tried as often as the engine needs,
/// each try as a new owner (a writer's ends in `:write`).
#[derive(Clone)]
pub(crate) struct PgRwAttempt {
    core: Arc<Core>,
    link: PgLink,
    name: Arc<str>,
    channel: Arc<str>,
    shared: bool,
    lease: Duration,
    lease_ms: u64,
    renew: bool,
}

impl PgRwAttempt {
    /// An acquisition of lock `name`, `shared` (a reader) or not, for `lease`
    /// (`lease_ms`, checked by the caller), renewed by the watchdog if `renew`.
    pub(crate) fn new(
        core: Arc<Core>,
        link: PgLink,
        name: Arc<str>,
        shared: bool,
        (lease, lease_ms, renew): (Duration, u64, bool),
    ) -> Self {
        PgRwAttempt {
            channel: channel_of(&name).into(),
            core,
            link,
            name,
            shared,
            lease,
            lease_ms,
            renew,
        }
    }

    pub(crate) fn core(&self) -> &Core {
        &self.core
    }

    /// The read holding `acquired` as a new owner, built once its row is there.
    fn read_hold(&self, owner: Arc<str>, sent_at: Instant) -> Hold {
        Acquired {
            core: Arc::clone(&self.core),
            name: Arc::clone(&self.name),
            owner,
            release: Arc::new(PgReadHold {
                link: self.link.clone(),
                channel: Arc::clone(&self.channel),
            }),
            token: 0,
            sent_at,
            lease: self.lease,
            lease_ms: self.lease_ms,
            renew: self.renew,
        }
        .into_hold()
    }

    /// A read holding of a new owner beside the write holding of `writer` (a downgrade):
    /// `None` when the writer no longer holds the lock. Its reply lost, a holding the
    /// statement took is given back before the error returns.
    pub(crate) async fn take_beside(&self, writer: &str) -> Result<Option<Hold>> {
        let owner = self.core.next_owner();
        let sent_at = Instant::now();
        let (name, reader, writer) = (self.name.to_string(), owner.to_string(), writer.to_owned());
        let lease_ms = self.lease_ms as f64;
        let taken = self
            .link
            .run(move |mut conn| async move {
                sqlx::query_scalar::<_, bool>(READ_DOWNGRADE)
                    .bind(name)
                    .bind(reader)
                    .bind(lease_ms)
                    .bind(writer)
                    .fetch_optional(&mut *conn)
                    .await
            })
            .await;
        match taken {
            Ok(Some(true)) => Ok(Some(self.read_hold(owner, sent_at))),
            Ok(_) => Ok(None),
            Err(err) => {
                if err.is_connection_error() {
                    self.forget(owner).await;
                }
                Err(err)
            }
        }
    }

    /// One try at a read holding, as a new owner.
    async fn read(&self) -> Result<Attempt<Hold>> {
        let owner = self.core.next_owner();
        let sent_at = Instant::now();
        let (name, reader) = (self.name.to_string(), owner.to_string());
        let lease_ms = self.lease_ms as f64;
        let reply = self
            .link
            .run(move |mut conn| async move {
                sqlx::query_as::<_, (bool, Option<i64>)>(READ_ACQUIRE)
                    .bind(name)
                    .bind(reader)
                    .bind(lease_ms)
                    .fetch_optional(&mut *conn)
                    .await
            })
            .await;
        let reply = match reply {
            Ok(reply) => reply,
            Err(err) => {
                if err.is_connection_error() {
                    self.forget(owner).await;
                }
                return Err(err);
            }
        };
        Ok(match reply {
            Some((true, _)) => Attempt::Acquired(self.read_hold(owner, sent_at)),
            Some((false, Some(left))) => Attempt::Busy {
                retry_after: Some(Duration::from_millis(left.unsigned_abs())),
            },
            _ => Attempt::Busy { retry_after: None },
        })
    }

    /// Ends whatever read holding `owner` may have (an attempt whose reply was lost),
    /// on the client's runtime, before the caller goes on. Harmless if none.
    async fn forget(&self, owner: Arc<str>) {
        let (link, name, channel) = (
            self.link.clone(),
            Arc::clone(&self.name),
            Arc::clone(&self.channel),
        );
        let request = format!("forget:{owner}");
        self.core
            .given_back(async move {
                let ended = release(&link, &name, &owner, &request, &channel).await;
                if let Err(err) = ended {
                    tracing::warn!(
                        error = %err,
                        lock = %name,
                        "could not give up a read holding whose reply was lost; it expires with its lease"
                    );
                }
            })
            .await;
    }
}

impl Acquire for PgRwAttempt {
    type Guard = Hold;

    fn kind(&self) -> &'static str {
        if self.shared {
            "read_lock"
        } else {
            "write_lock"
        }
    }

    fn attempt(&self) -> AttemptFuture<Hold> {
        if self.shared {
            let this = self.clone();
            return Box::pin(async move { this.read().await });
        }
        let owner: Arc<str> = format!("{}:write", self.core.next_owner()).into();
        Box::pin(write_attempt(
            Arc::clone(&self.core),
            self.link.clone(),
            Arc::clone(&self.name),
            Arc::clone(&self.channel),
            owner,
            (self.lease, self.lease_ms, self.renew),
            Instant::now(),
        ))
    }

    fn channel(&self) -> &str {
        &self.channel
    }

    fn queue(&self) -> &str {
        &self.name
    }

    fn key(&self) -> &str {
        &self.name
    }

    // A writer's release, or the last reader's, may let many readers in: every waiter
    // of the client looks again.
    fn wake_rule(&self) -> WakeRule {
        WakeRule::All
    }

    fn token(&self, guard: &Hold) -> Option<u64> {
        (!self.shared).then(|| guard.token())
    }
}

/// Gives a read holding back: 0 when this release (or an earlier try of it) ended it,
/// -1 when the owner no longer held it.
async fn release(
    link: &PgLink,
    name: &str,
    owner: &str,
    request: &str,
    channel: &str,
) -> Result<i64> {
    let (name, owner, request, channel) = (
        name.to_owned(),
        owner.to_owned(),
        request.to_owned(),
        channel.to_owned(),
    );
    let outcome = link
        .run_upkeep(move |mut conn| async move {
            sqlx::query_scalar::<_, Option<String>>(READ_RELEASE)
                .bind(name)
                .bind(owner)
                .bind(request)
                .bind(channel)
                .fetch_one(&mut *conn)
                .await
        })
        .await?;
    Ok(if outcome.is_some() { 0 } else { -1 })
}

/// A read holding's calls on PostgreSQL, on its row of `distlock_readers`.
struct PgReadHold {
    link: PgLink,
    channel: Arc<str>,
}

impl HoldOps for PgReadHold {
    fn release<'a>(
        &'a self,
        _core: &'a Core,
        name: &'a str,
        owner: &'a str,
        latch: &'a str,
        args: &'a ReleaseArgs<'a>,
    ) -> OpFuture<'a, i64> {
        if args.left > 0 {
            let left = args.left;
            return Box::pin(async move {
                let holds = set_holds(&self.link, name, owner, left).await?;
                Ok(holds.map_or(-1, i64::from))
            });
        }
        // The latch is unique to this release and the same on its retries: the request
        // id the row keeps.
        Box::pin(release(&self.link, name, owner, latch, &self.channel))
    }

    fn reenter<'a>(
        &'a self,
        _core: &'a Core,
        name: &'a str,
        owner: &'a str,
        holds: u32,
        _lease_ms: u64,
    ) -> OpFuture<'a, i64> {
        Box::pin(async move {
            let set = set_holds(&self.link, name, owner, holds).await?;
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
        let (name, owner, channel) = (name.to_owned(), owner.to_owned(), self.channel.to_string());
        Box::pin(async move {
            self.link
                .run_upkeep(move |mut conn| async move {
                    sqlx::query_scalar::<_, bool>(READ_EXTEND)
                        .bind(name)
                        .bind(owner)
                        .bind(lease_ms as f64)
                        .bind(channel)
                        .fetch_one(&mut *conn)
                        .await
                })
                .await
        })
    }

    fn verify<'a>(&'a self, _core: &'a Core, name: &'a str, owner: &'a str) -> OpFuture<'a, bool> {
        let (name, owner) = (name.to_owned(), owner.to_owned());
        Box::pin(async move {
            self.link
                .run_upkeep(move |mut conn| async move {
                    sqlx::query_scalar::<_, bool>(READ_VERIFY)
                        .bind(name)
                        .bind(owner)
                        .fetch_one(&mut *conn)
                        .await
                })
                .await
        })
    }

    // A partial release rewrites the hold count only.
    fn partial_release_renews(&self) -> bool {
        false
    }

    fn renewal(&self, owner: &Arc<str>) -> (&'static RenewalKind, Arc<str>) {
        (&PG_READ_RENEWAL, Arc::clone(owner))
    }

    fn unlock_channel(&self) -> Option<&str> {
        Some(&self.channel)
    }
}

/// Sets a read holding's hold count: the count now, or `None` when the owner no longer
/// holds it.
async fn set_holds(link: &PgLink, name: &str, owner: &str, holds: u32) -> Result<Option<i32>> {
    set_hold_count(link, READ_SET_HOLDS, (name, owner), holds, None).await
}

/// Whether anyone holds the read-write lock `name`, for writing or reading.
pub(crate) async fn is_locked(link: &PgLink, name: &str) -> Result<bool> {
    let name = name.to_owned();
    link.run(move |mut conn| async move {
        sqlx::query_scalar::<_, bool>(IS_LOCKED)
            .bind(name)
            .fetch_one(&mut *conn)
            .await
    })
    .await
}
