//! gradflow-server: receives gradient-flow telemetry from instrumented trainers,
//! stores it (SQLite embedded, or PostgreSQL shared by several servers) and serves
//! it back.
//!
//! The data path: a trainer sends step records (docs/PROTOCOL.md, parsed and validated by
//! `gradflow-protocol`) → [`routes`] reads the body ([`body`]) → [`ingest`] prepares the
//! batch (flattening each record into a row of its run's columns, rollups, the
//! detectors' verdicts) → [`store`] commits it in one transaction (SQLite or
//! PostgreSQL) → [`events`] announces it → reads come back through [`store`] and
//! the downsampler in [`series`].
//!
//! # Layout
//!
//! - [`config`]: command-line flags and their environment variables.
//! - [`demo`]: `gradflow-server demo`, the server with a demo trainer sidecar.
//! - [`startup`]: builds the [`startup::Application`] and runs it until shutdown.
//! - [`app`]: the router: routes, pages, the API document and metrics with their
//!   middleware.
//! - [`routes`]: the HTTP API, one file per resource.
//! - [`state`]: [`state::AppState`], what every handler and page can reach.
//! - [`api_types`]: the response bodies and error answers the handlers document.
//! - [`body`]: content types, gzip and size limits of request bodies.
//! - [`error`]: [`error::ApiError`], the JSON error body.
//! - [`ingest`]: what a registration and a batch mean: run state, detectors, alert
//!   episodes, kept right when several servers share a database.
//! - [`events`]: the live events of every commit, on every server.
//! - [`store`]: all SQL, for SQLite and PostgreSQL.
//! - [`series`]: pure downsampling and read planning.
//! - [`detect`]: the streaming detectors, pure: records in, alert transitions out.
//! - [`model`]: the vocabulary every layer shares (alerts, stored values, series
//!   kinds), importing nothing of the server.
//! - [`charts`]: charts drawn with plotters from the store's rollups.
//! - [`metrics`]: the server's own metrics for Prometheus (served by
//!   `routes::metrics`).
//! - [`openapi`]: `GET /api/v1/openapi.json`, the API document.
//! - [`pages`]: the dashboard's HTML pages and the embedded files of `web/`.
//! - [`retention`]: `--retain-days`, expiring idle runs and freeing their space.

pub mod api_types;
pub mod app;
pub mod body;
pub mod charts;
pub mod config;
pub mod demo;
pub mod error;
pub mod events;
pub mod import;
pub mod ingest;
pub mod metrics;
pub mod openapi;
pub mod pages;
pub mod retention;
pub mod routes;
pub mod startup;
pub mod state;
pub mod store;
pub mod webhooks;
