//! The read-write lock's scripts, one file each in `scripts/` with a header giving KEYS,
//! ARGV and what it returns (each built with `scripts/rw_common.lua` in front, and the
//! shared fencing step where it takes tokens), and the renewal kind of read holds.

use crate::engine::renewal::registry::{Renewal, RenewalKind};
use crate::transport::script::LuaScript;

macro_rules! rw_script {
    ($file:literal) => {
        LuaScript::new(concat!(
            include_str!("../shared/latch.lua"),
            include_str!("scripts/rw_common.lua"),
            include_str!($file)
        ))
    };
}

pub(crate) static RW_READ_ACQUIRE: LuaScript = rw_script!("scripts/rw_read_acquire.lua");
pub(crate) static RW_WRITE_ACQUIRE: LuaScript = LuaScript::new(concat!(
    include_str!("../shared/fence.lua"),
    include_str!("scripts/rw_common.lua"),
    include_str!("scripts/rw_write_acquire.lua")
));
pub(crate) static RW_READ_RELEASE: LuaScript = rw_script!("scripts/rw_read_release.lua");
pub(crate) static RW_WRITE_RELEASE: LuaScript = rw_script!("scripts/rw_write_release.lua");
pub(crate) static RW_READ_REENTER: LuaScript = rw_script!("scripts/rw_read_reenter.lua");
pub(crate) static RW_READ_RENEW: LuaScript = rw_script!("scripts/rw_read_renew.lua");
pub(crate) static RW_READ_VERIFY: LuaScript = rw_script!("scripts/rw_read_verify.lua");

/// A read holding, renewed by `rw_read_renew.lua`: every read hold's own key, and the
/// hash with the longest of them. The scheduler passes `"<owner>|<base>"` as the owner.
pub(crate) static RW_READ_RENEWAL: RenewalKind = RenewalKind {
    name: "read hold",
    renew: Renewal::Script(&RW_READ_RENEW),
};

/// Every script of the read-write lock, for loading at connect.
pub(crate) static ALL: [&LuaScript; 7] = [
    &RW_READ_ACQUIRE,
    &RW_WRITE_ACQUIRE,
    &RW_READ_RELEASE,
    &RW_WRITE_RELEASE,
    &RW_READ_REENTER,
    &RW_READ_RENEW,
    &RW_READ_VERIFY,
];
