//! A private `redis-server` process, owned by the process that starts it.
//!
//! Two uses share this crate:
//! - **a service's embedded mode**: with no Redis configured, the service runs its own,
//!   whose data must survive the service being killed and restarted
//!   ([`PrivateRedis::persistent`]);
//! - **tests and throwaway sandboxes**: a fresh, empty server per test, that can be
//!   paused, killed and restarted to reproduce failures ([`PrivateRedis::ephemeral`]).
//!
//! Either way the server listens on a free loopback port only. The binary is
//! `redis-server` from `PATH`, or the one named by `DISTLOCK_REDIS_SERVER`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), private_redis::Error> {
//! use private_redis::PrivateRedis;
//!
//! let scratch = PrivateRedis::ephemeral().args(&["--maxmemory", "10mb"]).start().await?;
//! println!("a throwaway redis at {}", scratch.url());
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod data_dir;
mod error;
mod process;
mod scratch;
mod server;

pub use data_dir::DirLock;
pub use error::Error;
pub use process::{pick_free_port, REDIS_SERVER_ENV};
pub use scratch::ScratchDir;
pub use server::{Builder, PrivateRedis};
