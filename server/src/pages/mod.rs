//! The dashboard: HTML pages rendered on the server, and the static files of `web/`
//! compiled into the binary, so the dashboard needs no build step or file copy.
//!
//! # Layout
//!
//! - [`runs_page`]: `GET /`, every run with its status and open alerts.
//! - [`run_page`]: `GET /runs/{run_id}`, one run: alerts, charts, modules, registration.
//! - [`ranks_page`]: `GET /runs/{run_id}/ranks`, a multi-rank run rank by rank: where
//!   each stands, a chart per metric with a line per rank, the alerts about ranks.
//! - [`compare_page`]: `GET /compare?run=a&run=b&metric=&subject=`, runs side by side
//!   in one chart (the runs page's checkboxes lead there).
//! - [`layout`]: the frame every page shares, and small formatting helpers.
//! - [`assets`]: `GET /static/{file}`, the embedded CSS and JS.
//! - [`login`]: `GET`/`POST /login` and `POST /logout`, for servers with a read token.
//!
//! Pages are [maud] templates: every value spliced into them is HTML-escaped, so
//! nothing a client sent (run names, alert details, config) can become markup. The
//! pages read fine without JavaScript; `web/static/dashboard.js` adds live updates
//! (it re-fetches the page when the event stream says something changed, and swaps
//! in the parts that did), sorting and filtering.

pub mod assets;
mod compare_page;
mod layout;
mod login;
mod ranks_page;
mod run_page;
mod runs_page;

use axum::Router;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use maud::html;

use crate::error::ApiError;
use crate::state::AppState;
use crate::store::StoreError;

/// The dashboard's routes.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(runs_page::show_runs))
        .route("/runs/{run_id}", get(run_page::show_run))
        .route("/runs/{run_id}/ranks", get(ranks_page::show_ranks))
        .route("/compare", get(compare_page::show_comparison))
        .route("/static/{file}", get(assets::serve_asset))
        .merge(login::routes())
}

/// Pages load only what the server itself serves: no inline script or style, no
/// third-party origin. A second line of defence behind the escaping.
const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; img-src 'self' data:; \
     style-src 'self'; script-src 'self'; connect-src 'self'; frame-ancestors 'none'; \
     base-uri 'none'; form-action 'self'";

/// A rendered page with the headers every page carries.
fn page_response(status: StatusCode, markup: maud::Markup) -> Response {
    (
        status,
        [
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(CONTENT_SECURITY_POLICY),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
            (
                HeaderName::from_static("x-content-type-options"),
                HeaderValue::from_static("nosniff"),
            ),
        ],
        Html(markup.into_string()),
    )
        .into_response()
}

/// An error answered as a page (a person is reading), with the API's status and
/// message.
#[derive(Debug)]
pub struct PageError(ApiError);

impl From<ApiError> for PageError {
    fn from(error: ApiError) -> Self {
        PageError(error)
    }
}

impl From<StoreError> for PageError {
    fn from(error: StoreError) -> Self {
        PageError(error.into())
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let status = self.0.status();
        let title = status.canonical_reason().unwrap_or("Error");
        let markup = layout::page(
            title,
            None,
            html! {
                h1 { (status.as_u16()) " " (title) }
                p.error-message { (self.0.message()) }
                p { a href="/" { "Back to the runs" } }
            },
        );
        page_response(status, markup)
    }
}
