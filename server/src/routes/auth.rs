//! The two tokens.
//!
//! - `--ingest-token`: every write (`PUT`, `POST`, `DELETE` under `/api/v1`) needs
//!   `Authorization: Bearer <token>`.
//! - `--read-token`: every read (the API's `GET`s, `/metrics`, the dashboard pages)
//!   needs `Authorization: Bearer <token>` or the login cookie that `POST /login`
//!   sets. The ingest token is accepted for reads too: whoever may write may read.
//!
//! Without a token its side is open. `/healthz`, `/readyz`, `/static/*` and `/login` are always
//! open: a health check needs no secret, and the login page must be reachable.
//! Every comparison is constant-time, so response timing does not reveal how much of
//! a guess was right.

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};

use crate::error::{ApiError, ErrorCode};
use crate::state::AppState;

/// The cookie `POST /login` sets; it holds the read token itself (HttpOnly,
/// SameSite=Strict), so the server keeps no session state.
pub const LOGIN_COOKIE: &str = "gradflow_token";

pub async fn require_ingest_token(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let Some(expected) = state.settings.ingest_token.as_deref() else {
        return next.run(request).await;
    };
    if is_read(request.method()) {
        return next.run(request).await;
    }
    match bearer(request.headers()) {
        Some(token) if same(token, expected) => next.run(request).await,
        Some(_) => ApiError::new(
            ErrorCode::Unauthorized,
            "the bearer token is not this server's ingest token",
        )
        .into_response(),
        None => ApiError::new(
            ErrorCode::Unauthorized,
            "this server needs an ingest token for writes: send Authorization: Bearer <token>",
        )
        .into_response(),
    }
}

/// Guards every read when `--read-token` is set. Pages without a valid token are
/// sent to the login page; API reads get 401.
pub async fn require_read_token(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if state.settings.read_token.is_none()
        || !is_read(request.method())
        || always_open(request.uri().path())
    {
        return next.run(request).await;
    }
    let headers = request.headers();
    let presented = bearer(headers)
        .map(str::to_owned)
        .or_else(|| login_cookie(headers));
    match presented {
        Some(token) if state.settings.may_read(&token) => next.run(request).await,
        _ if is_page(request.uri().path()) => {
            let back = request.uri().path_and_query().map_or("/", |p| p.as_str());
            let query = serde_urlencoded::to_string([("next", back)])
                .expect("a string pair always encodes");
            Redirect::to(&format!("/login?{query}")).into_response()
        }
        Some(_) => ApiError::new(ErrorCode::Unauthorized,
            "the token presented is not this server's read token",
        )
        .into_response(),
        None => ApiError::new(ErrorCode::Unauthorized,
            "this server needs a read token: send Authorization: Bearer <token>, or log in at /login",
        )
        .into_response(),
    }
}

impl crate::state::ApiSettings {
    /// Whether `token` is the read token or the ingest token.
    pub fn may_read(&self, token: &str) -> bool {
        // Both are compared (no early exit) so timing does not say which one matched.
        let read = self.read_token.as_deref().is_some_and(|t| same(token, t));
        let ingest = self.ingest_token.as_deref().is_some_and(|t| same(token, t));
        read | ingest
    }
}

fn is_read(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

fn always_open(path: &str) -> bool {
    path == "/healthz" || path == "/readyz" || path == "/login" || path.starts_with("/static/")
}

/// Dashboard pages, which a person opens in a browser.
fn is_page(path: &str) -> bool {
    path == "/" || path == "/compare" || path.starts_with("/runs/")
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// The login cookie's token, decoded as `POST /login` encoded it.
fn login_cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(cookie::Cookie::split_parse_encoded)
        .filter_map(Result::ok)
        .find(|c| c.name() == LOGIN_COOKIE)
        .map(|c| c.value().to_owned())
}

fn same(presented: &str, expected: &str) -> bool {
    constant_time_eq::constant_time_eq(presented.as_bytes(), expected.as_bytes())
}
