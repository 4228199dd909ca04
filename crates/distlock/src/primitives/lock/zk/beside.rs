//! A writer's downgrade on ZooKeeper (`RwLock::downgrade`): a shared holding taken beside
//! an exclusive one that still holds, so that no other writer can come between them.
//!
//! The shared holding's node is made in one multi-op with a check that the writer's node
//! is still there. A writer on a fixed lease (a `held-` node) is written again in the
//! same multi-op, unchanged but for its version: a waiter that read it expired and is
//! about to delete it (version-checked) then fails and waits, so a downgrade that reaches
//! the ensemble after the writer's lease ended can never leave a writer beside its reader.
//! (The write moves the node's mtime, so the writer's lease restarts there: others wait
//! for it at most a lease longer if the writer never releases; the writer's own trust is
//! not moved.)
//! - in watchdog mode, `read-<reader>-<the writer's sequence>`, ephemeral and not
//!   sequential: it takes the writer's place in the queue, so every exclusive waiter
//!   (queued behind the writer) waits for it and no shared one does, and the writer does
//!   not wait for it (a node waits only for nodes with a smaller sequence). Nothing ahead
//!   of the writer held (its turn had come), so the reader holds at once. A writer on a
//!   fixed lease has no queued node: its reader's sequence is 0, ahead of every node;
//! - on a fixed lease, `held-read-<reader>`, as any shared fixed-lease holding.

use std::time::Duration;

use tokio::time::Instant;
use zookeeper_client::{Acls, CreateMode, Error as ZkError, MultiWriteError, MultiWriteResult};

use super::fixed::HELD;
use super::{Placed, State, ZkAttempt};
use crate::error::Result;
use crate::primitives::lock::Hold;
use crate::transport::zk::watch::{sequence_of, EXCLUSIVE, SHARED};

/// What a downgrade's multi-op found.
enum Beside {
    /// The reader's node, made at `czxid`.
    Made { path: String, czxid: i64 },
    /// The writer's node is gone: its holding is lost.
    WriterGone,
}

impl ZkAttempt {
    /// Takes this (shared) acquisition's holding beside the exclusive holding of
    /// `writer`, which must still hold; `None` when its node is gone or was written
    /// meanwhile. Its node is made in one request, with no wait; a reply lost after the
    /// node was made leaves it to be deleted once the ensemble answers.
    pub(crate) async fn take_beside(&self, writer: &str) -> Result<Option<Hold>> {
        self.state.take_beside(writer).await
    }
}

impl State {
    async fn take_beside(&self, writer: &str) -> Result<Option<Hold>> {
        debug_assert!(
            self.shared,
            "only a shared holding is taken beside a writer"
        );
        let client = self.link.client().await?;
        let session = client.session_id().0;
        let parent = self.parent.to_string();
        // A watchdog reader's node takes its writer's place in the queue (its sequence
        // is known once the writer's node is found).
        let (path, data, mode) = match self.fixed {
            Some((_, lease_ms)) => (
                self.held_path(),
                lease_ms.to_string().into_bytes(),
                CreateMode::Persistent,
            ),
            None => (
                format!("{parent}/{SHARED}{}-", self.owner),
                b"1".to_vec(),
                CreateMode::Ephemeral,
            ),
        };
        let (queued, held) = (format!("{EXCLUSIVE}{writer}-"), format!("{HELD}{writer}"));
        let sent_at = Instant::now();
        let made = {
            let path = path.clone();
            self.link
                .run_on(client, move |client| async move {
                    let children = match client.list_children(&parent).await {
                        Ok(children) => children,
                        Err(ZkError::NoNode) => return Ok(Beside::WriterGone),
                        Err(err) => return Err(err),
                    };
                    let Some(writer) = children
                        .iter()
                        .find(|child| child.starts_with(&queued) || **child == held)
                    else {
                        return Ok(Beside::WriterGone);
                    };
                    let path = match mode {
                        CreateMode::Ephemeral => {
                            format!("{path}{:010}", sequence_of(writer).unwrap_or(0))
                        }
                        _ => path,
                    };
                    let writer = format!("{parent}/{writer}");
                    let mut multi = client.new_multi_writer();
                    if writer.ends_with(&held) {
                        let (lease, stat) = match client.get_data(&writer).await {
                            Ok(read) => read,
                            Err(ZkError::NoNode) => return Ok(Beside::WriterGone),
                            Err(err) => return Err(err),
                        };
                        multi.add_set_data(&writer, &lease, Some(stat.version))?;
                    } else {
                        multi.add_check_version(&writer, -1)?;
                    }
                    multi.add_create(&path, &data, &mode.with_acls(Acls::anyone_all()))?;
                    match multi.commit().await {
                        Ok(results) => {
                            let czxid = results.iter().find_map(|result| match result {
                                MultiWriteResult::Create { stat, .. } if !stat.is_invalid() => {
                                    Some(stat.czxid)
                                }
                                _ => None,
                            });
                            // A stat the server left invalid (ZOOKEEPER-4026) is read.
                            let czxid = match czxid {
                                Some(czxid) => czxid,
                                None => match client.check_stat(&path).await? {
                                    Some(stat) => stat.czxid,
                                    None => return Ok(Beside::WriterGone),
                                },
                            };
                            Ok(Beside::Made { path, czxid })
                        }
                        // Gone, or written since it was read (a waiter deleting it, an
                        // extension whose reply was lost): the writer may have lost it.
                        Err(MultiWriteError::OperationFailed {
                            source: ZkError::NoNode | ZkError::BadVersion,
                            ..
                        }) => Ok(Beside::WriterGone),
                        Err(err) => Err(err.into()),
                    }
                })
                .await
        };
        match made {
            Ok(Beside::Made { path, czxid }) => Ok(Some(match self.fixed {
                Some((lease, _)) => self.fixed_hold((sent_at, czxid), lease),
                None => self.session_hold(
                    Placed {
                        path,
                        czxid,
                        session,
                    },
                    sent_at,
                ),
            })),
            Ok(Beside::WriterGone) => Ok(None),
            Err(err) => {
                if err.is_connection_error() {
                    // Made or not, a node left behind would hold the lock for as long as
                    // the client's session lives, or a fixed lease's whole length: no
                    // guard was handed out for it. (A watchdog reader's path is its
                    // node's name up to its sequence: the prefix of the node to delete.)
                    let node = path.rsplit_once('/').map_or("", |(_, node)| node);
                    let ephemeral = self.fixed.is_none().then_some(session);
                    self.link.reap(
                        self.parent.to_string(),
                        node.to_owned(),
                        ephemeral,
                        Duration::ZERO,
                    );
                }
                Err(err)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_downgraded_reader_takes_its_writers_place() {
        let writer = "lock-c0ffee:7:write-0000000042";
        let reader = format!(
            "{SHARED}{}-{:010}",
            "c0ffee:8",
            sequence_of(writer).unwrap_or(0)
        );
        assert_eq!(reader, "read-c0ffee:8-0000000042");
        assert_eq!(sequence_of(&reader), sequence_of(writer));
    }
}
