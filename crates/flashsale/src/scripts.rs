//! The Lua scripts, compiled in from `src/scripts/*.lua`. Each file's header states its
//! KEYS, ARGV and return values. [`redis::Script`] runs them with EVALSHA and reloads a
//! script the server has forgotten.

use std::sync::LazyLock;

use redis::Script;

pub(crate) static RESERVE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/reserve.lua")));
pub(crate) static LOAD_STOCK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/load_stock.lua")));
