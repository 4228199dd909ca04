//! A holding kept on PostgreSQL as a row of its own, with its own expiry (a read hold of
//! the read-write lock, an acquisition of permits): its calls are statements that each
//! take the row of the primitive it belongs to first, named by the primitive
//! ([`RowStatements`]), and one [`HoldOps`] sends them.

use std::sync::Arc;

use super::hold_ops::{HoldOps, OpFuture, ReleaseArgs};
use super::postgres::set_hold_count;
use crate::engine::renewal::registry::RenewalKind;
use crate::engine::session::Core;
use crate::error::{Error, Result};
use crate::transport::postgres::PgLink;

/// The statements of one kind of row holding. Each binds the primitive's name and the
/// holding's owner first.
pub(crate) struct RowStatements {
    /// Gives the holding back: binds the request id (the same on a retry) and the
    /// notification channel; answers a text, NULL when the owner no longer held it.
    pub(crate) release: &'static str,
    /// Sets the lease to a new length from now: binds the lease (ms, double precision)
    /// and the channel; answers true while held.
    pub(crate) extend: &'static str,
    /// Whether the owner holds it now: answers a boolean.
    pub(crate) verify: &'static str,
    /// Sets the hold count (a re-entry, or a release that leaves holds): binds the
    /// count; answers the count, no row when not held. `None`: one hold only.
    pub(crate) set_holds: Option<&'static str>,
    /// How the watchdog renews it (a batch statement).
    pub(crate) renewal: &'static RenewalKind,
    /// The holding listens on the primitive's channel for a force-unlock.
    pub(crate) listens: bool,
    /// What a re-entry is called in the error of a holding that has none.
    pub(crate) reentry: &'static str,
}

/// A row holding's calls, on its primitive's link and channel.
pub(crate) struct RowHold {
    pub(crate) link: PgLink,
    pub(crate) channel: Arc<str>,
    pub(crate) statements: &'static RowStatements,
}

/// Gives `owner`'s row holding back with `statement` (see [`RowStatements::release`]):
/// 0 when this release (or an earlier try of it) ended it, -1 when the owner no longer
/// held it.
pub(crate) async fn release_row(
    link: &PgLink,
    statement: &'static str,
    (name, owner): (&str, &str),
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
            sqlx::query_scalar::<_, Option<String>>(statement)
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

impl RowHold {
    /// Sets the hold count, or refuses on a holding of one hold.
    async fn set_holds(
        &self,
        core: &Core,
        (name, owner): (&str, &str),
        holds: u32,
    ) -> Result<Option<i32>> {
        let Some(statement) = self.statements.set_holds else {
            return Err(Error::Unsupported {
                store: core.store().name(),
                what: self.statements.reentry,
            });
        };
        set_hold_count(&self.link, statement, (name, owner), holds, None).await
    }
}

impl HoldOps for RowHold {
    fn release<'a>(
        &'a self,
        core: &'a Core,
        name: &'a str,
        owner: &'a str,
        latch: &'a str,
        args: &'a ReleaseArgs<'a>,
    ) -> OpFuture<'a, i64> {
        if args.left > 0 {
            let left = args.left;
            return Box::pin(async move {
                let holds = self.set_holds(core, (name, owner), left).await?;
                Ok(holds.map_or(-1, i64::from))
            });
        }
        // The latch is unique to this release and the same on its retries: the request
        // id the row keeps.
        Box::pin(release_row(
            &self.link,
            self.statements.release,
            (name, owner),
            latch,
            &self.channel,
        ))
    }

    fn reenter<'a>(
        &'a self,
        core: &'a Core,
        name: &'a str,
        owner: &'a str,
        holds: u32,
        _lease_ms: u64,
    ) -> OpFuture<'a, i64> {
        Box::pin(async move {
            let set = self.set_holds(core, (name, owner), holds).await?;
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
        let statement = self.statements.extend;
        Box::pin(async move {
            self.link
                .run_upkeep(move |mut conn| async move {
                    sqlx::query_scalar::<_, bool>(statement)
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
        let statement = self.statements.verify;
        Box::pin(async move {
            self.link
                .run_upkeep(move |mut conn| async move {
                    sqlx::query_scalar::<_, bool>(statement)
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
        (self.statements.renewal, Arc::clone(owner))
    }

    fn unlock_channel(&self) -> Option<&str> {
        self.statements.listens.then_some(&*self.channel)
    }
}
