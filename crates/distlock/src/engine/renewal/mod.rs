//! Renewal: one scheduler per client renews every held lease, of every kind, in batches
//! from one task, and says when one is lost.
//!
//! - [`registry`]: the entries (one per held lease) and the renewal kinds;
//! - [`lease`]: a holder's handle on its entry: trusted until when, and its lost signal;
//! - [`scheduler`]: the task that renews and expires entries.

pub(crate) mod lease;
pub(crate) mod registry;
pub(crate) mod scheduler;
