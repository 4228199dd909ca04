//! The primitives: each a thin layer over the engine that states its keys, its scripts,
//! its channels and how its leases are renewed.
//!
//! - [`keys`]: Redisson's key and channel names, shared by every primitive;
//! - [`lock`]: the lease lock (`RLock`), with fencing tokens and explicit re-entry;
//! - [`fair_lock`]: first come, first served (`RFairLock`), with direct handoff;
//! - [`rw_lock`]: many readers or one writer (`RReadWriteLock`), writer preference;
//! - [`semaphore`]: permits shared by a fleet (`RSemaphore`);
//! - [`permit_semaphore`]: permits that are leases, renewed while held
//!   (`RPermitExpirableSemaphore`);
//! - [`count_down_latch`]: wait until a count reaches zero (`RCountDownLatch`);
//! - [`red_lock`]: one lock over several independent masters, held by a majority;
//! - [`multi_lock`]: several locks taken together, held while all are.

pub(crate) mod count_down_latch;
pub(crate) mod fair_lock;
pub(crate) mod keys;
pub(crate) mod lock;
pub(crate) mod multi_lock;
pub(crate) mod permit_semaphore;
pub(crate) mod red_lock;
pub(crate) mod rw_lock;
pub(crate) mod semaphore;

use crate::transport::script::LuaScript;
use crate::transport::Store;

/// Every script of every primitive, loaded into the server's cache at connect.
pub(crate) fn scripts() -> impl Iterator<Item = &'static LuaScript> {
    lock::scripts::ALL
        .iter()
        .chain(fair_lock::scripts::ALL.iter())
        .chain(semaphore::scripts::ALL.iter())
        .chain(permit_semaphore::scripts::ALL.iter())
        .chain(count_down_latch::scripts::ALL.iter())
        .chain(rw_lock::scripts::ALL.iter())
        .copied()
}

/// What a client on PostgreSQL creates at connect when missing (every primitive's
/// tables), and the statements that check them whoever created them.
#[cfg(feature = "postgres")]
pub(crate) fn postgres_setup() -> (&'static [&'static str], &'static [&'static str]) {
    static SETUP: [&str; 3] = [
        lock::postgres::SCHEMA,
        rw_lock::postgres::SCHEMA,
        permit_semaphore::postgres::SCHEMA,
    ];
    static CHECK: [&str; 3] = [
        lock::postgres::SCHEMA_CHECK,
        rw_lock::postgres::SCHEMA_CHECK,
        permit_semaphore::postgres::SCHEMA_CHECK,
    ];
    (&SETUP, &CHECK)
}

/// Refuses a name the client's store cannot keep, beyond what every store refuses
/// ([`keys::validate_name`]).
pub(crate) fn validate_name_for(store: &Store, name: &str) -> crate::error::Result<()> {
    match store {
        Store::Redis => {
            let _ = name;
            Ok(())
        }
        #[cfg(feature = "postgres")]
        Store::Postgres(_) => lock::postgres::validate_name(name),
        #[cfg(feature = "etcd")]
        Store::Etcd(_) => lock::etcd::validate_name(name),
        #[cfg(feature = "zk")]
        Store::Zk(_) => lock::zk::validate_name(name),
    }
}
