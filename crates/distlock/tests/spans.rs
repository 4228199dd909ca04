//! Every acquisition runs in a `distlock.acquire` span that names the primitive and its
//! key, and records how long it waited, how it ended and the fencing token it got; what
//! the acquisition logs (the holding it starts) is inside it.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{bounded, client, server};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;
use tracing_subscriber::registry::LookupSpan;

const LIMIT: Duration = Duration::from_secs(20);

/// A span's fields as text, and the messages of the events logged inside it.
#[derive(Default, Debug, Clone)]
struct Seen {
    fields: HashMap<String, String>,
    events: Vec<String>,
}

/// Collects every `distlock.acquire` span, in the order they close.
#[derive(Clone, Default)]
struct Spans {
    open: Arc<Mutex<HashMap<u64, Seen>>>,
    closed: Arc<Mutex<Vec<Seen>>>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_owned(),
            format!("{value:?}").replace('"', ""),
        );
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        if attrs.metadata().name() != "distlock.acquire" {
            return;
        }
        let mut seen = Seen::default();
        attrs.record(&mut Fields(&mut seen.fields));
        self.open.lock().unwrap().insert(id.into_u64(), seen);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        if let Some(seen) = self.open.lock().unwrap().get_mut(&id.into_u64()) {
            values.record(&mut Fields(&mut seen.fields));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        let within = span
            .scope()
            .find(|span| span.name() == "distlock.acquire")
            .map(|span| span.id().into_u64());
        let Some(id) = within else {
            return;
        };
        let mut fields = HashMap::new();
        event.record(&mut Fields(&mut fields));
        if let Some(open) = self.open.lock().unwrap().get_mut(&id) {
            open.events
                .push(fields.remove("message").unwrap_or_default());
        }
    }

    fn on_close(&self, id: Id, _: Context<'_, S>) {
        if let Some(seen) = self.open.lock().unwrap().remove(&id.into_u64()) {
            self.closed.lock().unwrap().push(seen);
        }
    }
}

/// Spans are collected from this test's thread only: a current-thread runtime.
#[tokio::test(flavor = "current_thread")]
async fn each_acquisition_runs_in_a_span_with_its_wait_outcome_and_token() {
    let spans = Spans::default();
    let _default = tracing_subscriber::registry()
        .with(
            spans
                .clone()
                .with_filter(tracing_subscriber::filter::LevelFilter::DEBUG),
        )
        .set_default();
    let server = server().await;
    let client = client(&server).await;

    let guard = bounded(LIMIT, client.lock("spanned").unwrap().lock())
        .await
        .unwrap();
    let token = guard.fencing_token();
    // Busy: a second acquisition that gives up at once.
    let busy = bounded(LIMIT, client.lock("spanned").unwrap().try_lock())
        .await
        .unwrap();
    assert!(busy.is_none());
    guard.release().await.unwrap();
    let fair = bounded(LIMIT, client.fair_lock("fair-spanned").unwrap().try_lock())
        .await
        .unwrap()
        .expect("free");
    let semaphore = client.semaphore("sem-spanned").unwrap();
    assert!(semaphore.try_set_permits(1).await.unwrap().is_set());
    let permits = bounded(LIMIT, semaphore.try_acquire(1))
        .await
        .unwrap()
        .expect("free");

    let closed = spans.closed.lock().unwrap().clone();
    let field = |seen: &Seen, name: &str| seen.fields.get(name).cloned().unwrap_or_default();
    assert_eq!(closed.len(), 4, "{closed:#?}");
    let (taken, refused, fair_span, sem_span) = (&closed[0], &closed[1], &closed[2], &closed[3]);
    assert_eq!(field(taken, "primitive"), "lock");
    assert_eq!(field(taken, "key"), "spanned");
    assert_eq!(field(taken, "outcome"), "acquired");
    assert_eq!(field(taken, "token"), token.to_string());
    assert!(field(taken, "waited_ms").parse::<f64>().unwrap() >= 0.0);
    assert!(
        taken.events.iter().any(|message| message == "held"),
        "the holding's start is logged inside the acquisition's span: {:?}",
        taken.events
    );
    assert_eq!(field(refused, "outcome"), "busy");
    assert_eq!(field(refused, "token"), "");
    assert_eq!(field(fair_span, "primitive"), "fair_lock");
    // The lock's key, not the waiter's own channel.
    assert_eq!(field(fair_span, "key"), "fair-spanned");
    assert_eq!(field(fair_span, "token"), fair.fencing_token().to_string());
    assert_eq!(field(sem_span, "primitive"), "semaphore");
    assert_eq!(field(sem_span, "outcome"), "acquired");
    assert_eq!(field(sem_span, "token"), "", "permits carry no token");
    drop(permits);
    fair.release().await.unwrap();
}
