//! The ingest service: what a registration and a batch of step records mean, between
//! the HTTP routes above and the store below.
//!
//! For each batch it keeps the run's state in step with the database (the column
//! dictionary, the registration in force, the detectors' state, the open alert
//! episodes), prepares the rows to write and the detectors' verdicts, has the store
//! write them in one transaction, and announces what committed on the event bus.
//!
//! Several servers may share one PostgreSQL database, and batches of one run may
//! reach any of them. A server's cached state of a run is therefore only ever a
//! guess: each batch checks it against the run's head in the database (under the
//! run's row lock with PostgreSQL; by the write's own check with SQLite) and reads
//! the state again when another writer has moved the run on. Verdicts are then the
//! same whichever replica a batch reached.
//!
//! # Layout
//!
//! - `state`: [`state::RunState`], what is kept of a run between its batches.
//! - `cache`: the runs' states, bounded, one slot per run.
//! - `batch`: preparing a batch (pure: flatten, compress, rollups, detectors).
//! - `register`: registering a run, and comparing a registration sent again.

mod batch;
mod cache;
mod register;
mod state;

use std::sync::Arc;

use gradflow_protocol::{RunId, RunRegistration, StepRecord};
use serde::Serialize;

use self::batch::{prepare, with_codec};
use self::cache::RunCache;
use self::state::{Episode, RunState};
use crate::detect::{Detection, registration};
use crate::events::EventBus;
use crate::store::notify::Notice;
use crate::store::{AlertRef, NewRun, Registered, Store, StoreError, StoreResult, StoredRun};

/// The answer to a batch, as docs/PROTOCOL.md words it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct IngestOutcome {
    /// Records stored by this request.
    pub accepted: usize,
    /// Records whose step was not after the run's last stored step: ignored.
    pub duplicates: usize,
    /// The run's last stored step after this request.
    pub last_step: Option<u64>,
    /// Values stored by this request (for the server's own metrics; not in the
    /// response).
    #[serde(skip)]
    pub values: usize,
}

/// How often a batch is prepared again when the run moved on under it before it
/// gives up (each retry reads the run's state afresh, so a second attempt fails
/// only if another writer commits to the same run in between again).
const ATTEMPTS: usize = 3;

pub struct Ingest {
    store: Arc<Store>,
    events: Arc<EventBus>,
    detection: Detection,
    runs: RunCache,
}

impl Ingest {
    /// `detection` says whether the detectors run, and their server-wide thresholds
    /// (runs may override them); `cached_runs` how many runs' states to keep.
    pub fn new(
        store: Arc<Store>,
        events: Arc<EventBus>,
        detection: Detection,
        cached_runs: usize,
    ) -> Ingest {
        Ingest {
            store,
            events,
            detection,
            runs: RunCache::new(cached_runs),
        }
    }

    /// An ingest service with an event bus of its own that no one listens to, for
    /// what loads data without serving it (`gradflow-server import`, benchmarks).
    pub fn standalone(store: Arc<Store>, detection: Detection) -> Ingest {
        // A closed shutdown channel: a PostgreSQL listener would stop at once.
        let (_, shutdown) = tokio::sync::watch::channel(true);
        let events = EventBus::start(store.clone(), shutdown);
        Ingest::new(store, events, detection, 16)
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Registers `run_id`. Idempotent: the same registration again returns the stored
    /// run and `false`; a different one for an existing run is a conflict that names
    /// the first field that differs. What the registration alone proves wrong opens
    /// alerts before the first step.
    pub async fn register_run(
        &self,
        run_id: &RunId,
        registration: RunRegistration,
    ) -> StoreResult<(StoredRun, bool)> {
        let registration = registration.normalized();
        let canonical = serde_json::to_string(&registration)
            .map_err(|e| StoreError::Internal(anyhow::Error::new(e)))?;
        let mut state = RunState::new(0, &registration, self.detection.thresholds);
        let checks = if self.detection.enabled {
            registration::check(&state.registry.context)
        } else {
            Vec::new()
        };
        let (key, created_at, alert_ids) = match self
            .store
            .insert_run(NewRun {
                run_id: run_id.as_str(),
                registration: &registration,
                canonical: &canonical,
                alerts: &checks,
            })
            .await?
        {
            Registered::New {
                key,
                created_at,
                alert_ids,
            } => (key, created_at, alert_ids),
            Registered::Existing(stored) => {
                register::compare(run_id.as_str(), &stored.registration, &registration)?;
                return Ok((self.store.run(run_id).await?, false));
            }
        };
        state.head.key = key;
        for (alert, id) in checks.iter().zip(&alert_ids) {
            state.open.insert(
                (alert.kind, alert.subject.clone()),
                Episode {
                    alert: AlertRef::Stored(*id),
                    last_step: None,
                },
            );
        }
        *self.runs.slot(run_id.as_str()).lock().await = Some(state);
        tracing::info!(run_id = %run_id, params = registration.params.len(), alerts = alert_ids.len(), "run registered");
        self.events
            .committed(alert_ids.iter().map(|&id| Notice::opened(id)).collect())
            .await;
        Ok((
            StoredRun {
                run_id: run_id.as_str().to_owned(),
                registration,
                amendments: Vec::new(),
                created_at,
                first_step: None,
                last_step: None,
                last_seen: None,
                step_count: 0,
                finished_at: None,
            },
            true,
        ))
    }

    /// Stores a validated batch (steps strictly increasing) for `run_id`, all or
    /// nothing, and runs the detectors over its new records.
    pub async fn ingest(
        &self,
        run_id: &RunId,
        records: &[StepRecord],
    ) -> StoreResult<IngestOutcome> {
        let slot = self.runs.slot(run_id.as_str());
        let mut cached = slot.lock().await;
        for attempt in 0..ATTEMPTS {
            let mut lock = self.store.lock_run(run_id.as_str()).await?;
            // Taken out of the slot while the batch is in flight: if this future is
            // dropped half-way (the request cancelled), the slot is left empty and
            // the next batch reads the state the database holds.
            let state = match (cached.take(), lock.head()) {
                (Some(state), Some(head)) if state.head == head => state,
                // SQLite's write checks the head itself: trust the cache once.
                (Some(state), None) if attempt == 0 => state,
                _ => {
                    let loaded = self.store.load_run(&mut lock, run_id.as_str()).await?;
                    with_codec(|codec| {
                        RunState::from_loaded(
                            loaded,
                            run_id.as_str(),
                            self.detection.thresholds,
                            &mut codec.decompressor,
                        )
                    })?
                }
            };
            let prepared = match with_codec(|codec| {
                prepare(&state, run_id.as_str(), records, self.detection, codec)
            }) {
                Ok(Ok(prepared)) => prepared,
                Ok(Err(duplicates)) => {
                    *cached = Some(state);
                    return Ok(duplicates);
                }
                Err(error) => {
                    // The batch was wrong, not the state.
                    *cached = Some(state);
                    return Err(error);
                }
            };
            let written = match self.store.write_batch(lock, &prepared.write).await {
                Ok(written) => written,
                Err(StoreError::Stale) => {
                    tracing::debug!(run_id = %run_id, attempt, "the run moved on under a batch; preparing it again");
                    continue;
                }
                Err(error) => return Err(error),
            };
            let mut next = prepared.next;
            next.settle(&written);
            *cached = Some(next);
            drop(cached);
            self.events
                .committed(Notice::of_batch(&prepared.write, &written))
                .await;
            return Ok(prepared.outcome);
        }
        Err(StoreError::Unavailable(format!(
            "run {run_id} kept moving on under this batch ({ATTEMPTS} attempts): another \
             writer is storing the same steps; retry"
        )))
    }
}
