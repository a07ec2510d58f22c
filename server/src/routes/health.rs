//! `GET /healthz`: the process is up and answering (liveness). `GET /readyz`: it can
//! serve requests, its database reachable and migrated (readiness: what a load
//! balancer in front of several replicas asks).

use axum::Json;
use axum::extract::State;

use crate::api_types::Health;
use crate::error::ApiError;
use crate::state::AppState;

#[utoipa::path(get, path = "/healthz", tag = "server",
    responses((status = 200, description = "The server is up", body = crate::api_types::Health)))]
pub async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
    })
}

#[utoipa::path(get, path = "/readyz", tag = "server",
    responses(
        (status = 200, description = "The database answers: requests can be served", body = crate::api_types::Health),
        (status = 503, response = crate::api_types::Unavailable)))]
pub async fn readyz(State(state): State<AppState>) -> Result<Json<Health>, ApiError> {
    state.store.ready().await?;
    if !state.events.hearing() {
        return Err(crate::store::StoreError::Unavailable(
            "not listening for the other servers' events yet".to_owned(),
        )
        .into());
    }
    Ok(Json(Health {
        status: "ready".into(),
    }))
}
