//! The count-down latch's scripts, one file each in `scripts/` with a header giving KEYS,
//! ARGV and what it returns.

use crate::transport::script::LuaScript;

pub(crate) static LATCH_COUNT_DOWN: LuaScript =
    LuaScript::new(include_str!("scripts/latch_count_down.lua"));
pub(crate) static LATCH_SET: LuaScript = LuaScript::new(include_str!("scripts/latch_set.lua"));

/// Every script of the latch, for loading at connect.
pub(crate) static ALL: [&LuaScript; 2] = [&LATCH_COUNT_DOWN, &LATCH_SET];
