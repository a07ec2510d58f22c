//! `GET /api/v1/webhooks/deliveries`: the webhook delivery log.

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};

use super::extract::{ApiQuery, run_id_query};
use crate::error::ApiError;
use crate::state::AppState;
use crate::store::webhooks::{DeliveryFilter, DeliveryStatus, WebhookDelivery};

/// Deliveries listed when `limit` is not given, and the most it may ask for.
const DEFAULT_LIMIT: u32 = 100;
const MAX_LIMIT: u32 = 1_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeliveryParams {
    run_id: Option<String>,
    status: Option<String>,
    limit: Option<String>,
}

/// The body of `GET /api/v1/webhooks/deliveries`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct DeliveryList {
    /// Newest first.
    pub deliveries: Vec<WebhookDelivery>,
}

/// Every alert notification queued for a webhook, and what became of it, newest
/// first.
#[utoipa::path(get, path = "/api/v1/webhooks/deliveries", tag = "alerts",
    params(
        ("run_id" = Option<String>, Query, description = "Only this run's"),
        ("status" = Option<String>, Query, description = "pending, delivered, failed or dropped"),
        ("limit" = Option<u32>, Query, description = "At most this many (default 100, at most 1000)")),
    responses((status = 200, description = "Deliveries, newest first", body = DeliveryList), (status = 400, response = crate::api_types::BadRequest), (status = 404, response = crate::api_types::RunNotFound)))]
pub async fn list_deliveries(
    State(state): State<AppState>,
    ApiQuery(params): ApiQuery<DeliveryParams>,
) -> Result<Json<DeliveryList>, ApiError> {
    let run_id = run_id_query(params.run_id.as_deref())?;
    let status = match params.status.as_deref() {
        None => None,
        Some(text) => Some(DeliveryStatus::parse(text).ok_or_else(|| {
            ApiError::invalid_query(format!(
                "unknown status {text:?}: one of pending, delivered, failed, dropped"
            ))
            .with_path("status")
        })?),
    };
    let limit = match params.limit.as_deref() {
        None => DEFAULT_LIMIT,
        Some(text) => text
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=MAX_LIMIT).contains(n))
            .ok_or_else(|| {
                ApiError::invalid_query(format!(
                    "limit {text:?} is not a whole number from 1 to {MAX_LIMIT}"
                ))
                .with_path("limit")
            })?,
    };
    let deliveries = state
        .store
        .deliveries(&DeliveryFilter {
            run_id,
            status,
            limit,
        })
        .await?;
    Ok(Json(DeliveryList { deliveries }))
}
