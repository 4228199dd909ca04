//! The watchdog's renewals on etcd, and the keys that must go although the session lease
//! that carries them is renewed.
//!
//! Every watchdog-mode key of a client rides on its session lease, so one keepalive
//! renews them all. Two things follow, both handled here:
//!
//! - a keepalive says the *lease* lives, not that a key on it does: a key deleted by a
//!   force-unlock or by hand leaves the lease alive. A renewal therefore also reads, in
//!   one read-only transaction per batch, that each key is still the one it took;
//! - a key whose holding ended without its delete reaching the server (a release that
//!   failed, a waiter's give-up that failed, a lock left to expire) would live as long as
//!   the client renews anything. The link keeps such keys ("doomed") and deletes each one
//!   when it is due, before it renews the session lease again.

use std::sync::Arc;

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse};
use tokio::time::Instant;

use super::{keep_alive_once, EtcdLink};
use crate::error::{Error, Result, StoreFailure};

/// At most this many keys are checked in one transaction (etcd's default limit on a
/// transaction's operations is 128).
const KEYS_PER_CHECK: usize = 64;

/// What a holding's renewal names: the lease its key is on, and the key as it took it.
pub(crate) struct Renewed<'a> {
    pub(crate) lease: i64,
    pub(crate) key: &'a str,
    pub(crate) revision: i64,
}

impl Renewed<'_> {
    /// The renewal's owner string: `<lease hex>:<create revision>:<key>`.
    pub(crate) fn encode(&self) -> String {
        format!("{:x}:{}:{}", self.lease, self.revision, self.key)
    }
}

/// [`Renewed`], read back from its owner string.
fn decode(owner: &str) -> Option<(i64, i64, &str)> {
    let (lease, rest) = owner.split_once(':')?;
    let (revision, key) = rest.split_once(':')?;
    Some((
        i64::from_str_radix(lease, 16).ok()?,
        revision.parse().ok()?,
        key,
    ))
}

/// A key to delete once `due`, unless it was created at another revision (0: any); or,
/// with `recheck_until`, a key to look for at every renewal until then and delete if it
/// is there (a late copy of its creation, sent to a member that was slow to answer, may
/// write it again after it was deleted).
pub(super) struct Doomed {
    key: String,
    revision: i64,
    due: Instant,
    recheck_until: Option<Instant>,
}

impl EtcdLink {
    /// Leaves `key` (created at `revision`) to be deleted once `due`, before the session
    /// lease is renewed again after that.
    pub(crate) fn doom(&self, key: String, revision: i64, due: Instant) {
        self.doomed_list().push(Doomed {
            key,
            revision,
            due,
            recheck_until: None,
        });
    }

    /// Looks for `key` at every renewal for a session TTL and deletes it if it is there:
    /// for a key deleted after its creation was sent twice, whose first send may still be
    /// applied late and bring it back, where it would stay (on the renewed session lease)
    /// and block the lock's queue.
    pub(crate) fn watch_for_late_copy(&self, key: String) {
        let now = Instant::now();
        let window = std::time::Duration::from_secs(self.inner.session_ttl.unsigned_abs());
        self.doomed_list().push(Doomed {
            key,
            revision: 0,
            due: now,
            recheck_until: Some(now + window),
        });
    }

    /// When the session lease, as last confirmed, runs out on the server if nothing
    /// renews it: when a key left to expire would have gone.
    pub(crate) fn session_expiry(&self) -> Instant {
        match self.inner.session.try_lock() {
            Ok(session) => match *session {
                Some(session) => session.confirmed_at + session.ttl,
                None => Instant::now(),
            },
            // Being confirmed right now: a full TTL from now at most.
            Err(_) => {
                Instant::now()
                    + std::time::Duration::from_secs(self.inner.session_ttl.unsigned_abs())
            }
        }
    }

    fn doomed_list(&self) -> std::sync::MutexGuard<'_, Vec<Doomed>> {
        self.inner
            .doomed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Deletes the doomed keys that are due; one that cannot be deleted now stays for
    /// the next time.
    pub(super) async fn delete_doomed(&self) {
        let now = Instant::now();
        let due: Vec<Doomed> = {
            let mut doomed = self.doomed_list();
            let (due, later) = std::mem::take(&mut *doomed)
                .into_iter()
                .partition(|entry| entry.due <= now);
            *doomed = later;
            due
        };
        for entry in due {
            let gone = match entry.recheck_until {
                Some(_) => self.delete_if_there(&entry.key).await,
                None => self.delete_guarded(&entry.key, entry.revision).await,
            };
            match (gone, entry.recheck_until) {
                (Err(err), _) => {
                    tracing::debug!(error = %err, "could not delete a key left behind; trying again at the next renewal");
                    self.doomed_list().push(entry);
                }
                (Ok(()), Some(until)) if until > Instant::now() => self.doomed_list().push(entry),
                (Ok(()), _) => {}
            }
        }
    }

    /// Deletes `key` if it was created at `revision` (0: whatever its revision).
    async fn delete_guarded(&self, key: &str, revision: i64) -> Result<()> {
        let key = key.to_owned();
        self.run(move |mut client| {
            let guard = if revision > 0 {
                vec![Compare::create_revision(
                    key.clone(),
                    CompareOp::Equal,
                    revision,
                )]
            } else {
                Vec::new()
            };
            let txn = Txn::new()
                .when(guard)
                .and_then([TxnOp::delete(key.clone(), None)]);
            async move { client.txn(txn).await }
        })
        .await
        .map(drop)
    }

    /// Reads whether `key` is there (a read, so checking costs no Raft write), and
    /// deletes it if it is.
    async fn delete_if_there(&self, key: &str) -> Result<()> {
        let looked_for = key.to_owned();
        let found = self
            .run(move |mut client| {
                let key = looked_for.clone();
                async move {
                    client
                        .get(key, Some(GetOptions::new().with_count_only()))
                        .await
                }
            })
            .await?;
        if found.count() > 0 {
            tracing::debug!("a late copy of a waiter's placement wrote its key again; deleting it");
            self.delete_guarded(key, 0).await?;
        }
        Ok(())
    }

    /// Renews the holdings named by `renewed` (their renewal owners, [`Renewed`]): one
    /// keepalive per distinct lease, then a read of their keys. Answers, per entry,
    /// whether it is still held. A session lease found expired is dropped, so that the
    /// next acquisition grants a new one.
    pub(crate) async fn keep_alive(&self, renewed: &[Arc<str>]) -> Result<Vec<bool>> {
        self.delete_doomed().await;
        let sent_at = Instant::now();
        // Per lease: the term that renewed it, or None once it expired.
        let mut alive: Vec<(i64, Option<u64>)> = Vec::new();
        let mut answers = Vec::with_capacity(renewed.len());
        let mut to_check = Vec::new();
        for (index, owner) in renewed.iter().enumerate() {
            let Some((id, revision, key)) = decode(owner) else {
                answers.push(false);
                continue;
            };
            let known = alive
                .iter()
                .find(|(seen, _)| *seen == id)
                .map(|(_, ok)| *ok);
            let renewed_at_term = match known {
                Some(term) => term,
                None => {
                    let term = self.keep_alive_one(id).await?;
                    alive.push((id, term));
                    term
                }
            };
            if let Some(term) = renewed_at_term {
                to_check.push((index, key.to_owned(), revision, term));
            }
            answers.push(renewed_at_term.is_some());
        }
        for batch in to_check.chunks(KEYS_PER_CHECK) {
            let keys: Vec<(String, i64)> = batch
                .iter()
                .map(|(_, key, revision, _)| (key.clone(), *revision))
                .collect();
            let (present, read_at_term) = self.keys_present(keys).await?;
            if batch.iter().any(|(_, _, _, term)| *term < read_at_term) {
                // The keepalive was answered in an older term than this read, which the
                // cluster confirmed after it: maybe by a leader that had lost its
                // leadership (etcd-io/etcd#15247), whose renewal the new leader never
                // saw. Not counted; the next round renews on the new leader.
                return Err(Error::Store {
                    store: super::STORE,
                    target: self.target().to_owned(),
                    failure: StoreFailure::Connection,
                    detail: format!(
                        "a lease renewal was answered in Raft term {}, before the cluster's \
                         term {read_at_term}: not counted (a leader change, or an old leader \
                         renewing on its own; see docs/safety.md, etcd)",
                        batch.iter().map(|(_, _, _, term)| *term).min().unwrap_or(0)
                    ),
                });
            }
            for ((index, _, _, _), present) in batch.iter().zip(present) {
                answers[*index] = present;
            }
        }
        // Counted only now, past the term check: a later acquisition's deadline counts
        // from it.
        let mut session = self.inner.session.lock().await;
        if let Some(current) = session.as_mut() {
            if alive
                .iter()
                .any(|(id, term)| *id == current.id && term.is_some())
            {
                current.confirmed_at = current.confirmed_at.max(sent_at);
            }
        }
        Ok(answers)
    }

    /// One keepalive of lease `id`: the term that renewed it, or `None` once it expired
    /// (then, if it was the session's, the session is forgotten).
    async fn keep_alive_one(&self, id: i64) -> Result<Option<u64>> {
        let term = self.run(move |client| keep_alive_once(client, id)).await?;
        if term.is_some() {
            return Ok(term);
        }
        let mut session = self.inner.session.lock().await;
        match session.as_mut() {
            Some(current) if current.id == id => {
                *session = None;
            }
            _ => {}
        }
        Ok(term)
    }

    /// Whether each key is still there, created at its revision: one read-only
    /// transaction (all compares hold, or each key is read), linearizable, so it also
    /// answers the cluster's Raft term after it.
    async fn keys_present(&self, keys: Vec<(String, i64)>) -> Result<(Vec<bool>, u64)> {
        let count = keys.len();
        let asked = keys.clone();
        let answer = self
            .run(move |mut client| {
                let compares: Vec<Compare> = asked
                    .iter()
                    .map(|(key, revision)| {
                        Compare::create_revision(key.clone(), CompareOp::Equal, *revision)
                    })
                    .collect();
                let reads: Vec<TxnOp> = asked
                    .iter()
                    .map(|(key, _)| {
                        TxnOp::get(key.clone(), Some(GetOptions::new().with_keys_only()))
                    })
                    .collect();
                let txn = Txn::new().when(compares).or_else(reads);
                async move { client.txn(txn).await }
            })
            .await?;
        let term = answer.header().map_or(0, |header| header.raft_term());
        if answer.succeeded() {
            return Ok((vec![true; count], term));
        }
        let present = keys
            .iter()
            .zip(answer.op_responses())
            .map(|((_, revision), read)| match read {
                TxnOpResponse::Get(read) => read
                    .kvs()
                    .first()
                    .is_some_and(|kv| kv.create_revision() == *revision),
                _ => false,
            })
            .chain(std::iter::repeat(false))
            .take(count)
            .collect();
        Ok((present, term))
    }
}
