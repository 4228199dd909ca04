//! How a client reaches an etcd cluster: one gRPC client (etcd-client) on the client's own
//! runtime, the client's session lease and its keepalives, what failures mean, and (in
//! [`watch`]) the watches the engine's subscription hub waits on.
//!
//! It knows no lock: the primitives build the transactions. What it keeps is the session
//! lease, because a lease is how etcd ties keys to a live client: every key a client
//! writes for a watchdog-mode holding is attached to it, and one keepalive renews them all.

mod leases;
mod members;
pub(crate) mod watch;

pub(crate) use leases::Renewed;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use tokio::runtime::Handle;
use tokio::time::Instant;

use crate::config::Config;
use crate::error::{Error, Result, StoreFailure};
use crate::transport::endpoint::EtcdSpec;
use crate::transport::on_runtime::{self, StoreAt};

/// The store's name in errors and logs.
pub(crate) const STORE: &str = "etcd";

/// How long past a request's limit its task may run before it counts as unanswered: the
/// members' tries stop at the limit and report the last failure themselves.
const LIMIT_SLACK: Duration = Duration::from_millis(50);

/// The link to one etcd cluster, shared by the client's calls, its renewals and its hub.
#[derive(Clone)]
pub(crate) struct EtcdLink {
    inner: Arc<Inner>,
}

struct Inner {
    members: members::Members,
    runtime: Handle,
    target: String,
    prefix: String,
    response_timeout: Duration,
    /// The session lease's length in whole seconds, as asked for: the watchdog timeout
    /// rounded up (etcd's TTLs are seconds; the server may grant more).
    session_ttl: i64,
    session: tokio::sync::Mutex<Option<Session>>,
    /// Keys on the session lease that must go although it is renewed (see
    /// [`leases`]).
    doomed: std::sync::Mutex<Vec<leases::Doomed>>,
}

/// The client's session lease, as last confirmed.
#[derive(Clone, Copy)]
pub(crate) struct Session {
    pub(crate) id: i64,
    /// When the request that last set its TTL (the grant, or a keepalive the server
    /// answered) was sent: the lease lasts at least `ttl` from then.
    pub(crate) confirmed_at: Instant,
    pub(crate) ttl: Duration,
}

impl EtcdLink {
    /// Connects on `runtime` (the client's), checks that the cluster answers within the
    /// connection timeout, and grants the session lease.
    pub(crate) async fn connect(
        spec: EtcdSpec,
        config: &Config,
        runtime: &Handle,
    ) -> Result<EtcdLink> {
        let target = spec.endpoints.join(",");
        let mut options = ConnectOptions::new()
            .with_connect_timeout(config.connection_timeout)
            .with_timeout(config.response_timeout)
            // A dead peer is noticed by HTTP/2 pings, not only by a request timing out.
            .with_keep_alive(Duration::from_secs(5), config.response_timeout)
            .with_require_leader(true)
            // etcd drops an auth token unused for --auth-token-ttl (5 min): a member's
            // client idle that long (the others answering) must sign in again, not fail
            // every call. etcd-client resends only the request the token was refused for.
            .with_auto_token_refresh(true);
        if let Some((user, password)) = spec.user.clone() {
            options = options.with_user(user, password);
        }
        let session_ttl = i64::try_from(config.watchdog_timeout.as_millis().div_ceil(1000))
            .unwrap_or(i64::MAX)
            .max(1);
        let link = EtcdLink {
            inner: Arc::new(Inner {
                members: members::Members::new(&spec.endpoints, options),
                runtime: runtime.clone(),
                target,
                prefix: spec.prefix,
                response_timeout: config.response_timeout,
                session_ttl,
                session: tokio::sync::Mutex::new(None),
                doomed: std::sync::Mutex::new(Vec::new()),
            }),
        };
        // The first request: the cluster answers (with a leader), and the session exists.
        match link.session_within(config.connection_timeout).await {
            Err(Error::Store {
                failure: StoreFailure::Connection,
                ..
            }) => Err(Error::ConnectTimeout {
                target: link.target().to_owned(),
                after: config.connection_timeout,
            }),
            Err(err) => Err(err),
            Ok(_) => {
                link.warn_if_stale_leader_renews().await;
                Ok(link)
            }
        }
    }

    /// Warns when the member answering runs an etcd that renews leases on a leader that
    /// has lost its leadership (etcd-io/etcd#15247, fixed in 3.4.25 and 3.5.8): a renewal
    /// a frozen old leader answers can make a holder trust its lease past the one the new
    /// leader keeps (docs/safety.md, etcd).
    async fn warn_if_stale_leader_renews(&self) {
        let Ok(status) = self
            .run(|mut client| async move { client.status().await })
            .await
        else {
            return;
        };
        let version = status.version().to_owned();
        let parts: Vec<u32> = version
            .split('.')
            .filter_map(|part| part.parse().ok())
            .collect();
        let fixed = match parts.as_slice() {
            [3, 4, patch, ..] => *patch >= 25,
            [3, 5, patch, ..] => *patch >= 8,
            [3, minor, ..] => *minor >= 6,
            [major, ..] => *major > 3,
            [] => true,
        };
        if !fixed {
            tracing::warn!(
                target = %self.inner.target,
                %version,
                "this etcd renews leases on a leader that lost its leadership (fixed in \
                 3.4.25 and 3.5.8): a holder may trust its lease past the new leader's; \
                 upgrade etcd (docs/safety.md)"
            );
        }
    }

    /// The endpoints, as errors name the store.
    pub(crate) fn target(&self) -> &str {
        &self.inner.target
    }

    /// A member's gRPC client, for a stream that outlives the response timeout (a
    /// watch): the preferred member's, or the next one that connects. Call it on the
    /// client's runtime.
    pub(crate) async fn streaming_client(&self) -> std::result::Result<Client, etcd_client::Error> {
        self.inner.members.streaming_client().await
    }

    /// The prefix every key distlock writes starts with.
    pub(crate) fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// Runs `work` on the client's runtime with a member's client, within the response
    /// timeout, on the next member after a member's failure (so `work` must be safe to
    /// run twice); its failure is classified for the caller.
    pub(crate) async fn run<T, F, Fut>(&self, work: F) -> Result<T>
    where
        F: Fn(Client) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>> + Send + 'static,
        T: Send + 'static,
    {
        self.run_within(self.inner.response_timeout, work).await
    }

    /// [`EtcdLink::run`], answering also whether an earlier send of `work` may have been
    /// applied before the one that answered: a guarded change answered "not done" may
    /// then have been done by that earlier send.
    pub(crate) async fn run_noting_resends<T, F, Fut>(&self, work: F) -> Result<(T, bool)>
    where
        F: Fn(Client) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>> + Send + 'static,
        T: Send + 'static,
    {
        self.call_within(self.inner.response_timeout, work).await
    }

    async fn run_within<T, F, Fut>(&self, limit: Duration, work: F) -> Result<T>
    where
        F: Fn(Client) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>> + Send + 'static,
        T: Send + 'static,
    {
        Ok(self.call_within(limit, work).await?.0)
    }

    async fn call_within<T, F, Fut>(&self, limit: Duration, work: F) -> Result<(T, bool)>
    where
        F: Fn(Client) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>> + Send + 'static,
        T: Send + 'static,
    {
        let at = StoreAt {
            store: STORE,
            target: &self.inner.target,
        };
        let inner = Arc::clone(&self.inner);
        let deadline = Instant::now() + limit;
        // The members' tries end at the deadline with the last member's error; the outer
        // limit only catches a try that overran it.
        let tried = async move { inner.members.call(deadline, &work).await };
        on_runtime::run(
            &self.inner.runtime,
            at,
            limit + LIMIT_SLACK,
            tried,
            classify,
        )
        .await
    }

    /// The session lease every watchdog-mode key is attached to: the current one, or a
    /// new one when there is none (the first acquisition, or the last one expired).
    pub(crate) async fn session(&self) -> Result<Session> {
        self.session_within(self.inner.response_timeout).await
    }

    async fn session_within(&self, limit: Duration) -> Result<Session> {
        let mut current = self.inner.session.lock().await;
        if let Some(mut session) = *current {
            // Renewed by the watchdog while it holds something; otherwise nothing keeps
            // it alive, and an acquisition must not count on a lease that may be gone:
            // past a third of its TTL it is confirmed first (or replaced).
            if session.confirmed_at.elapsed() < session.ttl / 3 {
                return Ok(session);
            }
            self.delete_doomed().await;
            let id = session.id;
            // A renewal answered in an older Raft term than a read confirmed after it may
            // come from a leader that lost its leadership (etcd before 3.4.25 / 3.5.8),
            // which the new leader never saw: not counted, and asked again (the second
            // goes where the first read went).
            let mut stale = false;
            for _ in 0..2 {
                let sent_at = Instant::now();
                let Some(term) = self
                    .run_within(limit, move |client| keep_alive_once(client, id))
                    .await?
                else {
                    // Expired: a new session lease below.
                    stale = false;
                    break;
                };
                if term >= self.cluster_term(limit).await? {
                    session.confirmed_at = sent_at;
                    *current = Some(session);
                    return Ok(session);
                }
                stale = true;
            }
            if stale {
                return Err(Error::Store {
                    store: STORE,
                    target: self.target().to_owned(),
                    failure: StoreFailure::Connection,
                    detail: "the session lease was renewed twice in an older Raft term than \
                             the cluster's (a leader change, or an old leader renewing on \
                             its own): not counted"
                        .into(),
                });
            }
            *current = None;
        }
        let sent_at = Instant::now();
        let ttl = self.inner.session_ttl;
        let granted = self
            .run_within(limit, move |mut client| async move {
                client.lease_grant(ttl, None).await
            })
            .await?;
        let session = Session {
            id: granted.id(),
            confirmed_at: sent_at,
            ttl: Duration::from_secs(granted.ttl().max(0).unsigned_abs()),
        };
        *current = Some(session);
        Ok(session)
    }

    /// The cluster's Raft term, from a linearizable read (confirmed by a majority) of a
    /// key under the prefix, where the client's user has rights.
    pub(super) async fn cluster_term(&self, limit: Duration) -> Result<u64> {
        let key = self.prefix().to_owned();
        let read = self
            .run_within(limit, move |mut client| {
                let key = key.clone();
                async move {
                    client
                        .get(key, Some(etcd_client::GetOptions::new().with_count_only()))
                        .await
                }
            })
            .await?;
        Ok(read.header().map_or(0, |header| header.raft_term()))
    }

    /// Forgets session lease `id`, which the cluster said it does not know (it expired):
    /// the next acquisition grants a new one.
    pub(crate) async fn session_gone(&self, id: i64) {
        let mut current = self.inner.session.lock().await;
        if current.is_some_and(|session| session.id == id) {
            *current = None;
        }
    }

    /// A lease of its own for a fixed-lease holding: `lease` rounded up to whole seconds.
    /// Answers its id.
    pub(crate) async fn grant(&self, lease: Duration) -> Result<i64> {
        let ttl = i64::try_from(lease.as_millis().div_ceil(1000))
            .unwrap_or(i64::MAX)
            .max(1);
        let granted = self
            .run(move |mut client| async move { client.lease_grant(ttl, None).await })
            .await?;
        Ok(granted.id())
    }

    /// Revokes `lease` (its keys go with it). Best effort: a lease not revoked expires.
    pub(crate) async fn revoke(&self, lease: i64) {
        if let Err(err) = self
            .run(move |mut client| async move { client.lease_revoke(lease).await })
            .await
        {
            tracing::debug!(error = %err, lease, "could not revoke a lease; it expires by itself");
        }
    }
}

/// One keepalive of lease `id`: the Raft term of the member that renewed it while the
/// lease lives (its TTL is set again to the length it was granted with), `None` once it
/// has expired.
///
/// The term is read from a second keepalive on the same stream (etcd-client keeps the
/// first answer's header): a renewal answered by a leader that lost its leadership
/// without knowing it (etcd before 3.4.25 and 3.5.8) carries an older term than a read
/// confirmed by the cluster afterwards, which is how the renewal tells it apart.
pub(super) async fn keep_alive_once(
    mut client: Client,
    id: i64,
) -> std::result::Result<Option<u64>, etcd_client::Error> {
    // Opening the stream sends the first keepalive and reads its answer; an expired lease
    // (TTL 0) is reported as this error.
    let (mut keeper, mut answers) = match client.lease_keep_alive(id).await {
        Ok(opened) => opened,
        Err(etcd_client::Error::LeaseKeepAliveError(reason)) if reason.contains("not found") => {
            return Ok(None)
        }
        Err(err) => return Err(err),
    };
    keeper.keep_alive().await?;
    match answers.message().await? {
        Some(answer) if answer.ttl() > 0 => {
            Ok(Some(answer.header().map_or(0, |header| header.raft_term())))
        }
        Some(_) => Ok(None),
        None => Err(etcd_client::Error::LeaseKeepAliveError(
            "the keepalive stream ended without an answer".into(),
        )),
    }
}

/// Whether `err` says a lease the request named is gone.
pub(crate) fn is_lease_gone(err: &Error) -> bool {
    matches!(err, Error::Store { store: STORE, detail, .. } if detail.contains("lease not found"))
}

/// What an etcd-client error means for the caller: the connection or the cluster's state
/// (try again: the request may or may not have run), a missing right, or a refusal of the
/// request itself.
pub(crate) fn classify(target: &str, err: etcd_client::Error) -> Error {
    use etcd_client::Error as E;
    // gRPC's status codes (fixed by the gRPC specification).
    const CANCELLED: i32 = 1;
    const UNKNOWN: i32 = 2;
    const DEADLINE_EXCEEDED: i32 = 4;
    const PERMISSION_DENIED: i32 = 7;
    const RESOURCE_EXHAUSTED: i32 = 8;
    const ABORTED: i32 = 10;
    const INTERNAL: i32 = 13;
    const UNAVAILABLE: i32 = 14;
    const UNAUTHENTICATED: i32 = 16;
    let failure = match &err {
        E::GRpcStatus(status) => match i32::from(status.code()) {
            PERMISSION_DENIED | UNAUTHENTICATED => StoreFailure::PermissionDenied,
            CANCELLED | UNKNOWN | DEADLINE_EXCEEDED | RESOURCE_EXHAUSTED | ABORTED | INTERNAL
            | UNAVAILABLE => StoreFailure::Connection,
            _ => StoreFailure::Request,
        },
        E::TransportError(_)
        | E::IoError(_)
        | E::WatchError(_)
        | E::LeaseKeepAliveError(_)
        | E::EndpointError(_) => StoreFailure::Connection,
        _ => StoreFailure::Request,
    };
    let detail = match (&err, failure) {
        (E::GRpcStatus(status), StoreFailure::PermissionDenied) => format!(
            "{} ({:?}); grant the user the rights listed in distlock's docs/safety.md",
            status.message(),
            status.code()
        ),
        (E::GRpcStatus(status), _) => format!("{} ({:?})", status.message(), status.code()),
        _ => err.to_string(),
    };
    Error::Store {
        store: STORE,
        target: target.to_owned(),
        failure,
        detail,
    }
}
