//! `GET /static/{file}`: the dashboard's CSS and JS from `web/static/`, compiled into
//! the binary. The request names a file; it is looked up in a fixed table, never
//! joined to a filesystem path, so no request can reach anything else.

use axum::extract::Path;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use crate::error::{ApiError, ErrorCode};

/// (name, content type, contents).
const ASSETS: &[(&str, &str, &str)] = &[
    (
        "gradflow.css",
        "text/css; charset=utf-8",
        include_str!("../../../web/static/gradflow.css"),
    ),
    (
        "dashboard.js",
        "text/javascript; charset=utf-8",
        include_str!("../../../web/static/dashboard.js"),
    ),
];

/// The URL of an embedded file.
pub fn url(name: &str) -> String {
    debug_assert!(ASSETS.iter().any(|(n, _, _)| *n == name), "no asset {name}");
    format!("/static/{name}")
}

pub async fn serve_asset(Path(file): Path<String>) -> Result<Response, ApiError> {
    let Some((_, content_type, contents)) = ASSETS.iter().find(|(name, _, _)| *name == file) else {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            format!("no static file {file:?}"),
        ));
    };
    Ok((
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            // Small files; revalidating them costs little and a new binary's files
            // are picked up at once.
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                header::HeaderName::from_static("x-content-type-options"),
                HeaderValue::from_static("nosniff"),
            ),
        ],
        *contents,
    )
        .into_response())
}
