//! Preparing a batch: from a run's state and its new records to the rows to write
//! and the state that follows once they are committed. Pure CPU work — flattening,
//! packing steps into blocks, rollups, the detectors — with no I/O, so it runs
//! outside any transaction on SQLite and batches of different runs prepare in
//! parallel.

use std::sync::Arc;

use anyhow::Context;
use gradflow_protocol::{Amendment, StepRecord};

use super::IngestOutcome;
use super::error::{IngestError, IngestResult};
use super::registry::Registry;
use super::state::{OpenBucket, RunState, StreamTail};
use crate::store::{
    AlertOp, BatchWrite, BlockWrite, NewColumn, Progress, RUN_STREAM, RollupRow, StoreResult,
};
use gradflow_core::columnar::block::{self, BlockRow, block_index};
use gradflow_core::columnar::codec::{self, ABSENT_BITS};
use gradflow_core::columnar::columns::ColumnAssigner;
use gradflow_core::columnar::flatten::flatten;
use gradflow_core::columnar::rollup::{BucketSummary, ROLLUP_WIDTHS};
use gradflow_core::detect::ranks::RankView;
use gradflow_core::detect::{Detection, DetectorSet, Thresholds, Transition};
use gradflow_core::model::series_kind::SeriesKind;

/// What preparing a batch came to: rows to write, or nothing new to store (every
/// record at or below its stream's last stored step). `Unchanged` is what the
/// preparer hands back with the latter: nothing for [`prepare`], which borrows the
/// run's state; the state itself for `prepare_ranks`, which takes it.
pub enum Preparation<Unchanged> {
    Write(Box<Prepared>),
    NothingNew(IngestOutcome, Unchanged),
}

/// A batch ready to write, and the run's state once it is written.
pub struct Prepared {
    pub write: BatchWrite,
    pub next: RunState,
    pub outcome: IngestOutcome,
}

/// The zstd contexts a preparation reuses.
pub struct Codec {
    pub compressor: zstd::bulk::Compressor<'static>,
    pub decompressor: zstd::bulk::Decompressor<'static>,
}

thread_local! {
    /// One set of contexts per thread: preparing is synchronous, so a preparation
    /// never shares its thread's contexts, and creating them per batch would cost
    /// more than some small batches' compression.
    static CODEC: std::cell::RefCell<Option<Codec>> = const { std::cell::RefCell::new(None) };
}

/// Runs `work` with this thread's zstd contexts.
pub fn with_codec<T, E: From<anyhow::Error>>(
    work: impl FnOnce(&mut Codec) -> Result<T, E>,
) -> Result<T, E> {
    CODEC.with(|cell| {
        let mut cell = cell.borrow_mut();
        if cell.is_none() {
            *cell = Some(Codec {
                compressor: codec::compressor()?,
                decompressor: codec::decompressor()?,
            });
        }
        work(cell.as_mut().expect("created above"))
    })
}

/// Prepares `records` (validated, steps strictly increasing) for the run of
/// `state`. The records up to the run's last stored step are not new; a batch of
/// nothing else is [`Preparation::NothingNew`].
pub fn prepare(
    state: &RunState,
    run_id: &str,
    records: &[StepRecord],
    detection: Detection,
    codec: &mut Codec,
) -> IngestResult<Preparation<()>> {
    let last_stored = state.last_step;
    // Steps strictly increase within a batch, so the duplicates are a prefix.
    let first_new = records
        .iter()
        .position(|r| last_stored.is_none_or(|last| r.step > last))
        .unwrap_or(records.len());
    let (duplicates, new) = records.split_at(first_new);
    if new.is_empty() {
        return Ok(Preparation::NothingNew(
            IngestOutcome {
                accepted: 0,
                duplicates: duplicates.len(),
                late: 0,
                last_step: last_stored,
                values: 0,
            },
            (),
        ));
    }
    // The registration in force at each new record: v1.1 amendments take effect at
    // the record that carries them. A duplicate's amendment was applied when it was
    // first stored.
    let registries = registries_in_force(state, new, first_new, detection.thresholds)?;

    let mut assigner = ColumnAssigner::new(&state.columns);
    let rows: Vec<StepCells> = new
        .iter()
        .zip(&registries)
        .map(|(record, registry)| StepCells {
            step: record.step,
            time: record.time.map(|t| t.unix_seconds()),
            cells: flatten(record, &registry.module_groups, &mut assigner),
        })
        .collect();
    let added = assigner.added();

    let mut next = state.clone();
    for (kind, subject, position) in &added {
        next.columns.restore(*kind, subject, *position);
    }
    let mut blocks = Vec::new();
    let mut rollups = Vec::new();
    let tail = write_stream(
        state.streams.get(&RUN_STREAM),
        RUN_STREAM,
        &rows,
        next.columns.kinds(),
        &mut blocks,
        &mut rollups,
        codec,
    )?;
    next.streams.insert(RUN_STREAM, tail);

    let alerts = detect(
        detection.enabled,
        &mut next.detectors,
        &state.registry,
        new.iter().zip(&registries).map(|(r, g)| (r, g, None)),
    );
    let last = new.last().expect("at least one new record").step;
    next.last_step = Some(last);
    next.head.version += 1;
    next.registry = registries.last().expect("at least one new record").clone();

    let amendments = new
        .iter()
        .filter_map(|r| r.amend.as_ref().map(|a| (r.step, a)))
        .map(|(step, amendment)| {
            Ok((
                step,
                serde_json::to_string(amendment).context("encoding an amendment")?,
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    let outcome = IngestOutcome {
        accepted: new.len(),
        duplicates: duplicates.len(),
        late: 0,
        last_step: Some(last),
        values: rows
            .iter()
            .map(|row| row.cells.iter().filter(|c| **c != ABSENT_BITS).count())
            .sum(),
    };
    let write = BatchWrite {
        run_id: run_id.to_owned(),
        key: state.head.key,
        expected_version: state.head.version,
        progress: Progress {
            first_step: Some(new[0].step),
            last_step: Some(last),
            steps: new.len() as u64,
        },
        amendments,
        columns: new_columns(added),
        blocks,
        rollups,
        alerts,
        detector_state: serde_json::to_string(&next.detectors)
            .context("encoding detector state")?,
        pending_since: None,
    };
    Ok(Preparation::Write(Box::new(Prepared {
        write,
        next,
        outcome,
    })))
}

/// Runs the detectors over the new records in step order (each against the
/// registration in force at it, amendments judged where they take effect, and a
/// multi-rank step's view of its ranks), turning their transitions into alert
/// operations; every episode still open is extended. With the detectors off, only
/// that.
pub fn detect<'a>(
    enabled: bool,
    detectors: &mut DetectorSet,
    before: &'a Arc<Registry>,
    records: impl IntoIterator<Item = (&'a StepRecord, &'a Arc<Registry>, Option<&'a RankView>)>,
) -> Vec<AlertOp> {
    let mut alerts = Vec::new();
    let mut in_force = before;
    for (record, registry, ranks) in records.into_iter().filter(|_| enabled) {
        let amended = (!Arc::ptr_eq(in_force, registry)).then_some(&*in_force.context);
        in_force = registry;
        let transitions = detectors.on_step(&registry.context, record, amended, ranks);
        alerts.extend(transitions.into_iter().map(|transition| match transition {
            Transition::Open(alert) => AlertOp::Open(Box::new(alert)),
            Transition::Resolve {
                kind,
                subject,
                step,
                last_step,
            } => AlertOp::Resolve {
                kind,
                subject,
                step,
                last_step,
            },
        }));
    }
    for (kind, subject, episode) in detectors.episodes.iter() {
        alerts.push(AlertOp::Extend {
            kind,
            subject: subject.to_owned(),
            last_step: episode.last_step,
        });
    }
    alerts
}

/// One step of one stream, flattened.
pub struct StepCells {
    pub step: u64,
    /// The client's timestamp, Unix seconds.
    pub time: Option<f64>,
    pub cells: Vec<u32>,
}

/// Adds `rows` (new steps, ascending, all after the stream's last) to `stream`:
/// queues every block and rollup bucket they touch for writing — the stream's last
/// block again whole when they extend it — and returns the stream's new tail.
pub fn write_stream(
    tail: Option<&StreamTail>,
    stream: u32,
    rows: &[StepCells],
    families: &[Option<SeriesKind>],
    blocks: &mut Vec<BlockWrite>,
    rollups: &mut Vec<RollupRow>,
    codec: &mut Codec,
) -> StoreResult<StreamTail> {
    let mut last_block = None;
    for group in rows.chunk_by(|a, b| block_index(a.step) == block_index(b.step)) {
        let index = block_index(group[0].step);
        // Steps only grow: only the stream's last block can already hold some.
        let stored = match tail {
            Some(tail) if tail.block.0 == index => Some(
                block::decode(&tail.block.1)
                    .with_context(|| format!("decoding block {index} of stream {stream}"))?,
            ),
            _ => None,
        };
        let stored_cells: Vec<Vec<u32>> = stored.as_ref().map_or_else(Vec::new, |block| {
            (0..block.len())
                .map(|i| {
                    (0..block.column_count())
                        .map(|c| block.bits(i, c))
                        .collect()
                })
                .collect()
        });
        let mut block_rows: Vec<BlockRow<'_>> = Vec::with_capacity(64);
        if let Some(stored) = &stored {
            for (i, cells) in stored_cells.iter().enumerate() {
                block_rows.push(BlockRow {
                    step: stored.steps()[i],
                    time: stored.times()[i],
                    cells,
                });
            }
        }
        block_rows.extend(group.iter().map(|row| BlockRow {
            step: row.step,
            time: row.time,
            cells: &row.cells,
        }));
        let blob = block::encode(index, &block_rows, families)?;
        let mask = block::peek(&blob)?.mask;
        blocks.push(BlockWrite {
            stream,
            index,
            mask,
            blob: blob.clone(),
        });
        last_block = Some((index, blob));
    }
    let open = ROLLUP_WIDTHS
        .iter()
        .map(|&width| {
            fold_rollups(
                tail.and_then(|t| t.open_bucket(width)),
                stream,
                width,
                rows,
                rollups,
                &mut codec.compressor,
            )
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(StreamTail {
        last_step: rows.last().expect("at least one row").step,
        block: last_block.expect("at least one row"),
        rollups: open,
    })
}

/// Folds the new rows into the rollup buckets of one width, queues every bucket
/// they touched for writing, and returns the bucket now growing.
/// The columns a batch added, as the store writes them.
pub fn new_columns(added: Vec<(SeriesKind, String, u32)>) -> Vec<NewColumn> {
    added
        .into_iter()
        .map(|(kind, subject, position)| NewColumn {
            position,
            kind,
            subject,
        })
        .collect()
}

fn fold_rollups(
    open: Option<&OpenBucket>,
    stream: u32,
    width: u64,
    rows: &[StepCells],
    out: &mut Vec<RollupRow>,
    compressor: &mut zstd::bulk::Compressor<'static>,
) -> anyhow::Result<OpenBucket> {
    let mut last = None;
    for group in rows.chunk_by(|a, b| a.step / width == b.step / width) {
        let bucket = group[0].step / width;
        // Only the bucket holding the stream's previous last step can already exist:
        // steps only grow.
        let mut summary = match open {
            Some(open) if open.bucket == bucket => open.summary.clone(),
            _ => BucketSummary::default(),
        };
        for row in group {
            summary.add_row((row.step - bucket * width) as u16, &row.cells);
        }
        for chunk in 0..summary.chunk_count() {
            out.push(RollupRow {
                stream,
                width,
                chunk: chunk as u32,
                bucket,
                blob: summary.encode_chunk(chunk, compressor)?,
            });
        }
        last = Some(OpenBucket {
            width,
            bucket,
            summary,
        });
    }
    Ok(last.expect("at least one row"))
}

/// The registration in force at each of `new` (which starts at batch index
/// `offset`), checking that the parameters each record reports are registered by
/// then and that what an amendment says holds together. Shares the registry between
/// records until an amendment changes it.
fn registries_in_force(
    state: &RunState,
    new: &[StepRecord],
    offset: usize,
    thresholds: Thresholds,
) -> IngestResult<Vec<Arc<Registry>>> {
    let mut current = state.registry.clone();
    let mut registries = Vec::with_capacity(new.len());
    for (k, record) in new.iter().enumerate() {
        let i = offset + k;
        if let Some(amendment) = &record.amend {
            let amended = current.amended(amendment, thresholds);
            check_amendment(&amended, amendment, i)?;
            current = Arc::new(amended);
        }
        check_params(&current, record, i)?;
        registries.push(current.clone());
    }
    Ok(registries)
}

/// Every parameter a record (at batch index `i`) reports must be in the
/// registration in force at its step.
pub fn check_params(registry: &Registry, record: &StepRecord, i: usize) -> IngestResult<()> {
    for (j, param) in record.params.iter().enumerate() {
        if !registry.params.contains(&param.name) {
            return Err(IngestError::invalid(
                format!("steps[{i}].params[{j}].name"),
                format!(
                    "parameter {:?} is not in the run's registration at step {}: register \
                     every parameter the model has in PUT /api/v1/runs/{{run_id}}, or add it \
                     with an amendment (`amend`) in this or an earlier record",
                    param.name, record.step
                ),
            ));
        }
    }
    Ok(())
}

/// What an amendment says must hold together with the registration it amends: a
/// parameter's optimizer group must exist, and the ranks it is sharded across must
/// be ranks of the run.
pub fn check_amendment(amended: &Registry, amendment: &Amendment, i: usize) -> IngestResult<()> {
    let groups = amended
        .registration
        .optimizer
        .as_ref()
        .map(|o| o.param_groups.as_slice())
        .unwrap_or_default();
    for (j, param) in amendment.params.iter().enumerate() {
        if let Some(group) = &param.param_group
            && !groups.iter().any(|g| &g.name == group)
        {
            return Err(IngestError::invalid(
                format!("steps[{i}].amend.params[{j}].param_group"),
                format!(
                    "parameter group {group:?} is neither in the registration nor in this \
                     amendment's param_groups"
                ),
            ));
        }
    }
    let world_size = amended.registration.world_size();
    if let Some((j, k, message)) =
        gradflow_protocol::shard_rank_outside(&amendment.params, world_size)
    {
        return Err(IngestError::invalid(
            format!("steps[{i}].amend.params[{j}].shard_ranks[{k}]"),
            message,
        ));
    }
    Ok(())
}
