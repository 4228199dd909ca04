//! The Lua scripts, compiled into the crate from `src/scripts/*.lua`.
//!
//! Each is run with EVALSHA; [`redis::Script`] reloads it and retries once when the
//! server answers NOSCRIPT, so a Redis restart or `SCRIPT FLUSH` costs one extra round trip
//! instead of an error.

use std::sync::LazyLock;

use redis::Script;

macro_rules! script {
    ($name:ident, $file:literal) => {
        pub(crate) static $name: LazyLock<Script> =
            LazyLock::new(|| Script::new(include_str!(concat!("scripts/", $file))));
    };
}

script!(LOCK_ACQUIRE, "lock_acquire.lua");
script!(LOCK_RELEASE, "lock_release.lua");
script!(LOCK_RENEW, "lock_renew.lua");
script!(LOCK_FORCE_UNLOCK, "lock_force_unlock.lua");
