//! The one error every handler returns, answered as docs/PROTOCOL.md's JSON error body:
//! `{"error": {"code": "...", "message": "...", "path": "..."}}`. Client errors say
//! what was wrong and where; internal ones are logged in full and answered generically.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use gradflow_protocol::InvalidBody;
use serde::Serialize;

use crate::ingest::IngestError;
use crate::store::StoreError;

/// Every `code` an error answer carries (docs/PROTOCOL.md lists them; a test holds
/// the two together). The code decides the HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    InvalidBody,
    InvalidRunId,
    InvalidQuery,
    InvalidGzip,
    Unauthorized,
    RunNotFound,
    UnknownSubject,
    UnknownChart,
    NotFound,
    MethodNotAllowed,
    RequestTimeout,
    Conflict,
    BodyTooLarge,
    UnsupportedMediaType,
    UnsupportedEncoding,
    StorageUnavailable,
    Overloaded,
    Internal,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 18] = [
        ErrorCode::InvalidBody,
        ErrorCode::InvalidRunId,
        ErrorCode::InvalidQuery,
        ErrorCode::InvalidGzip,
        ErrorCode::Unauthorized,
        ErrorCode::RunNotFound,
        ErrorCode::UnknownSubject,
        ErrorCode::UnknownChart,
        ErrorCode::NotFound,
        ErrorCode::MethodNotAllowed,
        ErrorCode::RequestTimeout,
        ErrorCode::Conflict,
        ErrorCode::BodyTooLarge,
        ErrorCode::UnsupportedMediaType,
        ErrorCode::UnsupportedEncoding,
        ErrorCode::StorageUnavailable,
        ErrorCode::Overloaded,
        ErrorCode::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidBody => "invalid_body",
            ErrorCode::InvalidRunId => "invalid_run_id",
            ErrorCode::InvalidQuery => "invalid_query",
            ErrorCode::InvalidGzip => "invalid_gzip",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::RunNotFound => "run_not_found",
            ErrorCode::UnknownSubject => "unknown_subject",
            ErrorCode::UnknownChart => "unknown_chart",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::RequestTimeout => "request_timeout",
            ErrorCode::Conflict => "conflict",
            ErrorCode::BodyTooLarge => "body_too_large",
            ErrorCode::UnsupportedMediaType => "unsupported_media_type",
            ErrorCode::UnsupportedEncoding => "unsupported_encoding",
            ErrorCode::StorageUnavailable => "storage_unavailable",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::Internal => "internal",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            ErrorCode::InvalidBody
            | ErrorCode::InvalidRunId
            | ErrorCode::InvalidQuery
            | ErrorCode::InvalidGzip => StatusCode::BAD_REQUEST,
            ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorCode::RunNotFound
            | ErrorCode::UnknownSubject
            | ErrorCode::UnknownChart
            | ErrorCode::NotFound => StatusCode::NOT_FOUND,
            ErrorCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorCode::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorCode::Conflict => StatusCode::CONFLICT,
            ErrorCode::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::UnsupportedMediaType | ErrorCode::UnsupportedEncoding => {
                StatusCode::UNSUPPORTED_MEDIA_TYPE
            }
            ErrorCode::StorageUnavailable | ErrorCode::Overloaded => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
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
