//! How a client reaches a ZooKeeper ensemble: one session (zookeeper-client) opened on
//! the client's own runtime, replaced by a new one when the ensemble expires it, what
//! failures mean, and (in [`watch`]) the watches the engine's subscription hub waits on.
//!
//! It knows no lock: the primitives name the nodes. What it keeps is the session, because
//! a session is how ZooKeeper ties nodes to a live client: every ephemeral node a client
//! creates lives exactly as long as the session that created it, and the session lives as
//! long as the ensemble hears from the client at least once per negotiated timeout.

pub(crate) mod watch;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::time::Instant;
use zookeeper_client::Client;

use crate::config::Config;
use crate::error::{Error, Result, StoreFailure};
use crate::transport::endpoint::ZkSpec;
use crate::transport::on_runtime::{self, StoreAt};

/// The store's name in errors and logs.
pub(crate) const STORE: &str = "ZooKeeper";

/// The link to one ZooKeeper ensemble, shared by the client's calls, its renewals and its
/// hub.
#[derive(Clone)]
pub(crate) struct ZkLink {
    inner: Arc<Inner>,
}

struct Inner {
    runtime: Handle,
    /// `host:port,host:port`, as zookeeper-client takes it (and errors name the store).
    target: String,
    prefix: String,
    response_timeout: Duration,
    connection_timeout: Duration,
    /// The session timeout asked for: the watchdog timeout.
    asked: Duration,
    /// The current session; replaced once the ensemble expired it.
    session: tokio::sync::Mutex<Client>,
}

impl ZkLink {
    /// Opens a session on `runtime` (the client's) within the connection timeout, asking
    /// for the watchdog timeout as the session timeout, and creates the prefix node if
    /// missing.
    pub(crate) async fn connect(spec: ZkSpec, config: &Config, runtime: &Handle) -> Result<ZkLink> {
        let target = spec.hosts.join(",");
        let asked = config.watchdog_timeout;
        let client = open_session(
            runtime,
            &target,
            asked,
            config.connection_timeout,
            config.response_timeout,
        )
        .await?;
        let link = ZkLink {
            inner: Arc::new(Inner {
                runtime: runtime.clone(),
                target,
                prefix: spec.prefix,
                response_timeout: config.response_timeout,
                connection_timeout: config.connection_timeout,
                asked,
                session: tokio::sync::Mutex::new(client),
            }),
        };
        let prefix = link.inner.prefix.clone();
        link.run(move |client| async move {
            let persistent = zookeeper_client::CreateMode::Persistent
                .with_acls(zookeeper_client::Acls::anyone_all());
            client.mkdir(&prefix, &persistent).await
        })
        .await?;
        Ok(link)
    }

    /// The servers, as errors name the store.
    pub(crate) fn target(&self) -> &str {
        &self.inner.target
    }

    /// The node every lock's node lives under (no trailing `/`).
    pub(crate) fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The current session, or a new one when the ensemble expired it (or it was closed):
    /// the nodes of an expired session are gone, so later acquisitions need a live one.
    pub(crate) async fn client(&self) -> Result<Client> {
        let mut session = self.inner.session.lock().await;
        if !session.state().is_terminated() {
            return Ok(session.clone());
        }
        let fresh = open_session(
            &self.inner.runtime,
            &self.inner.target,
            self.inner.asked,
            self.inner.connection_timeout,
            self.inner.response_timeout,
        )
        .await?;
        tracing::warn!(
            target = %self.inner.target,
            old = %session.session_id(),
            new = %fresh.session_id(),
            "the ZooKeeper session expired; a new one serves later acquisitions"
        );
        *session = fresh.clone();
        Ok(fresh)
    }

    /// The current session's id, without waiting (0 while another task replaces it).
    pub(crate) fn session_id(&self) -> i64 {
        self.inner
            .session
            .try_lock()
            .map_or(0, |session| session.session_id().0)
    }

    /// The session timeout a holding may count on from a request its session answered:
    /// the watchdog timeout, which the negotiated timeout was checked to cover.
    pub(crate) fn lease(&self) -> Duration {
        self.inner.asked
    }

    /// Runs `work` on the client's runtime with the current session, within the response
    /// timeout; its failure is classified for the caller.
    pub(crate) async fn run<T, F, Fut>(&self, work: F) -> Result<T>
    where
        F: FnOnce(Client) -> Fut + Send + 'static,
        Fut: Future<Output = std::result::Result<T, zookeeper_client::Error>> + Send + 'static,
        T: Send + 'static,
    {
        let client = self.client().await?;
        self.run_on(client, work).await
    }

    /// [`run`](Self::run) on a given session (the one an acquisition's node belongs to).
    pub(crate) async fn run_on<T, F, Fut>(&self, client: Client, work: F) -> Result<T>
    where
        F: FnOnce(Client) -> Fut + Send + 'static,
        Fut: Future<Output = std::result::Result<T, zookeeper_client::Error>> + Send + 'static,
        T: Send + 'static,
    {
        let at = StoreAt {
            store: STORE,
            target: &self.inner.target,
        };
        on_runtime::run(
            &self.inner.runtime,
            at,
            self.inner.response_timeout,
            work(client),
            classify,
        )
        .await
    }

    /// Whether each node in `paths` still exists and belongs to the current session, in
    /// one sync and one multi-read: the renewal of the holdings on those nodes. The session itself is
    /// kept alive by zookeeper-client's heartbeats; an answer here proves it was alive
    /// when the request was sent.
    pub(crate) async fn still_held(&self, paths: &[Arc<str>]) -> Result<Vec<bool>> {
        let client = self.client().await?;
        let session = client.session_id().0;
        let paths: Vec<String> = paths.iter().map(|path| path.to_string()).collect();
        let count = paths.len();
        let found = self
            .run_on(client, move |client| async move {
                // A server cut off from the leader still answers reads (for up to
                // syncLimit ticks) while the leader hears nothing of this session: a
                // sync goes through the leader, so a server that cannot reach it fails
                // the renewal instead of vouching for a session the leader may expire.
                if let Some(first) = paths.first() {
                    client.sync(first).await?;
                }
                let mut reader = client.new_multi_reader();
                for path in &paths {
                    reader.add_get_data(path)?;
                }
                reader.commit().await
            })
            .await?;
        let mut answers: Vec<bool> = found
            .into_iter()
            .map(|result| match result {
                zookeeper_client::MultiReadResult::Data { stat, .. } => {
                    stat.ephemeral_owner == session
                }
                _ => false,
            })
            .collect();
        answers.resize(count, false);
        Ok(answers)
    }
}

impl ZkLink {
    /// Deletes, `after` from now, the children of `parent` whose names start with
    /// `prefix`, as long as session `session` (theirs, when they are ephemeral) is the
    /// current one, or whatever the session for persistent nodes (`None`); connection
    /// failures are waited out with backoff. For nodes no request managed to delete (a
    /// give-up or a release during a network blip): the session lives on with the
    /// client, and so would they, keeping the lock taken (a persistent fixed-lease node,
    /// until its lease ends).
    pub(crate) fn reap(
        &self,
        parent: String,
        prefix: String,
        session: Option<i64>,
        after: Duration,
    ) {
        let link = self.clone();
        self.inner.runtime.spawn(async move {
            tokio::time::sleep(after).await;
            let mut pause = Duration::from_millis(50);
            loop {
                let (parent, prefix) = (parent.clone(), prefix.clone());
                let reaped = link
                    .run(move |client| async move {
                        if session.is_some_and(|session| client.session_id().0 != session) {
                            // Gone with their session.
                            return Ok(());
                        }
                        let children = match client.list_children(&parent).await {
                            Ok(children) => children,
                            Err(zookeeper_client::Error::NoNode) => return Ok(()),
                            Err(err) => return Err(err),
                        };
                        for child in children.iter().filter(|child| child.starts_with(&prefix)) {
                            match client.delete(&format!("{parent}/{child}"), None).await {
                                Ok(()) | Err(zookeeper_client::Error::NoNode) => {}
                                Err(err) => return Err(err),
                            }
                        }
                        Ok(())
                    })
                    .await;
                match reaped {
                    Ok(()) => return,
                    Err(err) if err.is_connection_error() => {
                        tracing::debug!(error = %err, "a node left behind could not be deleted yet; trying again");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(2));
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, "a node left behind could not be deleted; the lock stays taken until this client's session ends");
                        return;
                    }
                }
            }
        });
    }
}

/// Opens a session: at most `connect_within` for the ensemble to answer. A session task
/// runs on `runtime`, where zookeeper-client spawns it. A session the ensemble grants for
/// less than `session_timeout` is refused: every holding counts on that long.
async fn open_session(
    runtime: &Handle,
    target: &str,
    session_timeout: Duration,
    connect_within: Duration,
    response_timeout: Duration,
) -> Result<Client> {
    let connector = Client::connector()
        .with_session_timeout(session_timeout)
        // A silent server is given up for another within the response timeout (and
        // never later than zookeeper-client's default, 2/5 of the session timeout).
        .with_connection_timeout(response_timeout.min(session_timeout * 2 / 5))
        .with_fail_eagerly();
    let cluster = target.to_owned();
    let connecting = runtime.spawn(async move {
        let deadline = tokio::time::Instant::now() + connect_within;
        // With fail_eagerly, a pass over servers that all refuse ends at once; the
        // ensemble may be starting, so passes are tried again until the deadline.
        let mut pause = Duration::from_millis(50);
        loop {
            let attempt =
                tokio::time::timeout_at(deadline, connector.clone().connect(&cluster)).await;
            match attempt {
                Ok(Err(zookeeper_client::Error::NoHosts)) if Instant::now() + pause < deadline => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                other => return other,
            }
        }
    });
    match connecting.await {
        Ok(Ok(Ok(client))) => {
            let negotiated = client.session_timeout();
            if negotiated < session_timeout {
                // The ensemble keeps a session for less than the watchdog timeout (its
                // maxSessionTimeout): a lock would be freed by the ensemble before its
                // holder stops trusting it. The session is closed as the client drops.
                return Err(Error::InvalidConfig {
                    what: "watchdog_timeout",
                    reason: format!(
                        "is {session_timeout:?}, and this ZooKeeper ensemble grants sessions \
                         of at most {negotiated:?} (its maxSessionTimeout): a lock would be \
                         freed by the ensemble before its holder stops trusting it; set the \
                         watchdog timeout to {negotiated:?} or less, or raise \
                         maxSessionTimeout"
                    ),
                });
            }
            Ok(client)
        }
        Ok(Ok(Err(err))) => Err(match err {
            zookeeper_client::Error::NoHosts | zookeeper_client::Error::Timeout => {
                Error::ConnectTimeout {
                    target: target.to_owned(),
                    after: connect_within,
                }
            }
            other => classify(target, other),
        }),
        Ok(Err(_elapsed)) => Err(Error::ConnectTimeout {
            target: target.to_owned(),
            after: connect_within,
        }),
        Err(err) => Err(Error::Runtime(std::io::Error::other(err.to_string()))),
    }
}

/// What a zookeeper-client error means for the caller: the connection or the session
/// (try again: the request may or may not have run), a missing right, or a refusal of
/// the request itself.
pub(crate) fn classify(target: &str, err: zookeeper_client::Error) -> Error {
    use zookeeper_client::Error as E;
    let failure = match &err {
        E::NoAuth | E::AuthFailed | E::InvalidAcl => StoreFailure::PermissionDenied,
        E::ConnectionLoss
        | E::SessionExpired
        | E::SessionMoved
        | E::Timeout
        | E::NoHosts
        | E::ClientClosed
        | E::Throttled
        | E::NotReadOnly
        // zookeeper-client's own failures of the connection under a request ("no
        // response from connection in …", an I/O error): the server's refusals all have
        // variants of their own.
        | E::Custom(_) => StoreFailure::Connection,
        _ => StoreFailure::Request,
    };
    let detail = match failure {
        StoreFailure::PermissionDenied => format!(
            "{err}; the nodes under the prefix must let this client create, read, write and \
             delete (distlock's docs/safety.md)"
        ),
        _ => err.to_string(),
    };
    Error::Store {
        store: STORE,
        target: target.to_owned(),
        failure,
        detail,
    }
}
