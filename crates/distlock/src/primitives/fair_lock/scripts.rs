//! The fair lock's scripts, one file each in `scripts/` with a header giving KEYS, ARGV and
//! what it returns. Each is built with the shared fencing step (`../shared/fence.lua`) and
//! the queue's functions (`scripts/queue.lua`) in front.

use crate::transport::script::LuaScript;

pub(crate) static FAIR_ACQUIRE: LuaScript = LuaScript::new(concat!(
    include_str!("../shared/fence.lua"),
    include_str!("scripts/queue.lua"),
    include_str!("scripts/fair_acquire.lua")
));
pub(crate) static FAIR_RELEASE: LuaScript = LuaScript::new(concat!(
    include_str!("../shared/fence.lua"),
    include_str!("../shared/latch.lua"),
    include_str!("scripts/queue.lua"),
    include_str!("scripts/fair_release.lua")
));
pub(crate) static FAIR_LEAVE: LuaScript = LuaScript::new(concat!(
    include_str!("../shared/fence.lua"),
    include_str!("scripts/queue.lua"),
    include_str!("scripts/fair_leave.lua")
));

/// Standalone: it reads two fields and needs none of the shared functions.
pub(crate) static FAIR_LOOK: LuaScript = LuaScript::new(include_str!("scripts/fair_look.lua"));

/// Every script of the fair lock, for loading at connect.
pub(crate) static ALL: [&LuaScript; 4] = [&FAIR_ACQUIRE, &FAIR_RELEASE, &FAIR_LEAVE, &FAIR_LOOK];
