//! The one error every handler returns, answered as docs/PROTOCOL.md's JSON error body:
//! `{"error": {"code": "...", "message": "...", "path": "..."}}`. Client errors say
//! what was wrong and where; internal ones are logged in full and answered generically.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use gradflow_protocol::InvalidBody;
use serde_json::json;

use crate::store::StoreError;

#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    path: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            path: None,
        }
    }

    pub fn with_path(mut self, path: impl Into<String>) -> Self {
        let path = path.into();
        self.path = (!path.is_empty()).then_some(path);
        self
    }

    pub fn invalid_body(error: InvalidBody) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_body", error.message).with_path(error.path)
    }

    pub fn invalid_query(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_query", message)
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, code, message)
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn code(&self) -> &'static str {
        self.code
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::RunNotFound(run_id) => ApiError::not_found(
                "run_not_found",
                format!("run {run_id:?} is not registered: PUT /api/v1/runs/{run_id} first"),
            ),
            StoreError::Invalid(invalid) => ApiError::invalid_body(invalid),
            StoreError::Conflict { path, message } => {
                ApiError::new(StatusCode::CONFLICT, "conflict", message).with_path(path)
            }
            StoreError::Stale => ApiError::from(StoreError::Unavailable(
                "the run moved on while the request was handled".to_owned(),
            )),
            StoreError::Unavailable(detail) => {
                tracing::warn!(error = %detail, "storage unavailable");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "storage_unavailable",
                    format!(
                        "the database cannot take this request right now ({detail}); nothing was stored, retry later"
                    ),
                )
            }
            StoreError::Internal(error) => {
                tracing::error!(error = format!("{error:#}"), "internal error");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "internal error; the server log has the details",
                )
            }
        }
    }
}

/// The `code` of an error response, left in the response's extensions for the
/// metrics middleware.
#[derive(Debug, Clone, Copy)]
pub struct ErrorCode(pub &'static str);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = ErrorCode(self.code);
        let mut error = json!({"code": self.code, "message": self.message});
        if let Some(path) = self.path {
            error["path"] = path.into();
        }
        let mut response = (self.status, axum::Json(json!({ "error": error }))).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response.extensions_mut().insert(code);
        response
    }
}
