//! The response bodies, error answers and path parameters the handlers name in their
//! `#[utoipa::path]` annotations: a leaf the routes import, so that the document
//! that lists the routes (`crate::openapi`) is imported by nothing but the router.
//! The handlers answer with these types, except [`RunView`]: it is the registration
//! (whose schema forbids unknown fields, so it cannot be flattened into another
//! schema) merged with the run's progress, built as JSON and described here.
//! `server/tests/openapi.rs` checks real responses against the document, so the
//! two cannot drift apart unnoticed.

use gradflow_protocol::{Float, Precision};
use serde::Serialize;
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, Type};
use utoipa::{IntoParams, PartialSchema, ToResponse, ToSchema};

use crate::store::RunStatus;
use crate::store::alerts::{Alert, OpenAlertCounts};

/// The `{run_id}` of a path.
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
pub struct RunIdPath {
    /// The run's id: [A-Za-z0-9._-]{1,128}
    pub run_id: String,
}

/// The error answers most endpoints share, each with docs/PROTOCOL.md's error body.
#[derive(ToResponse)]
#[response(description = "Malformed or invalid: the error says what and where")]
pub struct BadRequest(pub ErrorBody);

#[derive(ToResponse)]
#[response(description = "Missing or wrong ingest token")]
pub struct Unauthorized(pub ErrorBody);

#[derive(ToResponse)]
#[response(description = "Unknown run")]
pub struct RunNotFound(pub ErrorBody);

#[derive(ToResponse)]
#[response(description = "Body too large")]
pub struct TooLarge(pub ErrorBody);

#[derive(ToResponse)]
#[response(description = "Unsupported content type or encoding")]
pub struct Unsupported(pub ErrorBody);

#[derive(ToResponse)]
#[response(description = "Storage unavailable (disk full, locked): nothing stored, retry")]
pub struct Unavailable(pub ErrorBody);

/// docs/PROTOCOL.md's error body: [`ApiError`](crate::error::ApiError) answers with it.
pub use crate::error::{ErrorBody, ErrorDetail};

#[derive(Serialize, ToSchema)]
pub struct Health {
    /// `ok`.
    pub status: String,
}

/// A run: its registration (defaults written out) and where its stream stands.
#[derive(Serialize, ToSchema)]
pub struct RunView {
    pub run_id: String,
    #[schema(required = false)]
    pub name: Option<String>,
    #[schema(required = false, value_type = Option<String>)]
    pub started_at: Option<String>,
    #[schema(required = false)]
    pub host: Option<String>,
    #[schema(required = false)]
    pub rank: Option<u32>,
    #[schema(required = false)]
    pub world_size: Option<u32>,
    #[schema(required = false)]
    pub precision: Option<Precision>,
    #[schema(required = false, value_type = Option<Object>)]
    pub optimizer: Option<serde_json::Value>,
    #[schema(value_type = Vec<gradflow_protocol::ParamSpec>)]
    pub params: Vec<serde_json::Value>,
    #[schema(required = false)]
    pub detectors: Option<gradflow_protocol::DetectorOverrides>,
    /// Free-form, as registered.
    #[schema(required = false, value_type = Option<Object>)]
    pub config: Option<serde_json::Value>,
    /// The groups meant to train (v1.1).
    #[schema(required = false)]
    pub train: Option<Vec<String>>,
    /// The amendments that made the registration shown (v1.1), oldest first.
    pub amendments: Vec<AmendmentView>,
    pub first_step: Option<u64>,
    #[serde(flatten)]
    pub progress: RunProgress,
}

/// One amendment of a run's registration and the step it took effect at.
#[derive(Serialize, ToSchema)]
pub struct AmendmentView {
    pub step: u64,
    pub amend: gradflow_protocol::Amendment,
}

/// Where a run's stream stands: in a run, and in each line of the runs list.
#[derive(Serialize, ToSchema)]
pub struct RunProgress {
    /// RFC 3339, server clock.
    pub created_at: String,
    pub last_step: Option<u64>,
    /// When the last batch arrived (RFC 3339, server clock).
    pub last_seen: Option<String>,
    pub step_count: u64,
    pub status: RunStatus,
    pub finished_at: Option<String>,
    pub open_alerts: OpenAlertCounts,
}

#[derive(Serialize, ToSchema)]
pub struct RunList {
    pub runs: Vec<RunListItem>,
}

#[derive(Serialize, ToSchema)]
pub struct RunListItem {
    pub run_id: String,
    pub name: Option<String>,
    #[serde(flatten)]
    pub progress: RunProgress,
}

#[derive(Serialize, ToSchema)]
pub struct Deleted {
    pub run_id: String,
    pub deleted: bool,
    pub steps_deleted: u64,
}

/// A series: `points` are `[step, value]` pairs.
#[derive(Serialize, ToSchema)]
pub struct Series {
    pub metric: String,
    pub subject: Option<String>,
    /// v1.4: the rank whose own records these are; absent for the run's steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    /// Whether `max_points` reduced it (min/max per bucket).
    pub downsampled: bool,
    pub points: Vec<SeriesPoint>,
}

/// `[step, value]`: the value a number (an integer without a fraction), a
/// non-finite spelling, or null (measured, no gradient): the JSON value as built,
/// described by the schema below.
#[derive(Serialize)]
pub struct SeriesPoint(pub u64, pub serde_json::Value);

impl PartialSchema for SeriesPoint {
    fn schema() -> RefOr<Schema> {
        let value = OneOfBuilder::new()
            .item(Float::schema())
            .item(ObjectBuilder::new().schema_type(Type::Null));
        ArrayBuilder::new()
            .prefix_items([
                Schema::from(
                    ObjectBuilder::new()
                        .schema_type(Type::Integer)
                        .minimum(Some(0)),
                ),
                Schema::from(value),
            ])
            .items(utoipa::openapi::schema::ArrayItems::False)
            .min_items(Some(2))
            .max_items(Some(2))
            .into()
    }
}

impl ToSchema for SeriesPoint {}

#[derive(Serialize, ToSchema)]
pub struct AlertList {
    pub alerts: Vec<Alert>,
}

/// `GET /api/v1/runs/{run_id}/ranks`: where each rank of a run stands.
#[derive(Serialize, ToSchema)]
pub struct RunRanks {
    /// The run's ranks (`world_size` as registered; 1 for a single process).
    pub world_size: u32,
    /// The run's last step: for a multi-rank run, its last combined step.
    #[schema(required = true)]
    pub last_step: Option<u64>,
    /// Every rank, `0` to `world_size - 1`, in order.
    pub ranks: Vec<RankStanding>,
}

/// One rank of a run.
#[derive(Serialize, ToSchema)]
pub struct RankStanding {
    pub rank: u32,
    /// Its last stored step; null while it has sent nothing.
    #[schema(required = true)]
    pub last_step: Option<u64>,
    /// Steps behind the most advanced rank; null while it has sent nothing.
    #[schema(required = true)]
    pub behind: Option<u64>,
    /// Its latest `step_time`, in seconds; null when it sent none.
    #[schema(required = true)]
    pub step_time: Option<f64>,
    /// The kinds of its open alerts (subject `rank N`), in the order they opened.
    pub open_alerts: Vec<String>,
}
