//! Key and channel names, following Redisson's layout so that Redisson and distlock
//! exclude each other on the same lock name.
//!
//! Helper keys carry the lock name inside a hash tag (`prefix:{name}`) so every key of one
//! lock lands in the same Redis Cluster slot and one script may touch them all. A name that
//! already contains `{` is used as is (`prefix:name`): its own tag then decides the slot.

use std::sync::Arc;

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

/// The keys and channel of one reentrant lock.
#[derive(Debug, Clone)]
pub(crate) struct LockKeys {
    /// The hash holding owner → hold count; its PEXPIRE is the lease. Shared with the
    /// watchdog's registry, which keys held leases by it.
    pub(crate) lock: Arc<str>,
    /// The fencing-token counter, never expired.
    pub(crate) token: String,
    /// The channel a release is published on.
    pub(crate) channel: String,
}

impl LockKeys {
    pub(crate) fn new(name: &str) -> Self {
        Self {
            lock: name.into(),
            token: tagged("redisson_lock_token", name),
            channel: tagged("redisson_lock__channel", name),
        }
    }

    /// The key caching the answer of one release request, so a retry after an ambiguous
    /// failure reads the first answer instead of a false "not held".
    pub(crate) fn unlock_latch(&self, request_id: &str) -> String {
        format!(
            "{}:{request_id}",
            tagged("redisson_unlock_latch", &self.lock)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_redisson_layout() {
        let keys = LockKeys::new("orders");
        assert_eq!(&*keys.lock, "orders");
        assert_eq!(keys.token, "redisson_lock_token:{orders}");
        assert_eq!(keys.channel, "redisson_lock__channel:{orders}");
        assert_eq!(keys.unlock_latch("r1"), "redisson_unlock_latch:{orders}:r1");
    }

    #[test]
    fn keeps_a_users_own_hash_tag() {
        let keys = LockKeys::new("{user:7}:cart");
        assert_eq!(keys.token, "redisson_lock_token:{user:7}:cart");
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
