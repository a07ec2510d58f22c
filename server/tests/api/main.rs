//! The server's integration tests, one binary: a module per area, all through a
//! real server on `127.0.0.1:0` with its own database (SQLite, or PostgreSQL with
//! `GRADFLOW_TEST_BACKEND=postgres`). One binary links the server once, not once per
//! file.

// A test may be one long table of cases: the 150-line limit is production code's.
#![allow(clippy::too_many_lines)]

mod common;

mod access;
mod alerts;
mod amendments;
mod api;
mod bad_input;
mod cancel_safety;
mod charts;
mod compare;
mod legacy_steps;
mod openapi;
mod pages;
mod protocol_doc;
mod ranks;
mod ranks_close;
mod ranks_view;
mod retention;
mod rollup_levels;
mod signals;
mod store_reads;
mod webhooks;
