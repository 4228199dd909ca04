//! A storage system that rejects writes from stale lock holders.
//!
//! A lock alone cannot stop a holder that was paused (GC, SIGSTOP, network
//! partition) from writing after its lease expired and someone else took the
//! lock. Fencing fixes that on the storage side: every write carries the
//! holder's fencing token and the storage refuses tokens older than the
//! newest one it has accepted. [`FencedResource`] models such a storage
//! system inside Redis so that tests can show stale writes are refused.
//!
//! All state lives in Redis, so any number of processes can share one
//! resource by using the same key.

use std::fmt;
use std::sync::LazyLock;

use redis::aio::MultiplexedConnection;

use crate::error::TestkitError;

/// Compiled once so its SHA1 is computed once; `invoke_async` sends EVALSHA
/// and falls back to loading the script when the server answers NOSCRIPT
/// (e.g. after a restart).
static FENCED_WRITE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("scripts/fenced_write.lua")));

/// A Redis-backed value that only accepts writes carrying a fencing token at
/// least as high as any token it has accepted before.
///
/// Besides the data key itself it uses `{key}:fence` (highest accepted token)
/// and `{key}:rejected` (count of refused writes). Their hash tag is the data
/// key, so on a Redis Cluster all three land in the data key's slot (as long
/// as the data key itself contains no braces) and the script may touch them
/// atomically.
#[derive(Clone)]
pub struct FencedResource {
    conn: MultiplexedConnection,
    key: String,
}

impl fmt::Debug for FencedResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FencedResource")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl FencedResource {
    /// Wraps `key` on the server behind `conn`.
    pub fn new(conn: MultiplexedConnection, key: impl Into<String>) -> Self {
        Self {
            conn,
            key: key.into(),
        }
    }

    /// Writes `value` if `token` is at least the highest token accepted so
    /// far. Returns `true` when accepted, `false` when refused as stale (the
    /// refusal is counted in [`rejected`](Self::rejected)).
    pub async fn write(&self, token: u64, value: &str) -> Result<bool, TestkitError> {
        // MultiplexedConnection clones share one socket; a clone per call
        // lets `write` take `&self` and run concurrently.
        let mut conn = self.conn.clone();
        let accepted: i64 = FENCED_WRITE
            .key(&self.key)
            .key(self.fence_key())
            .key(self.rejected_key())
            .arg(token)
            .arg(value)
            .invoke_async(&mut conn)
            .await?;
        match accepted {
            1 => Ok(true),
            0 => Ok(false),
            other => Err(TestkitError::UnexpectedReply(format!(
                "fenced_write returned {other}, expected 0 or 1"
            ))),
        }
    }

    /// Number of writes refused because their token was stale.
    pub async fn rejected(&self) -> Result<u64, TestkitError> {
        let count: Option<u64> = self.get(&self.rejected_key()).await?;
        Ok(count.unwrap_or(0))
    }

    /// Highest fencing token accepted so far, `None` before the first write.
    pub async fn highest_token(&self) -> Result<Option<u64>, TestkitError> {
        self.get(&self.fence_key()).await
    }

    /// The last accepted value, `None` before the first write.
    pub async fn value(&self) -> Result<Option<String>, TestkitError> {
        self.get(&self.key).await
    }

    async fn get<T: redis::FromRedisValue>(&self, key: &str) -> Result<T, TestkitError> {
        let mut conn = self.conn.clone();
        Ok(redis::cmd("GET").arg(key).query_async(&mut conn).await?)
    }

    fn fence_key(&self) -> String {
        format!("{{{}}}:fence", self.key)
    }

    fn rejected_key(&self) -> String {
        format!("{{{}}}:rejected", self.key)
    }
}
