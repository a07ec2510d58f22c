//! `POST /api/v1/runs/{run_id}/steps`: the ingest path.

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use gradflow_protocol::{parse_steps_cbor, parse_steps_json, parse_steps_ndjson};

use super::extract::RunIdParam;
use crate::body::{self, BodyFormat};
use crate::error::ApiError;
use crate::ingest::IngestOutcome;
use crate::state::AppState;
use crate::store::StoreError;

/// Stores a batch of step records (a JSON array, NDJSON, or a CBOR array), all or
/// nothing.
#[utoipa::path(post, path = "/api/v1/runs/{run_id}/steps", tag = "steps",
    params(crate::api_types::RunIdPath),
    request_body(description = "Step records, steps strictly increasing: a JSON array, NDJSON (application/x-ndjson, one record a line), or the JSON array's data model as one CBOR data item (application/cbor, v1.6); may be gzip-compressed",
        content((Vec<gradflow_protocol::StepRecord> = "application/json"), (gradflow_protocol::StepRecord = "application/x-ndjson"), (Vec<gradflow_protocol::StepRecord> = "application/cbor"))),
    responses(
        (status = 200, description = "Stored and committed (all or nothing)", body = crate::ingest::IngestOutcome),
        (status = 400, response = crate::api_types::BadRequest), (status = 401, response = crate::api_types::Unauthorized), (status = 404, response = crate::api_types::RunNotFound),
        (status = 413, response = crate::api_types::TooLarge),
        (status = 415, response = crate::api_types::Unsupported),
        (status = 503, response = crate::api_types::Unavailable)))]
#[tracing::instrument(skip_all, fields(run_id = %run_id.0))]
pub async fn ingest_steps(
    State(state): State<AppState>,
    run_id: RunIdParam,
    headers: HeaderMap,
    request_body: Body,
) -> Result<Json<IngestOutcome>, ApiError> {
    let started = std::time::Instant::now();
    let RunIdParam(run_id) = run_id;
    let format = body::body_format(&headers, true)?;
    let encoding = body::body_encoding(&headers)?;
    let limit = state.settings.max_body_bytes;
    let received = body::receive(&headers, request_body, limit).await?;
    // Decompressing and parsing a batch is CPU work of milliseconds: keep it off the
    // async executor.
    let records = tokio::task::spawn_blocking(move || {
        let bytes = body::decode(received, encoding, limit)?;
        match format {
            BodyFormat::Json => parse_steps_json(&bytes),
            BodyFormat::Ndjson => parse_steps_ndjson(&bytes),
            BodyFormat::Cbor => parse_steps_cbor(&bytes),
        }
        .map_err(ApiError::invalid_body)
    })
    .await
    .map_err(|e| StoreError::Internal(e.into()))??;
    // The batch transaction runs in a task of its own, which a dropped request (the
    // client gone, the request timeout) does not cancel: a COMMIT in flight either
    // completes with the run's cached state updated after it, or fails and leaves
    // both as they were. Cancelled half-way, the database could hold a batch the
    // cache does not know of.
    let ingest = state.ingest.clone();
    let outcome = tokio::spawn(async move { ingest.ingest(&run_id, &records).await })
        .await
        .map_err(|e| StoreError::Internal(e.into()))??;
    state.metrics.batch_stored(
        outcome.accepted,
        outcome.values,
        started.elapsed().as_secs_f64(),
    );
    if outcome.duplicates > 0 {
        tracing::info!(
            duplicates = outcome.duplicates,
            accepted = outcome.accepted,
            "duplicate steps ignored"
        );
    }
    Ok(Json(outcome))
}
