//! The Lua scripts, compiled into the crate from `src/scripts/*.lua`.
//!
//! Each is run with EVALSHA; [`redis::Script`] reloads it and retries once when the
//! server answers NOSCRIPT, so a Redis restart or `SCRIPT FLUSH` costs one extra round trip
//! instead of an error.

use std::sync::LazyLock;

use redis::Script;

use crate::connection::Connection;

macro_rules! script {
    ($name:ident, $file:literal) => {
        pub(crate) static $name: LazyLock<Script> =
            LazyLock::new(|| Script::new(include_str!(concat!("scripts/", $file))));
    };
}

script!(LOCK_ACQUIRE, "lock_acquire.lua");
script!(LOCK_REENTER, "lock_reenter.lua");
script!(LOCK_RELEASE, "lock_release.lua");
script!(LOCK_RENEW, "lock_renew.lua");
script!(LOCK_FORCE_UNLOCK, "lock_force_unlock.lua");

/// Loads every script into the server's cache. Without this, the first use of a script
/// costs NOSCRIPT, SCRIPT LOAD and a second EVALSHA, and a watchdog that sends many
/// renewal batches at once would pay that for each batch.
pub(crate) async fn preload(connection: &Connection) -> redis::RedisResult<()> {
    let all = [
        &LOCK_ACQUIRE,
        &LOCK_REENTER,
        &LOCK_RELEASE,
        &LOCK_RENEW,
        &LOCK_FORCE_UNLOCK,
    ];
    let loads = all.map(|script| {
        let mut connection = connection.clone();
        async move { script.prepare_invoke().load_async(&mut connection).await }
    });
    for loaded in futures_util::future::join_all(loads).await {
        loaded?;
    }
    Ok(())
}
