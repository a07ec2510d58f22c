//! The trainer's integration tests, one binary (each module was its own test binary,
//! linked apart): the model against its reference and finite differences, and the
//! reporter against real servers.

// A test may be one long table of cases: the 150-line limit is production code's.
#![allow(clippy::too_many_lines)]

mod body_negotiation;
mod failover;
mod model;
mod reference;
