//! The engine: the machinery every primitive shares, knowing no primitive by name.
//!
//! - [`session`]: a client's shared state (connection, subscriptions, renewal, owner ids)
//!   and the counted handle that keeps it open;
//! - [`acquire`]: the one acquisition loop: try the primitive's script, wait on a
//!   notification, retry, stay safe under cancellation;
//! - [`subscriptions`]: one pub/sub connection per client, one subscription per channel,
//!   shared by all local waiters;
//! - [`waiters`]: the local waiters of one primitive, and what a message means for them
//!   (wake rules, arrival order with permit counts, a waiter's mailbox);
//! - [`renewal`]: one renewal scheduler per client, renewing held leases of every kind in
//!   batches and signalling the ones that are lost;
//! - [`lease_set`]: leases made of other leases (a MultiLock's, a RedLock's);
//! - [`detach`]: run-to-completion, so a cancelled caller never leaves a script's effect
//!   half-handled;
//! - [`latches`]: deleting the answers of releases once read;
//! - [`write`]: acquisitions sent with replica sync, and given back when they cannot be
//!   trusted;
//! - [`observe`]: tracing events and, with the `metrics` feature, metrics of acquisitions
//!   and lost leases.
//!
//! A primitive only describes its scripts, channels and lease kinds; it never writes its
//! own wait or renewal loop.

pub(crate) mod acquire;
pub(crate) mod detach;
pub(crate) mod latches;
pub(crate) mod lease_set;
pub(crate) mod observe;
pub(crate) mod renewal;
pub(crate) mod session;
pub(crate) mod subscriptions;
pub(crate) mod waiters;
pub(crate) mod write;
