//! The hub's ZooKeeper connection: what a waiter or a holder waits for, as ZooKeeper
//! watches, in the shape the hub takes from Redis pub/sub
//! ([`Sink`](crate::transport::pubsub::Sink), [`Events`](crate::transport::pubsub::Events)).
//!
//! A topic names a node and what to wait for:
//!
//! - `first:<parent>/<node prefix>`: when the waiter's node (the child of `parent` whose
//!   name starts with the prefix) has no sibling it must wait for ([`waits_for`]: any, or
//!   for a shared node the exclusive ones) with a smaller sequence number (the digits
//!   after a node name's last `-`): a waiter's turn; or when it has no node (it
//!   must make one). Only its predecessor is watched, so a release wakes the next waiter
//!   alone, never the whole queue, and a waiter ahead that gives up wakes nobody: the
//!   watch moves to the new predecessor. Once answered, the topic is answered again at
//!   the next change of the queue, for a waiter that looked and must wait on;
//! - `gone:<path>`: when the node is deleted, or its session ends: a holder listening
//!   for a force-unlock or an expired session. Answered once.
//!
//! Each topic is a task that reads the state with a watch set in the same request (so a
//! change after the read is always delivered), and reads again after each event or
//! failure. An answer is a message `0` on the topic.

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zookeeper_client::{EventType, OneshotWatcher};

use super::ZkLink;
use crate::error::Result;

/// The sending half: start and stop following topics, and a health check.
pub(crate) struct ZkSink {
    link: ZkLink,
    following: HashMap<String, CancellationToken>,
    answers: mpsc::UnboundedSender<(String, Vec<u8>)>,
}

/// The topics' answers.
pub(crate) struct ZkEvents {
    answers: mpsc::UnboundedReceiver<(String, Vec<u8>)>,
}

impl Drop for ZkSink {
    fn drop(&mut self) {
        for stop in self.following.values() {
            stop.cancel();
        }
    }
}

/// Opens the hub's side (on the client's runtime, where the hub runs). Fails if the
/// ensemble does not answer.
pub(crate) async fn open(link: &ZkLink) -> Result<(ZkSink, ZkEvents)> {
    let prefix = link.prefix().to_owned();
    link.run(move |client| async move { client.check_stat(&prefix).await })
        .await?;
    let (answers, received) = mpsc::unbounded_channel();
    Ok((
        ZkSink {
            link: link.clone(),
            following: HashMap::new(),
            answers,
        },
        ZkEvents { answers: received },
    ))
}

impl ZkSink {
    /// Follows (`on`) or stops following `topics`. A topic is followed from its state
    /// now, so following it is confirmed at once.
    pub(crate) async fn set(&mut self, topics: &[String], on: bool) -> Result<()> {
        // Topics whose task answered and ended are forgotten, so that they can be
        // followed again.
        self.following.retain(|_, stop| !stop.is_cancelled());
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
                    () = follow(&link, &topic, &answers) => stop.cancel(),
                }
            });
        }
        Ok(())
    }

    /// True if the ensemble answers within `timeout`.
    pub(crate) async fn healthy(&mut self, timeout: Duration) -> bool {
        let prefix = self.link.prefix().to_owned();
        let asked = self
            .link
            .run(move |client| async move { client.check_stat(&prefix).await });
        matches!(tokio::time::timeout(timeout, asked).await, Ok(Ok(_)))
    }
}

impl ZkEvents {
    /// The next answered topic as `(topic, payload)`.
    pub(crate) async fn next(&mut self) -> Option<(String, Vec<u8>)> {
        self.answers.recv().await
    }
}

/// What a topic waits for next.
enum Step {
    /// It happened; for a queue, as its children were then (sorted; `None`: no queue).
    Answer(Option<Vec<String>>),
    /// It may have happened once this watch fires.
    Watch(OneshotWatcher),
    /// Read the state again at once.
    Again,
}

/// Answers the topic each time its condition holds; returns when it never will again.
/// Failures (a leader election, a broken connection) are waited out with backoff: the
/// state is read again each time.
async fn follow(link: &ZkLink, topic: &str, answers: &mpsc::UnboundedSender<(String, Vec<u8>)>) {
    let mut pause = Duration::from_millis(20);
    loop {
        let step = match topic.split_once(':') {
            Some(("first", node)) => first_step(link, node).await,
            Some(("gone", path)) => gone_step(link, path.to_owned()).await,
            _ => Ok(Step::Answer(None)),
        };
        match step {
            Ok(Step::Answer(seen)) => {
                if answers.send((topic.to_owned(), b"0".to_vec())).is_err() {
                    return;
                }
                let Some(("first", node)) = topic.split_once(':') else {
                    return;
                };
                // The waiter looks now; it may find it must wait on (its node was made
                // again, behind others): the next change of its queue is answered too,
                // and one that came before the watch was set is looked at at once.
                match queue_changed(link, node).await {
                    Ok((now, watcher)) => {
                        if now == seen {
                            watcher.changed().await;
                        }
                        pause = Duration::from_millis(20);
                        continue;
                    }
                    Err(err) => {
                        tracing::debug!(error = %err, "a ZooKeeper watch could not read its state; trying again");
                    }
                }
            }
            Ok(Step::Again) => continue,
            Ok(Step::Watch(watcher)) => {
                let event = watcher.changed().await;
                if event.event_type == EventType::Session && event.session_state.is_terminated() {
                    // The session ended: its nodes are gone, so whoever waits here must
                    // look again (a holder finds its node gone, a waiter makes another).
                    if answers.send((topic.to_owned(), b"0".to_vec())).is_err() {
                        return;
                    }
                }
                pause = Duration::from_millis(20);
                continue;
            }
            Err(err) => {
                tracing::debug!(error = %err, "a ZooKeeper watch could not read its state; trying again");
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// A watch on the children of a waiter's queue (`node` is `<parent>/<node prefix>`), and
/// the children it was set on (sorted; `None`: no queue, whose creation is watched).
async fn queue_changed(link: &ZkLink, node: &str) -> Result<(Option<Vec<String>>, OneshotWatcher)> {
    let parent = node
        .rsplit_once('/')
        .map_or("", |(parent, _)| parent)
        .to_owned();
    link.run(move |client| async move {
        match client.list_and_watch_children(&parent).await {
            Ok((mut children, watcher)) => {
                children.sort_unstable();
                Ok((Some(children), watcher))
            }
            // No queue at all: its creation is watched instead.
            Err(zookeeper_client::Error::NoNode) => {
                let (_, watcher) = client.check_and_watch_stat(&parent).await?;
                Ok((None, watcher))
            }
            Err(err) => Err(err),
        }
    })
    .await
}

/// A queued node that takes the lock alone (a `Lock`'s, an `RwLock` writer's):
/// `lock-<owner>-<sequence>`.
pub(crate) const EXCLUSIVE: &str = "lock-";

/// A queued node that shares the lock with the other shared ones (an `RwLock` reader's):
/// `read-<owner>-<sequence>`.
pub(crate) const SHARED: &str = "read-";

/// Whether the queued node `own` (its name, or the start of it) must wait for `other`, a
/// sibling queued ahead of it: an exclusive node waits for every node ahead, a shared one
/// for the exclusive ones only (Curator's shared lock recipe). Other children (fixed-lease
/// holdings) are not queued.
pub(crate) fn waits_for(own: &str, other: &str) -> bool {
    other.starts_with(EXCLUSIVE) || (other.starts_with(SHARED) && !own.starts_with(SHARED))
}

/// A fixed-lease holding's node, `held-<owner>` (not queued: it holds until its lease
/// ends or it is deleted).
pub(crate) const HELD: &str = "held-";

/// A shared fixed-lease holding's node (an `RwLock` reader's), `held-read-<owner>`.
pub(crate) const SHARED_HELD: &str = "held-read-";

/// Whether a waiter (`shared` or not) must wait for the fixed-lease holding `node` while
/// it is live: a shared waiter waits for exclusive holdings only.
pub(crate) fn waits_for_held(shared: bool, node: &str) -> bool {
    node.starts_with(HELD) && (!shared || !node.starts_with(SHARED_HELD))
}

/// The sequence number of a sequential node's name: the digits after its last `-`.
pub(crate) fn sequence_of(node: &str) -> Option<i64> {
    node.rsplit_once('-')
        .and_then(|(_, digits)| digits.parse().ok())
}

/// `first:<parent>/<node prefix>`: answered when the waiter has no node, or none of the
/// siblings it waits for has a smaller sequence and no fixed-lease holding it waits for
/// is there; otherwise an exists-watch on its predecessor (of those, the one with the
/// largest smaller sequence), or on such a holding.
async fn first_step(link: &ZkLink, node: &str) -> Result<Step> {
    let Some((parent, prefix)) = node.rsplit_once('/') else {
        return Ok(Step::Answer(None));
    };
    let (parent, prefix) = (parent.to_owned(), prefix.to_owned());
    link.run(move |client| async move {
        let mut children = match client.list_children(&parent).await {
            Ok(children) => children,
            Err(zookeeper_client::Error::NoNode) => return Ok(Step::Answer(None)),
            Err(err) => return Err(err),
        };
        children.sort_unstable();
        let Some(own) = children
            .iter()
            .filter(|child| child.starts_with(prefix.as_str()))
            .find_map(|child| sequence_of(child))
        else {
            return Ok(Step::Answer(Some(children)));
        };
        let predecessor = children
            .iter()
            .filter(|child| waits_for(&prefix, child))
            .filter_map(|child| sequence_of(child).map(|sequence| (sequence, child)))
            .filter(|(sequence, _)| *sequence < own)
            .max_by_key(|(sequence, _)| *sequence)
            .map(|(_, child)| format!("{parent}/{child}"));
        // With no queued node to wait for, a fixed-lease holding it waits for is watched
        // instead (its deletion; its lease's end is the waiter's own timer), so that the
        // queue's other changes do not wake every waiter behind it.
        let shared = prefix.starts_with(SHARED);
        let predecessor = predecessor.or_else(|| {
            children
                .iter()
                .find(|child| waits_for_held(shared, child))
                .map(|child| format!("{parent}/{child}"))
        });
        let Some(predecessor) = predecessor else {
            return Ok(Step::Answer(Some(children)));
        };
        let (stat, watcher) = client.check_and_watch_stat(&predecessor).await?;
        if stat.is_none() {
            // The predecessor went between the listing and the watch, which now
            // waits for a creation that never comes (a sequence is not reused):
            // dropped (zookeeper-client removes a dropped watch), and the queue
            // listed again.
            drop(watcher);
            return Ok(Step::Again);
        }
        Ok(Step::Watch(watcher))
    })
    .await
}

/// `gone:<path>`: answered when the node is gone; otherwise an exists-watch on it.
async fn gone_step(link: &ZkLink, path: String) -> Result<Step> {
    let watched = link
        .run(move |client| async move {
            let (stat, watcher) = client.check_and_watch_stat(&path).await?;
            Ok((stat.is_some(), watcher))
        })
        .await?;
    Ok(match watched {
        (false, _) => Step::Answer(None),
        (true, watcher) => Step::Watch(watcher),
    })
}
