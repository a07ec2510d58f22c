//! What ingest needs to know of a run, and the right to write its next batch.
//!
//! With PostgreSQL, batches of one run may reach several replicas at once. Each
//! batch therefore begins by locking the run's row (`SELECT … FOR UPDATE`): the
//! replicas take turns on a run, while different runs ingest in parallel. Inside
//! that transaction the run's head (key and version, which every batch moves on)
//! says whether a replica's cached state of the run is still current; when it is
//! not, the state is read again in the same transaction, so no batch is ever
//! prepared against a state another replica has moved on.
//!
//! SQLite has one server and one writer connection. Its batches are prepared
//! outside any transaction, so that runs prepare in parallel, and the write checks
//! that the run's version is still the one the batch was prepared against.

use anyhow::Context;
use gradflow_protocol::{Amendment, RunRegistration};

use super::{Db, Store, StoreError, StoreResult, Tx, runs};
use gradflow_core::columnar::columns::SeriesKind;
use gradflow_core::columnar::rollup::ROLLUP_WIDTHS;

/// A run's key and version: which state of the run a batch builds on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunHead {
    pub key: i64,
    /// Batches that have changed the run.
    pub version: i64,
}

/// The right to write a run's next batch.
pub struct RunLock {
    /// PostgreSQL: the transaction that holds the run's row lock.
    tx: Option<Tx>,
    /// The run's head, when the lock read it (PostgreSQL).
    head: Option<RunHead>,
}

impl RunLock {
    /// The run's head as locked; `None` on SQLite, whose write checks it instead.
    pub fn head(&self) -> Option<RunHead> {
        self.head
    }

    pub(super) fn into_tx(self) -> Option<Tx> {
        self.tx
    }
}

/// Everything stored about a run that ingest keeps in memory.
#[derive(Debug, Clone)]
pub struct LoadedRun {
    pub head: RunHead,
    /// The run's last step (of its stream 0).
    pub last_step: Option<u64>,
    /// The registration as first sent (module and group written out).
    pub registration: RunRegistration,
    /// v1.1 amendments, oldest first.
    pub amendments: Vec<(u64, Amendment)>,
    /// The detectors' state (JSON), if a batch has been stored.
    pub detector_state: Option<String>,
    /// Open alerts: (id, kind, subject, last step).
    pub open_alerts: Vec<(i64, String, String, Option<u64>)>,
    /// The column dictionary: (position, kind, subject).
    pub columns: Vec<(u32, SeriesKind, String)>,
    /// Each stream's last block: (stream, index, blob). Only it can still grow.
    pub open_blocks: Vec<(u32, u64, Vec<u8>)>,
    /// A multi-rank run's ranks' blocks from the one holding the step after the
    /// run's last on: what they sent of steps not combined yet. (stream, index,
    /// blob).
    pub rank_blocks: Vec<(u32, u64, Vec<u8>)>,
    /// The rollup chunks of the bucket of each width that holds each stream's last
    /// step: (stream, width, chunk, blob). Only those can still grow.
    pub open_rollups: Vec<(u32, u64, u32, Vec<u8>)>,
}

impl Store {
    /// Takes the right to write `run_id`'s next batch (see the module's doc).
    pub async fn lock_run(&self, run_id: &str) -> StoreResult<RunLock> {
        self.check_ready()?;
        match &self.db {
            Db::Sqlite(_) => Ok(RunLock {
                tx: None,
                head: None,
            }),
            Db::Postgres(db) => {
                let mut tx = db.pool.begin().await?;
                let row: Option<(i64, i64)> =
                    sqlx::query_as("SELECT id, version FROM runs WHERE run_id = $1 FOR UPDATE")
                        .bind(run_id)
                        .fetch_optional(&mut *tx)
                        .await?;
                let Some((key, version)) = row else {
                    return Err(StoreError::RunNotFound(run_id.to_owned()));
                };
                Ok(RunLock {
                    tx: Some(Tx::Postgres(tx)),
                    head: Some(RunHead { key, version }),
                })
            }
        }
    }

    /// Reads what ingest keeps of `run_id`: in the lock's transaction (PostgreSQL),
    /// or in one read transaction, a consistent snapshot (SQLite).
    pub async fn load_run(&self, lock: &mut RunLock, run_id: &str) -> StoreResult<LoadedRun> {
        match (&mut lock.tx, &self.db) {
            (Some(tx), _) => load(tx, run_id).await,
            (None, Db::Sqlite(db)) => {
                let mut tx = Tx::Sqlite(db.read.begin().await?);
                let loaded = load(&mut tx, run_id).await;
                // A read transaction has nothing to keep; ending it releases the
                // snapshot.
                tx.commit().await?;
                loaded
            }
            (None, Db::Postgres(_)) => unreachable!("a PostgreSQL lock holds its transaction"),
        }
    }
}

async fn load(tx: &mut Tx, run_id: &str) -> StoreResult<LoadedRun> {
    let row: Option<(i64, i64, String, Option<i64>)> = super::on_tx!(tx, |c| {
        sqlx::query_as("SELECT id, version, registration, last_step FROM runs WHERE run_id = $1")
            .bind(run_id)
            .fetch_optional(&mut *c)
            .await?
    });
    let Some((key, version, registration, last_step)) = row else {
        return Err(StoreError::RunNotFound(run_id.to_owned()));
    };
    let head = RunHead { key, version };
    let registration: RunRegistration = serde_json::from_str(&registration)
        .with_context(|| format!("reading the stored registration of run {run_id}"))?;
    let amendments = runs::load_amendments(tx, key, run_id).await?;
    let (detector_state, open_alerts, columns, blocks) = super::on_tx!(tx, |c| {
        let detector_state: Option<String> =
            sqlx::query_scalar("SELECT state FROM detector_state WHERE run = $1")
                .bind(key)
                .fetch_optional(&mut *c)
                .await?;
        let open_alerts: Vec<(i64, String, String, Option<i64>)> = sqlx::query_as(
            "SELECT id, kind, subject, last_step FROM alerts WHERE run = $1 AND status = 'open'",
        )
        .bind(key)
        .fetch_all(&mut *c)
        .await?;
        let columns: Vec<(i64, String, String)> =
            sqlx::query_as("SELECT col, kind, subject FROM columns WHERE run = $1")
                .bind(key)
                .fetch_all(&mut *c)
                .await?;
        // Each stream's last block.
        let blocks: Vec<(i64, i64, i64, Vec<u8>)> = sqlx::query_as(
            "SELECT b.stream, b.block, b.mask, b.vals FROM blocks b \
             WHERE b.run = $1 AND b.block = \
             (SELECT max(l.block) FROM blocks l WHERE l.run = $1 AND l.stream = b.stream)",
        )
        .bind(key)
        .fetch_all(&mut *c)
        .await?;
        (detector_state, open_alerts, columns, blocks)
    });
    let mut open_rollups = Vec::new();
    for (stream, index, mask, _) in &blocks {
        let Some(last) = last_present(*index as u64, *mask as u64) else {
            continue;
        };
        for width in ROLLUP_WIDTHS {
            let chunks: Vec<(i64, Vec<u8>)> = super::on_tx!(tx, |c| {
                sqlx::query_as(
                    "SELECT chunk, summary FROM rollups WHERE run = $1 AND stream = $2 \
                     AND width = $3 AND bucket = $4 ORDER BY chunk",
                )
                .bind(key)
                .bind(stream)
                .bind(width as i64)
                .bind((last / width) as i64)
                .fetch_all(&mut *c)
                .await?
            });
            open_rollups.extend(
                chunks
                    .into_iter()
                    .map(|(chunk, blob)| (*stream as u32, width, chunk as u32, blob)),
            );
        }
    }
    let mut rank_blocks = Vec::new();
    if registration.world_size() > 1 {
        let from = last_step.map_or(0, |last| {
            gradflow_core::columnar::block::block_index(last as u64 + 1)
        });
        let rows: Vec<(i64, i64, Vec<u8>)> = super::on_tx!(tx, |c| {
            sqlx::query_as(
                "SELECT stream, block, vals FROM blocks WHERE run = $1 AND stream > 0 \
                 AND block >= $2 ORDER BY block, stream",
            )
            .bind(key)
            .bind(from as i64)
            .fetch_all(&mut *c)
            .await?
        });
        rank_blocks = rows
            .into_iter()
            .map(|(stream, index, blob)| (stream as u32, index as u64, blob))
            .collect();
    }
    let columns = columns
        .into_iter()
        .map(|(position, kind, subject)| {
            let kind = SeriesKind::parse(&kind)
                .with_context(|| format!("unknown column kind {kind:?} in run {run_id}"))?;
            Ok((position as u32, kind, subject))
        })
        .collect::<StoreResult<Vec<_>>>()?;
    Ok(LoadedRun {
        head,
        last_step: last_step.map(|s| s as u64),
        registration,
        amendments,
        detector_state,
        open_alerts: open_alerts
            .into_iter()
            .map(|(id, kind, subject, last)| (id, kind, subject, last.map(|s| s as u64)))
            .collect(),
        columns,
        open_blocks: blocks
            .into_iter()
            .map(|(stream, index, _, blob)| (stream as u32, index as u64, blob))
            .collect(),
        open_rollups,
        rank_blocks,
    })
}

/// The last present step of block `index` with `mask`.
pub fn last_present(index: u64, mask: u64) -> Option<u64> {
    (mask != 0).then(|| {
        gradflow_core::columnar::block::first_step(index) + 63 - u64::from(mask.leading_zeros())
    })
}
