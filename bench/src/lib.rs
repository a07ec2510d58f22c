//! Shared parts of the load and benchmark programs: the telemetry they send
//! ([`workload`]), what they read of the real `gradflow-server` they start (through
//! `gradflow_e2e::ServerProcess`, as the end-to-end tests do), percentiles, and the
//! benchmark harness behind `gradflow-bench` ([`harness`]).

pub mod harness;
pub mod server;
pub mod stats;
pub mod workload;
