//! `GET /api/v1/runs/{run_id}/charts/{chart}.svg` (and `.png`), with optional
//! `from_step`, `to_step`, `width`, `height` (and, for the `ranks` chart of one
//! metric per rank, `metric` and `subject`); and `GET /api/v1/charts/compare.svg`
//! (and `.png`), one metric of several runs (`run=a&run=b&metric=&subject=`).

use axum::extract::{Path, RawQuery, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use gradflow_protocol::RunId;
use serde::Deserialize;

use super::extract::{ApiQuery, RunIdParam, check_step_range};
use crate::charts::compare::{self, CompareMetric, ComparedRun, MAX_RUNS, MIN_RUNS};
use crate::charts::ranks::{self, RankMetric, Ranks};
use crate::charts::{self, ChartData, ChartKind, Format, MAX_SIDE, MIN_SIDE};
use crate::error::{ApiError, ErrorCode};
use crate::state::AppState;
use crate::store::{Store, StoreError};
use gradflow_core::model::series_kind::SeriesKind;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChartParams {
    from_step: Option<u64>,
    to_step: Option<u64>,
    width: Option<u32>,
    height: Option<u32>,
    /// The `ranks` chart only: `step_time` (the default) or `grad_norm`.
    metric: Option<String>,
    /// The `ranks` chart's module, for `grad_norm`.
    subject: Option<String>,
}

#[utoipa::path(get, path = "/api/v1/runs/{run_id}/charts/{file}", tag = "charts",
    params(crate::api_types::RunIdPath,
        ("file" = String, Path, description = "grad-flow, group-grad-norms, norm-drift, scaler, loss, gpu, metrics (the run's own metrics, a panel each), attention-logits, adam-updates, moe-loads (a v1.8 signal, a line per module) or ranks (one metric per rank), with .svg or .png"),
        ("from_step" = Option<u64>, Query, description = "First step"),
        ("to_step" = Option<u64>, Query, description = "Last step"),
        ("width" = Option<u32>, Query, description = "Pixels, 300 to 4000"),
        ("height" = Option<u32>, Query, description = "Pixels, 300 to 4000"),
        ("metric" = Option<String>, Query, description = "ranks only: step_time (the default) or grad_norm, a line per rank (at most 16; the legend names the rest)"),
        ("subject" = Option<String>, Query, description = "ranks only: the module, for grad_norm")),
    responses(
        (status = 200, description = "The chart", content((String = "image/svg+xml"), (Vec<u8> = "image/png"))),
        (status = 400, response = crate::api_types::BadRequest),
        (status = 404, description = "Unknown run, chart or subject", body = crate::api_types::ErrorBody)))]
pub async fn render_chart(
    State(state): State<AppState>,
    RunIdParam(run_id): RunIdParam,
    Path((_, file)): Path<(String, String)>,
    ApiQuery(params): ApiQuery<ChartParams>,
) -> Result<Response, ApiError> {
    let mut names: Vec<&str> = ChartKind::ALL.iter().map(|k| k.as_str()).collect();
    names.push(RANKS_CHART);
    let unknown = || {
        ApiError::new(
            ErrorCode::UnknownChart,
            format!(
                "no chart {file:?}: one of {} with .svg or .png",
                names.join(", ")
            ),
        )
    };
    let (name, extension) = file.rsplit_once('.').ok_or_else(unknown)?;
    let format = match extension {
        "svg" => Format::Svg,
        "png" => Format::Png,
        _ => return Err(unknown()),
    };
    check_size(params.width, params.height)?;
    check_step_range(params.from_step, params.to_step)?;
    if name == RANKS_CHART {
        return render_ranks(&state, &run_id, params, format).await;
    }
    let kind = ChartKind::parse(name).ok_or_else(unknown)?;
    for (field, value) in [("metric", &params.metric), ("subject", &params.subject)] {
        if value.is_some() {
            return Err(ApiError::invalid_query(format!(
                "{field} is a parameter of the {RANKS_CHART} chart only, not of {name}"
            ))
            .with_path(field));
        }
    }
    let width = params.width.unwrap_or(charts::DEFAULT_WIDTH);
    // About one point per pixel column of the plot; a heatmap cell every 3 pixels.
    let points = match kind {
        ChartKind::GradFlow => (width as usize * 2 / 3) / 3,
        _ => width as usize,
    };
    let stored = state.store.run(&run_id).await?;
    let window = charts::data::window(&stored, params.from_step, params.to_step, points);
    let data = charts::data::gather(&state.store, &run_id, &stored, kind, window).await?;
    let height = params.height.unwrap_or(match &data {
        ChartData::GradFlow(flow) => charts::grad_flow::natural_height(flow.modules.len()),
        ChartData::Panels(panels) => charts::panels::natural_height(panels.panels.len(), width),
        _ => charts::DEFAULT_HEIGHT,
    });
    respond(data, format, width, height).await
}

/// The chart of one metric per rank: `ranks.svg`, `ranks.png`.
pub const RANKS_CHART: &str = "ranks";

/// One metric per rank of a run on one step axis: each rank's step time, or a
/// module's gradient norm as each rank computed it.
async fn render_ranks(
    state: &AppState,
    run_id: &RunId,
    params: ChartParams,
    format: Format,
) -> Result<Response, ApiError> {
    let metric = match params.metric.as_deref() {
        None | Some("") => RankMetric::StepTime,
        Some(name) => RankMetric::parse(name).ok_or_else(|| {
            ApiError::invalid_query(format!(
                "unknown metric {name:?} for the ranks chart: one of {}",
                RankMetric::names()
            ))
            .with_path("metric")
        })?,
    };
    let subject = match (metric, params.subject) {
        (RankMetric::StepTime, None) => String::new(),
        (RankMetric::StepTime, Some(_)) => {
            return Err(ApiError::invalid_query(
                "metric \"step_time\" is of the whole rank and takes no subject",
            )
            .with_path("subject"));
        }
        (RankMetric::GradNorm, None) => {
            return Err(
                ApiError::invalid_query("metric \"grad_norm\" needs a subject: a module")
                    .with_path("subject"),
            );
        }
        (RankMetric::GradNorm, Some(subject)) => subject,
    };
    let stored = state.store.run(run_id).await?;
    if metric == RankMetric::GradNorm
        && !state
            .store
            .subjects(run_id, SeriesKind::ModuleGradNorm)
            .await?
            .contains(&subject)
    {
        return Err(ApiError::new(
            ErrorCode::UnknownSubject,
            format!("run {run_id} has reported no module named {subject:?}"),
        )
        .with_path("subject"));
    }
    let ranks = Ranks::of(&state.store, run_id, &stored).await?;
    let width = params.width.unwrap_or(charts::DEFAULT_WIDTH);
    let window = ranks::window(
        &stored,
        &ranks,
        params.from_step,
        params.to_step,
        width as usize,
    );
    let chart = ranks::gather(&state.store, run_id, &ranks, metric, &subject, window).await?;
    let height = params
        .height
        .unwrap_or_else(|| ranks::natural_height(&chart));
    respond(ChartData::Lines(chart), format, width, height).await
}

fn check_size(width: Option<u32>, height: Option<u32>) -> Result<(), ApiError> {
    for (field, value) in [("width", width), ("height", height)] {
        if let Some(v) = value
            && !(MIN_SIDE..=MAX_SIDE).contains(&v)
        {
            return Err(ApiError::invalid_query(format!(
                "{field} must lie between {MIN_SIDE} and {MAX_SIDE} pixels, got {v}"
            ))
            .with_path(field));
        }
    }
    Ok(())
}

/// Draws `data` off the async executor and answers it as `format`.
async fn respond(
    data: ChartData,
    format: Format,
    width: u32,
    height: u32,
) -> Result<Response, ApiError> {
    // Drawing is CPU work: keep it off the async executor.
    let bytes = tokio::task::spawn_blocking(move || charts::render(&data, format, width, height))
        .await
        .map_err(|e| StoreError::Internal(e.into()))?
        .map_err(StoreError::Internal)?;
    let content_type = match format {
        Format::Svg => "image/svg+xml",
        Format::Png => "image/png",
    };
    Ok((
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-store"),
        ],
        bytes,
    )
        .into_response())
}

/// The query of a comparison, shared by its chart and its page: `run` once per run,
/// `metric`, `subject`, a step range and a size. An empty value (a form's emptied
/// field) counts as absent.
#[derive(Debug, Default)]
pub struct CompareQuery {
    pub runs: Vec<RunId>,
    pub metric: Option<CompareMetric>,
    pub subject: Option<String>,
    pub from_step: Option<u64>,
    pub to_step: Option<u64>,
    pub width: Option<u32>,
    pub height: Option<u32>,
}

/// Every field of a comparison's query.
pub const COMPARE_FIELDS: [&str; 7] = [
    "run",
    "metric",
    "subject",
    "from_step",
    "to_step",
    "width",
    "height",
];

impl CompareQuery {
    /// Parses and checks `query`; a field outside `fields` is refused by name.
    pub fn parse(query: Option<&str>, fields: &[&str]) -> Result<CompareQuery, ApiError> {
        let pairs: Vec<(String, String)> = serde_urlencoded::from_str(query.unwrap_or_default())
            .map_err(|e| ApiError::invalid_query(format!("malformed query: {e}")))?;
        let mut parsed = CompareQuery::default();
        for (field, value) in &pairs {
            if !fields.contains(&field.as_str()) {
                return Err(ApiError::invalid_query(format!(
                    "unknown query parameter {field:?}: expected {}",
                    fields.join(", ")
                ))
                .with_path(field.as_str()));
            }
            let value = value.trim();
            if value.is_empty() {
                continue;
            }
            let step = || whole_number(field, value, "a step number (a whole number, 0 or more)");
            let pixels = || whole_number(field, value, "a whole number of pixels");
            match field.as_str() {
                "run" => {
                    let id = RunId::parse(value).map_err(|message| {
                        ApiError::invalid_query(format!("run {value:?}: {message}"))
                            .with_path("run")
                    })?;
                    if parsed.runs.contains(&id) {
                        return Err(ApiError::invalid_query(format!(
                            "run {value:?} is named twice"
                        ))
                        .with_path("run"));
                    }
                    parsed.runs.push(id);
                }
                "metric" => {
                    let metric = CompareMetric::parse(value).ok_or_else(|| {
                        ApiError::invalid_query(format!(
                            "unknown metric {value:?}: one of {}",
                            CompareMetric::names()
                        ))
                        .with_path("metric")
                    })?;
                    parsed.metric = Some(metric);
                }
                "subject" => parsed.subject = Some(value.to_owned()),
                "from_step" => parsed.from_step = Some(step()?),
                "to_step" => parsed.to_step = Some(step()?),
                "width" => parsed.width = Some(pixels()?),
                _ => parsed.height = Some(pixels()?),
            }
        }
        let count = parsed.runs.len();
        if count < MIN_RUNS {
            return Err(ApiError::invalid_query(format!(
                "a comparison needs at least {MIN_RUNS} runs, got {count}: name each with run="
            ))
            .with_path("run"));
        }
        if count > MAX_RUNS {
            return Err(ApiError::invalid_query(format!(
                "at most {MAX_RUNS} runs can be compared at once, got {count}"
            ))
            .with_path("run"));
        }
        check_step_range(parsed.from_step, parsed.to_step)?;
        check_size(parsed.width, parsed.height)?;
        Ok(parsed)
    }
}

fn whole_number<T: std::str::FromStr>(field: &str, value: &str, what: &str) -> Result<T, ApiError> {
    value.parse().map_err(|_| {
        ApiError::invalid_query(format!("{field} must be {what}, got {value:?}")).with_path(field)
    })
}

/// The compared runs as stored; a run that is not registered is `404 run_not_found`.
pub async fn compared_runs(store: &Store, ids: &[RunId]) -> Result<Vec<ComparedRun>, ApiError> {
    let mut runs = Vec::with_capacity(ids.len());
    for id in ids {
        runs.push(ComparedRun {
            id: id.clone(),
            stored: store.run(id).await?,
        });
    }
    Ok(runs)
}

/// One metric of two to eight runs in one chart, a line per run on a shared step
/// axis; a run that never reported the subject is named in the legend as such.
#[utoipa::path(get, path = "/api/v1/charts/{file}", tag = "charts",
    params(
        ("file" = String, Path, description = "compare.svg or compare.png"),
        ("run" = Vec<String>, Query, explode, description = "A run to compare, repeated once per run: 2 to 8 runs"),
        ("metric" = Option<String>, Query, description = "loss (the default), grad_norm, drift or metric (one of the run's own metrics), as the series endpoint names them"),
        ("subject" = Option<String>, Query, description = "A group or module (grad_norm), a norm weight (drift), a metrics name (metric); none for loss"),
        ("from_step" = Option<u64>, Query, description = "First step"),
        ("to_step" = Option<u64>, Query, description = "Last step"),
        ("width" = Option<u32>, Query, description = "Pixels, 300 to 4000"),
        ("height" = Option<u32>, Query, description = "Pixels, 300 to 4000")),
    responses(
        (status = 200, description = "The chart", content((String = "image/svg+xml"), (Vec<u8> = "image/png"))),
        (status = 400, response = crate::api_types::BadRequest),
        (status = 404, description = "Unknown run, subject (reported by none of the runs) or chart", body = crate::api_types::ErrorBody)))]
pub async fn render_comparison(
    State(state): State<AppState>,
    Path(file): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let format = match file.as_str() {
        "compare.svg" => Format::Svg,
        "compare.png" => Format::Png,
        _ => {
            return Err(ApiError::new(
                ErrorCode::UnknownChart,
                format!("no chart {file:?}: compare.svg or compare.png"),
            ));
        }
    };
    let query = CompareQuery::parse(query.as_deref(), &COMPARE_FIELDS)?;
    let metric = query.metric.unwrap_or(CompareMetric::Loss);
    let subject = match (metric.subject_noun(), query.subject) {
        (None, None) => String::new(),
        (None, Some(_)) => {
            return Err(ApiError::invalid_query(format!(
                "metric {:?} is run-wide and takes no subject",
                metric.as_str()
            ))
            .with_path("subject"));
        }
        (Some(noun), None) => {
            return Err(ApiError::invalid_query(format!(
                "metric {:?} needs a subject: a {noun}",
                metric.as_str()
            ))
            .with_path("subject"));
        }
        (Some(_), Some(subject)) => subject,
    };
    let runs = compared_runs(&state.store, &query.runs).await?;
    if let Some(noun) = metric.subject_noun()
        && compare::missing(&state.store, &runs, metric, &subject)
            .await?
            .len()
            == runs.len()
    {
        return Err(ApiError::new(
            ErrorCode::UnknownSubject,
            format!("none of these runs has reported a {noun} named {subject:?}"),
        )
        .with_path("subject"));
    }
    let width = query.width.unwrap_or(charts::DEFAULT_WIDTH);
    let window = compare::window(&runs, query.from_step, query.to_step, width as usize);
    let chart = compare::gather(&state.store, &runs, metric, &subject, window).await?;
    let height = query.height.unwrap_or(charts::DEFAULT_HEIGHT);
    respond(ChartData::Lines(chart), format, width, height).await
}
