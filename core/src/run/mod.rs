//! What the core knows of a run as a whole, between its registration and the
//! detectors: the registration in force with the lookups derived from it
//! ([`registry`]), and a multi-rank run's steps combined from its ranks' records
//! ([`combine`]). Pure, like the rest of the core: the server's ingest service
//! feeds them and persists what they return.

pub mod combine;
pub mod registry;
