//! Registering, listing, reading and deleting runs.

use anyhow::Context;
use gradflow_protocol::{Amendment, RunId, RunRegistration};

use super::notify::{self, Notice};
use super::{
    Db, Store, StoreError, StoreResult, Tx, alerts, now_seconds, on_tx, webhooks, with_reader,
};
use gradflow_core::model::alert::Opened;

/// A run as stored: its registration (with the protocol's defaults written out) and
/// where its stream stands.
#[derive(Debug, Clone)]
pub struct StoredRun {
    pub run_id: String,
    /// The registration in force: as first sent, with `amendments` applied.
    pub registration: RunRegistration,
    /// v1.1 amendments with the step each took effect at, oldest first.
    pub amendments: Vec<(u64, Amendment)>,
    pub created_at: f64,
    pub first_step: Option<u64>,
    pub last_step: Option<u64>,
    pub last_seen: Option<f64>,
    pub step_count: u64,
    /// When the trainer said the run had finished (server clock).
    pub finished_at: Option<f64>,
}

impl StoredRun {
    pub fn status(&self, now: f64) -> RunStatus {
        RunStatus::of(self.finished_at, self.last_seen, self.created_at, now)
    }
}

/// A line of the runs list.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct RunSummary {
    pub run_id: String,
    pub name: Option<String>,
    pub created_at: f64,
    pub last_step: Option<i64>,
    pub last_seen: Option<f64>,
    pub step_count: i64,
    pub finished_at: Option<f64>,
}

impl RunSummary {
    pub fn status(&self, now: f64) -> RunStatus {
        RunStatus::of(self.finished_at, self.last_seen, self.created_at, now)
    }
}

/// Where a run stands, as the runs list and the dashboard show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// Its trainer said it finished, and nothing arrived since.
    Finished,
    /// Registered or sent a batch within the last [`STALE_AFTER_SECONDS`].
    Live,
    /// Neither: its trainer went quiet without saying it finished.
    Stale,
}

/// How long a run may go without a batch before it counts as stale. Trainers that
/// report every step send a batch every few seconds at most; two minutes of silence
/// longer than any checkpoint pause is worth a look.
pub const STALE_AFTER_SECONDS: f64 = 120.0;

impl RunStatus {
    fn of(finished_at: Option<f64>, last_seen: Option<f64>, created_at: f64, now: f64) -> Self {
        let last_heard = last_seen.unwrap_or(created_at);
        match finished_at {
            Some(finished) if finished >= last_heard => RunStatus::Finished,
            _ if now - last_heard <= STALE_AFTER_SECONDS => RunStatus::Live,
            _ => RunStatus::Stale,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Finished => "finished",
            RunStatus::Live => "live",
            RunStatus::Stale => "stale",
        }
    }
}

type RunRow = (
    String,
    String,
    f64,
    Option<i64>,
    Option<i64>,
    Option<f64>,
    i64,
    Option<f64>,
);

const SELECT_RUN: &str = "SELECT run_id, registration, created_at, first_step, last_step, \
                          last_seen, step_count, finished_at FROM runs WHERE run_id = $1";

/// A run to register: its normalized registration, that registration as stored
/// (JSON), and the alerts the registration alone already proves.
pub struct NewRun<'a> {
    pub run_id: &'a str,
    pub registration: &'a RunRegistration,
    pub canonical: &'a str,
    pub alerts: &'a [Opened],
}

/// What registering came to.
#[derive(Debug)]
pub enum Registered {
    /// Registered now, under `key`, with the ids of its alerts.
    New {
        key: i64,
        created_at: f64,
        alert_ids: Vec<i64>,
    },
    /// The run already existed: as stored, its registration as first sent (no
    /// amendments applied), for the caller to compare.
    Existing(Box<StoredRun>),
}

impl Store {
    /// Registers a run unless one of its id exists (two replicas registering the
    /// same run at once both end here: one inserts, the other finds it). The run's
    /// webhooks and its registration alerts are written in the same transaction.
    pub async fn insert_run(&self, run: NewRun<'_>) -> StoreResult<Registered> {
        let created_at = now_seconds();
        let mut tx = self.begin().await?;
        let key: Option<i64> = on_tx!(&mut tx, |c| {
            sqlx::query_scalar(
                "INSERT INTO runs (run_id, name, registration, created_at) \
                 VALUES ($1, $2, $3, $4) ON CONFLICT (run_id) DO NOTHING RETURNING id",
            )
            .bind(run.run_id)
            .bind(run.registration.name.as_deref())
            .bind(run.canonical)
            .bind(created_at)
            .fetch_optional(&mut *c)
            .await?
        });
        let Some(key) = key else {
            drop(tx);
            return Ok(Registered::Existing(Box::new(
                self.stored_run(run.run_id).await?,
            )));
        };
        webhooks::add_run_targets(&mut tx, key, &run.registration.webhooks).await?;
        let mut alert_ids = Vec::with_capacity(run.alerts.len());
        for alert in run.alerts {
            let id = alerts::insert_opened(&mut tx, key, alert).await?;
            webhooks::enqueue_opened(&mut tx, key, run.run_id, id, alert).await?;
            alert_ids.push(id);
        }
        let notices: Vec<Notice> = alert_ids.iter().map(|&id| Notice::opened(id)).collect();
        notify::send(&mut tx, &notices).await?;
        tx.commit().await?;
        Ok(Registered::New {
            key,
            created_at,
            alert_ids,
        })
    }

    /// The run as stored, its registration as first sent.
    async fn stored_run(&self, run_id: &str) -> StoreResult<StoredRun> {
        let row: Option<RunRow> = with_reader!(self, |pool| {
            sqlx::query_as(SELECT_RUN)
                .bind(run_id)
                .fetch_optional(pool)
                .await?
        });
        match row {
            Some(row) => stored_run(row),
            None => Err(StoreError::RunNotFound(run_id.to_owned())),
        }
    }

    /// The run with its registration in force: as first sent, with every
    /// amendment applied.
    pub async fn run(&self, run_id: &RunId) -> StoreResult<StoredRun> {
        self.check_ready()?;
        let mut run = self.stored_run(run_id.as_str()).await?;
        let rows: Vec<(i64, String)> = with_reader!(self, |pool| {
            sqlx::query_as(
                "SELECT a.step, a.body FROM amendments a JOIN runs r ON r.id = a.run \
                 WHERE r.run_id = $1 ORDER BY a.step",
            )
            .bind(run_id.as_str())
            .fetch_all(pool)
            .await?
        });
        if !rows.is_empty() {
            run.amendments = decode_amendments(rows, run_id.as_str())?;
            for (_, amendment) in &run.amendments {
                run.registration.amend(amendment);
            }
            run.registration = run.registration.normalized();
        }
        Ok(run)
    }

    /// Every run, newest first.
    pub async fn runs(&self) -> StoreResult<Vec<RunSummary>> {
        self.check_ready()?;
        Ok(with_reader!(self, |pool| {
            sqlx::query_as(
                "SELECT run_id, name, created_at, last_step, last_seen, step_count, finished_at \
                 FROM runs ORDER BY created_at DESC, id DESC",
            )
            .fetch_all(pool)
            .await?
        }))
    }

    /// The multi-rank runs with a step that has waited for its ranks since before
    /// `cutoff` (server clock).
    pub async fn runs_waiting_since(&self, cutoff: f64) -> StoreResult<Vec<String>> {
        self.check_ready()?;
        Ok(with_reader!(self, |pool| {
            sqlx::query_scalar(
                "SELECT run_id FROM runs WHERE pending_since IS NOT NULL AND pending_since < $1",
            )
            .bind(cutoff)
            .fetch_all(pool)
            .await?
        }))
    }

    /// Marks the run finished now (again, if it was: a resumed run may finish twice).
    pub async fn finish_run(&self, run_id: &RunId) -> StoreResult<StoredRun> {
        let mut tx = self.begin().await?;
        let updated = on_tx!(&mut tx, |c| {
            sqlx::query("UPDATE runs SET finished_at = $1 WHERE run_id = $2")
                .bind(now_seconds())
                .bind(run_id.as_str())
                .execute(&mut *c)
                .await?
                .rows_affected()
        });
        tx.commit().await?;
        if updated == 0 {
            return Err(StoreError::RunNotFound(run_id.as_str().to_owned()));
        }
        tracing::info!(run_id = %run_id, "run finished");
        self.run(run_id).await
    }

    /// Removes the run and everything of it, and gives the space back to the file
    /// system; returns how many steps went with it.
    pub async fn delete_run(&self, run_id: &RunId) -> StoreResult<u64> {
        let mut tx = self.begin().await?;
        let row: Option<(i64, i64)> = on_tx!(&mut tx, |c| {
            sqlx::query_as("SELECT id, step_count FROM runs WHERE run_id = $1")
                .bind(run_id.as_str())
                .fetch_optional(&mut *c)
                .await?
        });
        let Some((key, step_count)) = row else {
            return Err(StoreError::RunNotFound(run_id.as_str().to_owned()));
        };
        delete_rows(&mut tx, key).await?;
        tx.commit().await?;
        self.free_space().await;
        tracing::info!(run_id = %run_id, steps = step_count, "run deleted");
        Ok(step_count as u64)
    }

    /// Retention: deletes every run with nothing received since `cutoff` (Unix
    /// seconds; the registration counts for a run without steps), then frees the
    /// space. Returns the runs deleted with their step counts. With several
    /// replicas, one of them does it at a time (the others find nothing left).
    pub async fn expire_runs(&self, cutoff: f64) -> StoreResult<Vec<(String, u64)>> {
        let deleted = self
            .exclusively("retention", async || {
                let expired: Vec<(i64, String, i64)> = with_reader!(self, |pool| {
                    sqlx::query_as(
                        "SELECT id, run_id, step_count FROM runs \
                         WHERE coalesce(last_seen, created_at) < $1 ORDER BY id",
                    )
                    .bind(cutoff)
                    .fetch_all(pool)
                    .await?
                });
                let mut deleted = Vec::with_capacity(expired.len());
                for (key, run_id, step_count) in expired {
                    let mut tx = self.begin().await?;
                    delete_rows(&mut tx, key).await?;
                    tx.commit().await?;
                    tracing::info!(run_id = %run_id, steps = step_count, "run expired (--retain-days)");
                    deleted.push((run_id, step_count as u64));
                }
                Ok(deleted)
            })
            .await?
            .unwrap_or_default();
        if !deleted.is_empty() {
            self.free_space().await;
        }
        Ok(deleted)
    }

    /// Gives the space of deleted rows back to the file system (SQLite;
    /// PostgreSQL's autovacuum reuses it). Best effort.
    async fn free_space(&self) {
        if let Db::Sqlite(db) = &self.db {
            db.free_space().await;
        }
    }
}

/// Deletes run `key` and all of its rows.
async fn delete_rows(tx: &mut Tx, key: i64) -> StoreResult<()> {
    on_tx!(tx, |c| {
        // Children first: the foreign keys would cascade, but naming every table
        // keeps the delete independent of how each database enforces them.
        for table in [
            "webhook_deliveries",
            "webhook_targets",
            "alerts",
            "detector_state",
            "rollups",
            "blocks",
            "columns",
            "amendments",
        ] {
            sqlx::query(&format!("DELETE FROM {table} WHERE run = $1"))
                .bind(key)
                .execute(&mut *c)
                .await?;
        }
        sqlx::query("DELETE FROM runs WHERE id = $1")
            .bind(key)
            .execute(&mut *c)
            .await?;
    });
    Ok(())
}

fn stored_run(row: RunRow) -> StoreResult<StoredRun> {
    let (
        run_id,
        registration,
        created_at,
        first_step,
        last_step,
        last_seen,
        step_count,
        finished_at,
    ) = row;
    let registration = serde_json::from_str(&registration)
        .with_context(|| format!("reading the stored registration of run {run_id}"))?;
    Ok(StoredRun {
        run_id,
        registration,
        amendments: Vec::new(),
        created_at,
        first_step: first_step.map(|s| s as u64),
        last_step: last_step.map(|s| s as u64),
        last_seen,
        step_count: step_count as u64,
        finished_at,
    })
}

/// The amendments of run `key`, oldest first.
pub(super) async fn load_amendments(
    tx: &mut Tx,
    key: i64,
    run_id: &str,
) -> StoreResult<Vec<(u64, Amendment)>> {
    let rows: Vec<(i64, String)> = on_tx!(tx, |c| {
        sqlx::query_as("SELECT step, body FROM amendments WHERE run = $1 ORDER BY step")
            .bind(key)
            .fetch_all(&mut *c)
            .await?
    });
    decode_amendments(rows, run_id)
}

fn decode_amendments(rows: Vec<(i64, String)>, run: &str) -> StoreResult<Vec<(u64, Amendment)>> {
    rows.into_iter()
        .map(|(step, body)| {
            let amendment = serde_json::from_str(&body)
                .with_context(|| format!("reading the amendment of run {run} at step {step}"))?;
            Ok((step as u64, amendment))
        })
        .collect()
}
