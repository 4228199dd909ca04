//! Key and channel names, following Redisson's layout so that Redisson and distlock
//! exclude each other on the same lock name.
//!
//! Helper keys carry the lock name inside a hash tag (`kind:{name}`) so every key of one
//! lock lands in the same Redis Cluster slot and one script may touch them all. A name that
//! already contains `{` is used as is (`kind:name`): its own tag then decides the slot.
//!
//! With a key prefix `P` ([`ClientBuilder::key_prefix`](crate::ClientBuilder::key_prefix)),
//! the lock's key is `P<name>` and every helper key and channel is `P` followed by the
//! helper of that key: `P` + `redisson_lock__channel:{P<name>}`, and so on. Everything the
//! library writes then starts with `P`, so one ACL pattern covers it, and every helper
//! still hashes with the lock key. Without a prefix (the default) the layout is exactly
//! Redisson's.

use redis::cluster_routing::Slot;

use crate::config::FencingCounter;
use crate::crc16::crc16;
use crate::error::{Error, Result};

/// Redis keys may be up to 512 MB; a lock name that large is a bug, and it would be copied
/// into every script call. The limit is generous but finite.
const MAX_NAME_LEN: usize = 64 * 1024;

/// The longest key prefix: it is copied into every key and script call.
const MAX_PREFIX_LEN: usize = 1024;

/// Checks a key prefix: braces would change which part of each key Redis hashes.
pub(crate) fn validate_prefix(prefix: &str) -> Result<()> {
    let refuse = |reason: &str| Error::InvalidConfig {
        what: "key prefix",
        reason: format!("{prefix:?}: {reason}"),
    };
    if prefix.contains(['{', '}']) {
        return Err(refuse(
            "must not contain `{` or `}`, which would change the Redis Cluster slot of every key",
        ));
    }
    if prefix.len() > MAX_PREFIX_LEN {
        return Err(refuse("longer than 1 KiB"));
    }
    Ok(())
}

/// Checks a user-supplied lock name (and, under a prefix, the key it makes).
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

/// The fencing-token counter of the lock whose key is `key`: never expired, so tokens
/// keep increasing across holders.
pub(crate) fn token_key(counter: FencingCounter, prefix: &str, key: &str) -> String {
    match counter {
        FencingCounter::PerName => format!("{prefix}{}", tagged("redisson_lock_token", key)),
        FencingCounter::PerSlot => format!("{prefix}distlock_fence:{{{}}}", slot_tag(key)),
    }
}

/// The counter `name` would use under the other [`FencingCounter`] setting. Every
/// acquisition reads it and takes a token above both, so clients that count differently on
/// one lock still hand out strictly increasing tokens.
pub(crate) fn token_key_of_other(counter: FencingCounter, prefix: &str, key: &str) -> String {
    let other = match counter {
        FencingCounter::PerSlot => FencingCounter::PerName,
        FencingCounter::PerName => FencingCounter::PerSlot,
    };
    token_key(other, prefix, key)
}

// SLOT_TAGS: for every hash slot, the smallest decimal number whose text hashes to it,
// computed by build.rs (checked below against redis-rs's slot function, which the cluster
// client uses).
include!(concat!(env!("OUT_DIR"), "/slot_tags.rs"));

/// A short tag that hashes to the same slot as the key `name`.
fn slot_tag(name: &str) -> u32 {
    SLOT_TAGS[usize::from(slot_of(name))]
}

/// The cluster slot of `key`: the checksum of its hash tag (the text between its first
/// `{` and the next `}`, when not empty) or of the whole key.
fn slot_of(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = bytes
        .iter()
        .position(|&byte| byte == b'{')
        .and_then(|open| {
            let rest = &bytes[open + 1..];
            let close = rest.iter().position(|&byte| byte == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(bytes);
    crc16(hashed) % 16_384
}

/// A fair lock's queue of waiting owners (Redisson's list).
pub(crate) fn fair_queue(prefix: &str, key: &str) -> String {
    format!("{prefix}{}", tagged("redisson_lock_queue", key))
}

/// A fair lock's waiters' deadlines (Redisson's sorted set).
pub(crate) fn fair_timeouts(prefix: &str, key: &str) -> String {
    format!("{prefix}{}", tagged("redisson_lock_timeout", key))
}

/// distlock's own waiters of a fair lock, and the lease each takes on a direct grant.
pub(crate) fn fair_waiters(prefix: &str, key: &str) -> String {
    format!("{prefix}{}", tagged("distlock_fair_waiters", key))
}

/// The channel a semaphore publishes its free permits on (Redisson's `RSemaphore`).
pub(crate) fn semaphore_channel(prefix: &str, key: &str) -> String {
    format!("{prefix}{}", tagged("redisson_sc", key))
}

/// The taken permits of a permit semaphore and their leases (Redisson's
/// `RPermitExpirableSemaphore`): `{name}:timeout`, or `name:timeout` when the name carries
/// its own hash tag.
pub(crate) fn permit_timeouts(prefix: &str, key: &str) -> String {
    if key.contains('{') {
        format!("{prefix}{key}:timeout")
    } else {
        format!("{prefix}{{{key}}}:timeout")
    }
}

/// The channel a read-write lock's releases are published on (Redisson's).
pub(crate) fn rwlock_channel(prefix: &str, key: &str) -> String {
    format!("{prefix}{}", tagged("redisson_rwlock", key))
}

/// The writers waiting for a read-write lock (distlock's own, for writer preference).
pub(crate) fn rwlock_writers(prefix: &str, key: &str) -> String {
    format!("{prefix}{}", tagged("distlock_rwlock_writers", key))
}

/// The channel a count-down latch announces itself on: always with braces around the
/// name, as Redisson writes it, whatever the name holds.
pub(crate) fn latch_channel(prefix: &str, key: &str) -> String {
    format!("{prefix}redisson_countdownlatch__channel__{{{key}}}")
}

/// The channel on which a release of the lock whose key is `key` is published.
pub(crate) fn release_channel(prefix: &str, key: &str) -> String {
    format!("{prefix}{}", tagged("redisson_lock__channel", key))
}

/// The key caching the answer of one release request, so a retry after an ambiguous
/// failure reads the first answer instead of a false "not held".
pub(crate) fn unlock_latch(prefix: &str, key: &str, request_id: impl std::fmt::Display) -> String {
    use std::fmt::Write;
    // One allocation: this runs on every final release, and `format!` guesses a capacity
    // from its literal parts alone, then grows the string while writing the rest.
    const LATCH: &str = "redisson_unlock_latch:";
    /// The braces, the colon, and a request id (a 36-character client id, ":r", a u64).
    const BEYOND_THE_KEY: usize = 3 + 36 + 2 + 20;
    let mut latch = String::with_capacity(prefix.len() + LATCH.len() + key.len() + BEYOND_THE_KEY);
    // Writing to a String cannot fail.
    let _ = if key.contains('{') {
        write!(latch, "{prefix}{LATCH}{key}:{request_id}")
    } else {
        write!(latch, "{prefix}{LATCH}{{{key}}}:{request_id}")
    };
    latch
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// The table build.rs wrote holds, for every slot, the smallest number hashing to it
    /// by redis-rs's slot function (the cluster client's), and our slot function agrees
    /// with redis-rs's on names with and without hash tags.
    #[test]
    fn the_tag_table_and_the_slot_function_agree_with_redis_rs() {
        let mut smallest: HashMap<Slot, u32> = HashMap::new();
        let mut candidate = 0u32;
        while smallest.len() < SLOT_TAGS.len() {
            smallest
                .entry(Slot::for_key(candidate.to_string()))
                .or_insert(candidate);
            candidate += 1;
        }
        for (slot, tag) in SLOT_TAGS.iter().enumerate() {
            let slot = Slot::new(u16::try_from(slot).unwrap()).unwrap();
            assert_eq!(smallest.get(&slot), Some(tag));
        }
        for name in [
            "jobs",
            "a{b}c",
            "{}x",
            "x{}",
            "{a",
            "a}",
            "{{a}}",
            "é",
            "",
            "{user1000}.following",
        ] {
            assert_eq!(
                Slot::new(slot_of(name)),
                Some(Slot::for_key(name)),
                "{name:?}"
            );
        }
    }

    #[test]
    fn per_slot_counters_share_the_lock_names_slot() {
        for name in ["orders", "coupon:42", "{user:7}:cart", "é", "x"] {
            let key = token_key(FencingCounter::PerSlot, "", name);
            assert_eq!(Slot::for_key(&key), Slot::for_key(name), "{name} -> {key}");
            assert!(key.len() <= "distlock_fence:{16383}".len() + 10, "{key}");
        }
    }

    #[test]
    fn follows_redisson_layout() {
        assert_eq!(
            token_key(FencingCounter::PerName, "", "orders"),
            "redisson_lock_token:{orders}"
        );
        assert_eq!(
            release_channel("", "orders"),
            "redisson_lock__channel:{orders}"
        );
        assert_eq!(
            unlock_latch("", "orders", "r1"),
            "redisson_unlock_latch:{orders}:r1"
        );
    }

    #[test]
    fn keeps_a_users_own_hash_tag() {
        assert_eq!(
            token_key(FencingCounter::PerName, "", "{user:7}:cart"),
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
                release_channel("", name),
                unlock_latch("", name, "r1"),
                token_key_of_other(FencingCounter::PerSlot, "", name),
                token_key(FencingCounter::PerName, "", name),
                token_key(FencingCounter::PerSlot, "", name),
            ] {
                assert_eq!(Slot::for_key(&key), slot, "{name}: {key}");
            }
        }
    }

    /// Under a prefix every key and channel starts with it (one ACL pattern covers them)
    /// and still hashes with the lock key.
    #[test]
    fn a_prefix_leads_every_key_and_keeps_them_in_one_slot() {
        let prefix = "billing:";
        for name in ["orders", "{user:7}:cart", "a{b}c", "é"] {
            let key = format!("{prefix}{name}");
            assert!(validate_name(&key).is_ok(), "{key}");
            let slot = Slot::for_key(&key);
            for helper in [
                release_channel(prefix, &key),
                unlock_latch(prefix, &key, "r1"),
                token_key(FencingCounter::PerName, prefix, &key),
                token_key(FencingCounter::PerSlot, prefix, &key),
            ] {
                assert!(helper.starts_with(prefix), "{helper}");
                assert_eq!(Slot::for_key(&helper), slot, "{key}: {helper}");
            }
        }
        assert_eq!(
            release_channel(prefix, "billing:orders"),
            "billing:redisson_lock__channel:{billing:orders}"
        );
        for bad in ["a{", "}", "{x}:"] {
            assert!(matches!(
                validate_prefix(bad),
                Err(Error::InvalidConfig { .. })
            ));
        }
        assert!(validate_prefix("").is_ok());
        assert!(validate_prefix("app:v2:").is_ok());
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
