//! Runs: `PUT`, `GET` and `DELETE /api/v1/runs/{run_id}`, and `GET /api/v1/runs`.

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use gradflow_protocol::{RunRegistration, Timestamp};
use serde_json::{Value, json};

use super::extract::{ApiQuery, RunIdParam};
use crate::api_types::{Deleted, RunList, RunListItem, RunProgress};
use crate::body::{self, BodyFormat};
use crate::error::ApiError;
use crate::state::AppState;
use crate::store::alerts::OpenAlertCounts;
use crate::store::{StoredRun, now_seconds};

/// `PUT /api/v1/runs/{run_id}`: `201` the first time, `200` for the same body again,
/// `409` for a different one.
#[utoipa::path(put, path = "/api/v1/runs/{run_id}", tag = "runs",
    params(crate::api_types::RunIdPath),
    request_body(description = "The registration: JSON, or the same data model as CBOR (application/cbor, v1.6); may be gzip-compressed",
        content((gradflow_protocol::RunRegistration = "application/json"), (gradflow_protocol::RunRegistration = "application/cbor"))),
    responses(
        (status = 201, description = "Registered", body = crate::api_types::RunView),
        (status = 200, description = "Already registered with this very body", body = crate::api_types::RunView),
        (status = 400, response = crate::api_types::BadRequest), (status = 401, response = crate::api_types::Unauthorized),
        (status = 409, description = "Registered before with a different body", body = crate::api_types::ErrorBody),
        (status = 413, response = crate::api_types::TooLarge),
        (status = 415, response = crate::api_types::Unsupported),
        (status = 503, response = crate::api_types::Unavailable)))]
#[tracing::instrument(skip_all, fields(run_id = %run_id.0))]
pub async fn register_run(
    State(state): State<AppState>,
    run_id: RunIdParam,
    headers: HeaderMap,
    request_body: Body,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let RunIdParam(run_id) = run_id;
    let format = body::body_format(&headers, false)?;
    debug_assert_ne!(format, BodyFormat::Ndjson);
    let encoding = body::body_encoding(&headers)?;
    let limit = state.settings.max_body_bytes;
    let received = body::receive(&headers, request_body, limit).await?;
    let registration = tokio::task::spawn_blocking(move || {
        let bytes = body::decode(received, encoding, limit)?;
        match format {
            BodyFormat::Cbor => RunRegistration::from_cbor(&bytes),
            BodyFormat::Json | BodyFormat::Ndjson => RunRegistration::from_json(&bytes),
        }
        .map_err(ApiError::invalid_body)
    })
    .await
    .map_err(|e| crate::store::StoreError::Internal(e.into()))??;
    let (run, created) = state.ingest.register_run(&run_id, registration).await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let open_alerts = open_alerts_of(&state, run_id.as_str()).await?;
    Ok((status, Json(run_view(&run, open_alerts))))
}

/// `GET /api/v1/runs/{run_id}`: the registration in force (amendments applied), the
/// amendments, and where the stream stands.
#[utoipa::path(get, path = "/api/v1/runs/{run_id}", tag = "runs",
    params(crate::api_types::RunIdPath),
    responses((status = 200, description = "The registration and where the run stands", body = crate::api_types::RunView), (status = 400, response = crate::api_types::BadRequest), (status = 404, response = crate::api_types::RunNotFound)))]
pub async fn get_run(
    State(state): State<AppState>,
    RunIdParam(run_id): RunIdParam,
) -> Result<Json<Value>, ApiError> {
    let run = state.store.run(&run_id).await?;
    let open_alerts = open_alerts_of(&state, run_id.as_str()).await?;
    Ok(Json(run_view(&run, open_alerts)))
}

/// `GET /api/v1/runs`: every run, newest first.
#[utoipa::path(get, path = "/api/v1/runs", tag = "runs",
    responses((status = 200, description = "Every run, newest first", body = crate::api_types::RunList)))]
pub async fn list_runs(State(state): State<AppState>) -> Result<Json<RunList>, ApiError> {
    let runs = state.store.runs().await?;
    let counts = state.store.open_alert_counts(None).await?;
    let now = now_seconds();
    let runs = runs
        .into_iter()
        .map(|run| {
            let open_alerts = counts.get(&run.run_id).copied().unwrap_or_default();
            RunListItem {
                progress: RunProgress {
                    created_at: rfc3339(run.created_at),
                    last_step: run.last_step.map(|s| s as u64),
                    last_seen: run.last_seen.map(rfc3339),
                    step_count: run.step_count as u64,
                    status: run.status(now),
                    finished_at: run.finished_at.map(rfc3339),
                    open_alerts,
                },
                run_id: run.run_id,
                name: run.name,
            }
        })
        .collect();
    Ok(Json(RunList { runs }))
}

/// `POST /api/v1/runs/{run_id}/finish`: the trainer says the run is over, so the
/// dashboard shows it finished rather than stale. Takes no body; answers the run.
/// *(v1.5)* In a multi-rank run, `?rank=N` says that rank closed: the steps it did
/// not send are completed at once (without it: `rank_missing`).
#[utoipa::path(post, path = "/api/v1/runs/{run_id}/finish", tag = "runs",
    params(crate::api_types::RunIdPath,
        ("rank" = Option<u32>, Query, description = "(v1.5) the rank of a multi-rank run that closed")),
    responses((status = 200, description = "Marked finished", body = crate::api_types::RunView), (status = 400, response = crate::api_types::BadRequest), (status = 401, response = crate::api_types::Unauthorized), (status = 404, response = crate::api_types::RunNotFound)))]
#[tracing::instrument(skip_all, fields(run_id = %run_id.0))]
pub async fn finish_run(
    State(state): State<AppState>,
    run_id: RunIdParam,
    ApiQuery(finish): ApiQuery<FinishQuery>,
) -> Result<Json<Value>, ApiError> {
    let RunIdParam(run_id) = run_id;
    // Before the run is marked finished: completing steps is a write, which counts as
    // hearing from the run.
    if let Some(rank) = finish.rank {
        state.ingest.close_rank(&run_id, rank).await?;
    }
    let run = state.store.finish_run(&run_id).await?;
    let open_alerts = open_alerts_of(&state, run_id.as_str()).await?;
    Ok(Json(run_view(&run, open_alerts)))
}

/// `POST .../finish`'s query *(v1.5)*.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FinishQuery {
    /// The rank of a multi-rank run that closed.
    pub rank: Option<u32>,
}

/// `DELETE /api/v1/runs/{run_id}`: removes the run and everything of it.
#[utoipa::path(delete, path = "/api/v1/runs/{run_id}", tag = "runs",
    params(crate::api_types::RunIdPath),
    responses((status = 200, description = "Deleted with all its steps and alerts", body = crate::api_types::Deleted), (status = 400, response = crate::api_types::BadRequest), (status = 401, response = crate::api_types::Unauthorized), (status = 404, response = crate::api_types::RunNotFound)))]
#[tracing::instrument(skip_all, fields(run_id = %run_id.0))]
pub async fn delete_run(
    State(state): State<AppState>,
    run_id: RunIdParam,
) -> Result<Json<Deleted>, ApiError> {
    let RunIdParam(run_id) = run_id;
    let steps_deleted = state.store.delete_run(&run_id).await?;
    Ok(Json(Deleted {
        run_id: run_id.as_str().to_owned(),
        deleted: true,
        steps_deleted,
    }))
}

/// One run's open alerts by severity.
async fn open_alerts_of(state: &AppState, run_id: &str) -> Result<OpenAlertCounts, ApiError> {
    let counts = state.store.open_alert_counts(Some(run_id)).await?;
    Ok(counts.get(run_id).copied().unwrap_or_default())
}

/// The registration's fields with the run's progress beside them.
fn run_view(run: &StoredRun, open_alerts: OpenAlertCounts) -> Value {
    let mut view =
        serde_json::to_value(run.registration.clone().redacted()).unwrap_or_else(|_| json!({}));
    let progress = json!({
        "run_id": run.run_id,
        "created_at": rfc3339(run.created_at),
        "first_step": run.first_step,
        "last_step": run.last_step,
        "last_seen": run.last_seen.map(rfc3339),
        "step_count": run.step_count,
        "status": run.status(now_seconds()),
        "finished_at": run.finished_at.map(rfc3339),
        "open_alerts": open_alerts,
        "amendments": run
            .amendments
            .iter()
            .map(|(step, amend)| json!({"step": step, "amend": amend}))
            .collect::<Vec<_>>(),
    });
    if let (Some(view), Value::Object(progress)) = (view.as_object_mut(), progress) {
        view.extend(progress);
    }
    view
}

pub(crate) fn rfc3339(unix_seconds: f64) -> String {
    Timestamp::from_unix_seconds(unix_seconds)
        .map(Timestamp::to_rfc3339)
        .unwrap_or_default()
}
