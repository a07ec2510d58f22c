//! `GET /healthz`: the process is up and answering.

use axum::Json;

use crate::api_types::Health;

#[utoipa::path(get, path = "/healthz", tag = "server",
    responses((status = 200, description = "The server is up", body = crate::api_types::Health)))]
pub async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
    })
}
