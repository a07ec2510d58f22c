//! The HTTP API of docs/PROTOCOL.md: one file per resource, handlers named for what they do.
//!
//! # Layout
//!
//! - [`health`]: `GET /healthz`.
//! - [`runs`]: register, list, read and delete runs.
//! - [`steps`]: `POST /api/v1/runs/{run_id}/steps`, the ingest path.
//! - [`series`]: `GET /api/v1/runs/{run_id}/series`.
//! - [`ranks`]: `GET /api/v1/runs/{run_id}/ranks`, where each rank of a run stands.
//! - [`alerts`]: `GET /api/v1/alerts` and `GET /api/v1/runs/{run_id}/alerts`.
//! - [`charts`]: `GET /api/v1/runs/{run_id}/charts/{chart}.svg|.png`, and
//!   `GET /api/v1/charts/compare.svg|.png` (several runs side by side).
//! - [`events`]: `GET /api/v1/events`, Server-Sent Events.
//! - [`webhooks`]: `GET /api/v1/webhooks/deliveries`, the webhook delivery log.
//! - [`extract`]: extractors that reject bad input with the API's JSON errors.
//! - [`auth`]: the ingest token that guards every write, the read token that guards
//!   every read.
//! - [`cors`]: cross-origin access, only for the origins configured.
//! - [`limits`]: the request timeout and the cap on concurrent requests.
//! - [`metrics`]: `GET /metrics`, and the middleware that counts rejected requests.
//!
//! `crate::app` assembles them into the router; `crate::state` is what they share.

pub mod alerts;
pub mod auth;
pub mod charts;
pub mod cors;
pub mod events;
pub mod extract;
pub mod health;
pub mod limits;
pub mod metrics;
pub mod ranks;
pub mod runs;
pub mod series;
pub mod steps;
pub mod webhooks;
