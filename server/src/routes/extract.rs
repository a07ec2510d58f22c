//! Extractors whose rejections are the API's JSON errors (axum's own answer in plain
//! text).

use std::collections::HashMap;

use axum::extract::{FromRequestParts, Path, Query};
use axum::http::request::Parts;
use gradflow_protocol::RunId;
use serde::de::DeserializeOwned;

use crate::error::{ApiError, ErrorCode};

/// The `{run_id}` of the path, parsed.
pub struct RunIdParam(pub RunId);

impl<S: Send + Sync> FromRequestParts<S> for RunIdParam {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path(params) = Path::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map_err(|e| {
                ApiError::new(ErrorCode::InvalidRunId, e.body_text()).with_path("run_id")
            })?;
        let raw = params.get("run_id").map(String::as_str).unwrap_or_default();
        RunId::parse(raw)
            .map(RunIdParam)
            .map_err(|message| ApiError::new(ErrorCode::InvalidRunId, message).with_path("run_id"))
    }
}

/// Query parameters, deserialized into `T` (which should deny unknown fields).
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        Query::<T>::try_from_uri(&parts.uri)
            .map(|Query(value)| ApiQuery(value))
            .map_err(|e| ApiError::invalid_query(e.body_text()))
    }
}

/// A step range of the query: `from_step` may not come after `to_step` (either may be
/// left open).
/// A `run_id` query parameter, checked like the path's.
pub fn run_id_query(raw: Option<&str>) -> Result<Option<String>, ApiError> {
    raw.map(|raw| {
        RunId::parse(raw)
            .map(|id| id.as_str().to_owned())
            .map_err(|m| ApiError::invalid_query(m).with_path("run_id"))
    })
    .transpose()
}

pub fn check_step_range(from: Option<u64>, to: Option<u64>) -> Result<(), ApiError> {
    match (from, to) {
        (Some(from), Some(to)) if from > to => Err(ApiError::invalid_query(format!(
            "from_step {from} is after to_step {to}"
        ))
        .with_path("from_step")),
        _ => Ok(()),
    }
}
