//! The hub's etcd connection: what a waiter or a holder waits for, as etcd watches, in the
//! shape the hub takes from Redis pub/sub ([`Sink`](crate::transport::pubsub::Sink),
//! [`Events`](crate::transport::pubsub::Events)).
//!
//! A topic names a key and what to wait for:
//!
//! - `first:<key>`: until no key under the key's queue (the key up to its last NUL byte)
//!   was created before it (for a shared key, [`SHARED`], no exclusive key): a waiter's
//!   turn. Only its predecessor is watched, so a release wakes the next waiter alone,
//!   never the whole queue;
//! - `gone:<key>`: until the key is deleted: a holder listening for a force-unlock;
//! - `fits:<key>`: whenever the permits asked by the keys of a permit semaphore's queue
//!   created before it, plus its own, fit the semaphore's total ([`permits_fit`]),
//!   answered again at each change while it is followed. Any release ahead, or a new
//!   total, may let it in, so it watches the whole queue and the total: a herd bounded
//!   by the semaphore's own waiters.
//!
//! Each topic is a task that reads the state first and then watches from the revision it
//! read, so a change between the read and the watch is never missed; after a broken watch
//! it reads again. A topic is answered once (a message `0` on it), then its task ends.

use std::collections::HashMap;
use std::time::Duration;

use etcd_client::{
    EventType, GetOptions, KeyValue, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
    WatchFilterType, WatchOptions,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::EtcdLink;
use crate::error::Result;

/// The sending half: start and stop following topics, and a health check.
pub(crate) struct EtcdSink {
    link: EtcdLink,
    following: HashMap<String, CancellationToken>,
    answers: mpsc::UnboundedSender<(String, Vec<u8>)>,
}

/// The topics' answers.
pub(crate) struct EtcdEvents {
    answers: mpsc::UnboundedReceiver<(String, Vec<u8>)>,
}

impl Drop for EtcdSink {
    fn drop(&mut self) {
        for stop in self.following.values() {
            stop.cancel();
        }
    }
}

/// Opens the hub's side (on the client's runtime, where the hub runs). Fails if the
/// cluster does not answer.
pub(crate) async fn open(link: &EtcdLink) -> Result<(EtcdSink, EtcdEvents)> {
    link.run(|mut client| async move { client.status().await })
        .await?;
    let (answers, received) = mpsc::unbounded_channel();
    Ok((
        EtcdSink {
            link: link.clone(),
            following: HashMap::new(),
            answers,
        },
        EtcdEvents { answers: received },
    ))
}

impl EtcdSink {
    /// Follows (`on`) or stops following `topics`. A topic is followed from its state
    /// now, so following it is confirmed at once.
    pub(crate) async fn set(&mut self, topics: &[String], on: bool) -> Result<()> {
        for topic in topics {
            if !on {
                if let Some(stop) = self.following.remove(topic) {
                    stop.cancel();
                }
                continue;
            }
            if self.following.contains_key(topic) {
                continue;
            }
            let stop = CancellationToken::new();
            self.following.insert(topic.clone(), stop.clone());
            let (link, topic, answers) = (self.link.clone(), topic.clone(), self.answers.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = stop.cancelled() => {}
                    () = follow(&link, &topic, &answers) => {}
                }
            });
        }
        Ok(())
    }

    /// True if the cluster answers within `timeout`.
    pub(crate) async fn healthy(&mut self, timeout: Duration) -> bool {
        let asked = self
            .link
            .run(|mut client| async move { client.status().await });
        matches!(tokio::time::timeout(timeout, asked).await, Ok(Ok(_)))
    }
}

impl EtcdEvents {
    /// The next answered topic as `(topic, payload)`.
    pub(crate) async fn next(&mut self) -> Option<(String, Vec<u8>)> {
        self.answers.recv().await
    }
}

/// What a topic waits for next.
enum Step {
    /// It happened.
    Answer,
    /// A waiter's key is gone (read at revision `after`): answered, as the waiter must
    /// place it again; the topic then follows the key placed again.
    Gone { key: Vec<u8>, after: i64 },
    /// It happens when `key` is deleted, at a revision after `after`.
    DeletionOf { key: Vec<u8>, after: i64 },
    /// It may happen at any change of a key in `[start, end)` after revision `after`;
    /// `holds` says it holds now: answered, and followed on all the same (an attempt may
    /// still find it does not, the state having changed since).
    ChangeIn {
        start: Vec<u8>,
        end: Vec<u8>,
        after: i64,
        holds: bool,
    },
}

/// Answers the topic (a message `0` on `answers`) once its condition holds, and returns.
/// A waiter whose key was gone is answered and followed on: once it placed the key again
/// (behind others, maybe), its new predecessor's release answers it too. Failures (a
/// leader election, a broken connection) are waited out with backoff: the state is read
/// again each time.
async fn follow(link: &EtcdLink, topic: &str, answers: &mpsc::UnboundedSender<(String, Vec<u8>)>) {
    let answer = || answers.send((topic.to_owned(), b"0".to_vec())).is_ok();
    let mut pause = Duration::from_millis(20);
    loop {
        let step = match topic.split_once(':') {
            Some(("first", key)) => first_step(link, key.as_bytes().to_vec()).await,
            Some(("gone", key)) => gone_step(link, key.as_bytes().to_vec()).await,
            Some(("fits", key)) => fits_step(link, key.as_bytes().to_vec()).await,
            _ => Ok(Step::Answer),
        };
        match step {
            Ok(Step::Answer) => {
                answer();
                return;
            }
            Ok(Step::Gone { key, after }) => {
                if !answer() {
                    return;
                }
                if put(link, key, after).await {
                    pause = Duration::from_millis(20);
                    continue;
                }
            }
            Ok(Step::DeletionOf { key, after }) => {
                if deleted(link, key, after).await {
                    pause = Duration::from_millis(20);
                    continue;
                }
            }
            Ok(Step::ChangeIn {
                start,
                end,
                after,
                holds,
            }) => {
                if holds && !answer() {
                    return;
                }
                if changed_in(link, (start, end), after).await {
                    pause = Duration::from_millis(20);
                    continue;
                }
            }
            Err(err) => {
                tracing::debug!(error = %err, "an etcd watch could not read its state; trying again");
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// What follows a queue's NUL in a shared holding's key (an `RwLock` reader's), before
/// its owner: exclusive keys (`<queue><owner>`, an owner starting with a hex digit) sort
/// below every shared one.
pub(crate) const SHARED: &str = "\x7f";

/// `first:<key>`: answered when the key is gone or nothing older that it waits for is
/// left in its queue (any key; for a shared key, an exclusive one); otherwise the
/// deletion of its predecessor (the newest older such key).
async fn first_step(link: &EtcdLink, key: Vec<u8>) -> Result<Step> {
    let Some(end) = key.iter().rposition(|byte| *byte == 0) else {
        return Ok(Step::Answer);
    };
    let queue = key[..=end].to_vec();
    let shared = key.get(end + 1..end + 1 + SHARED.len()) == Some(SHARED.as_bytes());
    link.run(move |mut client| {
        let (key, queue) = (key.clone(), queue.clone());
        async move {
            let read = client.get(key.clone(), None).await?;
            let Some(own) = read.kvs().first() else {
                let after = read.header().map_or(0, |header| header.revision());
                return Ok(Step::Gone { key, after });
            };
            let older = if shared {
                let mut exclusive_end = queue.clone();
                exclusive_end.extend_from_slice(SHARED.as_bytes());
                GetOptions::new().with_range(exclusive_end)
            } else {
                GetOptions::new().with_prefix()
            };
            let older = older
                .with_max_create_revision(own.create_revision() - 1)
                .with_sort(SortTarget::Create, SortOrder::Descend)
                .with_limit(1)
                .with_keys_only();
            let before = client.get(queue, Some(older)).await?;
            let read_at = before.header().map_or(0, |header| header.revision());
            Ok(match before.kvs().first() {
                None => Step::Answer,
                Some(predecessor) => Step::DeletionOf {
                    key: predecessor.key().to_vec(),
                    after: read_at,
                },
            })
        }
    })
    .await
}

/// Whether a permit semaphore's waiter holds: its key, created at `own_revision`, is in
/// `queue` (the semaphore's keys, each valued with the permits it asks for), and the
/// permits of every key created before it plus its own fit `total` (the total's key).
/// The one rule both an acquisition and a waiter's watch apply. A key whose value is not
/// a count blocks everyone behind it rather than be counted as less than it may hold.
pub(crate) fn permits_fit(total: Option<&KeyValue>, queue: &[KeyValue], own_revision: i64) -> bool {
    let Some(total) = total.and_then(|total| count_of(total.value())) else {
        return false;
    };
    let mut ahead: i64 = 0;
    let mut own = None;
    for key in queue {
        let asked = count_of(key.value()).unwrap_or(i64::MAX);
        match key.create_revision().cmp(&own_revision) {
            std::cmp::Ordering::Less => ahead = ahead.saturating_add(asked),
            std::cmp::Ordering::Equal => own = Some(asked),
            std::cmp::Ordering::Greater => {}
        }
    }
    own.is_some_and(|own| ahead.saturating_add(own) <= total)
}

/// A count kept as decimal text.
pub(crate) fn count_of(value: &[u8]) -> Option<i64> {
    std::str::from_utf8(value).ok()?.trim().parse().ok()
}

/// `fits:<key>`: answered whenever the key's permits fit ([`permits_fit`]), and followed
/// on at every change of the semaphore's total or queue (`[total, queue end)`: the
/// total's key is the queue without its last NUL, and nothing else sorts between them).
/// Unlike a lock's first key, which stays first, a waiter that fitted may not fit when
/// its attempt looks (a total lowered in between): the topic must answer it again later.
async fn fits_step(link: &EtcdLink, key: Vec<u8>) -> Result<Step> {
    let Some(end) = key.iter().rposition(|byte| *byte == 0) else {
        return Ok(Step::Answer);
    };
    let queue = key[..=end].to_vec();
    let total = key[..end].to_vec();
    link.run(move |mut client| {
        let (key, queue, total) = (key.clone(), queue.clone(), total.clone());
        async move {
            let everyone = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend);
            let txn = Txn::new().and_then([
                TxnOp::get(key.clone(), None),
                TxnOp::get(total.clone(), None),
                TxnOp::get(queue.clone(), Some(everyone)),
            ]);
            let read = client.txn(txn).await?;
            let after = read.header().map_or(0, |header| header.revision());
            let got = |at: usize| match read.op_responses().get(at) {
                Some(TxnOpResponse::Get(got)) => got.kvs().to_vec(),
                _ => Vec::new(),
            };
            let Some(own) = got(0).first().map(KeyValue::create_revision) else {
                return Ok(Step::Gone { key, after });
            };
            let holds = permits_fit(got(1).first(), &got(2), own);
            let mut end = queue;
            if let Some(last) = end.last_mut() {
                *last += 1;
            }
            Ok(Step::ChangeIn {
                start: total,
                end,
                after,
                holds,
            })
        }
    })
    .await
}

/// `gone:<key>`: answered when the key is gone; otherwise its deletion.
async fn gone_step(link: &EtcdLink, key: Vec<u8>) -> Result<Step> {
    link.run(move |mut client| {
        let key = key.clone();
        async move {
            let own = client.get(key.clone(), None).await?;
            let read_at = own.header().map_or(0, |header| header.revision());
            Ok(if own.kvs().is_empty() {
                Step::Answer
            } else {
                Step::DeletionOf {
                    key,
                    after: read_at,
                }
            })
        }
    })
    .await
}

/// Watches `key` from the revision after `after` until it is deleted (true), or until the
/// watch fails (false: the caller reads the state again).
async fn deleted(link: &EtcdLink, key: Vec<u8>, after: i64) -> bool {
    changed(link, key, after, EventType::Delete).await
}

/// Watches `key` from the revision after `after` until it is written (true), or until the
/// watch fails (false).
async fn put(link: &EtcdLink, key: Vec<u8>, after: i64) -> bool {
    changed(link, key, after, EventType::Put).await
}

/// Watches the keys in `[start, end)` from the revision after `after` until any of them
/// changes (true), or until the watch fails (false: the caller reads the state again).
async fn changed_in(link: &EtcdLink, (start, end): (Vec<u8>, Vec<u8>), after: i64) -> bool {
    let Ok(mut client) = link.streaming_client().await else {
        return false;
    };
    let options = WatchOptions::new()
        .with_start_revision(after + 1)
        .with_range(end);
    let Ok(mut stream) = client.watch(start, Some(options)).await else {
        return false;
    };
    loop {
        match stream.message().await {
            Ok(Some(answer)) => {
                if answer.canceled() {
                    return false;
                }
                if !answer.events().is_empty() {
                    return true;
                }
            }
            _ => return false,
        }
    }
}

/// Watches `key` from the revision after `after` until an event of `kind` (true), or
/// until the watch fails (false: the caller reads the state again).
async fn changed(link: &EtcdLink, key: Vec<u8>, after: i64, kind: EventType) -> bool {
    let Ok(mut client) = link.streaming_client().await else {
        return false;
    };
    let filter = match kind {
        EventType::Put => WatchFilterType::NoDelete,
        EventType::Delete => WatchFilterType::NoPut,
    };
    let options = WatchOptions::new()
        .with_start_revision(after + 1)
        .with_filters([filter]);
    let Ok(mut stream) = client.watch(key, Some(options)).await else {
        return false;
    };
    loop {
        match stream.message().await {
            Ok(Some(answer)) => {
                if answer.canceled() {
                    return false;
                }
                if answer
                    .events()
                    .iter()
                    .any(|event| event.event_type() == kind)
                {
                    return true;
                }
            }
            _ => return false,
        }
    }
}
