//! `GET /api/v1/runs/{run_id}/charts/{chart}.svg` (and `.png`), with optional
//! `from_step`, `to_step`, `width`, `height`.

use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::AppState;
use super::extract::{ApiQuery, RunIdParam, check_step_range};
use crate::charts::{self, ChartKind, Format, MAX_SIDE, MIN_SIDE};
use crate::error::ApiError;
use crate::store::StoreError;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChartParams {
    from_step: Option<u64>,
    to_step: Option<u64>,
    width: Option<u32>,
    height: Option<u32>,
}

#[utoipa::path(get, path = "/api/v1/runs/{run_id}/charts/{file}", tag = "charts",
    params(crate::openapi::RunIdPath,
        ("file" = String, Path, description = "grad-flow, group-grad-norms, norm-drift, scaler, loss or gpu, with .svg or .png"),
        ("from_step" = Option<u64>, Query, description = "First step"),
        ("to_step" = Option<u64>, Query, description = "Last step"),
        ("width" = Option<u32>, Query, description = "Pixels, 300 to 4000"),
        ("height" = Option<u32>, Query, description = "Pixels, 300 to 4000")),
    responses(
        (status = 200, description = "The chart", content((String = "image/svg+xml"), (Vec<u8> = "image/png"))),
        (status = 400, response = crate::openapi::BadRequest),
        (status = 404, description = "Unknown run or chart", body = crate::openapi::ErrorBody)))]
pub async fn render_chart(
    State(state): State<AppState>,
    RunIdParam(run_id): RunIdParam,
    Path((_, file)): Path<(String, String)>,
    ApiQuery(params): ApiQuery<ChartParams>,
) -> Result<Response, ApiError> {
    let names: Vec<&str> = ChartKind::ALL.iter().map(|k| k.name()).collect();
    let unknown = || {
        ApiError::not_found(
            "unknown_chart",
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
    let kind = ChartKind::parse(name).ok_or_else(unknown)?;
    for (field, value) in [("width", params.width), ("height", params.height)] {
        if let Some(v) = value
            && !(MIN_SIDE..=MAX_SIDE).contains(&v)
        {
            return Err(ApiError::invalid_query(format!(
                "{field} must lie between {MIN_SIDE} and {MAX_SIDE} pixels, got {v}"
            ))
            .with_path(field));
        }
    }
    check_step_range(params.from_step, params.to_step)?;
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
        charts::ChartData::GradFlow(flow) => charts::grad_flow::natural_height(flow.modules.len()),
        _ => charts::DEFAULT_HEIGHT,
    });
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
