//! Redis key names.
//!
//! Every key carries the namespace of the SQL store it belongs to ([`Keyspace`]): an id
//! created with the schema and kept in the database. Two stores sharing one Redis (two
//! services, or a `load` run beside a `serve`) therefore never share a counter, a buyers
//! set, a stream or a lock, even when their coupon ids are the same.
//!
//! Every key of one coupon carries the hash tag `{NAMESPACE:coupon:ID}`, so they all live
//! in one Redis Cluster slot and the reservation script may touch them together.

use std::sync::Arc;

/// The consumer group of the order workers, one per coupon stream.
pub const ORDER_GROUP: &str = "flashsale-orders";

/// The key names of one SQL store's data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keyspace {
    namespace: Arc<str>,
}

impl Keyspace {
    /// The keys of the store whose namespace id is `namespace`.
    pub fn new(namespace: &str) -> Self {
        Keyspace {
            namespace: namespace.into(),
        }
    }

    /// The namespace id.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The keys of coupon `coupon_id`.
    pub fn coupon(&self, coupon_id: i64) -> CouponKeys {
        let tag = format!("flashsale:{{{}:coupon:{coupon_id}}}", self.namespace);
        CouponKeys {
            stock: format!("{tag}:stock"),
            buyers: format!("{tag}:buyers"),
            orders: format!("{tag}:orders"),
            claims: format!("{tag}:claims"),
            row: format!("{tag}:row"),
            retired: format!("{tag}:orders:retired"),
            tag,
        }
    }

    /// The distlock lock held while stock is loaded into Redis, so one instance loads it.
    pub fn stock_loader_lock(&self) -> String {
        format!("flashsale:{}:stock-loader", self.namespace)
    }

    /// A SCAN pattern matching every lock of this store's coupons: the `lock` strategy's
    /// and each segment's.
    pub fn coupon_locks_pattern(&self) -> String {
        format!("flashsale:{{{}:coupon:*}}:lock*", self.namespace)
    }

    /// Where this store's stock authority keeps its id (see [`crate::authority`]).
    pub fn authority(&self) -> String {
        format!("flashsale:{}:stock-authority", self.namespace)
    }

    /// The id of the tenure this Redis's coupon state (order streams, counters) belongs to:
    /// an earlier tenure's is set aside before a new one sells (`stock::StockLoader`).
    pub fn stream_tenure(&self) -> String {
        format!("flashsale:{}:stream-tenure", self.namespace)
    }

    /// Which coupon of this store a stream key belongs to, for entries read from several
    /// streams. `None` for any other key, another store's included.
    pub fn coupon_of_stream(&self, stream: &str) -> Option<i64> {
        stream
            .strip_prefix("flashsale:{")?
            .strip_prefix(&*self.namespace)?
            .strip_prefix(":coupon:")?
            .strip_suffix("}:orders")?
            .parse()
            .ok()
    }
}

/// The keys of one coupon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CouponKeys {
    /// A hash from segment number ("0", "1", …) to the stock left in that segment. Every
    /// strategy but `segmented` uses the single segment "0".
    pub stock: String,
    /// A hash from each buyer's user id to the order id it holds (or a segmented claim,
    /// `~…`, while its sale is in progress).
    pub buyers: String,
    /// The stream of order events, read by the workers' consumer group.
    pub orders: String,
    /// The segmented strategy's claims in progress: a sorted set of user ids, scored by
    /// the time each claim's sale is settled by (see `scripts/claim.lua`).
    pub claims: String,
    /// The coupon row these keys belong to (its creation time, Unix ms): after a database
    /// restore, a new coupon may get an old coupon's id, and must not inherit its keys.
    pub row: String,
    /// The set of this coupon's order streams set aside (`scripts/retire_stream.lua`),
    /// each named [`CouponKeys::retired_stream`].
    pub retired: String,
    tag: String,
}

impl CouponKeys {
    /// The distlock lock of the `lock` strategy.
    pub fn lock(&self) -> String {
        format!("{}:lock", self.tag)
    }

    /// A name to set the order stream aside under: `why` says what retired it (`t7`, the
    /// tenure that ended; `c…`, the coupon row replaced), made unique.
    pub fn retired_stream(&self, why: &str) -> String {
        format!(
            "{}:orders:retired:{why}:{}",
            self.tag,
            uuid::Uuid::new_v4().simple()
        )
    }

    /// The distlock lock of segment `segment` in the `segmented` strategy.
    pub fn segment_lock(&self, segment: u32) -> String {
        format!("{}:lock:{segment}", self.tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_keys_of_a_coupon_share_one_hash_tag() {
        let keys = Keyspace::new("a1b2").coupon(42);
        for key in [
            &keys.stock,
            &keys.buyers,
            &keys.orders,
            &keys.claims,
            &keys.row,
            &keys.retired,
            &keys.retired_stream("t1"),
            &keys.lock(),
            &keys.segment_lock(3),
        ] {
            assert!(key.contains("{a1b2:coupon:42}"), "{key}");
            let pattern = Keyspace::new("a1b2").coupon_locks_pattern();
            let prefix = pattern.split('*').next().unwrap_or_default();
            assert!(key.starts_with(prefix), "{key}");
            assert_eq!(key.matches('{').count(), 1, "{key}");
        }
    }

    #[test]
    fn a_stream_is_recognised_only_by_its_own_store() {
        let ours = Keyspace::new("a1b2");
        let theirs = Keyspace::new("c3d4");
        let stream = ours.coupon(42).orders;
        assert_eq!(ours.coupon_of_stream(&stream), Some(42));
        assert_eq!(theirs.coupon_of_stream(&stream), None);
        assert_eq!(ours.coupon_of_stream("other"), None);
        assert_ne!(ours.coupon(42).stock, theirs.coupon(42).stock);
        assert_ne!(ours.stock_loader_lock(), theirs.stock_loader_lock());
        assert_ne!(ours.authority(), theirs.authority());
    }
}
