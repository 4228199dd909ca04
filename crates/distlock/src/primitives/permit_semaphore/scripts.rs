//! The permit semaphore's scripts, one file each in `scripts/` with a header giving KEYS,
//! ARGV and what it returns, and its renewal kind.

use crate::engine::renewal::registry::{Renewal, RenewalKind};
use crate::transport::script::LuaScript;

pub(crate) static PERMIT_ACQUIRE: LuaScript = LuaScript::new(concat!(
    include_str!("scripts/permits.lua"),
    include_str!("scripts/permit_acquire.lua")
));
pub(crate) static PERMIT_RELEASE: LuaScript = LuaScript::new(concat!(
    include_str!("scripts/permits.lua"),
    include_str!("scripts/permit_release.lua")
));
pub(crate) static PERMIT_RENEW: LuaScript =
    LuaScript::new(include_str!("scripts/permit_renew.lua"));

pub(crate) static PERMIT_TOTAL: LuaScript =
    LuaScript::new(include_str!("scripts/permit_total.lua"));

/// A permit's lease, renewed by `permit_renew.lua`: its score in the timeouts set is
/// moved on while it is still there and not expired.
pub(crate) static PERMIT_RENEWAL: RenewalKind = RenewalKind {
    name: "permit",
    renew: Renewal::Script(&PERMIT_RENEW),
};

/// Every script of the permit semaphore, for loading at connect.
pub(crate) static ALL: [&LuaScript; 4] = [
    &PERMIT_ACQUIRE,
    &PERMIT_RELEASE,
    &PERMIT_RENEW,
    &PERMIT_TOTAL,
];
