//! `GET /api/v1/alerts` and `GET /api/v1/runs/{run_id}/alerts`.

use axum::Json;
use axum::extract::State;
use serde::Deserialize;

use super::extract::{ApiQuery, RunIdParam, run_id_query};
use crate::api_types::AlertList;
use crate::error::ApiError;
use crate::state::AppState;
use crate::store::alerts::AlertFilter;
use gradflow_core::detect::{AlertKind, Severity};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllAlertsParams {
    run_id: Option<String>,
    status: Option<String>,
    kind: Option<String>,
    severity: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunAlertsParams {
    status: Option<String>,
    kind: Option<String>,
    severity: Option<String>,
}

/// Alerts of every run (or of `run_id`), oldest `first_step` first.
#[utoipa::path(get, path = "/api/v1/alerts", tag = "alerts",
    params(
        ("run_id" = Option<String>, Query, description = "Only this run's"),
        ("status" = Option<String>, Query, description = "open, resolved or all (default)"),
        ("kind" = Option<String>, Query, description = "An alert kind"),
        ("severity" = Option<String>, Query, description = "critical, warning or info")),
    responses((status = 200, description = "Alerts, oldest first_step first", body = crate::api_types::AlertList), (status = 400, response = crate::api_types::BadRequest)))]
pub async fn list_alerts(
    State(state): State<AppState>,
    ApiQuery(params): ApiQuery<AllAlertsParams>,
) -> Result<Json<AlertList>, ApiError> {
    let run_id = run_id_query(params.run_id.as_deref())?;
    let filter = filter(run_id, params.status, params.kind, params.severity)?;
    let alerts = state.store.alerts(&filter).await?;
    Ok(Json(AlertList { alerts }))
}

/// One run's alerts.
#[utoipa::path(get, path = "/api/v1/runs/{run_id}/alerts", tag = "alerts",
    params(crate::api_types::RunIdPath,
        ("status" = Option<String>, Query, description = "open, resolved or all (default)"),
        ("kind" = Option<String>, Query, description = "An alert kind"),
        ("severity" = Option<String>, Query, description = "critical, warning or info")),
    responses((status = 200, description = "The run's alerts, oldest first_step first", body = crate::api_types::AlertList), (status = 400, response = crate::api_types::BadRequest), (status = 404, response = crate::api_types::RunNotFound)))]
pub async fn list_run_alerts(
    State(state): State<AppState>,
    RunIdParam(run_id): RunIdParam,
    ApiQuery(params): ApiQuery<RunAlertsParams>,
) -> Result<Json<AlertList>, ApiError> {
    let filter = filter(
        Some(run_id.as_str().to_owned()),
        params.status,
        params.kind,
        params.severity,
    )?;
    let alerts = state.store.alerts(&filter).await?;
    Ok(Json(AlertList { alerts }))
}

fn filter(
    run_id: Option<String>,
    status: Option<String>,
    kind: Option<String>,
    severity: Option<String>,
) -> Result<AlertFilter, ApiError> {
    let open = match status.as_deref() {
        None | Some("all") => None,
        Some("open") => Some(true),
        Some("resolved") => Some(false),
        Some(other) => {
            return Err(ApiError::invalid_query(format!(
                "unknown status {other:?}: one of open, resolved, all"
            ))
            .with_path("status"));
        }
    };
    let kind = match kind.as_deref() {
        None => None,
        Some(text) => Some(AlertKind::parse(text).ok_or_else(|| {
            let kinds: Vec<&str> = AlertKind::ALL.iter().map(|k| k.as_str()).collect();
            ApiError::invalid_query(format!(
                "unknown kind {text:?}: one of {}",
                kinds.join(", ")
            ))
            .with_path("kind")
        })?),
    };
    let severity = match severity.as_deref() {
        None => None,
        Some(text) => Some(Severity::parse(text).ok_or_else(|| {
            ApiError::invalid_query(format!(
                "unknown severity {text:?}: one of critical, warning, info"
            ))
            .with_path("severity")
        })?),
    };
    Ok(AlertFilter {
        run_id,
        open,
        kind,
        severity,
    })
}
