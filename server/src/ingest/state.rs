//! What the ingest service keeps in memory of a run between its batches: enough to
//! prepare the next batch without reading the database — the column dictionary, the
//! registration in force, the detectors' state (their open episodes with it), and each
//! stream's last block and rollup buckets, the only ones still growing — and the head
//! (key, version) that says which stored state of the run it is.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Context;
use gradflow_protocol::RunRegistration;

use crate::store::{LoadedRun, RunHead, StoreResult};
use gradflow_core::columnar::columns::ColumnDictionary;
use gradflow_core::columnar::rollup::{BucketSummary, ROLLUP_WIDTHS};
use gradflow_core::detect::{DetectorSet, Thresholds};
use gradflow_core::model::alert::AlertKind;
use gradflow_core::run::combine::{Pending, PendingStep};
use gradflow_core::run::registry::Registry;

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

#[cfg(test)]
mod tests {
    use gradflow_protocol::RunRegistration;
    use serde_json::json;

    use super::*;
    use crate::ingest::plan::Prepared;
    use crate::ingest::testing::{records, registered, written};
    use gradflow_core::columnar::codec;

    fn registration() -> RunRegistration {
        serde_json::from_value::<RunRegistration>(
            json!({"params": [{"name": "qwen.a.weight"}, {"name": "agent.b.weight"}]}),
        )
        .unwrap()
        .normalized()
    }

    /// What the store gives back of a run after `prepared` was its only batch.
    fn stored(
        prepared: &Prepared,
        open_alerts: Vec<(i64, String, String, Option<u64>)>,
    ) -> LoadedRun {
        let write = &prepared.write;
        let last = prepared.next.last_step;
        LoadedRun {
            head: RunHead {
                key: write.key,
                version: write.expected_version + 1,
            },
            last_step: last,
            registration: registration(),
            amendments: Vec::new(),
            detector_state: Some(write.detector_state.clone()),
            open_alerts,
            columns: write
                .columns
                .iter()
                .map(|c| (c.position, c.kind, c.subject.clone()))
                .collect(),
            open_blocks: write
                .blocks
                .iter()
                .map(|b| (b.stream, b.index, b.blob.clone()))
                .collect(),
            rank_blocks: Vec::new(),
            open_rollups: write
                .rollups
                .iter()
                .filter(|r| last.is_some_and(|last| r.bucket == last / r.width))
                .map(|r| (r.stream, r.width, r.chunk, r.blob.clone()))
                .collect(),
        }
    }

    fn read(loaded: LoadedRun) -> RunState {
        let mut decompressor = codec::decompressor().unwrap();
        RunState::from_loaded(loaded, "r", Thresholds::default(), 0.0, &mut decompressor).unwrap()
    }

    /// Steps 0–69 of a run whose `qwen` gets no gradient from step 10 on: its
    /// grad_stuck_zero alert is open after the batch.
    fn stuck_run() -> Prepared {
        let batch = records((0..70).map(|s| {
            let qwen = if s < 10 { 0.5 } else { 0.0 };
            json!({"step": s, "loss": 2.0, "modules": [
                {"module": "qwen.a", "grad_norm": qwen, "hook_hits": u32::from(s < 10)},
                {"module": "agent.b", "grad_norm": 0.25, "hook_hits": 1}]})
        }));
        written(
            registered(serde_json::to_value(registration()).unwrap()),
            &batch,
        )
    }

    #[test]
    fn a_run_reads_back_as_it_was_prepared() {
        let prepared = stuck_run();
        let state = read(stored(&prepared, Vec::new()));
        let next = &prepared.next;
        assert_eq!((state.head, state.last_step), (next.head, next.last_step));
        assert_eq!(state.columns.kinds(), next.columns.kinds());
        assert_eq!(state.streams, next.streams);
        assert_eq!(
            serde_json::to_value(&state.detectors).unwrap(),
            serde_json::to_value(&next.detectors).unwrap()
        );
        assert!(
            state
                .detectors
                .episodes
                .get(AlertKind::GradStuckZero, "qwen")
                .is_some()
        );
    }

    #[test]
    fn the_open_alert_rows_are_the_episodes_only_when_the_state_has_none() {
        let prepared = stuck_run();
        // A state stored with its episodes: they are what is open.
        let rows = vec![(1, "loss_divergence".to_owned(), "loss".to_owned(), Some(3))];
        let state = read(stored(&prepared, rows.clone()));
        assert!(
            state
                .detectors
                .episodes
                .get(AlertKind::LossDivergence, "loss")
                .is_none()
        );
        // Stored by a server that kept them apart, or no batch yet: the rows.
        let mut older = stored(&prepared, rows);
        let mut detectors: serde_json::Value =
            serde_json::from_str(older.detector_state.as_deref().unwrap()).unwrap();
        detectors.as_object_mut().unwrap().remove("episodes");
        older.detector_state = Some(detectors.to_string());
        let state = read(older.clone());
        let episode = state
            .detectors
            .episodes
            .get(AlertKind::LossDivergence, "loss");
        assert_eq!(episode.map(|e| e.last_step), Some(Some(3)));
        assert!(
            state
                .detectors
                .episodes
                .get(AlertKind::GradStuckZero, "qwen")
                .is_none()
        );
        older.detector_state = None;
        assert!(
            read(older)
                .detectors
                .episodes
                .get(AlertKind::LossDivergence, "loss")
                .is_some()
        );
    }
}
