//! The semaphore's scripts, one file each in `scripts/` with a header giving KEYS, ARGV
//! and what it returns.

use crate::transport::script::LuaScript;

pub(crate) static SEMAPHORE_ACQUIRE: LuaScript =
    LuaScript::new(include_str!("scripts/semaphore_acquire.lua"));
pub(crate) static SEMAPHORE_ADD: LuaScript = LuaScript::new(concat!(
    include_str!("../shared/latch.lua"),
    include_str!("scripts/semaphore_add.lua")
));
pub(crate) static SEMAPHORE_SET: LuaScript =
    LuaScript::new(include_str!("scripts/semaphore_set.lua"));
pub(crate) static SEMAPHORE_DRAIN: LuaScript =
    LuaScript::new(include_str!("scripts/semaphore_drain.lua"));

/// Every script of the semaphore, for loading at connect.
pub(crate) static ALL: [&LuaScript; 4] = [
    &SEMAPHORE_ACQUIRE,
    &SEMAPHORE_ADD,
    &SEMAPHORE_SET,
    &SEMAPHORE_DRAIN,
];
