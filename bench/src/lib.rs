//! Shared parts of the load and benchmark programs: the real `gradflow-server`
//! started as a child process, its memory read from `/proc`, and percentiles.

pub mod server;
pub mod stats;
