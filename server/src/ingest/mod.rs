//! The ingest service: what a registration and a batch of step records mean, between
//! the HTTP routes above and the store below.
//!
//! For each batch it keeps the run's state in step with the database (the column
//! dictionary, the registration in force, the detectors' state with the run's open
//! alert episodes), prepares the rows to write and the detectors' verdicts, has the
//! store write them in one transaction, and announces what committed on the event
//! bus.
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
//! - `plan`: preparing a batch, the one contract (pure: flatten, compress,
//!   rollups, detectors) and the phases both preparers share.
//! - `single`: preparing a batch of a run of one process.
//! - `ranks`: preparing a batch of a multi-rank run: each rank's records into its
//!   stream, and the steps all ranks have sent combined into the run's
//!   (`gradflow_core::run::combine`).
//! - `register`: registering a run, and comparing a registration sent again.
//! - `error`: [`IngestError`], what registering or storing a batch fails with.
//!
//! The registration in force and its lookups are `gradflow_core::run::registry`'s.

mod cache;
mod error;
mod plan;
mod ranks;
mod register;
mod single;
mod state;
mod testing;

use std::sync::Arc;
use std::time::Duration;

use gradflow_protocol::{RunId, RunRegistration, StepRecord};

use self::cache::RunCache;
pub use self::error::{IngestError, IngestResult};
pub use self::plan::IngestOutcome;
use self::plan::{Batch, Clock, Codec, Preparation, Refused, with_codec};
use self::state::RunState;
use crate::events::EventBus;
use crate::store::notify::Notice;
use crate::store::{
    NewRun, RUN_STREAM, Registered, Store, StoreError, StoredRun, now_seconds, rank_stream,
};
use gradflow_core::detect::Detection;

/// Completes timed-out steps of multi-rank runs (see
/// [`Ingest::complete_waiting_steps`]) until `shutdown` turns true, looking a few
/// times per rank timeout.
pub async fn complete_waiting_steps(
    ingest: Arc<Ingest>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let every = (ingest.settings.rank_timeout / 4)
        .clamp(Duration::from_millis(250), Duration::from_secs(15));
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
        if let Err(error) = ingest.complete_waiting_steps().await {
            tracing::warn!(%error, "cannot complete the steps waiting for ranks yet");
        }
    }
}

/// How often a batch is prepared again when the run moved on under it before it
/// gives up (each retry reads the run's state afresh, so a second attempt fails
/// only if another writer commits to the same run in between again).
const ATTEMPTS: usize = 3;

pub struct Ingest {
    store: Arc<Store>,
    events: Arc<EventBus>,
    settings: IngestSettings,
    runs: RunCache,
}

/// How the ingest service judges and keeps runs.
#[derive(Debug, Clone, Copy)]
pub struct IngestSettings {
    /// Whether the detectors run, and their server-wide thresholds (runs may
    /// override them).
    pub detection: Detection,
    /// How many runs' states to keep in memory.
    pub cached_runs: usize,
    /// How long a step of a multi-rank run waits for its last ranks before it is
    /// completed without them.
    pub rank_timeout: Duration,
}

impl IngestSettings {
    pub fn new(detection: Detection) -> IngestSettings {
        IngestSettings {
            detection,
            cached_runs: 256,
            rank_timeout: Duration::from_secs(60),
        }
    }
}

impl Ingest {
    pub fn new(store: Arc<Store>, events: Arc<EventBus>, settings: IngestSettings) -> Ingest {
        Ingest {
            store,
            events,
            runs: RunCache::new(settings.cached_runs),
            settings,
        }
    }

    /// An ingest service with an event bus of its own that no one listens to, for
    /// what loads data without serving it (`gradflow-server import`, benchmarks).
    pub fn standalone(store: Arc<Store>, detection: Detection) -> Ingest {
        // A closed shutdown channel: a PostgreSQL listener would stop at once.
        let (_, shutdown) = tokio::sync::watch::channel(true);
        let events = EventBus::start(store.clone(), shutdown);
        Ingest::new(store, events, IngestSettings::new(detection))
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
    ) -> IngestResult<(StoredRun, bool)> {
        let registration = registration.normalized();
        let canonical = serde_json::to_string(&registration)
            .map_err(|e| StoreError::Internal(anyhow::Error::new(e)))?;
        let mut state = RunState::new(0, &registration, self.settings.detection.thresholds);
        let checks = if self.settings.detection.enabled {
            let context = &state.registry.context;
            state.detectors.on_registration(context)
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

    /// Completes the steps of multi-rank runs that have waited longer than the rank
    /// timeout for ranks that stopped reporting (no record of theirs will come to
    /// do it). Returns the runs that had such steps.
    pub async fn complete_waiting_steps(&self) -> IngestResult<Vec<String>> {
        let cutoff = now_seconds() - self.settings.rank_timeout.as_secs_f64();
        let runs = self.store.runs_waiting_since(cutoff).await?;
        for run_id in &runs {
            let Ok(run) = RunId::parse(run_id) else {
                continue;
            };
            match self.ingest(&run, &[]).await {
                Ok(_) | Err(IngestError::Store(StoreError::RunNotFound(_))) => {}
                Err(error) => return Err(error),
            }
        }
        Ok(runs)
    }

    /// Stores a validated batch (steps strictly increasing) for `run_id`, all or
    /// nothing, and runs the detectors over its new records.
    pub async fn ingest(
        &self,
        run_id: &RunId,
        records: &[StepRecord],
    ) -> IngestResult<IngestOutcome> {
        self.ingest_closing(run_id, records, None).await
    }

    /// Rank `rank` of a multi-rank run said it finished (v1.5): it will send nothing
    /// more, so the steps waiting only for closed ranks are completed now. Nothing
    /// for a run of one process.
    pub async fn close_rank(&self, run_id: &RunId, rank: u32) -> IngestResult<()> {
        self.ingest_closing(run_id, &[], Some(rank)).await?;
        Ok(())
    }

    async fn ingest_closing(
        &self,
        run_id: &RunId,
        records: &[StepRecord],
        closing: Option<u32>,
    ) -> IngestResult<IngestOutcome> {
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
                            self.settings.detection.thresholds,
                            now_seconds(),
                            &mut codec.decompressor,
                        )
                    })?
                }
            };
            // Records at or below their stream's last stored step are not new; which
            // of them are stored (duplicates) and which never were (late) only the
            // stored blocks can say.
            let behind = behind_stored(&state, records);
            let late = if behind.is_empty() {
                0
            } else {
                let stored = self.store.stored_steps(state.head.key, &behind).await?;
                stored.iter().filter(|present| !**present).count()
            };
            let settle_late = |mut outcome: IngestOutcome| {
                if late > 0 {
                    tracing::warn!(run_id = %run_id, late, "steps below the run's last stored step that were never stored: refused as late");
                }
                outcome.duplicates -= late;
                outcome.late = late;
                outcome
            };
            let batch = Batch {
                run_id: run_id.as_str(),
                records,
                detection: self.settings.detection,
                clock: Clock {
                    now: now_seconds(),
                    rank_timeout: self.settings.rank_timeout.as_secs_f64(),
                },
                closing,
            };
            let prepared = match with_codec(|codec| prepare(state, &batch, codec)) {
                Ok(Preparation::Write(prepared)) => *prepared,
                Ok(Preparation::NothingNew(outcome, state)) => {
                    *cached = Some(*state);
                    return Ok(settle_late(outcome));
                }
                Err(Refused { error, state }) => {
                    // The batch was wrong; a state it left untouched stays, one it
                    // may have changed is read again by the next batch.
                    *cached = state.map(|state| *state);
                    return Err(error);
                }
            };
            let written = match self.store.write_batch(lock, &prepared.write).await {
                Ok(written) => written,
                Err(StoreError::Stale) => {
                    tracing::debug!(run_id = %run_id, attempt, "the run moved on under a batch; preparing it again");
                    continue;
                }
                Err(error) => return Err(error.into()),
            };
            *cached = Some(prepared.next);
            drop(cached);
            self.events
                .committed(Notice::of_batch(&prepared.write, &written))
                .await;
            return Ok(settle_late(prepared.outcome));
        }
        Err(StoreError::Unavailable(format!(
            "run {run_id} kept moving on under this batch ({ATTEMPTS} attempts): another \
             writer is storing the same steps; retry"
        ))
        .into())
    }
}

/// Prepares `batch` for the run of `state` (see `plan`), by the preparer of its kind
/// of run.
fn prepare(state: RunState, batch: &Batch<'_>, codec: &mut Codec) -> Result<Preparation, Refused> {
    if state.world_size > 1 {
        ranks::prepare_ranks(state, batch, codec)
    } else {
        single::prepare_single(state, batch, codec)
    }
}

/// The records of a batch that are not after their stream's last stored step (the
/// run's stream, or each rank's in a multi-rank run), as (stream, step): ingest
/// counts them as duplicates, or as late where the stored blocks lack their step.
fn behind_stored(state: &RunState, records: &[StepRecord]) -> Vec<(u32, u64)> {
    records
        .iter()
        .filter_map(|record| {
            let (stream, last) = if state.world_size > 1 {
                let stream = rank_stream(record.rank?);
                (
                    stream,
                    state.streams.get(&stream).map(|tail| tail.last_step),
                )
            } else {
                (RUN_STREAM, state.last_step)
            };
            last.is_some_and(|last| record.step <= last)
                .then_some((stream, record.step))
        })
        .collect()
}
