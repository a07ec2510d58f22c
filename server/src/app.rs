//! The application: the router that puts the API's routes, the pages, the
//! OpenAPI document and the metrics together with their middleware. The only module
//! that imports all of them, so that none of them imports another's neighbour.

use axum::Router;
use axum::http::{Method, Uri};
use axum::middleware;
use axum::routing::{get, post, put};
use tower_http::trace::TraceLayer;

use crate::error::{ApiError, ErrorCode};
use crate::routes::{
    alerts, auth, charts, cors, events, health, limits, metrics, ranks, runs, series, steps,
    webhooks,
};
use crate::state::AppState;

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
        .route("/runs/{run_id}/ranks", get(ranks::list_ranks))
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
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(metrics::serve_metrics))
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
            metrics::count_rejections,
        ));
    // Outside the token checks: a browser's preflight carries no credentials.
    let app = match cors::layer(&state.settings.cors_origins) {
        Some(cors) => app.layer(cors),
        None => app,
    };
    app.layer(TraceLayer::new_for_http()).with_state(state)
}

async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("no route for {method} {}", uri.path()),
    )
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        format!("{method} is not allowed on {}", uri.path()),
    )
}
