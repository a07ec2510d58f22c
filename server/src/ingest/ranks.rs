//! Preparing a batch of a multi-rank run (v1.4): each rank's records go into its
//! own stream as they arrive (what the per-rank views read), and are folded into
//! their steps' accumulators (`combine`); the steps every rank has sent — or that
//! can wait no longer — are combined, in order, into the run's steps, which the
//! detectors judge and stream 0 stores.
//!
//! A rank that closes (v1.5: its client's `POST .../finish?rank=N`, sent once its
//! records are delivered) will send nothing more: the steps it did not send are
//! completed at once, without it, instead of waiting the rank timeout; once every
//! rank has closed, every waiting step is. A finish that names no rank means what
//! it meant before v1.5 (the run is marked finished, its steps still wait for their
//! ranks): an older client sends one from each rank as soon as that rank is done.
//! A record from a closed rank reopens it.
//!
//! A record's step is a duplicate when its rank's stream already holds it, so a
//! rank may resend a batch as safely as a single process. A record that arrives
//! after its step was combined without it (its rank was too late) is stored in its
//! stream and changes nothing combined.

use anyhow::Context;
use gradflow_protocol::{InvalidBody, StepRecord, Timestamp};

use super::IngestOutcome;
use super::batch::{
    Codec, Preparation, Prepared, StepCells, check_amendment, check_params, detect, new_columns,
    write_stream,
};
use super::combine::{Combined, LAG_STEPS, PendingStep};
use super::registry::Registry;
use super::state::RunState;
use crate::store::{BatchWrite, Progress, RUN_STREAM, StoreError, StoreResult, rank_stream};
use gradflow_core::columnar::codec::ABSENT_BITS;
use gradflow_core::columnar::columns::ColumnAssigner;
use gradflow_core::columnar::flatten::{flatten, unflatten};
use gradflow_core::detect::Detection;
use std::collections::BTreeMap;
use std::sync::Arc;

/// When a multi-rank batch is prepared, and how long a step may wait for its ranks.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    /// Server clock, Unix seconds.
    pub now: f64,
    pub rank_timeout: f64,
}

/// [`super::batch::prepare`] for a run of several ranks.
///
/// It takes the run's state and turns it into the next one in place, instead of
/// preparing a copy: a multi-rank run's state holds a growing block and rollup
/// buckets for each of its ranks' streams and an accumulator for every step still
/// waiting for ranks, and copying all of that for every batch was a tenth of the
/// server's work. When nothing is new the state comes back untouched with the
/// outcome; when the batch is refused (an error) the state is gone, and the caller
/// reads it again from the database.
pub fn prepare_ranks(
    state: RunState,
    run_id: &str,
    records: &[StepRecord],
    detection: Detection,
    clock: Clock,
    closing: Option<u32>,
    codec: &mut Codec,
) -> StoreResult<Preparation<RunState>> {
    let world = state.world_size;
    let head = state.head;
    let mut next = state;
    let mut amendments = Vec::new();
    let mut duplicates = 0;
    let mut rows: Vec<(u32, StepCells, usize)> = Vec::new();
    let mut assigner = ColumnAssigner::new(&next.columns);
    let mut closed_changed = false;
    // Each stream's last step, as this batch moves it.
    let mut last_of: BTreeMap<u32, u64> = next
        .streams
        .iter()
        .map(|(stream, tail)| (*stream, tail.last_step))
        .collect();
    for (i, record) in records.iter().enumerate() {
        let rank = record.rank.ok_or_else(|| {
            invalid(
                format!("steps[{i}].rank"),
                format!(
                    "run {run_id} has {world} ranks (world_size): each record must say which \
                     rank sent it"
                ),
            )
        })?;
        if rank >= world {
            return Err(invalid(
                format!("steps[{i}].rank"),
                format!("rank {rank} is not below the run's world_size {world}"),
            ));
        }
        let stream = rank_stream(rank);
        if last_of
            .get(&stream)
            .is_some_and(|last| record.step <= *last)
        {
            duplicates += 1;
            continue;
        }
        last_of.insert(stream, record.step);
        // A closed rank that sends again is back (a resumed job).
        let reopened = next.detectors.ranks.closed.remove(&rank);
        closed_changed |= reopened;
        // Every rank sends the same amendment at the same step; the first to arrive
        // puts it in force.
        if let Some(amendment) = &record.amend
            && !next.registries.contains_key(&record.step)
        {
            let amended = next
                .registry_at(record.step)
                .amended(amendment, detection.thresholds);
            check_amendment(&amended, amendment, i)?;
            next.registries.insert(record.step, Arc::new(amended));
            amendments.push((
                record.step,
                serde_json::to_string(amendment).context("encoding an amendment")?,
            ));
        }
        let registry = next.registry_at(record.step).clone();
        check_params(&registry, record, i)?;
        rows.push((
            rank,
            StepCells {
                step: record.step,
                time: record.time.map(|t| t.unix_seconds()),
                cells: flatten(record, &registry.module_groups, &mut assigner),
            },
            i,
        ));
    }
    let mut added = assigner.added();
    for (kind, subject, position) in &added {
        next.columns.restore(*kind, subject, *position);
    }

    // Each rank's rows into its stream.
    let mut blocks = Vec::new();
    let mut rollups = Vec::new();
    let mut by_stream: BTreeMap<u32, Vec<StepCells>> = BTreeMap::new();
    let mut folds: Vec<(u32, u64, usize, usize)> = Vec::new();
    for (rank, row, i) in rows {
        let stream = rank_stream(rank);
        let stream_rows = by_stream.entry(stream).or_default();
        folds.push((rank, row.step, stream_rows.len(), i));
        stream_rows.push(row);
    }
    for (stream, stream_rows) in &by_stream {
        let tail = write_stream(
            next.streams.get(stream),
            *stream,
            stream_rows,
            next.columns.kinds(),
            &mut blocks,
            &mut rollups,
            codec,
        )?;
        next.streams.insert(*stream, tail);
    }
    let accepted = folds.len();
    let values = by_stream
        .values()
        .flatten()
        .map(|row| row.cells.iter().filter(|c| **c != ABSENT_BITS).count())
        .sum();

    // ...and into their steps' accumulators, unless the step is combined already.
    for (rank, step, index, i) in folds {
        if next.last_step.is_some_and(|last| step <= last) {
            continue;
        }
        let row = &by_stream[&rank_stream(rank)][index];
        let registry = next.registry_at(step).clone();
        next.pending
            .entry(step)
            .or_insert_with(|| PendingStep::new(clock.now))
            .fold(
                rank,
                &row.cells,
                row.time,
                &records[i].graph_cuts,
                &next.columns,
                &registry,
            );
    }

    // A rank that said it closed (v1.5) will send nothing more.
    if let Some(rank) = closing {
        if rank >= world {
            return Err(invalid(
                "rank".to_owned(),
                format!("rank {rank} is not below the run's world_size {world}"),
            ));
        }
        closed_changed |= next.detectors.ranks.closed.insert(rank);
    }
    let closed = next.detectors.ranks.closed.clone();

    // The steps that are complete, or can wait no longer, in order.
    let front = (0..world)
        .filter_map(|rank| next.streams.get(&rank_stream(rank)).map(|t| t.last_step))
        .max();
    let mut combined: Vec<Combined> = Vec::new();
    while let Some((&step, waiting)) = next.pending.first_key_value() {
        let complete = waiting.arrived.len() >= world
            || (0..world).all(|rank| waiting.arrived.contains(rank) || closed.contains(&rank));
        let left_behind = front.is_some_and(|front| front.saturating_sub(step) > LAG_STEPS);
        let timed_out = clock.now - waiting.first_seen > clock.rank_timeout;
        if !(complete || left_behind || timed_out) {
            break;
        }
        let (step, waiting) = next.pending.pop_first().expect("looked at above");
        let arrived = waiting.arrived.clone();
        let registry = next.registry_at(step).clone();
        let mut step_combined = waiting.combine(step, world, &next.columns, &registry);
        step_combined.view.missing = (0..world)
            .filter(|rank| !arrived.contains(*rank))
            .map(|rank| {
                let last = next.streams.get(&rank_stream(rank)).map(|t| t.last_step);
                (rank, last)
            })
            .collect();
        step_combined.view.closed = step_combined
            .view
            .missing
            .iter()
            .map(|(rank, _)| *rank)
            .filter(|rank| closed.contains(rank))
            .collect();
        combined.push(step_combined);
    }

    if accepted == 0 && combined.is_empty() && amendments.is_empty() && !closed_changed {
        // Nothing was new, so nothing above changed the state.
        let outcome = IngestOutcome {
            accepted: 0,
            duplicates,
            late: 0,
            last_step: next.last_step,
            values: 0,
        };
        return Ok(Preparation::NothingNew(outcome, next));
    }

    // The combined steps: records for the detectors, rows for stream 0.
    let mut assigner = ColumnAssigner::new(&next.columns);
    let mut run_rows = Vec::with_capacity(combined.len());
    let mut run_records: Vec<(
        StepRecord,
        Arc<Registry>,
        gradflow_core::detect::ranks::RankView,
    )> = Vec::with_capacity(combined.len());
    for step_combined in combined {
        let registry = next.registry_at(step_combined.step).clone();
        let mut record = unflatten(step_combined.step, &step_combined.cells, &next.columns);
        record.time = step_combined
            .time
            .and_then(|t| Timestamp::from_unix_seconds(t).ok());
        record.graph_cuts = step_combined.graph_cuts;
        run_rows.push(StepCells {
            step: record.step,
            time: step_combined.time,
            cells: flatten(&record, &registry.module_groups, &mut assigner),
        });
        run_records.push((record, registry, step_combined.view));
    }
    let run_added = assigner.added();
    for (kind, subject, position) in &run_added {
        next.columns.restore(*kind, subject, *position);
    }
    added.extend(run_added);
    let first_combined = run_rows.first().map(|row| row.step);
    if !run_rows.is_empty() {
        let tail = write_stream(
            next.streams.get(&RUN_STREAM),
            RUN_STREAM,
            &run_rows,
            next.columns.kinds(),
            &mut blocks,
            &mut rollups,
            codec,
        )?;
        next.streams.insert(RUN_STREAM, tail);
        next.last_step = run_rows.last().map(|row| row.step);
    }
    let in_force = next.registry.clone();
    let alerts = detect(
        detection.enabled,
        &mut next.detectors,
        &mut next.open,
        &in_force,
        run_records.iter().map(|(r, g, v)| (r, g, Some(v))),
    );
    if let Some((_, registry, _)) = run_records.last() {
        next.registry = registry.clone();
    }
    next.head.version += 1;

    // A batch from one rank answers with that rank's last step, which is what its
    // client can reason about; otherwise the run's.
    let ranks_in_batch: Vec<u32> = by_stream.keys().map(|s| s - 1).collect();
    let last_step = match ranks_in_batch.as_slice() {
        [rank] => next.streams.get(&rank_stream(*rank)).map(|t| t.last_step),
        _ => next.last_step,
    };
    let outcome = IngestOutcome {
        accepted,
        duplicates,
        late: 0,
        last_step,
        values,
    };
    let write = BatchWrite {
        run_id: run_id.to_owned(),
        key: head.key,
        expected_version: head.version,
        progress: Progress {
            first_step: first_combined,
            last_step: next.last_step,
            steps: run_rows.len() as u64,
        },
        amendments,
        columns: new_columns(added),
        blocks,
        rollups,
        alerts,
        detector_state: serde_json::to_string(&next.detectors)
            .context("encoding detector state")?,
        pending_since: next.pending.values().map(|p| p.first_seen).reduce(f64::min),
    };
    Ok(Preparation::Write(Box::new(Prepared {
        write,
        next,
        outcome,
    })))
}

fn invalid(path: String, message: String) -> StoreError {
    StoreError::Invalid(InvalidBody::new(path, message))
}
