//! What one client can hold of the server: a request has `--request-timeout-secs` to
//! be answered (a client trickling its body in gets 408 and its connection's work is
//! dropped), and at most `--max-concurrent-requests` are handled at once (beyond
//! that, 503 with Retry-After at once, rather than an unbounded queue).
//!
//! Both cover the time until the response's headers: an event stream, once started,
//! holds neither a permit nor a deadline.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::{ApiError, ErrorCode};
use crate::state::AppState;

pub async fn limit(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Ok(_permit) = state.in_flight.clone().try_acquire_owned() else {
        return ApiError::new(
            ErrorCode::Overloaded,
            format!(
                "the server is handling as many requests as it is allowed to \
                 ({} at once, --max-concurrent-requests); retry shortly",
                state.settings.max_concurrent_requests
            ),
        )
        .into_response();
    };
    let timeout = state.settings.request_timeout;
    match tokio::time::timeout(timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::new(
            ErrorCode::RequestTimeout,
            format!(
                "the request was not complete within {} s (--request-timeout-secs); a \
                 batch whose body had arrived may still have been stored: resend it, and \
                 its stored records count as duplicates",
                timeout.as_secs()
            ),
        )
        .into_response(),
    }
}
