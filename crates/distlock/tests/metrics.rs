//! With the `metrics` feature, acquisitions and lost leases are counted through the
//! `metrics` facade, labelled by the kind of primitive (never by key).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{bounded, client, server};
use metrics::{
    Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};

/// Every value recorded: the metric's name, its labels, the value.
type Records = Arc<Mutex<Vec<(String, Vec<(String, String)>, f64)>>>;

struct Handle {
    key: Key,
    records: Records,
}

impl Handle {
    fn push(&self, value: f64) {
        let labels = self
            .key
            .labels()
            .map(|label| (label.key().to_owned(), label.value().to_owned()))
            .collect();
        self.records
            .lock()
            .unwrap()
            .push((self.key.name().to_owned(), labels, value));
    }
}

impl CounterFn for Handle {
    fn increment(&self, value: u64) {
        self.push(value as f64);
    }

    fn absolute(&self, value: u64) {
        self.push(value as f64);
    }
}

impl HistogramFn for Handle {
    fn record(&self, value: f64) {
        self.push(value);
    }
}

struct Capture(Records);

impl Recorder for Capture {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(Arc::new(Handle {
            key: key.clone(),
            records: Arc::clone(&self.0),
        }))
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(Arc::new(Handle {
            key: key.clone(),
            records: Arc::clone(&self.0),
        }))
    }
}

fn seen(records: &Records, name: &str, label: (&str, &str)) -> Vec<f64> {
    records
        .lock()
        .unwrap()
        .iter()
        .filter(|(metric, labels, _)| {
            metric == name
                && labels
                    .iter()
                    .any(|(key, value)| key == label.0 && value == label.1)
        })
        .map(|(_, _, value)| *value)
        .collect()
}

#[tokio::test]
async fn waits_outcomes_and_lost_leases_are_counted() {
    let records: Records = Arc::default();
    metrics::set_global_recorder(Capture(Arc::clone(&records)))
        .expect("one recorder per test binary");
    let server = server().await;
    let client = client(&server).await;
    bounded(Duration::from_secs(30), async {
        let lock = client.lock("metered").unwrap();
        let guard = lock.lock().await.unwrap();
        assert!(lock.try_lock().await.unwrap().is_none());
        guard.release().await.unwrap();
        let short = lock
            .with_lease(Duration::from_millis(100))
            .lock()
            .await
            .unwrap();
        short.lost().await;
        let pool = client.semaphore("metered-pool").unwrap();
        assert!(pool.try_set_permits(1).await.unwrap().is_set());
        pool.acquire(1).await.unwrap().release().await.unwrap();
    })
    .await;
    let waits = seen(&records, "distlock_wait_seconds", ("primitive", "lock"));
    assert!(waits.len() >= 3, "{waits:?}");
    assert!(
        waits.iter().all(|wait| (0.0..5.0).contains(wait)),
        "{waits:?}"
    );
    assert_eq!(
        seen(&records, "distlock_acquisitions_total", ("outcome", "busy")).len(),
        1
    );
    assert!(!seen(
        &records,
        "distlock_wait_seconds",
        ("primitive", "semaphore")
    )
    .is_empty());
    assert_eq!(
        seen(&records, "distlock_lost_total", ("lease", "lock hold")),
        [1.0]
    );
    // No label carries a key.
    assert!(records
        .lock()
        .unwrap()
        .iter()
        .all(|(_, labels, _)| labels.iter().all(|(_, value)| !value.contains("metered"))));
}
