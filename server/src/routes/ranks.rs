//! `GET /api/v1/runs/{run_id}/ranks`: where each rank of a run stands — its last
//! step, how far behind the most advanced rank, its latest step time, its open
//! alerts. A single-process run is one rank, read from the run's own steps.

use axum::Json;
use axum::extract::State;

use super::extract::RunIdParam;
use crate::api_types::{RankStanding, RunRanks};
use crate::charts::ranks::Ranks;
use crate::error::ApiError;
use crate::state::AppState;

#[utoipa::path(get, path = "/api/v1/runs/{run_id}/ranks", tag = "runs",
    params(crate::api_types::RunIdPath),
    responses(
        (status = 200, description = "Every rank of the run, 0 to world_size - 1", body = crate::api_types::RunRanks),
        (status = 400, response = crate::api_types::BadRequest),
        (status = 404, response = crate::api_types::RunNotFound)))]
pub async fn list_ranks(
    State(state): State<AppState>,
    RunIdParam(run_id): RunIdParam,
) -> Result<Json<RunRanks>, ApiError> {
    let stored = state.store.run(&run_id).await?;
    let ranks = Ranks::of(&state.store, &run_id, &stored).await?;
    Ok(Json(RunRanks {
        world_size: ranks.world_size,
        last_step: ranks.last_step,
        ranks: ranks
            .ranks
            .into_iter()
            .map(|rank| RankStanding {
                rank: rank.rank,
                last_step: rank.last_step,
                behind: rank.behind,
                step_time: rank.step_time,
                open_alerts: rank
                    .open_alerts
                    .into_iter()
                    .map(|a| a.kind.to_string())
                    .collect(),
            })
            .collect(),
    }))
}
