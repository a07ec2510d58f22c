//! The batch transaction: a batch is stored whole or not at all.
//!
//! Everything a batch changes — new columns, step rows, rollup buckets, the run's
//! progress — is written in one SQLite transaction, so a failure anywhere leaves the
//! database as it was, and a commit (with `synchronous=FULL`, an fsync of the WAL)
//! makes the batch durable before the client hears `200`. The in-memory run state is
//! updated only after the commit succeeds.
//!
//! The detectors run here too, on each new record in step order: their transitions
//! become alert rows and their state a JSON row in the same transaction, so alerts,
//! streaks and steps can never disagree, not even after a crash.

use anyhow::Context;
use std::sync::Arc;

use gradflow_protocol::{Amendment, InvalidBody, RunId, StepRecord};
use serde::Serialize;
use sqlx::{Connection, QueryBuilder, Sqlite, SqliteConnection};

use super::alerts::{self, Alert, OpenEpisode};
use super::codec;
use super::columns::ColumnAssigner;
use super::events::{AlertAction, Event};
use super::flatten::flatten;
use super::rollup::{BucketSummary, ROLLUP_WIDTHS};
use super::{Registry, RunState, Store, StoreError, StoreResult, Writer, now_seconds, webhooks};
use crate::detect::{Thresholds, Transition};

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

/// A flattened record, ready to write.
/// Step rows written by one INSERT (four bound values each, far below SQLite's
/// 32,766-variable limit).
const STEP_ROWS_PER_INSERT: usize = 64;

struct NewRow {
    step: u64,
    time: Option<f64>,
    cells: Vec<u32>,
    blob: Vec<u8>,
}

impl Store {
    /// Stores a validated batch (steps strictly increasing) for `run_id`.
    pub async fn ingest(
        &self,
        run_id: &RunId,
        records: &[StepRecord],
    ) -> StoreResult<IngestOutcome> {
        let mut guard = self.lock_writer().await?;
        guard
            .run_state(run_id.as_str(), self.detection.thresholds)
            .await?;
        let Writer {
            conn,
            runs,
            compressor,
            decompressor,
        } = &mut *guard;
        let state = runs.get_mut(run_id.as_str()).expect("loaded above");

        // Steps strictly increase within a batch, so the duplicates are a prefix.
        let first_new = records
            .iter()
            .position(|r| state.last_step.is_none_or(|last| r.step > last))
            .unwrap_or(records.len());
        let (duplicates, new) = records.split_at(first_new);
        if new.is_empty() {
            return Ok(IngestOutcome {
                accepted: 0,
                duplicates: duplicates.len(),
                last_step: state.last_step,
                values: 0,
            });
        }
        // The registration in force at each new record: v1.1 amendments take effect
        // at the record that carries them. A duplicate's amendment was applied when
        // it was first stored.
        let registries = registries_in_force(state, new, first_new, self.detection.thresholds)?;

        let mut assigner = ColumnAssigner::new(&state.columns);
        let mut rows = Vec::with_capacity(new.len());
        for record in new {
            let cells = flatten(record, &registries[rows.len()].module_groups, &mut assigner);
            let blob = codec::encode(&cells, compressor)?;
            rows.push(NewRow {
                step: record.step,
                time: record.time.map(|t| t.unix_seconds()),
                cells,
                blob,
            });
        }
        let added = assigner.added();

        let mut tx = conn.begin().await?;
        for record in new {
            if let Some(amendment) = &record.amend {
                let body = serde_json::to_string(amendment).context("encoding an amendment")?;
                sqlx::query("INSERT INTO amendments (run, step, body) VALUES (?, ?, ?)")
                    .bind(state.key)
                    .bind(record.step as i64)
                    .bind(body)
                    .execute(&mut *tx)
                    .await?;
            }
        }
        for (kind, subject, position) in &added {
            sqlx::query("INSERT INTO columns (run, col, kind, subject) VALUES (?, ?, ?, ?)")
                .bind(state.key)
                .bind(*position as i64)
                .bind(kind.as_str())
                .bind(subject)
                .execute(&mut *tx)
                .await?;
        }
        // Many rows per statement: each statement is a round trip to sqlx's worker
        // thread (two context switches), which one row per step paid 50 times a
        // batch. Full chunks share one statement text, which sqlx caches prepared.
        for chunk in rows.chunks(STEP_ROWS_PER_INSERT) {
            let mut insert =
                QueryBuilder::<Sqlite>::new("INSERT INTO steps (run, step, time, vals) ");
            insert.push_values(chunk, |mut values, row| {
                values
                    .push_bind(state.key)
                    .push_bind(row.step as i64)
                    .push_bind(row.time)
                    .push_bind(row.blob.as_slice());
            });
            insert.build().execute(&mut *tx).await?;
        }
        for width in ROLLUP_WIDTHS {
            update_rollups(&mut tx, state, width, &rows, compressor, decompressor).await?;
        }

        let mut detectors = state.detectors.clone();
        let mut open = state.open.clone();
        let mut opened = Vec::new();
        let mut resolved = Vec::new();
        let mut in_force = &state.registry;
        for (record, registry) in new
            .iter()
            .zip(&registries)
            .filter(|_| self.detection.enabled)
        {
            let mut transitions = Vec::new();
            if !Arc::ptr_eq(in_force, registry) {
                transitions =
                    detectors.on_amendment(&in_force.context, &registry.context, record.step);
                in_force = registry;
            }
            transitions.extend(detectors.on_step(&registry.context, record));
            for transition in transitions {
                match transition {
                    Transition::Open(alert) => {
                        let id = alerts::insert_opened(&mut tx, state.key, &alert).await?;
                        webhooks::enqueue_opened(&mut tx, state.key, id, &alert).await?;
                        open.insert(
                            (alert.kind, alert.subject.clone()),
                            OpenEpisode {
                                id,
                                last_step: alert.step,
                            },
                        );
                        opened.push(Alert::from_opened(id, run_id.as_str(), &alert));
                    }
                    Transition::Resolve {
                        kind,
                        subject,
                        step,
                    } => {
                        if let Some(episode) = open.remove(&(kind, subject)) {
                            alerts::resolve(&mut tx, episode, step).await?;
                            webhooks::enqueue_resolved(&mut tx, episode.id).await?;
                            resolved.push(episode.id);
                        }
                    }
                }
            }
            for episode in open.values_mut() {
                episode.last_step = Some(record.step);
            }
        }
        for episode in open.values() {
            alerts::extend(&mut tx, *episode).await?;
        }
        let detector_state =
            serde_json::to_string(&detectors).context("encoding detector state")?;
        sqlx::query(
            "INSERT INTO detector_state (run, state) VALUES (?, ?) \
             ON CONFLICT (run) DO UPDATE SET state = excluded.state",
        )
        .bind(state.key)
        .bind(detector_state)
        .execute(&mut *tx)
        .await?;
        let last = rows.last().expect("at least one new row").step;
        sqlx::query(
            "UPDATE runs SET first_step = COALESCE(first_step, ?), last_step = ?, \
             last_seen = ?, step_count = step_count + ? WHERE id = ?",
        )
        .bind(rows[0].step as i64)
        .bind(last as i64)
        .bind(now_seconds())
        .bind(rows.len() as i64)
        .bind(state.key)
        .execute(&mut *tx)
        .await?;
        state.commit_in_doubt = true;
        tx.commit().await?;

        for (kind, subject, position) in added {
            state.columns.restore(kind, &subject, position);
        }
        state.commit_in_doubt = false;
        state.last_step = Some(last);
        state.registry = registries.last().expect("at least one new record").clone();
        state.detectors = detectors;
        state.open = open;
        let outcome = IngestOutcome {
            accepted: rows.len(),
            duplicates: duplicates.len(),
            last_step: Some(last),
            values: rows
                .iter()
                .map(|row| {
                    row.cells
                        .iter()
                        .filter(|c| **c != codec::ABSENT_BITS)
                        .count()
                })
                .sum(),
        };
        drop(guard);

        self.announce(Event::Step {
            run_id: run_id.as_str().to_owned(),
            last_step: last,
            accepted: outcome.accepted,
        });
        for alert in opened {
            tracing::warn!(run_id = %run_id, kind = %alert.kind, subject = %alert.subject, "alert opened: {}", alert.title);
            self.announce(Event::Alert {
                action: AlertAction::Opened,
                alert: Box::new(alert),
            });
        }
        for id in resolved {
            if let Some(alert) = self.alert(id).await? {
                tracing::info!(run_id = %run_id, kind = %alert.kind, subject = %alert.subject, "alert resolved");
                self.announce(Event::Alert {
                    action: AlertAction::Resolved,
                    alert: Box::new(alert),
                });
            }
        }
        Ok(outcome)
    }
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
) -> StoreResult<Vec<Arc<Registry>>> {
    let mut current = state.registry.clone();
    let mut registries = Vec::with_capacity(new.len());
    for (k, record) in new.iter().enumerate() {
        let i = offset + k;
        if let Some(amendment) = &record.amend {
            let amended = current.amended(amendment, thresholds);
            check_param_groups(&amended, amendment, i)?;
            current = Arc::new(amended);
        }
        for (j, param) in record.params.iter().enumerate() {
            if !current.params.contains(&param.name) {
                return Err(StoreError::Invalid(InvalidBody::new(
                    format!("steps[{i}].params[{j}].name"),
                    format!(
                        "parameter {:?} is not in the run's registration at step {}: register \
                         every parameter the model has in PUT /api/v1/runs/{{run_id}}, or add \
                         it with an amendment (`amend`) in this or an earlier record",
                        param.name, record.step
                    ),
                )));
            }
        }
        registries.push(current.clone());
    }
    Ok(registries)
}

/// An amended parameter that names an optimizer parameter group must name one the
/// registration (as amended) has, when it lists any.
fn check_param_groups(amended: &Registry, amendment: &Amendment, i: usize) -> StoreResult<()> {
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
            return Err(StoreError::Invalid(InvalidBody::new(
                format!("steps[{i}].amend.params[{j}].param_group"),
                format!(
                    "parameter group {group:?} is neither in the registration nor in this \
                     amendment's param_groups"
                ),
            )));
        }
    }
    Ok(())
}

/// Folds the new rows into the rollup buckets of one level.
async fn update_rollups(
    conn: &mut SqliteConnection,
    state: &RunState,
    width: u64,
    rows: &[NewRow],
    compressor: &mut zstd::bulk::Compressor<'static>,
    decompressor: &mut zstd::bulk::Decompressor<'static>,
) -> StoreResult<()> {
    // Only the bucket holding the run's previous last step can already exist: steps
    // only grow.
    let open_bucket = state.last_step.map(|s| s / width);
    for group in rows.chunk_by(|a, b| a.step / width == b.step / width) {
        let bucket = group[0].step / width;
        let mut summary = BucketSummary::default();
        if open_bucket == Some(bucket) {
            let chunks =
                (state.columns.column_count() as usize).div_ceil(super::rollup::CHUNK_COLUMNS);
            for chunk in 0..chunks {
                let stored: Option<Vec<u8>> = sqlx::query_scalar(
                    "SELECT summary FROM rollups WHERE run = ? AND width = ? AND chunk = ? \
                     AND bucket = ?",
                )
                .bind(state.key)
                .bind(width as i64)
                .bind(chunk as i64)
                .bind(bucket as i64)
                .fetch_optional(&mut *conn)
                .await?;
                if let Some(blob) = stored {
                    summary
                        .restore_chunk(chunk, &blob, decompressor)
                        .with_context(|| {
                            format!("reading rollup bucket {bucket} of width {width}")
                        })?;
                }
            }
        }
        for row in group {
            summary.add_row((row.step - bucket * width) as u16, &row.cells);
        }
        for chunk in 0..summary.chunk_count() {
            let blob = summary.encode_chunk(chunk, compressor)?;
            sqlx::query(
                "INSERT INTO rollups (run, width, chunk, bucket, summary) VALUES (?, ?, ?, ?, ?) \
                 ON CONFLICT (run, width, chunk, bucket) DO UPDATE SET summary = excluded.summary",
            )
            .bind(state.key)
            .bind(width as i64)
            .bind(chunk as i64)
            .bind(bucket as i64)
            .bind(blob)
            .execute(&mut *conn)
            .await?;
        }
    }
    Ok(())
}
