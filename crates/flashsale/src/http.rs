//! The HTTP API (axum), JSON in and out.
//!
//! | route | answer |
//! | --- | --- |
//! | `POST /api/coupons` | 201 the coupon, with its `id` |
//! | `GET /api/coupons/{id}` | the coupon and its remaining stock |
//! | `POST /api/coupons/{id}/seckill` | 201 `{order_id}` and `Location: /api/orders/ID`; 409 `sold_out`, or `already_purchased` with the `order_id` the buyer holds; 403 `sale_not_started` / `sale_ended`; 400 `duplicate_user_id` for two X-User-Id headers; 503 with `"outcome": "not_sold"` or, when Redis could not tell, `"outcome": "unknown"` |
//! | `GET /api/orders/{id}` | the order: `stored` in SQL, or `queued` in Redis for the worker; 404 `order_not_found` |
//! | `GET /api/coupons/{id}/stats` | stock, sold, remaining, orders stored and queued |
//! | `GET /api/users/{id}/orders` | the user's stored orders |
//! | `GET /healthz` | 200, or 503 naming what is down: Redis, a database write, the worker, sales (the stock authority) |
//! | `GET /ping`, `GET /metrics` | one Redis PING, Prometheus |
//!
//! Every refusal is an [`ApiError`]: a status and a JSON body with a stable code. Input
//! is parsed by hand from strings, so no malformed id or header reaches an extractor's
//! plain-text rejection.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{FromRequest, MatchedPath, Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use redis::AsyncCommands;
use serde::Serialize;
use serde_json::json;

use crate::db::Db;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::model::{now_millis, parse_order_id, Coupon, NewCoupon, SaleWindow};
use crate::order_events::{event_state, stream_backlog, EventState};
use crate::stock::{remaining_stock, StockLoader};
use crate::strategy::{Reservation, Reserver};
use crate::worker::Watched;

/// The header that carries the buyer's id, a positive integer.
pub const USER_HEADER: &str = "x-user-id";

/// What every handler shares.
pub struct AppState {
    pub(crate) db: Db,
    pub(crate) locks: distlock::Client,
    pub(crate) reserver: Reserver,
    pub(crate) loader: StockLoader,
    pub(crate) watched: Watched,
    pub(crate) metrics: Metrics,
    /// Coupons never change after creation, so each is read from SQL once.
    pub(crate) coupons: RwLock<HashMap<i64, Coupon>>,
    /// Whether this instance runs the order worker (`/healthz` then reports on it).
    pub(crate) runs_worker: bool,
    /// When the service started: a worker gets that long to finish its first round.
    pub(crate) started: Instant,
    /// How long a request body may take to arrive.
    pub(crate) read_timeout: Duration,
}

/// The largest request body read: axum's default limit, which the JSON extractor applies
/// to bodies of undeclared length as they arrive.
const MAX_BODY_BYTES: u64 = 2 * 1024 * 1024;

/// The purchase route, which bounds itself by its own deadline (see [`observe`]).
const SECKILL_ROUTE: &str = "/api/coupons/{id}/seckill";

/// The service's routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/api/coupons", post(create_coupon))
        .route("/api/coupons/{id}", get(get_coupon))
        .route(SECKILL_ROUTE, post(seckill))
        .route("/api/coupons/{id}/stats", get(coupon_stats))
        .route("/api/users/{id}/orders", get(user_orders))
        .route("/api/orders/{id}", get(order_lookup))
        .route("/healthz", get(healthz))
        .route("/ping", get(ping))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), observe))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "this route does not take that method",
            )
        })
        .with_state(state)
}

/// Every routed request: bounded by the request timeout, and timed by route and status.
///
/// A purchase is not cut here: it is bounded by its own deadline, and answering a timeout
/// while its sale is being resolved could deny a sale that happened.
async fn observe(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_owned();
    let started = Instant::now();
    let response = if route == SECKILL_ROUTE {
        next.run(request).await
    } else {
        let limit = state.reserver.settings().request_timeout;
        match tokio::time::timeout(limit, next.run(request)).await {
            Ok(response) => response,
            Err(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "request_timeout",
                format!("the service could not answer within {limit:?}; try again"),
            )
            .retry_after(1)
            .into_response(),
        }
    };
    state
        .metrics
        .observe_http(&route, response.status().as_u16(), started.elapsed());
    response
}

/// Parses a positive id the way every route does: ASCII digits only, 1 to 2^63 − 1.
pub fn parse_id(text: &str) -> Option<i64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse::<i64>().ok().filter(|id| *id > 0)
}

fn path_id(path: Result<Path<String>, PathRejection>, code: &'static str) -> Result<i64, ApiError> {
    let text = path.map(|Path(text)| text).unwrap_or_default();
    parse_id(&text).ok_or_else(|| {
        ApiError::bad_request(code, format!("{text:?} is not a positive integer id"))
    })
}

fn user_id(headers: &HeaderMap) -> Result<i64, ApiError> {
    let mut values = headers.get_all(USER_HEADER).iter();
    let value = values.next().ok_or_else(|| {
        ApiError::bad_request("missing_user_id", "the X-User-Id header is required")
    })?;
    if values.next().is_some() {
        // Which one a proxy or a client meant is unknowable: refuse rather than pick.
        return Err(ApiError::bad_request(
            "duplicate_user_id",
            "send exactly one X-User-Id header",
        ));
    }
    value.to_str().ok().and_then(parse_id).ok_or_else(|| {
        ApiError::bad_request("invalid_user_id", "X-User-Id must be a positive integer")
    })
}

impl AppState {
    async fn coupon(&self, id: i64) -> Result<Coupon, ApiError> {
        let cached = self
            .coupons
            .read()
            .ok()
            .and_then(|map| map.get(&id).cloned());
        if let Some(coupon) = cached {
            return Ok(coupon);
        }
        let coupon = self
            .db
            .coupon(id)
            .await?
            .ok_or(ApiError::coupon_not_found(id))?;
        self.remember(&coupon);
        Ok(coupon)
    }

    fn remember(&self, coupon: &Coupon) {
        if let Ok(mut map) = self.coupons.write() {
            map.insert(coupon.id, coupon.clone());
        }
        self.watched.add(coupon.id);
    }

    async fn reserve(&self, coupon: &Coupon, user: i64) -> Result<Reservation, ApiError> {
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + self.reserver.settings().request_timeout;
        let mut outcome = self.reserver.reserve(coupon.id, user, deadline).await?;
        if outcome == Reservation::NotLoaded {
            // Redis lost the counter (or never had it): rebuild it from SQL and the stream,
            // under the loader lock, then try once more.
            self.loader.ensure_loaded(coupon, deadline).await?;
            outcome = self.reserver.reserve(coupon.id, user, deadline).await?;
        }
        self.metrics
            .reservation_seconds
            .observe(started.elapsed().as_secs_f64());
        Ok(outcome)
    }
}

async fn create_coupon(
    State(state): State<Arc<AppState>>,
    request: Request,
) -> Result<Response, ApiError> {
    // A body declared too large is refused before a byte of it is read or waited for.
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > MAX_BODY_BYTES) {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the body may be at most {MAX_BODY_BYTES} bytes"),
        ));
    }
    // The body is read under its own deadline: a client that trickles it must not hold a
    // connection and a task for as long as it likes.
    let body = tokio::time::timeout(
        state.read_timeout,
        Json::<NewCoupon>::from_request(request, &state),
    )
    .await
    .map_err(|_| {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            format!(
                "the request body did not arrive within {:?}",
                state.read_timeout
            ),
        )
    })?;
    let Json(new) = body.map_err(|rejection| match rejection {
        JsonRejection::MissingJsonContentType(_) => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "send the coupon as JSON with Content-Type: application/json",
        ),
        too_large if too_large.status() == StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            too_large.body_text(),
        ),
        other => ApiError::bad_request("invalid_body", other.body_text()),
    })?;
    new.validate()
        .map_err(|err| ApiError::bad_request("invalid_field", err.to_string()))?;
    let coupon = state.db.create_coupon(&new, now_millis()).await?;
    let load_by = tokio::time::Instant::now() + state.reserver.settings().request_timeout;
    state.loader.ensure_loaded(&coupon, load_by).await?;
    state.remember(&coupon);
    Ok((StatusCode::CREATED, Json(coupon)).into_response())
}

#[derive(Serialize)]
struct CouponView {
    #[serde(flatten)]
    coupon: Coupon,
    /// `None` while Redis holds no stock for it.
    remaining: Option<i64>,
    sale: &'static str,
}

async fn get_coupon(
    State(state): State<Arc<AppState>>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<CouponView>, ApiError> {
    let coupon = state.coupon(path_id(id, "invalid_coupon_id")?).await?;
    let keys = state.db.keyspace().coupon(coupon.id);
    let remaining = remaining_stock(&mut state.locks.connection(), &keys).await?;
    let sale = match coupon.window_at(now_millis()) {
        SaleWindow::NotStarted => "not_started",
        SaleWindow::Open => "open",
        SaleWindow::Ended => "ended",
    };
    Ok(Json(CouponView {
        coupon,
        remaining,
        sale,
    }))
}

async fn seckill(
    State(state): State<Arc<AppState>>,
    id: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
) -> Response {
    let outcome = purchase(&state, id, &headers).await;
    let label = match &outcome {
        Ok(_) => "reserved",
        Err(err) => err.code,
    };
    state.metrics.count_purchase(label);
    match outcome {
        Ok(order_id) => {
            let location = format!("/api/orders/{order_id}");
            let mut response = (
                StatusCode::CREATED,
                Json(json!({ "order_id": order_id, "location": location })),
            )
                .into_response();
            if let Ok(value) = HeaderValue::from_str(&location) {
                response.headers_mut().insert(header::LOCATION, value);
            }
            response
        }
        Err(err) => err.into_response(),
    }
}

async fn purchase(
    state: &AppState,
    id: Result<Path<String>, PathRejection>,
    headers: &HeaderMap,
) -> Result<String, ApiError> {
    let coupon_id = path_id(id, "invalid_coupon_id")?;
    let user = user_id(headers)?;
    let coupon = state.coupon(coupon_id).await?;
    match coupon.window_at(now_millis()) {
        SaleWindow::NotStarted => {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "sale_not_started",
                "the sale of this coupon has not started",
            ))
        }
        SaleWindow::Ended => {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "sale_ended",
                "the sale of this coupon has ended",
            ))
        }
        SaleWindow::Open => {}
    }
    match state.reserve(&coupon, user).await? {
        Reservation::Reserved { order_id } => Ok(order_id),
        Reservation::SoldOut => Err(ApiError::new(
            StatusCode::CONFLICT,
            "sold_out",
            "no stock left",
        )),
        Reservation::AlreadyPurchased { order_id } => {
            let refusal = ApiError::new(
                StatusCode::CONFLICT,
                "already_purchased",
                "this user already bought this coupon",
            );
            Err(match order_id {
                Some(order_id) => refusal
                    .with("location", format!("/api/orders/{order_id}"))
                    .with("order_id", order_id),
                // Another request of this user is completing its sale right now.
                None => refusal.with("order_id", serde_json::Value::Null),
            })
        }
        Reservation::Busy => Err(ApiError::not_sold(
            "busy",
            "the coupon's lock was not free in time; nothing was sold; try again",
        )),
        Reservation::LockLost => Err(ApiError::not_sold(
            "lock_lost",
            "the coupon's lock ran out before the sale could be written; nothing was sold; try again",
        )),
        Reservation::NotLoaded => Err(ApiError::not_sold(
            "stock_not_loaded",
            "the coupon's stock is not in Redis yet; nothing was sold; try again",
        )),
        Reservation::Expired => Err(ApiError::not_sold(
            "expired",
            "the purchase could not be made before its deadline; nothing was sold; try again",
        )),
        Reservation::Overloaded => Err(ApiError::not_sold(
            "overloaded",
            "too many purchases of this coupon are waiting; nothing was sold; try again shortly",
        )),
    }
}

/// The figures of one coupon's sale.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct CouponStats {
    /// The coupon.
    pub coupon_id: i64,
    /// Units for sale.
    pub stock: i64,
    /// Units left in Redis (negative only if a sale oversold); `None` if not loaded.
    pub remaining: Option<i64>,
    /// `stock − remaining`.
    pub sold: Option<i64>,
    /// Buyers in the coupon's buyers hash: the sales Redis recorded (with a segmented
    /// claim still in progress, or left by a crash, counted too).
    pub sales_recorded: i64,
    /// Orders in SQL.
    pub orders_stored: i64,
    /// Order events not yet stored: undelivered plus unacknowledged.
    pub orders_queued: i64,
}

async fn coupon_stats(
    State(state): State<Arc<AppState>>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<CouponStats>, ApiError> {
    let coupon = state.coupon(path_id(id, "invalid_coupon_id")?).await?;
    let keys = state.db.keyspace().coupon(coupon.id);
    let mut conn = state.locks.connection();
    let remaining = remaining_stock(&mut conn, &keys).await?;
    let backlog = stream_backlog(&mut conn, &keys).await?;
    let sales_recorded: i64 = conn.hlen(&keys.buyers).await?;
    let orders_stored = state.db.order_count(coupon.id).await?;
    Ok(Json(CouponStats {
        coupon_id: coupon.id,
        stock: coupon.stock,
        remaining,
        sold: remaining.map(|left| coupon.stock - left),
        sales_recorded,
        orders_stored,
        orders_queued: backlog.lag + backlog.pending,
    }))
}

async fn user_orders(
    State(state): State<Arc<AppState>>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let user = path_id(id, "invalid_user_id")?;
    let orders = state.db.user_orders(user).await?;
    Ok(Json(json!({ "user_id": user, "orders": orders })).into_response())
}

/// An order by id: `stored` once in SQL; `queued`, with how long, while its event waits
/// for a worker; `lost`, with the reason, when Redis holds it (its buyer was told 201) and
/// nothing will store it; 404 `order_not_found` when neither holds it (it was never made).
async fn order_lookup(
    State(state): State<Arc<AppState>>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let not_found = |id: &str| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "order_not_found",
            format!("there is no order {id}"),
        )
    };
    let Path(id) = id.map_err(|_| ApiError::bad_request("invalid_order_id", "bad order id"))?;
    let Some((coupon_id, user_id)) = parse_order_id(&id) else {
        return Err(ApiError::bad_request(
            "invalid_order_id",
            "an order id looks like c12-u34-0123abcd…",
        ));
    };
    let stored = |order| Json(json!({ "state": "stored", "order": order })).into_response();
    if let Some(order) = state.db.order(&id).await? {
        return Ok(stored(order));
    }
    let keys = state.db.keyspace().coupon(coupon_id);
    let mut conn = state.locks.connection();
    let held: Option<String> = conn.hget(&keys.buyers, user_id).await?;
    if held.as_deref() != Some(id.as_str()) {
        return Err(not_found(&id));
    }
    // Read before SQL is read again: a worker acknowledges an event only after its
    // commit, so an event found acknowledged here is in the second read unless SQL lost it.
    let event = event_state(&mut conn, &keys, &id).await?;
    if let Some(order) = state.db.order(&id).await? {
        return Ok(stored(order));
    }
    let order = json!({ "order_id": id, "coupon_id": coupon_id, "user_id": user_id });
    let lost = |reason: &str| {
        Json(json!({ "state": "lost", "order": order, "reason": reason })).into_response()
    };
    let refused = state.db.refused_orders(coupon_id).await?;
    if refused.iter().any(|refused| refused.order_id == id) {
        return Ok(lost(
            "Redis sold this order beyond the coupon's stock (it counted a unit that was sold \
             already: was it put back to an earlier state?), and the store refused it. \
             `flashsale reconcile` lists such orders, to be settled with their buyers",
        ));
    }
    if !state.reserver.admitted() {
        return Ok(lost(
            "this instance's store was taken over by another Redis while it was frozen or cut \
             off: the order will not be stored, and its unit was put back on sale. `flashsale \
             reconcile` against this instance's Redis lists such orders",
        ));
    }
    Ok(match event {
        EventState::Queued { told_at_ms } => Json(json!({
            "state": "queued",
            "order": order,
            "queued_ms": told_at_ms.map(|at| (now_millis() - at).max(0)),
        }))
        .into_response(),
        EventState::NotQueued => lost(
            "a worker stored this order (its event is acknowledged), but the database no longer \
             holds it: the database was restored from a backup or lost writes. `flashsale \
             reconcile` lists such orders, and the next start of `flashsale serve` stores them \
             again from Redis",
        ),
    })
}

/// How long each `/healthz` check may take. A locked SQLite file would otherwise make the
/// check wait out its busy timeout.
const HEALTH_CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// A worker that has not finished a round for this long is reported stale. A round ends at
/// least every read block (250 ms) when all is well.
const WORKER_STALE_AFTER: Duration = Duration::from_secs(10);

/// 200 when Redis answers, the database takes a write and the order worker (if this
/// instance runs one) finished a round recently; 503 naming what is down otherwise.
async fn healthz(State(state): State<Arc<AppState>>) -> Response {
    async fn check<E: std::fmt::Display>(
        work: impl std::future::Future<Output = Result<(), E>>,
    ) -> String {
        match tokio::time::timeout(HEALTH_CHECK_TIMEOUT, work).await {
            Ok(Ok(())) => "ok".to_owned(),
            Ok(Err(err)) => err.to_string(),
            Err(_) => format!("no answer within {HEALTH_CHECK_TIMEOUT:?}"),
        }
    }
    let redis = check(async {
        redis::cmd("PING")
            .query_async::<String>(&mut state.locks.connection())
            .await
            .map(drop)
    })
    .await;
    let now = now_millis();
    let database = check(state.db.check_writable(now)).await;
    let (worker, worker_ok) = if state.runs_worker {
        let last = state.metrics.worker_last_success_ms();
        let stale_ms = WORKER_STALE_AFTER.as_millis() as i64;
        let status = if last > 0 && now - last <= stale_ms {
            "ok"
        } else if last == 0 && state.started.elapsed() <= WORKER_STALE_AFTER {
            "starting"
        } else {
            "stale"
        };
        // Clamped: the clock may step back between the worker's write and this read.
        let ago = (last > 0).then(|| (now - last).max(0));
        let (queued, pending) =
            tokio::time::timeout(HEALTH_CHECK_TIMEOUT, backlog_of_watched(&state))
                .await
                .map_or((None, None), |(queued, pending)| {
                    (Some(queued), Some(pending))
                });
        (
            json!({
                "status": status,
                "last_success_ms_ago": ago,
                "queued": queued,
                "pending": pending,
            }),
            status != "stale",
        )
    } else {
        (json!({ "status": "none in this instance" }), true)
    };
    // An instance whose stock authority is not confirmed refuses every purchase: it is
    // not healthy, whatever Redis and the database say (a load balancer must stop sending
    // it buyers).
    let sales = if state.reserver.may_sell() {
        "ok"
    } else {
        "paused: this instance's stock authority is not confirmed (see docs/flashsale.md)"
    };
    let healthy = redis == "ok" && database == "ok" && worker_ok && sales == "ok";
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": if healthy { "ok" } else { "unavailable" },
        "strategy": state.reserver.settings().strategy,
        "redis": redis,
        "database": database,
        "worker": worker,
        "sales": sales,
    });
    (status, Json(body)).into_response()
}

/// One Redis round trip behind the same HTTP stack: the floor the benchmark compares
/// purchases with.
async fn ping(State(state): State<Arc<AppState>>) -> Result<Json<serde_json::Value>, ApiError> {
    let _: String = redis::cmd("PING")
        .query_async(&mut state.locks.connection())
        .await?;
    Ok(Json(json!({ "pong": true })))
}

/// Order events not yet delivered to a worker, and delivered but not yet stored, over
/// the coupons this instance watches.
async fn backlog_of_watched(state: &AppState) -> (i64, i64) {
    let mut conn = state.locks.connection();
    let (mut lag, mut pending) = (0, 0);
    for coupon in state.watched.coupons() {
        match stream_backlog(&mut conn, &state.db.keyspace().coupon(coupon)).await {
            Ok(backlog) => {
                lag += backlog.lag;
                pending += backlog.pending;
            }
            Err(err) => tracing::warn!(error = %err, coupon, "could not read the stream backlog"),
        }
    }
    (lag, pending)
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let (lag, pending) = backlog_of_watched(&state).await;
    state.metrics.stream_lag.set(lag);
    state.metrics.stream_pending.set(pending);
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::parse_id;

    #[test]
    fn ids() {
        assert_eq!(parse_id("42"), Some(42));
        for bad in [
            "",
            "0",
            "-1",
            "+1",
            "1.5",
            "abc",
            " 1",
            "99999999999999999999",
        ] {
            assert_eq!(parse_id(bad), None, "{bad:?}");
        }
        assert_eq!(parse_id("9223372036854775807"), Some(i64::MAX));
    }
}
