//! The API's errors: a status and a stable code, sent as `{"error": code, "message": …}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::db::DbError;
use crate::stock::LoadError;
use crate::strategy::ReserveError;

/// An error answer. The `code` is what clients match on; the message is for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// A stable, machine-readable code such as `sold_out`.
    pub code: &'static str,
    /// A human-readable explanation.
    pub message: String,
    /// More fields of the body, such as the `order_id` a buyer already holds.
    pub details: serde_json::Map<String, serde_json::Value>,
    /// Seconds for the Retry-After header, when trying again later may succeed.
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// An error with any status and code.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            details: serde_json::Map::new(),
            retry_after: None,
        }
    }

    /// Adds a field to the body.
    pub fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.details.insert(key.to_owned(), value.into());
        self
    }

    /// Sets the Retry-After header.
    pub fn retry_after(mut self, seconds: u32) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// 400: the request itself is wrong.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// 404 `coupon_not_found`.
    pub fn coupon_not_found(id: i64) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "coupon_not_found",
            format!("there is no coupon {id}"),
        )
    }

    /// 503 `unavailable`: Redis or the database failed. Logged here, because the client
    /// only sees that the service could not answer.
    pub fn unavailable(context: &str, err: &dyn std::error::Error) -> Self {
        tracing::error!(error = %err, "{context}");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            format!("{context}; try again"),
        )
    }

    /// 503 for a purchase that certainly did not happen: `"outcome": "not_sold"`.
    pub fn not_sold(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
            .with("outcome", "not_sold")
            .retry_after(1)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = self.details;
        body.insert("error".to_owned(), json!(self.code));
        body.insert("message".to_owned(), json!(self.message));
        let mut response = (self.status, Json(body)).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

impl From<DbError> for ApiError {
    fn from(err: DbError) -> Self {
        Self::unavailable("the database failed", &err)
    }
}

impl From<ReserveError> for ApiError {
    fn from(err: ReserveError) -> Self {
        match &err {
            ReserveError::Unknown { order_id, .. } => {
                tracing::error!(error = %err, "a purchase's outcome is unknown");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "outcome_unknown",
                    "the store stopped answering while this purchase was being written; look the order up to learn whether it was made",
                )
                .with("outcome", "unknown")
                .with("order_id", order_id.clone())
                .with("lookup", format!("/api/orders/{order_id}"))
                .retry_after(1)
            }
            ReserveError::InDoubt { .. } | ReserveError::CommitInDoubt { .. } => {
                // The reserver resolves these; one reaching here is a bug, and saying
                // "not sold" could be a lie.
                tracing::error!(error = %err, "an unresolved lost reply reached the API");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "outcome_unknown",
                    "the purchase's outcome is unknown",
                )
                .with("outcome", "unknown")
            }
            ReserveError::NotAuthority => Self::not_sold(
                "unavailable",
                "this instance cannot confirm that it still sells this store's stock (taken over, or the database is not answering); nothing was sold; try another instance",
            ),
            ReserveError::Redis(_) | ReserveError::Lock(_) | ReserveError::Db(_) => {
                tracing::error!(error = %err, "reserving stock failed before anything was written");
                Self::not_sold(
                    "unavailable",
                    "reserving stock failed; nothing was sold; try again",
                )
            }
        }
    }
}

impl From<LoadError> for ApiError {
    fn from(err: LoadError) -> Self {
        Self::unavailable("loading stock failed", &err)
    }
}

impl From<redis::RedisError> for ApiError {
    fn from(err: redis::RedisError) -> Self {
        Self::unavailable("redis failed", &err)
    }
}
