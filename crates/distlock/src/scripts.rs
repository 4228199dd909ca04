//! The Lua scripts, compiled into the crate from `src/scripts/*.lua`.
//!
//! Each is run with EVALSHA through [`ScriptCall`], which reloads it and retries once when
//! the server answers NOSCRIPT, so a Redis restart or `SCRIPT FLUSH` costs one extra round
//! trip instead of an error.

use std::sync::LazyLock;

use redis::{Cmd, FromRedisValue, RedisResult, Script, ToRedisArgs};

use crate::connection::Connection;
use crate::replica_sync::SyncedWrites;

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
script!(FENCE_ADVANCE, "fence_advance.lua");

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
        &FENCE_ADVANCE,
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

/// Room reserved for a script call's arguments, so that building one does not grow its
/// buffers: lock names and owners are short.
const BYTES_PER_ARGUMENT: usize = 48;

/// One EVALSHA of a script, built straight into a single command. (redis-rs's
/// `ScriptInvocation` keeps a buffer per key and argument and copies them all into a new
/// command on every send: a dozen allocations per lock operation, measured with the
/// bench's counting allocator.)
pub(crate) struct ScriptCall {
    script: &'static Script,
    cmd: Cmd,
}

impl ScriptCall {
    /// A call of `script` on `keys`, with room for `args` more arguments.
    pub(crate) fn new(script: &'static Script, keys: &[&str], args: usize) -> Self {
        let count = 3 + keys.len() + args;
        let mut cmd = Cmd::with_capacity(count, count * BYTES_PER_ARGUMENT);
        cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys.len());
        for key in keys {
            cmd.arg(*key);
        }
        Self { script, cmd }
    }

    /// Appends an argument (ARGV, in order).
    pub(crate) fn arg<A: ToRedisArgs>(&mut self, arg: A) -> &mut Self {
        self.cmd.arg(arg);
        self
    }

    /// Sends the call. A server that lost the script (restarted, or flushed its cache)
    /// gets it again and the call is sent once more.
    pub(crate) async fn invoke<T: FromRedisValue>(
        &self,
        connection: &mut Connection,
    ) -> RedisResult<T> {
        match self.cmd.query_async(connection).await {
            Err(err)
                if err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                self.script.prepare_invoke().load_async(connection).await?;
                self.cmd.query_async(connection).await
            }
            other => other,
        }
    }

    /// Sends the call followed by a WAIT for replicas, on a connection of `synced`.
    /// Returns the script's reply and how many replicas acknowledged the write.
    pub(crate) async fn invoke_synced<T: FromRedisValue>(
        &self,
        synced: &SyncedWrites,
    ) -> RedisResult<(T, u32)> {
        match synced.send(&self.cmd).await {
            Err(err)
                if err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                let mut connection = synced.connection();
                self.script
                    .prepare_invoke()
                    .load_async(&mut connection)
                    .await?;
                synced.send(&self.cmd).await
            }
            other => other,
        }
    }
}
