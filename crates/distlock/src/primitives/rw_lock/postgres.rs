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
use crate::primitives::lock::postgres::{attempt as write_attempt, channel_of};
use crate::primitives::lock::postgres_rows::{release_row, RowHold, RowStatements};
use crate::primitives::lock::{Acquired, Hold};
use crate::transport::postgres::PgLink;

/// What a client creates at connect when missing, after the lease lock's table.
pub(crate) const SCHEMA: &str = include_str!("sql/schema.sql");

/// What a client checks at connect, whoever created it.
pub(crate) const SCHEMA_CHECK: &str = include_str!("sql/schema_check.sql");

const READ_ACQUIRE: &str = include_str!("sql/read_acquire.sql");
const READ_DOWNGRADE: &str = include_str!("sql/read_downgrade.sql");
const IS_LOCKED: &str = include_str!("sql/is_locked.sql");

/// A read holding's calls: a row of `distlock_readers`, renewed by `sql/read_renew.sql`.
static READ_HOLD: RowStatements = RowStatements {
    release: include_str!("sql/read_release.sql"),
    extend: include_str!("sql/read_extend.sql"),
    verify: include_str!("sql/read_verify.sql"),
    set_holds: Some(include_str!("sql/read_set_holds.sql")),
    renewal: &RenewalKind {
        name: "read hold",
        renew: Renewal::Statement(include_str!("sql/read_renew.sql")),
    },
    listens: true,
    reentry: "re-entering a read hold",
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
            release: Arc::new(RowHold {
                link: self.link.clone(),
                channel: Arc::clone(&self.channel),
                statements: &READ_HOLD,
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
                let ended =
                    release_row(&link, READ_HOLD.release, (&name, &owner), &request, &channel)
                        .await;
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
