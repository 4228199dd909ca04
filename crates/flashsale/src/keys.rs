//! Redis key names.
//!
//! Every key of one coupon carries the hash tag `{flashsale:coupon:ID}`, so they all live
//! in one Redis Cluster slot and the reservation script may touch them together.

/// The consumer group of the order workers, one per coupon stream.
pub const ORDER_GROUP: &str = "flashsale-orders";

/// The distlock lock held while stock is loaded into Redis, so one instance loads it.
pub const STOCK_LOADER_LOCK: &str = "flashsale:stock-loader";

/// The keys of one coupon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CouponKeys {
    /// A hash from segment number ("0", "1", …) to the stock left in that segment. Every
    /// strategy but `segmented` uses the single segment "0".
    pub stock: String,
    /// The set of user ids that bought this coupon.
    pub buyers: String,
    /// The stream of order events, read by the workers' consumer group.
    pub orders: String,
    tag: String,
}

impl CouponKeys {
    /// The keys of coupon `coupon_id`.
    pub fn new(coupon_id: i64) -> Self {
        let tag = format!("flashsale:{{coupon:{coupon_id}}}");
        CouponKeys {
            stock: format!("{tag}:stock"),
            buyers: format!("{tag}:buyers"),
            orders: format!("{tag}:orders"),
            tag,
        }
    }

    /// The distlock lock of the `lock` strategy.
    pub fn lock(&self) -> String {
        format!("{}:lock", self.tag)
    }

    /// The distlock lock of segment `segment` in the `segmented` strategy.
    pub fn segment_lock(&self, segment: u32) -> String {
        format!("{}:lock:{segment}", self.tag)
    }

    /// Which coupon a stream key belongs to, for entries read from several streams.
    pub fn coupon_of_stream(stream: &str) -> Option<i64> {
        stream
            .strip_prefix("flashsale:{coupon:")?
            .strip_suffix("}:orders")?
            .parse()
            .ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_keys_of_a_coupon_share_one_hash_tag() {
        let keys = CouponKeys::new(42);
        for key in [
            &keys.stock,
            &keys.buyers,
            &keys.orders,
            &keys.lock(),
            &keys.segment_lock(3),
        ] {
            assert!(key.contains("{coupon:42}"), "{key}");
            assert_eq!(key.matches('{').count(), 1, "{key}");
        }
        assert_eq!(CouponKeys::coupon_of_stream(&keys.orders), Some(42));
        assert_eq!(CouponKeys::coupon_of_stream("other"), None);
    }
}
