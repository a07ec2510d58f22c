//! What the ingest service keeps in memory of a run between its batches: enough to
//! prepare the next batch without reading the database — the column dictionary, the
//! registration in force, the detectors' state (their open episodes with it), and each
//! stream's last block and rollup buckets, the only ones still growing — and the head
//! (key, version) that says which stored state of the run it is.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Context;
use gradflow_protocol::RunRegistration;

use super::combine::{Pending, PendingStep};
use super::registry::Registry;
use crate::store::{LoadedRun, RunHead, StoreResult};
use gradflow_core::columnar::columns::ColumnDictionary;
use gradflow_core::columnar::rollup::{BucketSummary, ROLLUP_WIDTHS};
use gradflow_core::detect::{DetectorSet, Thresholds};
use gradflow_core::model::alert::AlertKind;

/// A run's ingest state, as of `head`.
#[derive(Debug, Clone)]
pub struct RunState {
    pub head: RunHead,
    /// The run's last step (of its stream 0).
    pub last_step: Option<u64>,
    pub columns: ColumnDictionary,
    /// The registration in force and what is derived from it. Shared, since a batch
    /// that amends it keeps the one in force before the amendment for the records
    /// before it.
    pub registry: Arc<Registry>,
    /// The detectors' state, and which of the run's alerts are open.
    pub detectors: DetectorSet,
    /// Each stream's growing end.
    pub streams: BTreeMap<u32, StreamTail>,
    /// v1.4: ranks in the run (1 for a single process).
    pub world_size: u32,
    /// v1.4, multi-rank runs: the registration in force from each step on where it
    /// changed (the first entry at step 0), since ranks send records of steps the
    /// run has combined past and of steps it has not reached.
    pub registries: BTreeMap<u64, Arc<Registry>>,
    /// v1.4, multi-rank runs: steps some of whose ranks' records have arrived.
    pub pending: Pending,
}

/// The end of one stream that the next batch can still add to.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamTail {
    pub last_step: u64,
    /// The stream's last block as stored: (index, blob).
    pub block: (u64, Vec<u8>),
    /// Per rollup width, the bucket holding the last step and its summary so far.
    pub rollups: Vec<OpenBucket>,
}

impl StreamTail {
    /// The growing bucket of `width`.
    pub fn open_bucket(&self, width: u64) -> Option<&OpenBucket> {
        self.rollups.iter().find(|b| b.width == width)
    }
}

/// The growing bucket of one rollup width.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenBucket {
    pub width: u64,
    pub bucket: u64,
    pub summary: BucketSummary,
}

impl RunState {
    /// The state of a run just registered under `key`.
    pub fn new(key: i64, registration: &RunRegistration, thresholds: Thresholds) -> RunState {
        let registry = Arc::new(Registry::new(registration.clone(), thresholds));
        RunState {
            world_size: registration.world_size(),
            registries: BTreeMap::from([(0, registry.clone())]),
            pending: Pending::new(),
            head: RunHead { key, version: 0 },
            last_step: None,
            columns: ColumnDictionary::default(),
            registry,
            detectors: DetectorSet::default(),
            streams: BTreeMap::new(),
        }
    }

    /// The state as the database holds it; `now` (server clock) stands for when the
    /// records of steps still waiting for ranks arrived.
    pub fn from_loaded(
        loaded: LoadedRun,
        run_id: &str,
        thresholds: Thresholds,
        now: f64,
        decompressor: &mut zstd::bulk::Decompressor<'_>,
    ) -> StoreResult<RunState> {
        let base = loaded.registration.clone().normalized();
        let mut registration = loaded.registration;
        for (_, amendment) in &loaded.amendments {
            registration.amend(amendment);
        }
        let mut state = RunState::new(loaded.head.key, &registration.normalized(), thresholds);
        // Multi-rank runs keep the registration in force at each amendment's step.
        let mut in_force = Arc::new(Registry::new(base, thresholds));
        state.registries = BTreeMap::from([(0, in_force.clone())]);
        for (step, amendment) in &loaded.amendments {
            in_force = Arc::new(in_force.amended(amendment, thresholds));
            state.registries.insert(*step, in_force.clone());
        }
        state.head = loaded.head;
        state.last_step = loaded.last_step;
        let mut with_episodes = false;
        if let Some(detectors) = loaded.detector_state {
            let stored: serde_json::Value = serde_json::from_str(&detectors)
                .with_context(|| format!("reading the detector state of run {run_id}"))?;
            with_episodes = stored.get("episodes").is_some();
            state.detectors = serde_json::from_value(stored)
                .with_context(|| format!("reading the detector state of run {run_id}"))?;
        }
        // A run with no batch yet (its registration's alerts), or stored by a server
        // that kept the open episodes apart from the detectors: its open alerts are
        // the episodes.
        if !with_episodes {
            for (_, kind, subject, last_step) in loaded.open_alerts {
                let kind = AlertKind::parse(&kind)
                    .with_context(|| format!("unknown alert kind {kind:?}"))?;
                state.detectors.episodes.restore(kind, subject, last_step);
            }
        }
        for (position, kind, subject) in loaded.columns {
            state.columns.restore(kind, &subject, position);
        }
        for (stream, index, blob) in loaded.open_blocks {
            let header = gradflow_core::columnar::block::peek(&blob)
                .with_context(|| format!("reading block {index} of stream {stream}"))?;
            let Some(last) = crate::store::last_present(index, header.mask) else {
                continue;
            };
            let mut rollups = Vec::new();
            for width in ROLLUP_WIDTHS {
                let mut summary = BucketSummary::default();
                for (_, _, chunk, blob) in loaded
                    .open_rollups
                    .iter()
                    .filter(|r| r.0 == stream && r.1 == width)
                {
                    summary
                        .restore_chunk(*chunk as usize, blob, decompressor)
                        .with_context(|| {
                            format!("reading rollup bucket {} of width {width}", last / width)
                        })?;
                }
                rollups.push(OpenBucket {
                    width,
                    bucket: last / width,
                    summary,
                });
            }
            state.streams.insert(
                stream,
                StreamTail {
                    last_step: last,
                    block: (index, blob),
                    rollups,
                },
            );
        }
        // What the ranks sent of steps not combined yet, folded again from their
        // stored rows.
        for (stream, index, blob) in &loaded.rank_blocks {
            let block = gradflow_core::columnar::block::decode(blob)
                .with_context(|| format!("reading block {index} of stream {stream}"))?;
            let rank = stream - 1;
            for (position, &step) in block.steps().iter().enumerate() {
                if state.last_step.is_some_and(|last| step <= last) {
                    continue;
                }
                let cells: Vec<u32> = (0..block.column_count())
                    .map(|c| block.bits(position, c))
                    .collect();
                let registry = state.registry_at(step).clone();
                state
                    .pending
                    .entry(step)
                    .or_insert_with(|| PendingStep::new(now))
                    .fold(
                        rank,
                        &cells,
                        block.times()[position],
                        &[],
                        &state.columns,
                        &registry,
                    );
            }
        }
        Ok(state)
    }

    /// The registration in force at `step` (a multi-rank run's, by its amendments).
    pub fn registry_at(&self, step: u64) -> &Arc<Registry> {
        self.registries
            .range(..=step)
            .next_back()
            .map(|(_, registry)| registry)
            .unwrap_or(&self.registry)
    }
}
