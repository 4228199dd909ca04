//! Running distlock's Lua scripts. Each primitive keeps its scripts in files of its own
//! (`primitives/<primitive>/scripts/*.lua`) and declares them as [`LuaScript`]s.
//!
//! Each is run with EVALSHA through [`ScriptCall`], which sends it once more as EVAL, with
//! its source, when the server answers NOSCRIPT: a Redis restart, `SCRIPT FLUSH`, or a
//! cluster replica promoted in a failover (scripts loaded at connect reach the masters
//! only) then costs one extra round trip instead of an error. EVAL is routed by its keys
//! like the EVALSHA it replaces, so it reaches the very server that lacked the script, and
//! caches the script there.

use std::sync::OnceLock;

use redis::{Arg, Cmd, FromRedisValue, RedisResult, Script, ToRedisArgs, Value};

use crate::transport::connection::Connection;
use crate::transport::replica_sync::{Acks, SyncedWrites};

/// One of distlock's scripts: its source, and the hash EVALSHA calls it by (worked out on
/// first use).
pub(crate) struct LuaScript {
    source: &'static str,
    script: OnceLock<Script>,
}

impl LuaScript {
    /// A script with this source, for a `static`: `LuaScript::new(include_str!(…))`.
    pub(crate) const fn new(source: &'static str) -> Self {
        Self {
            source,
            script: OnceLock::new(),
        }
    }

    fn script(&self) -> &Script {
        self.script.get_or_init(|| Script::new(self.source))
    }
}

/// Loads `scripts` into the server's cache. Without this, the first use of a script costs
/// NOSCRIPT, SCRIPT LOAD and a second EVALSHA, and a scheduler that sends many renewal
/// batches at once would pay that for each batch.
pub(crate) async fn preload(
    connection: &Connection,
    scripts: impl IntoIterator<Item = &'static LuaScript>,
) -> redis::RedisResult<()> {
    let loads = scripts.into_iter().map(|script| {
        let mut connection = connection.clone();
        async move {
            script
                .script()
                .prepare_invoke()
                .load_async(&mut connection)
                .await
        }
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
    script: &'static LuaScript,
    cmd: Cmd,
}

impl ScriptCall {
    /// A call of `script` on `keys`, with room for `args` more arguments.
    pub(crate) fn new(script: &'static LuaScript, keys: &[&str], args: usize) -> Self {
        let count = 3 + keys.len() + args;
        let mut cmd = Cmd::with_capacity(count, count * BYTES_PER_ARGUMENT);
        cmd.arg("EVALSHA")
            .arg(script.script().get_hash())
            .arg(keys.len());
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

    /// The same call as `EVAL` with the script's source, for a server that answered
    /// NOSCRIPT.
    fn as_eval(&self) -> Cmd {
        let mut eval = redis::cmd("EVAL");
        eval.arg(self.script.source);
        // After EVALSHA and the hash: the key count, the keys and the arguments.
        for arg in self.cmd.args_iter().skip(2) {
            if let Arg::Simple(bytes) = arg {
                eval.arg(bytes);
            }
        }
        eval
    }

    /// Sends the call. A server that lost the script (restarted, flushed its cache, or
    /// promoted from a replica) gets the call again as EVAL.
    pub(crate) async fn invoke<T: FromRedisValue>(
        &self,
        connection: &mut Connection,
    ) -> RedisResult<T> {
        // As `Cmd::query_async` reads a reply: a server error in it is the call's error.
        let reply = match connection
            .send(&self.cmd)
            .await
            .and_then(Value::extract_error)
        {
            Err(err) if is_no_script(&err) => connection
                .send(&self.as_eval())
                .await
                .and_then(Value::extract_error),
            other => other,
        };
        Ok(redis::from_redis_value(reply?)?)
    }

    /// Sends the call followed by a WAIT for replicas, on a connection of `synced`.
    /// Returns the script's reply and what the WAIT reported.
    pub(crate) async fn invoke_synced<T: FromRedisValue>(
        &self,
        synced: &SyncedWrites,
    ) -> RedisResult<(T, Acks)> {
        match synced.send(&self.cmd).await {
            Err(err) if is_no_script(&err) => synced.send(&self.as_eval()).await,
            other => other,
        }
    }
}

fn is_no_script(err: &redis::RedisError) -> bool {
    err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_as_eval_carries_the_source_keys_and_arguments() {
        static SCRIPT: LuaScript = LuaScript::new("return KEYS[1]");
        let mut call = ScriptCall::new(&SCRIPT, &["a", "b"], 2);
        call.arg(30_000).arg("owner");
        let eval = call.as_eval();
        let args: Vec<Vec<u8>> = eval
            .args_iter()
            .map(|arg| match arg {
                Arg::Simple(bytes) => bytes.to_vec(),
                _ => Vec::new(),
            })
            .collect();
        let expected: Vec<&[u8]> = vec![
            b"EVAL",
            SCRIPT.source.as_bytes(),
            b"2",
            b"a",
            b"b",
            b"30000",
            b"owner",
        ];
        assert_eq!(args, expected);
    }
}
