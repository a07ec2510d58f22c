//! `GET /metrics` and the middleware that counts every rejected request by its error
//! code; the registry itself is `crate::metrics`.

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::{ApiError, ErrorCode};
use crate::metrics::StoreGauges;
use crate::state::AppState;
use crate::store::StoreError;

/// Middleware: counts every response that carries an API error, by its code.
pub async fn count_rejections(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let response = next.run(request).await;
    if let Some(code) = response.extensions().get::<ErrorCode>() {
        state.metrics.rejected(code.as_str());
    }
    response
}

/// `GET /metrics`.
#[utoipa::path(get, path = "/metrics", tag = "server",
    responses((status = 200, description = "The server's metrics, OpenMetrics text", content_type = "application/openmetrics-text")))]
pub async fn serve_metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
    let gauges = StoreGauges {
        open_alerts: state.store.open_alerts_by_kind().await?,
        runs: state.store.run_count().await?,
        database_bytes: state.store.database_bytes().await?,
    };
    let text = state
        .metrics
        .render(gauges)
        .map_err(|e| StoreError::Internal(e.into()))?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}
