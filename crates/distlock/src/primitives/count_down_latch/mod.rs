//! The count-down latch (Redisson's `RCountDownLatch` layout): a count at the name, and a
//! channel, `redisson_countdownlatch__channel__{name}`, on which the count reaching zero
//! publishes `0` and a new count publishes `1`.
//!
//! Waiting is the engine's loop: an "attempt" reads the count (open when it is gone or at
//! zero), and every message on the channel wakes every waiter
//! ([`WakeRule::All`](crate::engine::waiters::WakeRule::All)), so a waiter wakes on the
//! message, not by polling.

pub(crate) mod scripts;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::cluster_routing::Slot;
use scripts::{LATCH_COUNT_DOWN, LATCH_SET};

use crate::engine::acquire::{acquire, Acquire, Attempt, AttemptFuture, Patience};
use crate::engine::session::{Core, Session};
use crate::engine::subscriptions::WakeRule;
use crate::error::{Error, Result};
use crate::primitives::keys::latch_channel;
use crate::transport::script::ScriptCall;

/// A latch's key and channel, worked out once per handle.
struct LatchKeys {
    key: Arc<str>,
    channel: String,
}

/// A handle on one named count-down latch. Cheap to clone.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = distlock_testkit::RedisServer::start().await?;
/// # let client = distlock::Client::connect(&server.url()).await?;
/// use std::time::Duration;
///
/// let warmed_up = client.count_down_latch("cache:warm")?;
/// warmed_up.try_set_count(2).await?; // two shards to load
///
/// let waiter = tokio::spawn({
///     let latch = warmed_up.clone();
///     async move { latch.wait_for(Duration::from_secs(5)).await }
/// });
/// warmed_up.count_down().await?;
/// assert_eq!(warmed_up.count().await?, 1);
/// warmed_up.count_down().await?; // the latch opens; every waiter wakes
/// assert!(waiter.await??);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct CountDownLatch {
    session: Session,
    keys: Arc<LatchKeys>,
}

impl fmt::Debug for CountDownLatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountDownLatch")
            .field("key", &self.keys.key)
            .finish()
    }
}

impl CountDownLatch {
    /// The latch whose Redis key is `key`: the client's key prefix, then the name.
    ///
    /// Redisson's latch channel puts braces around the name whatever it holds, so a name
    /// with a hash tag of its own gives a channel in another slot than the key. On a Redis
    /// Cluster every script of the latch would then fail with CROSSSLOT: such a name is
    /// refused there ([`Error::InvalidName`]).
    pub(crate) fn new(session: Session, key: String) -> Result<Self> {
        let prefix = &session.core().config().key_prefix;
        let channel = latch_channel(prefix, &key);
        if session.core().deployment().is_cluster()
            && Slot::for_key(channel.as_bytes()) != Slot::for_key(key.as_bytes())
        {
            return Err(Error::InvalidName {
                name: key,
                reason: "a latch's channel wraps its name in braces, as Redisson's does, so \
                         a name with a hash tag of its own puts the channel in another \
                         Redis Cluster slot; leave the braces out of a latch's name",
            });
        }
        Ok(Self {
            session,
            keys: Arc::new(LatchKeys {
                key: key.into(),
                channel,
            }),
        })
    }

    /// The latch's Redis key: the client's key prefix, if any, followed by its name.
    pub fn key(&self) -> &str {
        &self.keys.key
    }

    /// Sets the count to `count` if the latch is open (no count set). Returns whether it
    /// set it. A count of zero is refused ([`Error::InvalidArgument`]): it would be an
    /// open latch.
    pub async fn try_set_count(&self, count: u64) -> Result<bool> {
        let count = match i64::try_from(count) {
            Ok(count @ 1..) => count,
            _ => {
                return Err(Error::InvalidArgument {
                    what: "latch count",
                    reason: format!("{count} is not in 1..=i64::MAX"),
                })
            }
        };
        let core = self.session.core();
        let mut call = ScriptCall::new(&LATCH_SET, &[&self.keys.key, &self.keys.channel], 2);
        call.arg(count).arg(core.deployment().publish_command());
        let set: i64 = core.write(&call, &self.keys.key, true).await?;
        Ok(set == 1)
    }

    /// Counts down by one; the last count opens the latch and wakes every waiter.
    /// Returns the count left (0: open). On an open latch it changes nothing.
    pub async fn count_down(&self) -> Result<u64> {
        // Sent once: sent again after a lost reply, it would count down twice.
        let core = self.session.core();
        let mut call = ScriptCall::new(&LATCH_COUNT_DOWN, &[&self.keys.key, &self.keys.channel], 1);
        call.arg(core.deployment().publish_command());
        let left: i64 = core.write(&call, &self.keys.key, false).await?;
        Ok(left.max(0).unsigned_abs())
    }

    /// The count left; 0 when the latch is open.
    pub async fn count(&self) -> Result<u64> {
        read_count(self.session.core(), &self.keys.key).await
    }

    /// Waits until the latch is open.
    pub async fn wait(&self) -> Result<()> {
        let opening = self.opening();
        loop {
            if acquire(&opening.core, &opening, Patience::Forever)
                .await?
                .is_some()
            {
                return Ok(());
            }
        }
    }

    /// Waits up to `timeout` for the latch to open; `Ok(false)` if it did not in time.
    pub async fn wait_for(&self, timeout: Duration) -> Result<bool> {
        let patience = Patience::within(timeout)?;
        let opening = self.opening();
        Ok(acquire(&opening.core, &opening, patience).await?.is_some())
    }

    fn opening(&self) -> Opening {
        Opening {
            core: Arc::clone(self.session.core()),
            keys: Arc::clone(&self.keys),
        }
    }
}

/// The latch's count: 0 when there is none.
async fn read_count(core: &Core, key: &str) -> Result<u64> {
    let get = redis::cmd("GET").arg(key).clone();
    let count: Option<String> = core.query(&get).await?;
    match count {
        None => Ok(0),
        Some(count) => count
            .parse::<i64>()
            .map(|count| count.max(0).unsigned_abs())
            .map_err(|_| Error::InvalidArgument {
                what: "latch",
                reason: format!("{key} holds {count:?}, not a count"),
            }),
    }
}

/// Waiting for a latch to open, as the engine tries it: each "attempt" reads the count.
struct Opening {
    core: Arc<Core>,
    keys: Arc<LatchKeys>,
}

impl Acquire for Opening {
    type Guard = ();

    fn kind(&self) -> &'static str {
        "latch"
    }

    fn attempt(&self) -> AttemptFuture<()> {
        let (core, keys) = (Arc::clone(&self.core), Arc::clone(&self.keys));
        Box::pin(async move {
            Ok(match read_count(&core, &keys.key).await? {
                0 => Attempt::Acquired(()),
                _ => Attempt::Busy { retry_after: None },
            })
        })
    }

    fn channel(&self) -> &str {
        &self.keys.channel
    }

    fn queue(&self) -> &str {
        &self.keys.key
    }

    fn wake_rule(&self) -> WakeRule {
        WakeRule::All
    }
}
