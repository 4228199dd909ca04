//! The cluster's members, each reached on a connection of its own, and the choice of the
//! member a request goes to.
//!
//! etcd-client balances one channel over every endpoint, and keeps sending to a member
//! that is dead (its connections refused) or cut off (its connection open, nothing coming
//! back): a third of a 3-member cluster's requests then fail, and a lease renewal that
//! lands there is lost although a majority answers. Here each member has a client of its
//! own, requests go to one preferred member, and a request that meets a member's failure
//! (no connection, no answer within its share of the limit, no leader) is sent to the next
//! member, until the caller's limit. The member that answered becomes the preferred one,
//! so a failed member costs one try, not one in three requests.
//!
//! Sending a request again is safe because every request distlock makes is idempotent or
//! guarded by a compare (see `primitives/lock/etcd.rs`); the few whose answer reads
//! differently on a second try count their tries.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use tokio::time::Instant;

/// The shortest share of a request's limit one member gets before the next is tried.
const SHORTEST_TRY: Duration = Duration::from_millis(100);
/// The longest pause before the members are tried again, all having failed (an election
/// takes about a second).
const LONGEST_PAUSE: Duration = Duration::from_millis(200);

/// Every member of the cluster, as the URL named them.
pub(super) struct Members {
    members: Vec<Member>,
    options: ConnectOptions,
    /// The member requests go to first: the last one that answered.
    preferred: AtomicUsize,
}

struct Member {
    endpoint: String,
    /// Connected on first use; a member down at connect time is connected later.
    client: tokio::sync::Mutex<Option<Client>>,
}

impl Members {
    pub(super) fn new(endpoints: &[String], options: ConnectOptions) -> Members {
        Members {
            members: endpoints
                .iter()
                .map(|endpoint| Member {
                    endpoint: endpoint.clone(),
                    client: tokio::sync::Mutex::new(None),
                })
                .collect(),
            options,
            preferred: AtomicUsize::new(0),
        }
    }

    /// Member `index`'s client, connected now if it was not yet. Call it on the client's
    /// runtime: a channel's tasks run where it is made.
    async fn client_of(&self, index: usize) -> Result<Client, etcd_client::Error> {
        let member = &self.members[index];
        let mut slot = member.client.lock().await;
        if let Some(client) = slot.as_ref() {
            return Ok(client.clone());
        }
        let client =
            Client::connect([member.endpoint.as_str()], Some(self.options.clone())).await?;
        *slot = Some(client.clone());
        Ok(client)
    }

    /// The preferred member's client, or the next one that connects: for a stream (a
    /// watch) that outlives a request's limit.
    pub(super) async fn streaming_client(&self) -> Result<Client, etcd_client::Error> {
        let first = self.preferred.load(Ordering::Relaxed);
        let mut last = None;
        for step in 0..self.members.len() {
            let index = (first + step) % self.members.len();
            match self.client_of(index).await {
                Ok(client) => return Ok(client),
                Err(err) => last = Some(err),
            }
        }
        Err(last.unwrap_or_else(|| etcd_client::Error::InvalidArgs("no endpoints".into())))
    }

    /// Runs `work` with a member's client until one answers, or until `deadline`: the
    /// preferred member first, then each next one on a member's failure, in rounds with a
    /// pause between them. A failure of the request itself (a compare's refusal is an
    /// answer; a missing right, an unknown lease) ends it at once.
    ///
    /// Answers, with the answer, whether an earlier try may have been applied (it timed
    /// out, or broke after it may have been sent): a caller that reads the answer of a
    /// guarded change ("the key was not there") must then allow that its own earlier
    /// try made it so.
    pub(super) async fn call<T, F, Fut>(
        &self,
        deadline: Instant,
        work: &F,
    ) -> Result<(T, bool), etcd_client::Error>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let count = self.members.len();
        let mut pause = Duration::from_millis(10);
        let mut maybe_applied = false;
        loop {
            let mut last = None;
            for _ in 0..count {
                let index = self.preferred.load(Ordering::Relaxed) % count;
                let left = deadline.saturating_duration_since(Instant::now());
                // Each member gets a share of what is left, the last try all of it: a
                // member cut off must not spend the whole limit.
                let share = if count == 1 {
                    left
                } else {
                    (left / 3).max(SHORTEST_TRY).min(left)
                };
                let tried = tokio::time::timeout(share, async {
                    let client = self.client_of(index).await?;
                    work(client).await
                })
                .await;
                let err = match tried {
                    Ok(Ok(answer)) => return Ok((answer, maybe_applied)),
                    Ok(Err(err)) if !is_member_failure(&err) => return Err(err),
                    Ok(Err(err)) => {
                        maybe_applied |= !surely_not_applied(&err);
                        err
                    }
                    Err(_) => {
                        maybe_applied = true;
                        etcd_client::Error::IoError(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!(
                                "member {} gave no answer within {share:?}",
                                self.members[index].endpoint
                            ),
                        ))
                    }
                };
                // The next request goes to the next member, unless another request
                // moved on already.
                let _ = self.preferred.compare_exchange(
                    index,
                    (index + 1) % count,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
                tracing::debug!(member = %self.members[index].endpoint, error = %err, "an etcd member failed a request; trying the next");
                last = Some(err);
                if Instant::now() >= deadline {
                    break;
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(last.unwrap_or_else(|| {
                    etcd_client::Error::IoError(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no member answered in time",
                    ))
                }));
            }
            tokio::time::sleep(pause.min(left)).await;
            pause = (pause * 2).min(LONGEST_PAUSE);
        }
    }
}

/// Whether `err` says the request never reached the cluster: no connection to the
/// member, or a member without a leader (refused before it was proposed).
fn surely_not_applied(err: &etcd_client::Error) -> bool {
    const UNAVAILABLE: i32 = 14;
    let text = match err {
        etcd_client::Error::GRpcStatus(status) if i32::from(status.code()) == UNAVAILABLE => {
            status.message().to_owned()
        }
        etcd_client::Error::TransportError(err) => err.to_string(),
        _ => return false,
    };
    let text = text.to_ascii_lowercase();
    ["no leader", "tcp connect error", "connection refused"]
        .iter()
        .any(|refusal| text.contains(refusal))
}

/// Whether `err` is a member's failure (another member may answer) rather than the
/// request's: no connection, a broken one, a timeout, no leader, a member shutting down.
fn is_member_failure(err: &etcd_client::Error) -> bool {
    use etcd_client::Error as E;
    // gRPC's status codes (fixed by the gRPC specification).
    const CANCELLED: i32 = 1;
    const UNKNOWN: i32 = 2;
    const DEADLINE_EXCEEDED: i32 = 4;
    const ABORTED: i32 = 10;
    const INTERNAL: i32 = 13;
    const UNAVAILABLE: i32 = 14;
    match err {
        E::GRpcStatus(status) => matches!(
            i32::from(status.code()),
            CANCELLED | UNKNOWN | DEADLINE_EXCEEDED | ABORTED | INTERNAL | UNAVAILABLE
        ),
        // A keepalive or watch stream that broke (an expired lease is answered, not an
        // error: see `keep_alive_once`).
        E::TransportError(_)
        | E::IoError(_)
        | E::EndpointError(_)
        | E::LeaseKeepAliveError(_)
        | E::WatchError(_) => true,
        _ => false,
    }
}
