//! `GET /api/v1/runs/{run_id}/series?metric=&subject=&from_step=&to_step=&max_points=&rank=`,
//! as JSON, or as CSV (`format=csv` or `Accept: text/csv`) for notebooks. `rank`
//! reads one rank's own records of a multi-rank run instead of the combined run.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use gradflow_protocol::limits::MAX_STEP;
use gradflow_protocol::non_finite_spelling;
use serde::Deserialize;
use serde_json::Value;

use super::extract::{ApiQuery, RunIdParam, check_step_range};
use crate::api_types::{Series, SeriesPoint};
use crate::error::{ApiError, ErrorCode};
use crate::state::AppState;
use crate::store::SeriesRequest;
use gradflow_core::model::cell::{Cell, widen_for_display};
use gradflow_core::model::metric::{Metric, Subject};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeriesParams {
    metric: String,
    subject: Option<String>,
    from_step: Option<u64>,
    to_step: Option<u64>,
    max_points: Option<usize>,
    /// `json` (the default) or `csv`.
    format: Option<String>,
    /// One rank's own records (v1.4), instead of the run's combined steps.
    rank: Option<u32>,
}

/// What the response is written as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ResponseFormat {
    Json,
    Csv,
}

/// `format=` wins; otherwise `Accept: text/csv` (and no JSON preferred) asks for CSV.
fn response_format(param: Option<&str>, headers: &HeaderMap) -> Result<ResponseFormat, ApiError> {
    match param {
        Some("json") => return Ok(ResponseFormat::Json),
        Some("csv") => return Ok(ResponseFormat::Csv),
        Some(other) => {
            return Err(ApiError::invalid_query(format!(
                "format must be json or csv, got {other:?}"
            ))
            .with_path("format"));
        }
        None => {}
    }
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let wants = |media: &str| {
        accept
            .split(',')
            .any(|part| part.split(';').next().unwrap_or_default().trim() == media)
    };
    Ok(if wants("text/csv") && !wants("application/json") {
        ResponseFormat::Csv
    } else {
        ResponseFormat::Json
    })
}

/// Reads one series; with `max_points`, a longer range is reduced to at most that
/// many points by min/max per bucket, which keeps spikes and non-finite values.
#[utoipa::path(get, path = "/api/v1/runs/{run_id}/series", tag = "series",
    params(crate::api_types::RunIdPath,
        ("metric" = String, Query, description = "The metric to read (the document's enum lists them)"),
        ("subject" = Option<String>, Query, description = "A group or module (grad_norm), module (hook_hits), parameter, metrics name, device index, or an optimizer parameter group (lr)"),
        ("from_step" = Option<u64>, Query, description = "First step"),
        ("to_step" = Option<u64>, Query, description = "Last step"),
        ("max_points" = Option<usize>, Query, description = "Reduce to at most this many points (min/max per bucket), at least 2"),
        ("format" = Option<String>, Query, description = "json (default) or csv"),
        ("rank" = Option<u32>, Query, description = "A multi-rank run: this rank's own records instead of the combined steps")),
    responses(
        (status = 200, description = "The series", content(
            (crate::api_types::Series = "application/json"),
            (String = "text/csv", example = "step,value\n0,2.5\n1,NaN\n"))),
        (status = 400, response = crate::api_types::BadRequest), (status = 404, response = crate::api_types::RunNotFound)))]
pub async fn read_series(
    State(state): State<AppState>,
    RunIdParam(run_id): RunIdParam,
    headers: HeaderMap,
    ApiQuery(params): ApiQuery<SeriesParams>,
) -> Result<Response, ApiError> {
    let format = response_format(params.format.as_deref(), &headers)?;
    let Some(metric) = Metric::named(&params.metric) else {
        return Err(ApiError::invalid_query(format!(
            "unknown metric {:?}: one of {}",
            params.metric,
            Metric::names()
        ))
        .with_path("metric"));
    };
    let subject = match (&metric.subject, params.subject.as_deref()) {
        (Subject::None, None) => None,
        (Subject::None, Some(_)) => {
            return Err(ApiError::invalid_query(format!(
                "metric {:?} is run-wide and takes no subject",
                params.metric
            ))
            .with_path("subject"));
        }
        (Subject::Required(what), None | Some("")) => {
            return Err(ApiError::invalid_query(format!(
                "metric {:?} needs a subject: {what}",
                params.metric
            ))
            .with_path("subject"));
        }
        (Subject::Required(_), Some(s)) => Some(s.to_owned()),
        (Subject::Optional, None | Some("")) => None,
        (Subject::Optional, Some(s)) => Some(s.to_owned()),
        (Subject::Device, None) => Some("0".to_owned()),
        (Subject::Device, Some(s)) => match s.parse::<u32>() {
            Ok(index) => Some(index.to_string()),
            Err(_) => {
                return Err(ApiError::invalid_query(format!(
                    "subject {s:?} is not a device index"
                ))
                .with_path("subject"));
            }
        },
    };
    check_step_range(params.from_step, params.to_step)?;
    let from = params.from_step.unwrap_or(0);
    let to = params.to_step.unwrap_or(MAX_STEP);
    if let Some(max_points) = params.max_points
        && max_points < 2
    {
        return Err(ApiError::invalid_query(format!(
            "max_points must be at least 2 (a minimum and a maximum), got {max_points}"
        ))
        .with_path("max_points"));
    }
    let stream = match params.rank {
        None => crate::store::RUN_STREAM,
        Some(rank) => {
            let world_size = state.store.run(&run_id).await?.registration.world_size();
            if rank >= world_size {
                return Err(ApiError::invalid_query(format!(
                    "rank {rank} is not a rank of run {run_id}, which has {world_size} \
                     (world_size)"
                ))
                .with_path("rank"));
            }
            crate::store::rank_stream(rank)
        }
    };
    let request = SeriesRequest {
        candidates: metric
            .kinds
            .iter()
            .map(|k| (*k, subject.clone().unwrap_or_default()))
            .collect(),
        from,
        to,
        max_points: params.max_points,
        stream,
    };
    let data = state.store.series(&run_id, &request).await?;
    let what = metric.subject_noun();
    if data.kind.is_none()
        && let (Some(what), Some(subject)) = (what, &subject)
    {
        return Err(ApiError::new(
            ErrorCode::UnknownSubject,
            format!(
                "run {run_id} has reported no {} named {subject:?}",
                what.trim_start_matches("a ")
            ),
        )
        .with_path("subject"));
    }
    if format == ResponseFormat::Csv {
        return Ok(csv_response(
            &run_id,
            &params.metric,
            subject.as_deref(),
            &data.points,
        ));
    }
    let points = data
        .points
        .iter()
        .map(|(step, cell)| SeriesPoint(*step, cell_json(*cell)))
        .collect();
    Ok(Json(Series {
        metric: params.metric,
        subject,
        rank: params.rank,
        downsampled: data.downsampled,
        points,
    })
    .into_response())
}

/// `step,value` lines: numbers as JSON writes them, `NaN`, `Infinity` and
/// `-Infinity` as pandas reads them, an empty value for a measured null.
fn csv_response(
    run_id: &gradflow_protocol::RunId,
    metric: &str,
    subject: Option<&str>,
    points: &[(u64, Cell)],
) -> Response {
    let mut csv = String::with_capacity(16 + points.len() * 16);
    csv.push_str("step,value\n");
    for (step, cell) in points {
        let value = match cell_json(*cell) {
            Value::Null => String::new(),
            Value::String(s) => s,
            number => number.to_string(),
        };
        csv.push_str(&format!("{step},{value}\n"));
    }
    // The file name carries only characters a run id, metric and device index
    // can have; a free-form subject is left out of it.
    let device = subject.filter(|s| s.bytes().all(|b| b.is_ascii_digit()));
    let name = match device {
        Some(device) => format!("{run_id}-{metric}-{device}.csv"),
        None => format!("{run_id}-{metric}.csv"),
    };
    (
        [
            (header::CONTENT_TYPE, "text/csv; charset=utf-8".to_owned()),
            (
                header::CONTENT_DISPOSITION,
                format!("inline; filename=\"{name}\""),
            ),
        ],
        csv,
    )
        .into_response()
}

/// A stored cell as the protocol spells it: numbers (integers without a fraction),
/// non-finite values as their strings, null as null.
fn cell_json(cell: Cell) -> Value {
    match cell {
        Cell::Absent | Cell::Null => Value::Null,
        Cell::Value(v) => {
            let wide = widen_for_display(v);
            if let Some(spelling) = non_finite_spelling(wide) {
                Value::from(spelling)
            } else if wide.fract() == 0.0 && wide.abs() < 9.0e15 {
                Value::from(wide as i64)
            } else {
                Value::from(wide)
            }
        }
    }
}
