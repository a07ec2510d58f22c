//! Shared parts of the load and benchmark programs: what they read of the real
//! `gradflow-server` they start (through `gradflow_e2e::ServerProcess`, as the
//! end-to-end tests do), and percentiles.

pub mod server;
pub mod stats;
