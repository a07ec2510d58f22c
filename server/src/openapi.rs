//! `GET /api/v1/openapi.json`: the API as an OpenAPI 3.1 document, generated from the
//! handlers' `#[utoipa::path]` annotations, the response bodies of `crate::api_types`
//! and the wire types (`gradflow-protocol` with its `openapi` feature).

use axum::Json;
use utoipa::OpenApi;

use crate::api_types::*;
use crate::ingest::IngestOutcome;
use crate::store::RunStatus;
use crate::store::alerts::{Alert, OpenAlertCounts};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "gradflow",
        description = "Gradient-flow diagnostics for deep-learning training: protocol v1 (docs/PROTOCOL.md) and the server's extensions (README, \"Protocol notes\")."
    ),
    paths(
        crate::routes::health::healthz,
        crate::routes::health::readyz,
        crate::routes::metrics::serve_metrics,
        openapi_json,
        crate::routes::runs::register_run,
        crate::routes::runs::get_run,
        crate::routes::runs::list_runs,
        crate::routes::runs::finish_run,
        crate::routes::runs::delete_run,
        crate::routes::steps::ingest_steps,
        crate::routes::series::read_series,
        crate::routes::ranks::list_ranks,
        crate::routes::alerts::list_alerts,
        crate::routes::alerts::list_run_alerts,
        crate::routes::charts::render_chart,
        crate::routes::charts::render_comparison,
        crate::routes::events::stream_events,
        crate::routes::webhooks::list_deliveries,
    ),
    components(
        responses(BadRequest, Unauthorized, RunNotFound, TooLarge, Unsupported, Unavailable),
        schemas(ErrorBody, ErrorDetail, Health, RunView, AmendmentView, RunList, RunListItem, RunProgress, Deleted, Series, RunRanks, RankStanding, AlertList, Alert, OpenAlertCounts, IngestOutcome, RunStatus, crate::routes::webhooks::DeliveryList, crate::store::webhooks::WebhookDelivery)),
    tags(
        (name = "runs", description = "Register, read, finish and delete runs"),
        (name = "steps", description = "Stream step records"),
        (name = "series", description = "Read a metric back"),
        (name = "alerts", description = "What the detectors found"),
        (name = "charts", description = "Charts drawn by the server"),
        (name = "events", description = "Live progress and alerts"),
        (name = "server", description = "Health, metrics, this document"),
    )
)]
pub struct ApiDoc;

/// `GET /api/v1/openapi.json`.
#[utoipa::path(get, path = "/api/v1/openapi.json", tag = "server",
    responses((status = 200, description = "This document", content_type = "application/json")))]
pub async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}
