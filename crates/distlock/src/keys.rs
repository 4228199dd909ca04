//! Key and channel names, following Redisson's layout so that Redisson and distlock
//! exclude each other on the same lock name.
//!
//! Helper keys carry the lock name inside a hash tag (`prefix:{name}`) so every key of one
//! lock lands in the same Redis Cluster slot and one script may touch them all. A name that
//! already contains `{` is used as is (`prefix:name`): its own tag then decides the slot.

use std::collections::HashMap;
use std::sync::LazyLock;

use redis::cluster_routing::Slot;

use crate::error::{Error, Result};

/// Redis keys may be up to 512 MB; a lock name that large is a bug, and it would be copied
/// into every script call. The limit is generous but finite.
const MAX_NAME_LEN: usize = 64 * 1024;

/// Checks a user-supplied lock name.
pub(crate) fn validate_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::InvalidName {
            name: name.to_owned(),
            reason: "must not be empty",
        });
    }
    if name.len() > MAX_NAME_LEN {
        return Err(Error::InvalidName {
            name: format!("{}…", name.chars().take(32).collect::<String>()),
            reason: "longer than 64 KiB",
        });
    }
    if Slot::for_key(tagged("p", name)) != Slot::for_key(name) {
        // Redis hashes a key by the text between its first `{` and the first `}` after
        // it, if that is not empty, or else by the whole key. A name with a stray `}`
        // (`a}b`), an empty first `{}` (`a{}b`) or an unclosed `{` hashes whole, but its
        // helper keys (`prefix:{a}b}`, `prefix:a{}b`) would not: on a Cluster every
        // release would fail with CROSSSLOT and the lock stay held until its lease ran out.
        return Err(Error::InvalidName {
            name: name.to_owned(),
            reason: "its helper keys would land in another Redis Cluster slot than the lock: \
                     a `}` outside a hash tag, an empty `{}` or an unclosed `{`; give it a \
                     hash tag such as `{order}42` or leave the braces out",
        });
    }
    Ok(())
}

/// `prefix:{name}`, or `prefix:name` when the name carries its own hash tag.
pub(crate) fn tagged(prefix: &str, name: &str) -> String {
    if name.contains('{') {
        format!("{prefix}:{name}")
    } else {
        format!("{prefix}:{{{name}}}")
    }
}

/// Where a lock's fencing tokens come from.
///
/// Tokens must strictly increase per lock name. A counter per name does that, but leaves
/// one key behind for every name ever locked: per-request lock names then grow Redis
/// forever. A counter per Redis Cluster hash slot does it too (a name's tokens come from
/// one counter that only goes up), with at most 16,384 keys whatever the number of names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FencingCounter {
    /// One counter per hash slot, `distlock_fence:{<tag>}`, where `<tag>` is a short string
    /// in the same slot as the lock name (so scripts stay single-slot on a cluster).
    /// Tokens of names that share a slot interleave, with gaps per name. The default.
    #[default]
    PerSlot,
    /// One counter per lock name, `redisson_lock_token:{<name>}`, as Redisson's
    /// `RFencedLock`. Choose it to share tokens with Redisson; every name locked leaves
    /// its counter behind.
    PerName,
}

/// The fencing-token counter of the lock `name`: never expired, so tokens keep increasing
/// across holders.
pub(crate) fn token_key(counter: FencingCounter, name: &str) -> String {
    match counter {
        FencingCounter::PerName => tagged("redisson_lock_token", name),
        FencingCounter::PerSlot => format!("distlock_fence:{{{}}}", slot_tag(name)),
    }
}

/// The counter `name` would use under the other [`FencingCounter`] setting. Every
/// acquisition reads it and takes a token above both, so clients that count differently on
/// one lock still hand out strictly increasing tokens.
pub(crate) fn token_key_of_other(counter: FencingCounter, name: &str) -> String {
    let other = match counter {
        FencingCounter::PerSlot => FencingCounter::PerName,
        FencingCounter::PerName => FencingCounter::PerSlot,
    };
    token_key(other, name)
}

/// For every hash slot, the smallest decimal number whose text hashes to it. Built once,
/// on first use, by hashing numbers until every slot has one (about 180,000 hashes, a few
/// milliseconds); redis-rs's own slot function, so it agrees with the cluster client.
static SLOT_TAGS: LazyLock<HashMap<Slot, u32>> = LazyLock::new(|| {
    const SLOTS: usize = 16_384;
    let mut tags = HashMap::with_capacity(SLOTS);
    let mut candidate: u32 = 0;
    while tags.len() < SLOTS {
        tags.entry(Slot::for_key(candidate.to_string()))
            .or_insert(candidate);
        candidate += 1;
    }
    tags
});

/// A short tag that hashes to the same slot as the key `name`.
fn slot_tag(name: &str) -> u32 {
    // Every slot has a tag: the table is filled until it covers all of them.
    SLOT_TAGS
        .get(&Slot::for_key(name))
        .copied()
        .unwrap_or_default()
}

/// The channel on which a release of the lock `name` is published.
pub(crate) fn release_channel(name: &str) -> String {
    tagged("redisson_lock__channel", name)
}

/// The key caching the answer of one release request, so a retry after an ambiguous
/// failure reads the first answer instead of a false "not held".
pub(crate) fn unlock_latch(name: &str, request_id: impl std::fmt::Display) -> String {
    // One allocation: this runs on every final release.
    if name.contains('{') {
        format!("redisson_unlock_latch:{name}:{request_id}")
    } else {
        format!("redisson_unlock_latch:{{{name}}}:{request_id}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_slot_counters_share_the_lock_names_slot() {
        for name in ["orders", "coupon:42", "{user:7}:cart", "é", "x"] {
            let key = token_key(FencingCounter::PerSlot, name);
            assert_eq!(Slot::for_key(&key), Slot::for_key(name), "{name} -> {key}");
            assert!(key.len() <= "distlock_fence:{16383}".len() + 10, "{key}");
        }
    }

    #[test]
    fn follows_redisson_layout() {
        assert_eq!(
            token_key(FencingCounter::PerName, "orders"),
            "redisson_lock_token:{orders}"
        );
        assert_eq!(release_channel("orders"), "redisson_lock__channel:{orders}");
        assert_eq!(
            unlock_latch("orders", "r1"),
            "redisson_unlock_latch:{orders}:r1"
        );
    }

    #[test]
    fn keeps_a_users_own_hash_tag() {
        assert_eq!(
            token_key(FencingCounter::PerName, "{user:7}:cart"),
            "redisson_lock_token:{user:7}:cart"
        );
    }

    /// Redis's hash-tag rule decides the slot; every helper key must land in the lock's
    /// (review: `a}b`, `order}42` and `a{}b` were accepted, and every release on a Cluster
    /// failed with CROSSSLOT until the lease ran out).
    #[test]
    fn refuses_names_whose_helper_keys_would_land_in_another_slot() {
        for name in ["a}b", "order}42", "a{}b", "{}", "{x", "x{", "}", "a{}{b}"] {
            assert!(
                matches!(validate_name(name), Err(Error::InvalidName { .. })),
                "{name} accepted"
            );
        }
        for name in [
            "orders",
            "{user:7}:cart",
            "a{b}c",
            "a{b}}c",
            "{a}{}",
            "é{ü}",
        ] {
            assert!(validate_name(name).is_ok(), "{name} refused");
            let slot = Slot::for_key(name);
            for key in [
                release_channel(name),
                unlock_latch(name, "r1"),
                token_key_of_other(FencingCounter::PerSlot, name),
                token_key(FencingCounter::PerName, name),
                token_key(FencingCounter::PerSlot, name),
            ] {
                assert_eq!(Slot::for_key(&key), slot, "{name}: {key}");
            }
        }
    }

    #[test]
    fn refuses_empty_and_giant_names() {
        assert!(matches!(validate_name(""), Err(Error::InvalidName { .. })));
        assert!(matches!(
            validate_name(&"é".repeat(MAX_NAME_LEN)),
            Err(Error::InvalidName { .. })
        ));
        assert!(validate_name("ok").is_ok());
    }
}
