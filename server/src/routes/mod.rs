//! The HTTP API of docs/PROTOCOL.md: one file per resource, handlers named for what they do.
//!
//! # Layout
//!
//! - [`health`]: `GET /healthz`.
//! - [`runs`]: register, list, read and delete runs.
//! - [`steps`]: `POST /api/v1/runs/{run_id}/steps`, the ingest path.
//! - [`series`]: `GET /api/v1/runs/{run_id}/series`.
//! - [`alerts`]: `GET /api/v1/alerts` and `GET /api/v1/runs/{run_id}/alerts`.
//! - [`charts`]: `GET /api/v1/runs/{run_id}/charts/{chart}.svg|.png`, and
//!   `GET /api/v1/charts/compare.svg|.png` (several runs side by side).
//! - [`events`]: `GET /api/v1/events`, Server-Sent Events.
//! - [`webhooks`]: `GET /api/v1/webhooks/deliveries`, the webhook delivery log.
//! - [`extract`]: extractors that reject bad input with the API's JSON errors.
//! - [`auth`]: the ingest token that guards every write, the read token that guards
//!   every read.
//! - [`cors`]: cross-origin access, only for the origins configured.
//! - [`limits`]: the request timeout and the cap on concurrent requests.

pub mod alerts;
pub mod auth;
pub mod charts;
pub mod cors;
pub mod events;
pub mod extract;
pub mod health;
pub mod limits;
pub mod runs;
pub mod series;
pub mod steps;
pub mod webhooks;

use std::sync::Arc;

use axum::Router;
use axum::http::{Method, StatusCode, Uri};
use axum::middleware;
use axum::routing::{get, post, put};
use tower_http::trace::TraceLayer;

use crate::error::ApiError;
use crate::store::Store;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub store: Arc<Store>,
    pub settings: Arc<ApiSettings>,
    /// Turns true when the server begins to shut down (ends event streams).
    pub shutdown: tokio::sync::watch::Receiver<bool>,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// One permit per request being handled (`--max-concurrent-requests`).
    pub in_flight: Arc<tokio::sync::Semaphore>,
}

/// The request-handling part of the server's configuration.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    /// When set, every write needs `Authorization: Bearer <token>`.
    pub ingest_token: Option<String>,
    /// When set, every read needs this token (or the ingest token), as a bearer
    /// token or the login cookie.
    pub read_token: Option<String>,
    /// Largest request body, before and after decompression.
    pub max_body_bytes: usize,
    /// Longest a request may take to be answered.
    pub request_timeout: std::time::Duration,
    /// Requests handled at once.
    pub max_concurrent_requests: usize,
    /// Origins whose pages may call the API from a browser; empty: no CORS headers.
    pub cors_origins: Vec<String>,
}

/// The application: every route of the API with its middleware.
pub fn app(state: AppState) -> Router {
    let api = Router::new()
        .route(
            "/runs/{run_id}",
            put(runs::register_run)
                .get(runs::get_run)
                .delete(runs::delete_run),
        )
        .route("/runs", get(runs::list_runs))
        .route("/runs/{run_id}/steps", post(steps::ingest_steps))
        .route("/runs/{run_id}/finish", post(runs::finish_run))
        .route("/runs/{run_id}/series", get(series::read_series))
        .route("/runs/{run_id}/alerts", get(alerts::list_run_alerts))
        .route("/alerts", get(alerts::list_alerts))
        .route("/runs/{run_id}/charts/{file}", get(charts::render_chart))
        .route("/charts/{file}", get(charts::render_comparison))
        .route("/events", get(events::stream_events))
        .route("/webhooks/deliveries", get(webhooks::list_deliveries))
        .route("/openapi.json", get(crate::openapi::openapi_json))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_ingest_token,
        ));
    let app = Router::new()
        .route("/healthz", get(health::healthz))
        .route("/metrics", get(crate::metrics::serve_metrics))
        .nest("/api/v1", api)
        .merge(crate::pages::routes())
        .fallback(no_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_read_token,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), limits::limit))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::metrics::count_rejections,
        ));
    // Outside the token checks: a browser's preflight carries no credentials.
    let app = match cors::layer(&state.settings.cors_origins) {
        Some(cors) => app.layer(cors),
        None => app,
    };
    app.layer(TraceLayer::new_for_http()).with_state(state)
}

async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::not_found("not_found", format!("no route for {method} {}", uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not allowed on {}", uri.path()),
    )
}
