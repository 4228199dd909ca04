//! The API's errors: a status and a stable code, sent as `{"error": code, "message": …}`.

use axum::http::StatusCode;
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
}

impl ApiError {
    /// An error with any status and code.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
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
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Json(json!({ "error": self.code, "message": self.message }));
        (self.status, body).into_response()
    }
}

impl From<DbError> for ApiError {
    fn from(err: DbError) -> Self {
        Self::unavailable("the database failed", &err)
    }
}

impl From<ReserveError> for ApiError {
    fn from(err: ReserveError) -> Self {
        Self::unavailable("reserving stock failed", &err)
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
