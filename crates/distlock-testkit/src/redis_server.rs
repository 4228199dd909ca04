//! A real `redis-server` process for tests.
//!
//! Each [`RedisServer`] runs its own `redis-server` on a private loopback port with a
//! private working directory and persistence disabled, so tests can run in parallel
//! without sharing state. The harness can pause (SIGSTOP), resume, kill and restart the
//! process to reproduce the failures a distributed lock has to survive.
//!
//! The process itself is a [`private_redis::PrivateRedis`], which the product also uses
//! for its embedded mode; this layer adds what only tests need.

use std::collections::HashMap;

use private_redis::PrivateRedis;

use crate::error::TestkitError;

pub use private_redis::{pick_free_port, REDIS_SERVER_ENV};

/// A `redis-server` process owned by the test.
///
/// The server listens on `127.0.0.1` only, keeps its files in a private temporary
/// directory, and persists nothing (`--save ""`, `--appendonly no`). Dropping the value
/// kills the process and deletes the directory.
///
/// Its output is drained continuously (so the pipe never fills and blocks the server) and
/// the last lines are kept for diagnostics, see [`recent_log`](Self::recent_log).
#[derive(Debug)]
pub struct RedisServer {
    process: PrivateRedis,
}

impl RedisServer {
    /// Starts a `redis-server` on a free loopback port and waits until it accepts
    /// connections.
    ///
    /// The binary is taken from the `DISTLOCK_REDIS_SERVER` environment variable if set,
    /// otherwise `redis-server` from `PATH`.
    pub async fn start() -> Result<RedisServer, TestkitError> {
        Self::start_with_args(&[]).await
    }

    /// Like [`start`](Self::start), with `extra` appended to the redis-server command line
    /// (e.g. `&["--maxmemory", "10mb"]`). Later arguments override earlier ones, so these
    /// can override the defaults. They are reused by [`restart`](Self::restart).
    pub async fn start_with_args(extra: &[&str]) -> Result<RedisServer, TestkitError> {
        let process = PrivateRedis::ephemeral().args(extra).start().await?;
        Ok(RedisServer { process })
    }

    /// Starts a single Sentinel (`redis-server --sentinel`) with `config` as its
    /// configuration, e.g. `sentinel monitor mymaster 127.0.0.1 6379 1` plus any
    /// `sentinel auth-pass` a test needs. For a whole deployment with failover helpers,
    /// use [`SentinelGroup`](crate::SentinelGroup).
    pub async fn start_sentinel(config: &str) -> Result<RedisServer, TestkitError> {
        let process = PrivateRedis::ephemeral()
            .sentinel(config.to_owned())
            .start()
            .await?;
        Ok(RedisServer { process })
    }

    /// The TCP port the server listens on (stable across restarts).
    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// Connection URL, `redis://127.0.0.1:{port}/`.
    pub fn url(&self) -> String {
        self.process.url()
    }

    /// Process id of the running server; `None` after [`kill`](Self::kill).
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// A client for this server. Creating it does not connect.
    pub fn client(&self) -> Result<redis::Client, TestkitError> {
        Ok(redis::Client::open(self.url())?)
    }

    /// Opens a new multiplexed connection to this server.
    pub async fn connection(&self) -> Result<redis::aio::MultiplexedConnection, TestkitError> {
        Ok(self.client()?.get_multiplexed_async_connection().await?)
    }

    /// Freezes the server with SIGSTOP, simulating a stop-the-world pause or an
    /// unreachable node: connections stay open but nothing is answered. Time keeps passing
    /// for everyone else, which is the point: leases expire while the server is frozen.
    pub fn pause(&self) -> Result<(), TestkitError> {
        Ok(self.process.pause()?)
    }

    /// Continues a server frozen by [`pause`](Self::pause) (SIGCONT). Harmless on a server
    /// that is not paused.
    pub fn resume(&self) -> Result<(), TestkitError> {
        Ok(self.process.resume()?)
    }

    /// Kills the server with SIGKILL, simulating a crash, and waits until the process has
    /// exited. Does nothing if it is not running.
    pub async fn kill(&mut self) -> Result<(), TestkitError> {
        Ok(self.process.kill().await?)
    }

    /// Kills the server if it is running, then starts a new one on the same port with the
    /// same arguments. Persistence is disabled, so **all data is lost**: the new server
    /// starts empty, like a master that crashed before persisting (or a failover to a
    /// replica that had not received the latest writes). Existing connections are broken;
    /// open new ones.
    pub async fn restart(&mut self) -> Result<(), TestkitError> {
        Ok(self.process.restart().await?)
    }

    /// The last lines (up to 50) the server wrote to stdout and stderr, oldest first.
    /// Stderr lines are prefixed with `stderr: `.
    pub fn recent_log(&self) -> Vec<String> {
        self.process.recent_log()
    }

    /// Runs `INFO commandstats` and returns the number of calls per command, e.g.
    /// `"evalsha" -> 12`. Subcommands appear as `"client|setinfo"`. Counters only include
    /// commands since the last start or `CONFIG RESETSTAT`.
    pub async fn info_commandstats(&self) -> Result<HashMap<String, u64>, TestkitError> {
        let mut conn = self.connection().await?;
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut conn)
            .await?;
        parse_commandstats(&info)
    }
}

/// Parses `cmdstat_<name>:calls=<n>,usec=...` lines of `INFO commandstats`.
fn parse_commandstats(info: &str) -> Result<HashMap<String, u64>, TestkitError> {
    let mut stats = HashMap::new();
    for line in info.lines() {
        let Some(rest) = line.trim_end().strip_prefix("cmdstat_") else {
            continue;
        };
        let malformed =
            || TestkitError::UnexpectedReply(format!("INFO commandstats line `{line}`"));
        let (name, fields) = rest.split_once(':').ok_or_else(malformed)?;
        let calls = fields
            .split(',')
            .find_map(|field| field.strip_prefix("calls="))
            .ok_or_else(malformed)?
            .parse::<u64>()
            .map_err(|_| malformed())?;
        stats.insert(name.to_owned(), calls);
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_commandstats() -> Result<(), TestkitError> {
        let info = "# Commandstats\r\n\
            cmdstat_evalsha:calls=12,usec=340,usec_per_call=28.33,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_client|setinfo:calls=2,usec=3,usec_per_call=1.50,rejected_calls=0,failed_calls=0\r\n";
        let stats = parse_commandstats(info)?;
        assert_eq!(stats.len(), 2);
        assert_eq!(stats.get("evalsha"), Some(&12));
        assert_eq!(stats.get("client|setinfo"), Some(&2));
        Ok(())
    }

    #[test]
    fn rejects_malformed_commandstats() {
        let result = parse_commandstats("cmdstat_get:usec=3\r\n");
        assert!(
            matches!(result, Err(TestkitError::UnexpectedReply(_))),
            "{result:?}"
        );
    }
}
