//! Prometheus metrics, served at `GET /metrics` in the text exposition format.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// The label of a purchase's outcome: `reserved`, `sold_out`, `already_purchased`, or the
/// error code of a refusal.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// The outcome.
    pub outcome: String,
}

/// Why the `lock` strategy refused its own write: `fenced` or `lease_lost`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// The reason.
    pub reason: String,
}

/// The labels of an HTTP request: its route pattern and response status.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabel {
    /// The route, as declared (`/api/coupons/{id}/seckill`).
    pub route: String,
    /// The response status.
    pub status: u16,
}

/// A histogram family whose histograms share one set of buckets.
type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// 100 µs to about 52 s.
fn http_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_1, 2.0, 20))
}

/// Why stock was loaded: `new` (a coupon with no sales yet) or `reload` (a coupon that
/// had sales: Redis lost its counter).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// The kind.
    pub kind: String,
}

/// Every metric of one service instance. Cheap to clone; clones share the values.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// Purchase requests by outcome.
    pub purchases: Family<OutcomeLabel, Counter>,
    /// Seconds from request to response, by route and status.
    pub http_seconds: Histograms<HttpLabel>,
    /// Seconds spent reserving in Redis (the strategy's work, not HTTP).
    pub reservation_seconds: Histogram,
    /// Seconds a purchase waited for a coupon or segment lock, acquired or not.
    pub lock_wait_seconds: Histogram,
    /// Sales the `lock` strategy refused to commit because its lease could no longer be
    /// trusted, by reason.
    pub lock_writes_refused: Family<ReasonLabel, Counter>,
    /// Segmented claims removed because their sale could no longer happen (a crash).
    pub claims_repaired: Counter,
    /// Stock loads into Redis, by kind. A `reload` is the one sign that Redis lost data.
    pub stock_loads: Family<KindLabel, Counter>,
    /// Seconds one worker commit (SQL transaction and acknowledgements) took.
    pub worker_commit_seconds: Histogram,
    /// Worker rounds that failed (Redis or SQL), each retried.
    pub worker_errors: Counter,
    /// Orders the worker inserted.
    pub orders_stored: Counter,
    /// Order events skipped as already stored.
    pub orders_duplicate: Counter,
    /// Stream entries acknowledged without storing because they were not order events.
    pub orders_malformed: Counter,
    /// Entries taken over from a worker that stopped.
    pub orders_reclaimed: Counter,
    /// Order events not yet delivered to any worker, over the watched streams; set when
    /// scraped.
    pub stream_lag: Gauge,
    /// Order events delivered but not yet acknowledged; set when scraped.
    pub stream_pending: Gauge,
    /// When the order worker last finished a round without error, Unix seconds (0:
    /// never). `/healthz` reads it.
    pub worker_last_success: Gauge<f64, AtomicU64>,
}

/// Every outcome a purchase can have, so each series exists at 0 from the start and an
/// `increase()` alert sees the first event: `reserved`, or the error code answered.
pub const PURCHASE_OUTCOMES: &[&str] = &[
    "reserved",
    "sold_out",
    "already_purchased",
    "sale_not_started",
    "sale_ended",
    "coupon_not_found",
    "invalid_coupon_id",
    "missing_user_id",
    "invalid_user_id",
    "duplicate_user_id",
    "busy",
    "lock_lost",
    "overloaded",
    "expired",
    "stock_not_loaded",
    "unavailable",
    "outcome_unknown",
];

impl Metrics {
    /// Registers every metric under the `flashsale_` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("flashsale");
        let purchases = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "purchases",
            "Purchase requests by outcome",
            purchases.clone(),
        );
        let http_seconds: Histograms<HttpLabel> = Family::new_with_constructor(http_histogram);
        registry.register(
            "http_request_duration_seconds",
            "Time from request to response, by route and status",
            http_seconds.clone(),
        );
        // 50 µs to about 1.6 s: a script round trip sits at the bottom, a lock wait in the middle.
        let reservation_seconds = Histogram::new(exponential_buckets(0.000_05, 2.0, 16));
        registry.register(
            "reservation_duration_seconds",
            "Time spent reserving stock in Redis",
            reservation_seconds.clone(),
        );
        // 50 µs to about 26 s: a free lock at the bottom, a wait out to a lease at the top.
        let lock_wait_seconds = Histogram::new(exponential_buckets(0.000_05, 2.0, 20));
        registry.register(
            "lock_wait_duration_seconds",
            "Time a purchase waited for a coupon or segment lock, acquired or not",
            lock_wait_seconds.clone(),
        );
        let lock_writes_refused = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "lock_writes_refused",
            "Sales the lock strategy refused to commit: a newer holder had written (fenced) or the lease ran out (lease_lost)",
            lock_writes_refused.clone(),
        );
        let claims_repaired = Counter::default();
        registry.register(
            "claims_repaired",
            "Segmented claims removed after their settle-by time: left by a crash between claim and sale",
            claims_repaired.clone(),
        );
        let stock_loads = Family::<KindLabel, Counter>::default();
        registry.register(
            "stock_loads",
            "Stock loaded into Redis: new (no sales yet) or reload (the coupon had sales, so Redis lost its counter)",
            stock_loads.clone(),
        );
        let worker_commit_seconds = Histogram::new(exponential_buckets(0.000_1, 2.0, 18));
        registry.register(
            "worker_commit_duration_seconds",
            "Time one order worker commit took: the SQL transaction and the acknowledgements",
            worker_commit_seconds.clone(),
        );
        let worker_errors = Counter::default();
        registry.register(
            "worker_errors",
            "Order worker rounds that failed and were retried",
            worker_errors.clone(),
        );
        let orders_stored = Counter::default();
        registry.register(
            "orders_stored",
            "Orders inserted into SQL",
            orders_stored.clone(),
        );
        let orders_duplicate = Counter::default();
        registry.register(
            "orders_duplicate",
            "Order events skipped because the order or the user's order was already stored",
            orders_duplicate.clone(),
        );
        let orders_malformed = Counter::default();
        registry.register(
            "orders_malformed",
            "Stream entries acknowledged without storing because they were not order events",
            orders_malformed.clone(),
        );
        let orders_reclaimed = Counter::default();
        registry.register(
            "orders_reclaimed",
            "Order events taken over from a worker that stopped",
            orders_reclaimed.clone(),
        );
        let stream_lag = Gauge::default();
        registry.register(
            "stream_lag",
            "Order events not yet delivered to a worker",
            stream_lag.clone(),
        );
        let stream_pending = Gauge::default();
        registry.register(
            "stream_pending",
            "Order events delivered to a worker but not yet stored",
            stream_pending.clone(),
        );
        let worker_last_success = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "worker_last_success_timestamp_seconds",
            "When the order worker last finished a round without error, in Unix seconds (0: never)",
            worker_last_success.clone(),
        );
        // Labelled series exist at 0 before their first event.
        for outcome in PURCHASE_OUTCOMES {
            drop(purchases.get_or_create(&OutcomeLabel {
                outcome: (*outcome).to_owned(),
            }));
        }
        for reason in ["fenced", "lease_lost"] {
            drop(lock_writes_refused.get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            }));
        }
        for kind in ["new", "reload"] {
            drop(stock_loads.get_or_create(&KindLabel {
                kind: kind.to_owned(),
            }));
        }
        Metrics {
            registry: Arc::new(registry),
            purchases,
            http_seconds,
            reservation_seconds,
            lock_wait_seconds,
            lock_writes_refused,
            claims_repaired,
            stock_loads,
            worker_commit_seconds,
            worker_errors,
            orders_stored,
            orders_duplicate,
            orders_malformed,
            orders_reclaimed,
            stream_lag,
            stream_pending,
            worker_last_success,
        }
    }

    /// Counts one purchase request.
    pub fn count_purchase(&self, outcome: &str) {
        self.purchases
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    /// Records one HTTP request.
    pub fn observe_http(&self, route: &str, status: u16, took: std::time::Duration) {
        self.http_seconds
            .get_or_create(&HttpLabel {
                route: route.to_owned(),
                status,
            })
            .observe(took.as_secs_f64());
    }

    /// Counts one stock load of `kind`.
    pub fn count_stock_load(&self, kind: &str) {
        self.stock_loads
            .get_or_create(&KindLabel {
                kind: kind.to_owned(),
            })
            .inc();
    }

    /// Counts one write the `lock` strategy refused.
    pub fn count_lock_write_refused(&self, reason: &str) {
        self.lock_writes_refused
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Marks a successful order worker round now.
    pub fn worker_succeeded(&self) {
        self.worker_last_success
            .set(crate::model::now_millis() as f64 / 1000.0);
    }

    /// When the order worker last finished a round without error, Unix ms; 0: never.
    pub fn worker_last_success_ms(&self) -> i64 {
        (self.worker_last_success.get() * 1000.0) as i64
    }

    /// The text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
