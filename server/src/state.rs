//! What every handler can reach: the store, the ingest service, the event bus, the
//! request-handling settings, the shutdown signal, the metrics and the in-flight
//! permits. Below the routes and pages that take it, so they and the middleware
//! import it, never each other.

use std::sync::Arc;

use crate::events::EventBus;
use crate::ingest::Ingest;
use crate::metrics::Metrics;
use crate::store::Store;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    /// Reads, and the writes that are not batches.
    pub store: Arc<Store>,
    /// Registrations and batches.
    pub ingest: Arc<Ingest>,
    pub events: Arc<EventBus>,
    pub settings: Arc<ApiSettings>,
    /// Turns true when the server begins to shut down (ends event streams).
    pub shutdown: tokio::sync::watch::Receiver<bool>,
    pub metrics: Arc<Metrics>,
    /// One permit per request being handled (`--max-concurrent-requests`).
    pub in_flight: Arc<tokio::sync::Semaphore>,
}

/// The request-handling part of the server's configuration.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    /// When set, every write needs `Authorization: Bearer <token>`.
    pub ingest_token: Option<String>,
    /// When set, every read needs this token (or the ingest token), as a bearer
    /// token or the login cookie.
    pub read_token: Option<String>,
    /// Largest request body, before and after decompression.
    pub max_body_bytes: usize,
    /// Longest a request may take to be answered.
    pub request_timeout: std::time::Duration,
    /// Requests handled at once.
    pub max_concurrent_requests: usize,
    /// Origins whose pages may call the API from a browser; empty: no CORS headers.
    pub cors_origins: Vec<String>,
}
