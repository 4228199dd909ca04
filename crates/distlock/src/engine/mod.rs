//! The machinery every primitive shares:
//!
//! - [`acquire`]: the acquisition engine: try the script, wait on a notification, retry,
//!   stay safe under cancellation;
//! - [`subscriptions`]: one pub/sub connection per client, one subscription per channel,
//!   shared by all local waiters;
//! - [`watchdog`]: one renewal scheduler per client, renewing held leases in batches and
//!   signalling the ones that are lost;
//! - [`detach`]: run-to-completion, so a cancelled caller never leaves a script's effect
//!   half-handled.
//!
//! A primitive only describes its scripts; it never writes its own wait or renewal loop.

pub(crate) mod acquire;
pub(crate) mod detach;
pub(crate) mod latches;
pub(crate) mod lease_set;
pub(crate) mod subscriptions;
pub(crate) mod watchdog;
