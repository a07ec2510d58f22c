//! The trainer's integration tests, one binary (each module was its own test binary,
//! linked apart): the model against its reference and finite differences, and the
//! reporter against real servers.

mod body_negotiation;
mod failover;
mod model;
mod reference;
