//! The one error every handler returns, answered as docs/PROTOCOL.md's JSON error body:
//! `{"error": {"code": "...", "message": "...", "path": "..."}}`. Client errors say
//! what was wrong and where; internal ones are logged in full and answered generically.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use gradflow_protocol::InvalidBody;
use serde::Serialize;

use crate::ingest::IngestError;
use crate::store::StoreError;

gradflow_protocol::vocabulary! {
    /// Every `code` an error answer carries, with the HTTP status it decides
    /// (docs/PROTOCOL.md lists them; a test holds the two together).
    pub enum ErrorCode: StatusCode {
        InvalidBody = "invalid_body" => StatusCode::BAD_REQUEST,
        InvalidRunId = "invalid_run_id" => StatusCode::BAD_REQUEST,
        InvalidQuery = "invalid_query" => StatusCode::BAD_REQUEST,
        InvalidGzip = "invalid_gzip" => StatusCode::BAD_REQUEST,
        Unauthorized = "unauthorized" => StatusCode::UNAUTHORIZED,
        RunNotFound = "run_not_found" => StatusCode::NOT_FOUND,
        UnknownSubject = "unknown_subject" => StatusCode::NOT_FOUND,
        UnknownChart = "unknown_chart" => StatusCode::NOT_FOUND,
        NotFound = "not_found" => StatusCode::NOT_FOUND,
        MethodNotAllowed = "method_not_allowed" => StatusCode::METHOD_NOT_ALLOWED,
        RequestTimeout = "request_timeout" => StatusCode::REQUEST_TIMEOUT,
        Conflict = "conflict" => StatusCode::CONFLICT,
        BodyTooLarge = "body_too_large" => StatusCode::PAYLOAD_TOO_LARGE,
        UnsupportedMediaType = "unsupported_media_type" => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        UnsupportedEncoding = "unsupported_encoding" => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        StorageUnavailable = "storage_unavailable" => StatusCode::SERVICE_UNAVAILABLE,
        Overloaded = "overloaded" => StatusCode::SERVICE_UNAVAILABLE,
        Internal = "internal" => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

gradflow_protocol::vocabulary_schema!(ErrorCode);

impl ErrorCode {
    pub fn status(self) -> StatusCode {
        self.properties()
    }
}

/// docs/PROTOCOL.md's error body.
#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// Machine-readable: what kind of error, which also decides the HTTP status.
    pub code: ErrorCode,
    /// What was wrong, for a person.
    pub message: String,
    /// Where, in the protocol's path notation (`steps[3].modules[0].grad_norm`).
    #[schema(required = false)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

#[derive(Debug)]
pub struct ApiError {
    code: ErrorCode,
    message: String,
    path: Option<String>,
    /// The full cause of a server-side error, for the log only: the answer stays
    /// generic. Logged once, when the error is answered, not where it is converted.
    cause: Option<String>,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
            path: None,
            cause: None,
        }
    }

    /// Keeps `cause` for the server log (see [`ApiError::cause`]).
    pub fn with_cause(mut self, cause: impl Into<String>) -> Self {
        self.cause = Some(cause.into());
        self
    }

    pub fn with_path(mut self, path: impl Into<String>) -> Self {
        let path = path.into();
        self.path = (!path.is_empty()).then_some(path);
        self
    }

    pub fn invalid_body(error: InvalidBody) -> Self {
        ApiError::new(ErrorCode::InvalidBody, error.message).with_path(error.path)
    }

    pub fn invalid_query(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::InvalidQuery, message)
    }

    pub fn status(&self) -> StatusCode {
        self.code.status()
    }

    pub fn code(&self) -> ErrorCode {
        self.code
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::RunNotFound(run_id) => ApiError::new(
                ErrorCode::RunNotFound,
                format!("run {run_id:?} is not registered: PUT /api/v1/runs/{run_id} first"),
            ),
            StoreError::Stale => ApiError::from(StoreError::Unavailable(
                "the run moved on while the request was handled".to_owned(),
            )),
            StoreError::Unavailable(detail) => ApiError::new(
                ErrorCode::StorageUnavailable,
                format!(
                    "the database cannot take this request right now ({detail}); nothing was stored, retry later"
                ),
            )
            .with_cause(detail),
            StoreError::Internal(error) => ApiError::new(
                ErrorCode::Internal,
                "internal error; the server log has the details",
            )
            .with_cause(format!("{error:#}")),
        }
    }
}

impl From<IngestError> for ApiError {
    fn from(error: IngestError) -> Self {
        match error {
            IngestError::Invalid(invalid) => ApiError::invalid_body(invalid),
            IngestError::Conflict { path, message } => {
                ApiError::new(ErrorCode::Conflict, message).with_path(path)
            }
            IngestError::Store(error) => error.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // The code stays in the response's extensions for the metrics middleware.
        let code = self.code;
        let status = code.status();
        match (code, &self.cause) {
            (ErrorCode::Internal, Some(cause)) => tracing::error!(error = %cause, "internal error"),
            (ErrorCode::StorageUnavailable, Some(cause)) => {
                tracing::warn!(error = %cause, "storage unavailable")
            }
            _ => {}
        }
        let body = ErrorBody {
            error: ErrorDetail {
                code,
                message: self.message,
                path: self.path,
            },
        };
        let mut response = (status, axum::Json(body)).into_response();
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response.extensions_mut().insert(code);
        response
    }
}
