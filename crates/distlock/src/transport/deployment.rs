//! The deployment a connected client talks to, as far as the lock protocol cares: how a
//! release is published (sharded pub/sub on a Redis 7 cluster), and whether keys of
//! different slots may share one command.

use redis::cluster_routing::Slot;

/// The deployment a connected client talks to, as far as the lock protocol cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Deployment {
    /// One server (or a proxy in front of one).
    Standalone,
    /// A Redis Cluster. `sharded_pubsub`: the servers have SPUBLISH/SSUBSCRIBE (Redis 7),
    /// so a release message goes to the one shard that owns the lock, and Redisson's
    /// waiters on a 7+ cluster, which listen there, hear it too.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    Cluster { sharded_pubsub: bool },
}

impl Deployment {
    /// The command the release scripts publish with.
    pub(crate) fn publish_command(self) -> &'static str {
        match self {
            Deployment::Cluster {
                sharded_pubsub: true,
            } => "spublish",
            _ => "publish",
        }
    }

    /// True if one command may only carry keys of one hash slot.
    pub(crate) fn is_cluster(self) -> bool {
        matches!(self, Deployment::Cluster { .. })
    }

    /// Splits `items` into groups that one command may carry together: all of them on one
    /// server, one group per hash slot (of `key(item)`) on a cluster, each group at most
    /// `max` long.
    pub(crate) fn batches<T>(
        self,
        items: Vec<T>,
        max: usize,
        key: impl Fn(&T) -> &str,
    ) -> Vec<Vec<T>> {
        let max = max.max(1);
        let groups: Vec<Vec<T>> = if self.is_cluster() {
            let mut by_slot: std::collections::HashMap<Slot, Vec<T>> = Default::default();
            for item in items {
                by_slot
                    .entry(Slot::for_key(key(&item)))
                    .or_default()
                    .push(item);
            }
            by_slot.into_values().collect()
        } else {
            vec![items]
        };
        let mut batches = Vec::new();
        for mut group in groups {
            while group.len() > max {
                let rest = group.split_off(max);
                batches.push(group);
                group = rest;
            }
            if !group.is_empty() {
                batches.push(group);
            }
        }
        batches
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_batches_never_mix_slots() {
        let keys: Vec<String> = (0..50).map(|n| format!("lock:{n}")).collect();
        let batches = Deployment::Cluster {
            sharded_pubsub: true,
        }
        .batches(keys.clone(), 3, |key| key);
        assert_eq!(batches.iter().map(Vec::len).sum::<usize>(), 50);
        for batch in &batches {
            assert!(batch.len() <= 3);
            let slot = Slot::for_key(&batch[0]);
            assert!(batch.iter().all(|key| Slot::for_key(key) == slot));
        }
        let standalone = Deployment::Standalone.batches(keys, 20, |key| key);
        assert_eq!(
            standalone.iter().map(Vec::len).collect::<Vec<_>>(),
            [20, 20, 10]
        );
    }
}
