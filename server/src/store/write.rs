//! A batch's rows, written in one transaction: a batch is stored whole or not at all.
//!
//! The ingest service prepares everything a batch changes — new columns, step blocks,
//! rollup buckets, alert transitions, the detectors' state, the run's progress — as
//! a [`BatchWrite`], plain data, and [`Store::write_batch`] writes it in one
//! transaction. A failure anywhere leaves the database as it was, and the commit
//! makes the batch durable before the client hears `200`.
//!
//! The first statement moves the run's version on, and only from the version the
//! batch was prepared against: if another writer got there first (a second replica,
//! or an earlier request of the same run whose commit landed after it was given up
//! on), nothing is written and the batch comes back [`StoreError::Stale`] to be
//! prepared again on fresh state.

use sqlx::QueryBuilder;

use super::load::RunLock;
use super::notify::Notice;
use super::{Store, StoreError, StoreResult, alerts, now_seconds, on_tx, webhooks};
use gradflow_core::columnar::columns::SeriesKind;
use gradflow_core::model::alert::{AlertKind, Opened};

/// Block rows upserted by one statement (five bound values each, far below both
/// databases' limits on bound values).
const BLOCK_ROWS_PER_UPSERT: usize = 64;
/// Rollup rows upserted by one statement.
const ROLLUP_ROWS_PER_UPSERT: usize = 128;

/// Everything one batch changes, ready to write.
#[derive(Debug, Clone)]
pub struct BatchWrite {
    pub run_id: String,
    /// The run's key.
    pub key: i64,
    /// The run's version the batch was prepared against.
    pub expected_version: i64,
    pub progress: Progress,
    /// v1.1 amendments, with the step each takes effect at (JSON bodies).
    pub amendments: Vec<(u64, String)>,
    pub columns: Vec<NewColumn>,
    /// Blocks to insert or replace (a block that grows is written again whole).
    pub blocks: Vec<BlockWrite>,
    /// Rollup chunks to insert or replace.
    pub rollups: Vec<RollupRow>,
    /// Alert transitions, in the order they happened.
    pub alerts: Vec<AlertOp>,
    /// The detectors' state after the batch (JSON).
    pub detector_state: String,
    /// A multi-rank run: when the oldest step still waiting for ranks began to
    /// (server clock), `None` when none waits.
    pub pending_since: Option<f64>,
}

/// How the run's steps (its stream 0) move on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// The batch's first new step of the run (`None`: the batch added none, as a
    /// multi-rank batch may while its steps wait for other ranks).
    pub first_step: Option<u64>,
    /// The run's last step after the batch.
    pub last_step: Option<u64>,
    /// New steps of the run stored.
    pub steps: u64,
}

/// A column the batch adds to the run's dictionary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewColumn {
    pub position: u32,
    pub kind: SeriesKind,
    pub subject: String,
}

/// One block of one stream (`store::block`).
#[derive(Debug, Clone)]
pub struct BlockWrite {
    pub stream: u32,
    pub index: u64,
    pub mask: u64,
    pub blob: Vec<u8>,
}

/// One chunk of one rollup bucket of one stream.
#[derive(Debug, Clone)]
pub struct RollupRow {
    pub stream: u32,
    pub width: u64,
    pub chunk: u32,
    pub bucket: u64,
    pub blob: Vec<u8>,
}

/// One alert transition of the batch. An open alert is named by its kind and
/// subject: a run has at most one open alert of each (the detectors' episodes say
/// which are open; PostgreSQL's `alerts_one_open` index holds it too).
#[derive(Debug, Clone)]
pub enum AlertOp {
    Open(Box<Opened>),
    /// The episode ended at `step`; `last_step` is the last step it held on.
    Resolve {
        kind: AlertKind,
        subject: String,
        step: u64,
        last_step: Option<u64>,
    },
    /// The episode still holds, through `last_step`.
    Extend {
        kind: AlertKind,
        subject: String,
        last_step: Option<u64>,
    },
}

/// What the write assigned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Written {
    /// The ids of the alerts the batch opened, in the order of its `Open`s.
    pub opened: Vec<i64>,
    /// The ids of the alerts it resolved.
    pub resolved: Vec<i64>,
}

impl Store {
    /// Writes `batch` and commits, in the transaction `lock` holds (PostgreSQL) or
    /// a new one on the writer (SQLite).
    pub async fn write_batch(&self, lock: RunLock, batch: &BatchWrite) -> StoreResult<Written> {
        let mut tx = match lock.into_tx() {
            Some(tx) => tx,
            None => self.begin().await?,
        };
        let advanced = on_tx!(&mut tx, |c| {
            sqlx::query(
                "UPDATE runs SET first_step = COALESCE(first_step, $2), \
                 last_step = COALESCE($3, last_step), last_seen = $4, \
                 step_count = step_count + $5, version = version + 1, pending_since = $7 \
                 WHERE id = $1 AND version = $6",
            )
            .bind(batch.key)
            .bind(batch.progress.first_step.map(|s| s as i64))
            .bind(batch.progress.last_step.map(|s| s as i64))
            .bind(now_seconds())
            .bind(batch.progress.steps as i64)
            .bind(batch.expected_version)
            .bind(batch.pending_since)
            .execute(&mut *c)
            .await?
            .rows_affected()
        });
        if advanced == 0 {
            return Err(StoreError::Stale);
        }
        on_tx!(&mut tx, |c| {
            for (step, body) in &batch.amendments {
                sqlx::query("INSERT INTO amendments (run, step, body) VALUES ($1, $2, $3)")
                    .bind(batch.key)
                    .bind(*step as i64)
                    .bind(body)
                    .execute(&mut *c)
                    .await?;
            }
            for column in &batch.columns {
                sqlx::query(
                    "INSERT INTO columns (run, col, kind, subject) VALUES ($1, $2, $3, $4)",
                )
                .bind(batch.key)
                .bind(column.position as i64)
                .bind(column.kind.as_str())
                .bind(&column.subject)
                .execute(&mut *c)
                .await?;
            }
            // Many rows per statement: with SQLite each statement is a round trip to
            // sqlx's worker thread (two context switches).
            for chunk in batch.blocks.chunks(BLOCK_ROWS_PER_UPSERT) {
                let mut upsert =
                    QueryBuilder::new("INSERT INTO blocks (run, stream, block, mask, vals) ");
                upsert.push_values(chunk, |mut values, block| {
                    values
                        .push_bind(batch.key)
                        .push_bind(i64::from(block.stream))
                        .push_bind(block.index as i64)
                        .push_bind(block.mask as i64)
                        .push_bind(block.blob.as_slice());
                });
                upsert.push(
                    " ON CONFLICT (run, stream, block) \
                     DO UPDATE SET mask = excluded.mask, vals = excluded.vals",
                );
                upsert.build().execute(&mut *c).await?;
            }
            for chunk in batch.rollups.chunks(ROLLUP_ROWS_PER_UPSERT) {
                let mut upsert = QueryBuilder::new(
                    "INSERT INTO rollups (run, stream, width, chunk, bucket, summary) ",
                );
                upsert.push_values(chunk, |mut values, row| {
                    values
                        .push_bind(batch.key)
                        .push_bind(i64::from(row.stream))
                        .push_bind(row.width as i64)
                        .push_bind(i64::from(row.chunk))
                        .push_bind(row.bucket as i64)
                        .push_bind(row.blob.as_slice());
                });
                upsert.push(
                    " ON CONFLICT (run, stream, width, chunk, bucket) \
                     DO UPDATE SET summary = excluded.summary",
                );
                upsert.build().execute(&mut *c).await?;
            }
        });
        let mut written = Written::default();
        for op in &batch.alerts {
            match op {
                AlertOp::Open(opened) => {
                    let id = alerts::insert_opened(&mut tx, batch.key, opened).await?;
                    webhooks::enqueue_opened(&mut tx, batch.key, &batch.run_id, id, opened).await?;
                    written.opened.push(id);
                }
                AlertOp::Resolve {
                    kind,
                    subject,
                    step,
                    last_step,
                } => {
                    let open = (batch.key, *kind, subject.as_str());
                    for id in alerts::resolve(&mut tx, open, *step, *last_step).await? {
                        webhooks::enqueue_resolved(&mut tx, batch.key, id).await?;
                        written.resolved.push(id);
                    }
                }
                AlertOp::Extend {
                    kind,
                    subject,
                    last_step,
                } => {
                    let open = (batch.key, *kind, subject.as_str());
                    alerts::extend(&mut tx, open, *last_step).await?;
                }
            }
        }
        on_tx!(&mut tx, |c| {
            sqlx::query(
                "INSERT INTO detector_state (run, state) VALUES ($1, $2) \
                 ON CONFLICT (run) DO UPDATE SET state = excluded.state",
            )
            .bind(batch.key)
            .bind(&batch.detector_state)
            .execute(&mut *c)
            .await?;
        });
        super::notify::send(&mut tx, &Notice::of_batch(batch, &written)).await?;
        tx.commit().await?;
        Ok(written)
    }
}
