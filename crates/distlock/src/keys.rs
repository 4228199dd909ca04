//! Key and channel names, following Redisson's layout so that Redisson and distlock
//! exclude each other on the same lock name.
//!
//! Helper keys carry the lock name inside a hash tag (`prefix:{name}`) so every key of one
//! lock lands in the same Redis Cluster slot and one script may touch them all. A name that
//! already contains `{` is used as is (`prefix:name`): its own tag then decides the slot.

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

/// The fencing-token counter of the lock `name`: never expired, so tokens keep increasing
/// across holders.
pub(crate) fn token_key(name: &str) -> String {
    tagged("redisson_lock_token", name)
}

/// The channel on which a release of the lock `name` is published.
pub(crate) fn release_channel(name: &str) -> String {
    tagged("redisson_lock__channel", name)
}

/// The key caching the answer of one release request, so a retry after an ambiguous
/// failure reads the first answer instead of a false "not held".
pub(crate) fn unlock_latch(name: &str, request_id: &str) -> String {
    format!("{}:{request_id}", tagged("redisson_unlock_latch", name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_redisson_layout() {
        assert_eq!(token_key("orders"), "redisson_lock_token:{orders}");
        assert_eq!(release_channel("orders"), "redisson_lock__channel:{orders}");
        assert_eq!(
            unlock_latch("orders", "r1"),
            "redisson_unlock_latch:{orders}:r1"
        );
    }

    #[test]
    fn keeps_a_users_own_hash_tag() {
        assert_eq!(
            token_key("{user:7}:cart"),
            "redisson_lock_token:{user:7}:cart"
        );
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
