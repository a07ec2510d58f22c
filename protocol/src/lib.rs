//! The gradflow wire protocol, v1.11 (docs/PROTOCOL.md): the types every instrumented trainer sends and the
//! server accepts, their parsing and validation, and the encoding of non-finite floats.
//!
//! This crate is the one boundary every client sees. It does no I/O and depends only
//! on serde, so any Rust client (the bundled trainer, someone's own) can use it.
//!
//! # Layout
//!
//! - [`run`]: the registration body of `PUT /api/v1/runs/{run_id}` and [`RunId`].
//! - [`step`]: the step records of `POST /api/v1/runs/{run_id}/steps`.
//! - [`amend`]: v1.1 registration amendments, carried by a step record.
//! - [`signals`]: v1.8 instability signals (attention, activations, Adam's state,
//!   output logits, MoE loads, batch ids; v1.9 the batch's repeated-token share and
//!   the logits' mean) and the registration's `signals`.
//! - [`parse`]: JSON, NDJSON and CBOR batch parsing with field paths in errors.
//! - [`float`]: [`Float`], a number that may be `"NaN"`, `"Infinity"`, `"-Infinity"`.
//! - [`timestamp`]: RFC 3339 or Unix-seconds timestamps.
//! - [`limits`]: the bounds on one request.
//! - [`error`]: [`InvalidBody`], what was wrong and where.
//! - [`vocabulary`]: [`vocabulary!`], a closed vocabulary declared once as a table.
//! - `located`: deserialising JSON with the path of what failed, for `run` and `parse`.

pub mod amend;
pub mod error;
pub mod float;
pub mod limits;
mod located;
pub mod parse;
pub mod run;
pub mod signals;
pub mod step;
pub mod timestamp;
mod validate;
pub mod vocabulary;
pub mod wiring;

pub use amend::Amendment;
pub use error::InvalidBody;
pub use float::{Float, non_finite_spelling};
pub use parse::{
    CBOR_CONTENT_TYPE, parse_steps_cbor, parse_steps_json, parse_steps_ndjson, to_cbor,
};
pub use run::{
    AlertSeverity, DetectorOverrides, Dtype, Layout, LossScaler, MAX_WEBHOOKS_PER_RUN, Optimizer,
    ParamGroup, ParamSpec, Precision, Role, RunId, RunRegistration, Webhook, WebhookFormat,
    check_webhook_url, default_group, default_module, redact_webhook_url, shard_rank_outside,
};
pub use signals::{AdamState, BatchInfo, MoeLayer, OutputLogits, SignalIntervals};
pub use step::{
    CallSite, GpuStat, GraphCut, GraphCutKind, GraphCutVia, ModuleStep, ParamStep, ScalerState,
    StepRecord, validate_batch,
};
pub use timestamp::Timestamp;
pub use wiring::{WiringFinding, WiringKind};

/// serde, for what [`vocabulary!`] expands to in other crates.
#[doc(hidden)]
pub use serde as __serde;

/// Formats a float for an error message: `NaN`, `Infinity`, `-Infinity` as the wire
/// spells them, other values in Rust's shortest round-trip form.
pub fn format_float(value: f64) -> String {
    match non_finite_spelling(value) {
        Some(spelling) => spelling.to_owned(),
        None => value.to_string(),
    }
}
