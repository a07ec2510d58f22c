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
use gradflow_protocol::{StepRecord, Timestamp};

use super::error::{IngestError, IngestResult};
use super::plan::{
    Batch, Clock, Codec, IngestOutcome, Preparation, Prepared, Refused, StepCells, check_amendment,
    check_params, detect, new_columns, steps_measured, write_stream,
};
use super::state::RunState;
use crate::store::{
    AlertOp, BatchWrite, BlockWrite, Progress, RUN_STREAM, RollupRow, StoreResult, rank_stream,
};
use gradflow_core::columnar::codec::ABSENT_BITS;
use gradflow_core::columnar::columns::{ColumnAssigner, SeriesKind};
use gradflow_core::columnar::flatten::{flatten, unflatten};
use gradflow_core::detect::Detection;
use gradflow_core::detect::ranks::RankView;
use gradflow_core::run::combine::{Combined, LAG_STEPS, PendingStep};
use gradflow_core::run::registry::Registry;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Prepares `batch` for a run of several ranks (see [`super::plan`]).
///
/// It turns the run's state into the next one in place: a multi-rank run's state
/// holds a growing block and rollup buckets for each of its ranks' streams and an
/// accumulator for every step still waiting for ranks, and copying all of that for
/// every batch was a tenth of the server's work. When nothing is new the state
/// comes back untouched with the outcome; a refused batch (an error) may have
/// changed it, so it is not given back, and the caller reads it again from the
/// database.
///
/// The phases, in order: [`take_records`] (which records are new, amendments,
/// flattening), [`store_rank_streams`] (each rank's rows into its stream),
/// [`fold_pending`] (into their steps' accumulators), [`complete_steps`] (the steps
/// all ranks have sent, or that can wait no longer), [`store_combined`] (those steps
/// into stream 0, judged by the detectors).
pub fn prepare_ranks(
    state: RunState,
    batch: &Batch<'_>,
    codec: &mut Codec,
) -> Result<Preparation, Refused> {
    let Batch {
        run_id,
        records,
        detection,
        clock,
        closing,
    } = *batch;
    let world = state.world_size;
    let head = state.head;
    let mut next = state;
    let Intake {
        rows,
        amendments,
        duplicates,
        mut added,
        mut closed_changed,
    } = take_records(&mut next, run_id, records, detection)?;
    let mut blocks = Vec::new();
    let mut rollups = Vec::new();
    let streams = store_rank_streams(&mut next, rows, &mut blocks, &mut rollups, codec)?;
    fold_pending(&mut next, &streams, records, clock.now);

    // A rank that said it closed (v1.5) will send nothing more.
    if let Some(rank) = closing {
        if rank >= world {
            return Err(IngestError::invalid(
                "rank".to_owned(),
                format!("rank {rank} is not below the run's world_size {world}"),
            )
            .into());
        }
        closed_changed |= next.detectors.ranks.closed.insert(rank);
    }
    let combined = complete_steps(&mut next, clock);
    if streams.accepted == 0 && combined.is_empty() && amendments.is_empty() && !closed_changed {
        // Nothing was new, so nothing above changed the state.
        let outcome = IngestOutcome {
            accepted: 0,
            duplicates,
            late: 0,
            last_step: next.last_step,
            values: 0,
        };
        return Ok(Preparation::NothingNew(outcome, Box::new(next)));
    }
    let run = store_combined(
        &mut next,
        combined,
        detection,
        &mut blocks,
        &mut rollups,
        codec,
    )?;
    added.extend(run.added);
    next.head.version += 1;

    // A batch from one rank answers with that rank's last step, which is what its
    // client can reason about; otherwise the run's.
    let ranks_in_batch: Vec<u32> = streams.rows.keys().map(|s| s - 1).collect();
    let last_step = match ranks_in_batch.as_slice() {
        [rank] => next.streams.get(&rank_stream(*rank)).map(|t| t.last_step),
        _ => next.last_step,
    };
    let outcome = IngestOutcome {
        accepted: streams.accepted,
        duplicates,
        late: 0,
        last_step,
        values: streams.values,
    };
    let write = BatchWrite {
        run_id: run_id.to_owned(),
        key: head.key,
        expected_version: head.version,
        progress: Progress {
            first_step: run.first_step,
            last_step: next.last_step,
            steps: run.steps,
        },
        amendments,
        columns: new_columns(added),
        blocks,
        rollups,
        alerts: run.alerts,
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

/// What [`take_records`] makes of a batch's records.
struct Intake {
    /// The new records, flattened: (rank, row, index in the batch).
    rows: Vec<(u32, StepCells, usize)>,
    /// Amendments put in force: (step, the amendment as JSON).
    amendments: Vec<(u64, String)>,
    /// Records whose rank's stream already holds their step.
    duplicates: usize,
    /// Columns the new records added.
    added: Vec<(SeriesKind, String, u32)>,
    /// Whether a closed rank came back.
    closed_changed: bool,
}

/// Checks each record's rank, tells new records from duplicates (by their rank's
/// stream), puts amendments in force and flattens the new records into rows of the
/// run's columns (adding the columns they name first).
fn take_records(
    next: &mut RunState,
    run_id: &str,
    records: &[StepRecord],
    detection: Detection,
) -> IngestResult<Intake> {
    let world = next.world_size;
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
            IngestError::invalid(
                format!("steps[{i}].rank"),
                format!(
                    "run {run_id} has {world} ranks (world_size): each record must say which \
                     rank sent it"
                ),
            )
        })?;
        if rank >= world {
            return Err(IngestError::invalid(
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
    let added = assigner.added();
    for (kind, subject, position) in &added {
        next.columns.restore(*kind, subject, *position);
    }
    Ok(Intake {
        rows,
        amendments,
        duplicates,
        added,
        closed_changed,
    })
}

/// The new rows, stored in their ranks' streams.
struct RankRows {
    /// Each stream's new rows, in step order.
    rows: BTreeMap<u32, Vec<StepCells>>,
    /// Each new record as (rank, step, position in its stream's rows, index in the
    /// batch), in the batch's order.
    folds: Vec<(u32, u64, usize, usize)>,
    accepted: usize,
    /// Values (present cells) among the new rows.
    values: usize,
}

/// Each rank's rows into its stream: the blocks and rollup buckets they touch are
/// queued for writing, and each stream's tail moves on.
fn store_rank_streams(
    next: &mut RunState,
    rows: Vec<(u32, StepCells, usize)>,
    blocks: &mut Vec<BlockWrite>,
    rollups: &mut Vec<RollupRow>,
    codec: &mut Codec,
) -> StoreResult<RankRows> {
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
            blocks,
            rollups,
            codec,
        )?;
        next.streams.insert(*stream, tail);
    }
    let values = by_stream
        .values()
        .flatten()
        .map(|row| row.cells.iter().filter(|c| **c != ABSENT_BITS).count())
        .sum();
    Ok(RankRows {
        accepted: folds.len(),
        rows: by_stream,
        folds,
        values,
    })
}

/// Folds each new record into its step's accumulator, unless the step is combined
/// already (its rank came too late for it).
fn fold_pending(next: &mut RunState, streams: &RankRows, records: &[StepRecord], now: f64) {
    for &(rank, step, index, i) in &streams.folds {
        if next.last_step.is_some_and(|last| step <= last) {
            continue;
        }
        let row = &streams.rows[&rank_stream(rank)][index];
        let registry = next.registry_at(step).clone();
        next.pending
            .entry(step)
            .or_insert_with(|| PendingStep::new(now))
            .fold(
                rank,
                &row.cells,
                row.time,
                &records[i].graph_cuts,
                &next.columns,
                &registry,
            );
    }
}

/// Takes out of the waiting steps, in step order, those that are complete (every
/// rank sent or closed) or can wait no longer (left too far behind, or timed out),
/// and combines each, naming the ranks it went without.
fn complete_steps(next: &mut RunState, clock: Clock) -> Vec<Combined> {
    let world = next.world_size;
    let closed = next.detectors.ranks.closed.clone();
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
    combined
}

/// What [`store_combined`] adds to the batch's write.
struct RunSteps {
    /// Columns the combined steps added.
    added: Vec<(SeriesKind, String, u32)>,
    first_step: Option<u64>,
    steps: u64,
    alerts: Vec<AlertOp>,
}

/// The combined steps as records: stored in stream 0 and judged by the detectors,
/// in step order.
fn store_combined(
    next: &mut RunState,
    combined: Vec<Combined>,
    detection: Detection,
    blocks: &mut Vec<BlockWrite>,
    rollups: &mut Vec<RollupRow>,
    codec: &mut Codec,
) -> StoreResult<RunSteps> {
    let mut assigner = ColumnAssigner::new(&next.columns);
    let mut run_rows = Vec::with_capacity(combined.len());
    let mut run_records: Vec<(StepRecord, Arc<Registry>, RankView)> =
        Vec::with_capacity(combined.len());
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
    let added = assigner.added();
    for (kind, subject, position) in &added {
        next.columns.restore(*kind, subject, *position);
    }
    if !run_rows.is_empty() {
        let tail = write_stream(
            next.streams.get(&RUN_STREAM),
            RUN_STREAM,
            &run_rows,
            next.columns.kinds(),
            blocks,
            rollups,
            codec,
        )?;
        next.streams.insert(RUN_STREAM, tail);
        next.last_step = run_rows.last().map(|row| row.step);
    }
    let in_force = next.registry.clone();
    let alerts = detect(
        detection.enabled,
        &mut next.detectors,
        &in_force,
        run_records.iter().map(|(r, g, v)| (r, g, Some(v))),
    );
    if let Some((_, registry, _)) = run_records.last() {
        next.registry = registry.clone();
    }
    Ok(RunSteps {
        added,
        first_step: run_rows.first().map(|row| row.step),
        steps: steps_measured(&run_rows),
        alerts,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::ingest::testing::{prepare_at, records, registered, written};
    use crate::store::AlertOp;

    /// Two ranks, `qwen.q` sharded across them.
    fn run() -> RunState {
        registered(json!({"world_size": 2, "params": [
            {"name": "qwen.q.weight", "layout": "sharded", "shard_ranks": [0, 1]},
            {"name": "agent.head.weight"}]}))
    }

    fn rank_steps(rank: u32, steps: std::ops::Range<u64>) -> Vec<StepRecord> {
        records(steps.map(|s| {
            json!({"step": s, "rank": rank, "loss": 2.0, "modules": [
                {"module": "qwen.q", "grad_sumsq": 1.0 + rank as f64, "hook_hits": 1},
                {"module": "agent.head", "grad_norm": 0.5, "hook_hits": 1}]})
        }))
    }

    #[test]
    fn a_step_is_the_run_s_once_every_rank_sent_it() {
        // Rank 0 alone: its stream grows, the run's steps wait.
        let first = written(run(), &rank_steps(0, 0..3));
        assert!(
            first
                .write
                .blocks
                .iter()
                .all(|b| b.stream == rank_stream(0))
        );
        assert_eq!(
            (first.write.progress.steps, first.next.last_step),
            (0, None)
        );
        assert_eq!(first.next.pending.len(), 3);
        assert_eq!(first.write.pending_since, Some(0.0));
        // Rank 1 of steps 0–1: those two are combined into the run's stream.
        let second = written(first.next, &rank_steps(1, 0..2));
        let write = &second.write;
        assert_eq!(
            (
                write.progress.first_step,
                write.progress.last_step,
                write.progress.steps
            ),
            (Some(0), Some(1), 2)
        );
        let streams: Vec<u32> = write.blocks.iter().map(|b| b.stream).collect();
        assert_eq!(streams, [rank_stream(1), RUN_STREAM]);
        assert_eq!(second.next.pending.keys().collect::<Vec<_>>(), [&2]);
        // One rank's batch answers with that rank's last step.
        assert_eq!(second.outcome.last_step, Some(1));
    }

    #[test]
    fn a_combined_step_with_only_an_amendment_is_not_counted() {
        let mut batch = rank_steps(0, 0..2);
        batch.extend(rank_steps(1, 0..2));
        let first = written(run(), &batch);
        assert_eq!(first.write.progress.steps, 2);
        // Each rank's last record carries only the amendment (sent at close).
        let closing = records((0..2).map(|rank| {
            json!({"step": 2, "rank": rank,
                   "amend": {"params": [{"name": "agent.head.weight", "requires_grad": false}]}})
        }));
        let second = written(first.next, &closing);
        let write = &second.write;
        assert_eq!(
            (write.progress.last_step, write.progress.steps),
            (Some(2), 0)
        );
        assert_eq!(write.amendments.len(), 1);
    }

    #[test]
    fn a_rank_outside_the_run_is_refused() {
        let Err(refused) = prepare_at(run(), &rank_steps(5, 0..1), 0.0, None) else {
            panic!("rank 5 of 2 is refused");
        };
        assert!(
            refused.error.to_string().contains("world_size 2"),
            "{}",
            refused.error
        );
        let records = records([json!({"step": 0, "loss": 1.0})]);
        let Err(refused) = prepare_at(run(), &records, 0.0, None) else {
            panic!("a record without its rank is refused");
        };
        assert!(
            refused.error.to_string().contains("which rank"),
            "{}",
            refused.error
        );
    }

    #[test]
    fn a_closed_rank_s_steps_complete_without_it_and_say_so() {
        let first = written(run(), &rank_steps(0, 0..3));
        let closed = match prepare_at(first.next, &[], 1.0, Some(1)) {
            Ok(Preparation::Write(prepared)) => *prepared,
            _ => panic!("a closing rank completes the waiting steps"),
        };
        assert_eq!(closed.write.progress.steps, 3);
        assert!(closed.next.detectors.ranks.closed.contains(&1));
        let opened: Vec<(String, Value)> = closed
            .write
            .alerts
            .iter()
            .filter_map(|op| match op {
                AlertOp::Open(o) => Some((o.subject.clone(), o.evidence["closed"].clone())),
                _ => None,
            })
            .collect();
        assert_eq!(opened, [("rank 1".to_owned(), json!(true))]);
        // A step that waits for nobody is not waited for again.
        assert!(closed.next.pending.is_empty());
    }
}
