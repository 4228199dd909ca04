//! A writer's downgrade on ZooKeeper (`RwLock::downgrade`): a shared holding taken beside
//! an exclusive one that still holds, so that no other writer can come between them.
//!
//! The shared holding's node is made in one multi-op with a check that the writer's node
//! is still there:
//! - in watchdog mode, `read-<reader>-0000000000`, ephemeral and not sequential: sequence
//!   0 sorts ahead of every queued node, so every exclusive waiter waits for it and no
//!   shared one does. Nothing ahead of the writer held (its turn had come), so the reader
//!   holds at once and stays compatible with everything the queue held before it;
//! - on a fixed lease, `held-read-<reader>`, as any shared fixed-lease holding.

use std::time::Duration;

use tokio::time::Instant;
use zookeeper_client::{Acls, CreateMode, Error as ZkError, MultiWriteError, MultiWriteResult};

use super::fixed::HELD;
use super::{Placed, State, ZkAttempt};
use crate::error::Result;
use crate::primitives::lock::Hold;
use crate::transport::zk::watch::{EXCLUSIVE, SHARED};

/// What a downgrade's multi-op found.
enum Beside {
    /// The reader's node, made at `czxid`.
    Made { path: String, czxid: i64 },
    /// The writer's node is gone: its holding is lost.
    WriterGone,
}

impl ZkAttempt {
    /// Takes this (shared) acquisition's holding beside the exclusive holding of
    /// `writer`, which must still hold; `None` when its node is gone. Its node is made in
    /// one request, with no wait; a reply lost after the node was made leaves it to be
    /// deleted once the ensemble answers (a fixed-lease one, to its lease).
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
        let (path, data, mode) = match self.fixed {
            Some((_, lease_ms)) => (
                self.held_path(),
                lease_ms.to_string().into_bytes(),
                CreateMode::Persistent,
            ),
            None => (
                format!("{parent}/{SHARED}{}-{:010}", self.owner, 0),
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
                    let mut multi = client.new_multi_writer();
                    multi.add_check_version(&format!("{parent}/{writer}"), -1)?;
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
                        Err(MultiWriteError::OperationFailed {
                            source: ZkError::NoNode,
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
                if err.is_connection_error() && self.fixed.is_none() {
                    // Made or not, a node left behind would hold the lock for as long as
                    // the client's session lives.
                    let node = path.rsplit_once('/').map_or("", |(_, node)| node);
                    self.link.reap(
                        self.parent.to_string(),
                        node.to_owned(),
                        session,
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
    fn a_downgraded_reader_sorts_ahead_of_every_queued_node() {
        let node = format!("{SHARED}{}-{:010}", "c0ffee:7", 0);
        assert_eq!(node, "read-c0ffee:7-0000000000");
        assert_eq!(crate::transport::zk::watch::sequence_of(&node), Some(0));
    }
}
