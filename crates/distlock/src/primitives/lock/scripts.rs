//! The lease lock's scripts (one file each in `scripts/`, with a header giving KEYS, ARGV
//! and what it returns), and its renewal kind.

use crate::engine::renewal::registry::{Renewal, RenewalKind};
use crate::transport::script::LuaScript;

/// The message Redisson publishes when a lock is freed: wake one waiter.
pub(crate) const RELEASE_MESSAGE: &str = "0";

pub(crate) static LOCK_ACQUIRE: LuaScript = LuaScript::new(concat!(
    include_str!("../shared/fence.lua"),
    include_str!("scripts/lock_acquire.lua")
));
pub(crate) static LOCK_REENTER: LuaScript =
    LuaScript::new(include_str!("scripts/lock_reenter.lua"));
pub(crate) static LOCK_RELEASE: LuaScript = LuaScript::new(concat!(
    include_str!("../shared/latch.lua"),
    include_str!("scripts/lock_release.lua")
));
pub(crate) static LOCK_RENEW: LuaScript = LuaScript::new(include_str!("scripts/lock_renew.lua"));
pub(crate) static LOCK_FORCE_UNLOCK: LuaScript =
    LuaScript::new(include_str!("scripts/lock_force_unlock.lua"));
pub(crate) static FENCE_ADVANCE: LuaScript =
    LuaScript::new(include_str!("scripts/fence_advance.lua"));

/// A lock hold, renewed by `lock_renew.lua`: the hash at the lock's key must still have
/// the owner's field.
pub(crate) static LOCK_RENEWAL: RenewalKind = RenewalKind {
    name: "lock hold",
    renew: Renewal::Script(&LOCK_RENEW),
};

/// Every script of the lease lock, for loading at connect.
pub(crate) static ALL: [&LuaScript; 6] = [
    &LOCK_ACQUIRE,
    &LOCK_REENTER,
    &LOCK_RELEASE,
    &LOCK_RENEW,
    &LOCK_FORCE_UNLOCK,
    &FENCE_ADVANCE,
];
