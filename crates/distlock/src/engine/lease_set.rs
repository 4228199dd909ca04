//! Leases made of other leases: a MultiLock holds while *all* of its members hold, a
//! RedLock while a *majority* of its nodes do. Both are a set of member [`Lease`]s and a
//! quorum: the set is trusted while at least `quorum` members are.
//!
//! Members stay what they are: each is renewed by its own client's watchdog (in that
//! client's batches) and each fires its own lost signal. A set only reads them, so it adds
//! nothing to the renewal scheduler and costs no task, except for a lost token that has
//! to be cancelled by someone: that one task waits on the members' signals.

use std::future::Future;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::engine::renewal::lease::Lease;
use crate::runtime::Background;

/// A quorum over member leases, borrowed from the guards that own them.
pub(crate) struct LeaseSet<'a> {
    members: Vec<&'a Lease>,
    quorum: usize,
    /// Where the lost token's watcher runs: the first member's client's runtime.
    background: Option<&'a Background>,
}

impl<'a> LeaseSet<'a> {
    /// `quorum` members must be trusted for the set to be; it is clamped to 1..=members.
    pub(crate) fn new(
        members: impl IntoIterator<Item = &'a Lease>,
        quorum: usize,
        background: Option<&'a Background>,
    ) -> Self {
        let members: Vec<&Lease> = members.into_iter().collect();
        let quorum = quorum.clamp(1, members.len().max(1));
        Self {
            members,
            quorum,
            background,
        }
    }

    /// True while at least `quorum` members are trusted.
    pub(crate) fn is_trusted(&self) -> bool {
        self.members
            .iter()
            .filter(|lease| lease.is_trusted())
            .count()
            >= self.quorum
    }

    /// When the set stops being trusted unless renewed: the moment by which all but
    /// `quorum - 1` members will no longer be trusted. `None` once the set is lost.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        let mut deadlines: Vec<Instant> = self
            .members
            .iter()
            .filter_map(|lease| lease.trusted_until())
            .collect();
        if deadlines.len() < self.quorum {
            return None;
        }
        // The quorum-th latest deadline: until then, `quorum` members are still in time.
        deadlines.sort_unstable_by(|a, b| b.cmp(a));
        deadlines.get(self.quorum - 1).copied()
    }

    /// How long the set is sure to be trusted, by the local clock: zero once lost.
    pub(crate) fn remaining(&self) -> Duration {
        self.deadline()
            .map(|deadline| deadline.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::ZERO)
    }

    /// Completes as soon as the set is lost; never after a normal release.
    pub(crate) fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let watch = self.watch();
        async move {
            if !watch.await {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Completes with `true` once more members are lost than the set can spare, or with
    /// `false` when the members ended (released) without that. Spawns nothing: it is the
    /// members' own watches, counted.
    pub(crate) fn watch(&self) -> impl Future<Output = bool> + Send + 'static {
        let spare = self.members.len() - self.quorum;
        let mut watches: FuturesUnordered<_> =
            self.members.iter().map(|lease| lease.watch()).collect();
        async move {
            let mut lost = 0;
            while let Some(member_lost) = watches.next().await {
                if member_lost {
                    lost += 1;
                    if lost > spare {
                        return true;
                    }
                }
            }
            false
        }
    }

    /// A token cancelled when the set is lost. One small task waits for it, and ends when
    /// the set is released: on the caller's runtime when there is one (it keeps time
    /// there even while the clients' thread is starved), on the first member's client's
    /// otherwise.
    pub(crate) fn lost_token(&self) -> CancellationToken {
        if let [only] = self.members.as_slice() {
            // One member: its own token, cancelled by its own deadline timer, with no
            // watcher task in between.
            return only.lost_token();
        }
        let token = CancellationToken::new();
        if !self.is_trusted() {
            token.cancel();
            return token;
        }
        let Some(background) = self.background else {
            // No member: a set that can never be lost.
            return token;
        };
        let watch = self.watch();
        let cancel = token.clone();
        let runtime =
            tokio::runtime::Handle::try_current().unwrap_or_else(|_| background.handle().clone());
        runtime.spawn(async move {
            tokio::select! {
                lost = watch => {
                    if lost {
                        cancel.cancel();
                    }
                }
                // The holder dropped every token it was given: nobody is listening.
                _ = cancel.cancelled() => {}
            }
        });
        token
    }
}
