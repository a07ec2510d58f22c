//! gradflow-core: what gradflow knows without touching a socket, a database or a clock.
//!
//! The server feeds it step records and registrations and persists what it returns;
//! nothing here does I/O, and the crate's dependencies (protocol, serde, the codecs)
//! are what makes that a fact the compiler checks rather than a convention.
//!
//! # Layout
//!
//! - [`model`]: the vocabulary every layer shares: alerts and their transitions,
//!   stored cell values, series kinds.
//! - [`detect`]: the streaming detectors, pure: records in, alert transitions out.
//! - [`columnar`]: how a run's values are laid out and encoded for storage: records
//!   flattened into columns, rollups, compressed blocks.
//! - [`series`]: downsampling and read planning over stored resolutions.
//! - [`run`]: a run as a whole: the registration in force with its lookups, and a
//!   multi-rank run's steps combined from its ranks' records.

pub mod columnar;
pub mod detect;
pub mod model;
pub mod run;
pub mod series;
