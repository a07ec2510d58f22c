//! What preparing a batch is, whichever its run: the one contract both preparers
//! keep (`super::single` for a run of one process, `super::ranks` for a multi-rank
//! run; the service picks one by the run's world size), and the phases they share: checking
//! records against the registration in force, adding rows to a stream (blocks and
//! rollup buckets), and running the detectors into alert operations. Pure CPU work,
//! no I/O, so it runs outside any transaction on SQLite and batches of different
//! runs prepare in parallel.
//!
//! # The contract
//!
//! A preparer takes the run's state and the batch, and gives either the rows to
//! write with the state that follows once they commit ([`Preparation::Write`]),
//! the state unchanged when nothing is new ([`Preparation::NothingNew`]), or the
//! refusal ([`Refused`]), with the state back when it is untouched (a record the
//! run refuses is found before anything changes) and without it otherwise (the
//! caller reads it again from the database). The state is taken, not copied: a
//! run's state holds a growing block and rollup buckets per stream and, in a
//! multi-rank run, an accumulator per waiting step.

use std::sync::Arc;

use gradflow_protocol::{Amendment, StepRecord};
use serde::Serialize;

use super::error::{IngestError, IngestResult};
use super::state::{OpenBucket, RunState, StreamTail};
use crate::store::{
    AlertOp, BatchWrite, BlockWrite, NewColumn, RollupRow, StoreError, StoreResult,
};
use anyhow::Context;
use gradflow_core::columnar::block::{self, BlockRow, block_index};
use gradflow_core::columnar::codec;
use gradflow_core::columnar::rollup::{BucketSummary, ROLLUP_WIDTHS};
use gradflow_core::detect::ranks::RankView;
use gradflow_core::detect::{Detection, DetectorSet, Transition};
use gradflow_core::model::series_kind::SeriesKind;
use gradflow_core::run::registry::Registry;

/// A batch to prepare: its run, its records (validated, steps strictly increasing
/// per stream), and what the server decides for it.
pub struct Batch<'a> {
    pub run_id: &'a str,
    pub records: &'a [StepRecord],
    pub detection: Detection,
    pub clock: Clock,
    /// v1.5: the rank of a multi-rank run that said it closed with this call.
    pub closing: Option<u32>,
}

/// When a batch is prepared, and how long a step of a multi-rank run may wait for
/// its ranks.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    /// Server clock, Unix seconds.
    pub now: f64,
    pub rank_timeout: f64,
}

/// The answer to a batch, as docs/PROTOCOL.md words it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct IngestOutcome {
    /// Records stored by this request.
    pub accepted: usize,
    /// Records whose step is already stored: ignored, as a resend after a timeout.
    pub duplicates: usize,
    /// *(v1.5)* Records whose step is below the run's (or the rank's) last stored step
    /// but was never stored: refused, not stored. Sent only when some were. Another
    /// writer moved the run past them (two clients, or a resend racing a batch still
    /// in flight): what a client should say, since these steps are lost.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub late: usize,
    /// The run's last stored step after this request.
    pub last_step: Option<u64>,
    /// Values stored by this request (for the server's own metrics; not in the
    /// response).
    #[serde(skip)]
    pub values: usize,
}

fn is_zero(count: &usize) -> bool {
    *count == 0
}

/// What preparing a batch came to.
pub enum Preparation {
    /// Rows to write, and the state once they are committed.
    Write(Box<Prepared>),
    /// Nothing new to store (every record at or below its stream's last stored
    /// step): the outcome, and the state unchanged.
    NothingNew(IngestOutcome, Box<RunState>),
}

/// A batch ready to write, and the run's state once it is written.
pub struct Prepared {
    pub write: BatchWrite,
    pub next: RunState,
    pub outcome: IngestOutcome,
}

/// A batch refused: why, and the run's state when the preparer left it untouched.
pub struct Refused {
    pub error: IngestError,
    pub state: Option<Box<RunState>>,
}

impl Refused {
    /// Refused before the state changed: it comes back.
    pub fn untouched(error: IngestError, state: RunState) -> Refused {
        Refused {
            error,
            state: Some(Box::new(state)),
        }
    }
}

/// A failure once the state has changed: it is gone.
impl From<IngestError> for Refused {
    fn from(error: IngestError) -> Refused {
        Refused { error, state: None }
    }
}

impl From<StoreError> for Refused {
    fn from(error: StoreError) -> Refused {
        IngestError::from(error).into()
    }
}

impl From<anyhow::Error> for Refused {
    fn from(error: anyhow::Error) -> Refused {
        IngestError::from(error).into()
    }
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

impl StepCells {
    /// Whether the record carries a step's measurements: at least one value stored in
    /// the stream. A record that only amends the registration (the last
    /// `requires_grad_(False)` a client sends at `close`) is stored, and its amendment
    /// judged, but it is not a step the run took (docs/PROTOCOL.md, "Streaming steps").
    /// The detectors ask the record the same question
    /// (`gradflow_core::columnar::flatten::measures_a_step`, held to this by a test);
    /// a rank-combined row has no single record, so the stream's own cells decide.
    pub fn measured(&self) -> bool {
        self.cells.iter().any(|cell| *cell != codec::ABSENT_BITS)
    }
}

/// The steps among `rows`: the records that carry a measurement (the run's
/// `step_count` adds these, not every record).
pub fn steps_measured(rows: &[StepCells]) -> u64 {
    rows.iter().filter(|row| row.measured()).count() as u64
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
