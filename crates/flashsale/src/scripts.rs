//! The Lua scripts, compiled in from `src/scripts/*.lua`. Each file's header states its
//! KEYS, ARGV and return values. [`redis::Script`] runs them with EVALSHA and reloads a
//! script the server has forgotten.

use std::sync::LazyLock;

use redis::Script;

pub(crate) static RESERVE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/reserve.lua")));
pub(crate) static RECORD: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/record.lua")));
pub(crate) static CLAIM: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/claim.lua")));
pub(crate) static REPAIR_CLAIMS: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/repair_claims.lua")));
pub(crate) static UNCLAIM: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/unclaim.lua")));
pub(crate) static RESPLIT_STOCK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/resplit_stock.lua")));
pub(crate) static LOAD_STOCK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/load_stock.lua")));
pub(crate) static REPAIR_STOCK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/repair_stock.lua")));
pub(crate) static RETIRE_STREAM: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/retire_stream.lua")));

/// Loads every script into the server's cache at start, so the first purchases do not
/// each pay NOSCRIPT and a reload.
pub(crate) async fn preload(conn: &mut distlock::Connection) -> redis::RedisResult<()> {
    for script in [
        &RESERVE,
        &RECORD,
        &CLAIM,
        &UNCLAIM,
        &REPAIR_CLAIMS,
        &LOAD_STOCK,
        &REPAIR_STOCK,
        &RESPLIT_STOCK,
        &RETIRE_STREAM,
    ] {
        script.prepare_invoke().load_async(conn).await?;
    }
    Ok(())
}
