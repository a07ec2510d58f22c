//! The ingest token: with `--ingest-token`, every write (`PUT`, `POST`, `DELETE`)
//! needs `Authorization: Bearer <token>`. Reads stay open.

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;
use crate::error::ApiError;

pub async fn require_ingest_token(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let Some(expected) = state.settings.ingest_token.as_deref() else {
        return next.run(request).await;
    };
    if matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    ) {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented {
        // Constant-time, so response timing does not reveal how much of a guess was right.
        Some(token)
            if constant_time_eq::constant_time_eq(token.as_bytes(), expected.as_bytes()) =>
        {
            next.run(request).await
        }
        Some(_) => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "the bearer token is not this server's ingest token",
        )
        .into_response(),
        None => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "this server needs an ingest token for writes: send Authorization: Bearer <token>",
        )
        .into_response(),
    }
}
