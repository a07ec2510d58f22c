//! `GET /api/v1/openapi.json`: the API as an OpenAPI 3.1 document, generated from the
//! handlers' `#[utoipa::path]` annotations, the response bodies of `crate::api_types`
//! and the wire types (`gradflow-protocol` with its `openapi` feature).

use axum::Json;
use gradflow_core::model::alert::{AlertKind, Severity};
use gradflow_core::model::metric::MetricName;
use utoipa::OpenApi;
use utoipa::openapi::schema::{ObjectBuilder, Type};

use crate::charts::compare::CompareMetric;
use crate::charts::ranks::RankMetric;

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
    modifiers(&NamedParameters),
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

/// The query parameters whose values are names of a vocabulary: (path, parameter,
/// the table's names). The document's `enum` for each is the table's list, so it
/// cannot fall behind the table.
pub fn named_parameters() -> [(&'static str, &'static str, &'static [&'static str]); 7] {
    [
        ("/api/v1/runs/{run_id}/series", "metric", &MetricName::NAMES),
        ("/api/v1/charts/{file}", "metric", &CompareMetric::NAMES),
        (
            "/api/v1/runs/{run_id}/charts/{file}",
            "metric",
            &RankMetric::NAMES,
        ),
        ("/api/v1/alerts", "kind", &AlertKind::NAMES),
        ("/api/v1/alerts", "severity", &Severity::NAMES),
        ("/api/v1/runs/{run_id}/alerts", "kind", &AlertKind::NAMES),
        ("/api/v1/runs/{run_id}/alerts", "severity", &Severity::NAMES),
    ]
}

/// Writes [`named_parameters`] into the document.
struct NamedParameters;

impl utoipa::Modify for NamedParameters {
    fn modify(&self, document: &mut utoipa::openapi::OpenApi) {
        for (path, name, names) in named_parameters() {
            let parameter = document
                .paths
                .paths
                .get_mut(path)
                .and_then(|item| item.get.as_mut())
                .and_then(|get| get.parameters.as_mut())
                .and_then(|parameters| parameters.iter_mut().find(|p| p.name == name))
                .unwrap_or_else(|| panic!("{path} has no parameter {name}"));
            parameter.schema = Some(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .enum_values(Some(names.iter().copied()))
                    .into(),
            );
        }
    }
}

/// `GET /api/v1/openapi.json`.
#[utoipa::path(get, path = "/api/v1/openapi.json", tag = "server",
    responses((status = 200, description = "This document", content_type = "application/json")))]
pub async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every vocabulary the API takes by name is the document's enum, name for name.
    #[test]
    fn the_document_lists_every_name_of_each_vocabulary() {
        let document = serde_json::to_value(ApiDoc::openapi()).unwrap();
        for (path, name, names) in named_parameters() {
            let parameter = document["paths"][path]["get"]["parameters"]
                .as_array()
                .and_then(|ps| ps.iter().find(|p| p["name"] == name))
                .unwrap_or_else(|| panic!("{path} {name}"));
            assert_eq!(
                parameter["schema"]["enum"],
                serde_json::json!(names),
                "{path} {name}"
            );
        }
        let alert = &document["components"]["schemas"]["Alert"]["properties"];
        assert_eq!(
            alert["kind"]["enum"],
            serde_json::json!(AlertKind::NAMES.as_slice())
        );
        assert_eq!(
            alert["status"]["enum"],
            serde_json::json!(["open", "resolved"])
        );
        let severity = &document["components"]["schemas"]["AlertSeverity"]["enum"];
        assert_eq!(severity, &serde_json::json!(Severity::NAMES.as_slice()));
        let code = &document["components"]["schemas"]["ErrorCode"]["enum"];
        assert_eq!(
            code,
            &serde_json::json!(crate::error::ErrorCode::NAMES.as_slice())
        );
    }
}
