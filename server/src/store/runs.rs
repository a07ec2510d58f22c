//! Registering, listing, reading and deleting runs.

use anyhow::Context;
use gradflow_protocol::{Amendment, RunId, RunRegistration};
use serde_json::Value;
use sqlx::Connection;

use super::alerts::{self, Alert, OpenEpisode};
use super::events::{AlertAction, Event};
use super::{RunState, Store, StoreError, StoreResult, Writer, now_seconds, webhooks};
use crate::detect::registration;

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
/// report every step send a batch every few seconds at most; a minute of silence
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
                          last_seen, step_count, finished_at FROM runs WHERE run_id = ?";

impl Store {
    /// Registers `run_id`. Idempotent: the same registration again returns the stored
    /// run and `false`; a different one for an existing run is a conflict that names
    /// the first field that differs.
    pub async fn register_run(
        &self,
        run_id: &RunId,
        registration: RunRegistration,
    ) -> StoreResult<(StoredRun, bool)> {
        let registration = registration.normalized();
        let canonical =
            serde_json::to_string(&registration).context("serializing a registration")?;
        let mut writer = self.lock_writer().await?;
        let existing: Option<RunRow> = sqlx::query_as(SELECT_RUN)
            .bind(run_id.as_str())
            .fetch_optional(&mut writer.conn)
            .await?;
        if let Some(row) = existing {
            let stored = stored_run(row)?;
            // Compared with the registration as first sent: a client that restarts
            // and registers again with its original body is welcome.
            if stored_canonical(&stored)? == canonical {
                return Ok((self.run(run_id).await?, false));
            }
            let old = serde_json::to_value(&stored.registration).context("re-encoding")?;
            let new = serde_json::to_value(&registration).context("re-encoding")?;
            let path = first_difference(&old, &new, String::new()).unwrap_or_default();
            return Err(StoreError::Conflict {
                message: format!(
                    "run {run_id} is already registered with a different body{}; to change \
                     the registration while the run trains, send the change as an amendment \
                     (`amend` in a step record, in force from that record's step); otherwise \
                     register under a new run id, or DELETE the run first",
                    if path.is_empty() {
                        String::new()
                    } else {
                        format!(" (first difference at {path})")
                    }
                ),
                path,
            });
        }
        let created_at = now_seconds();
        let mut tx = writer.conn.begin().await?;
        let key: i64 = sqlx::query_scalar(
            "INSERT INTO runs (run_id, name, registration, created_at) VALUES (?, ?, ?, ?) \
             RETURNING id",
        )
        .bind(run_id.as_str())
        .bind(registration.name.as_deref())
        .bind(&canonical)
        .bind(created_at)
        .fetch_one(&mut *tx)
        .await?;
        webhooks::add_run_targets(&mut tx, key, &registration.webhooks).await?;
        // What the registration alone proves wrong is known before the first step.
        let mut state = RunState::new(key, &registration, self.detection.thresholds);
        let mut opened = Vec::new();
        let checks = if self.detection.enabled {
            registration::check(&state.registry.context)
        } else {
            Vec::new()
        };
        for alert in checks {
            let id = alerts::insert_opened(&mut tx, key, &alert).await?;
            webhooks::enqueue_opened(&mut tx, key, id, &alert).await?;
            state.open.insert(
                (alert.kind, alert.subject.clone()),
                OpenEpisode {
                    id,
                    last_step: None,
                },
            );
            opened.push(Alert::from_opened(id, run_id.as_str(), &alert));
        }
        tx.commit().await?;
        writer.runs.insert(run_id.as_str().to_owned(), state);
        drop(writer);
        tracing::info!(run_id = %run_id, params = registration.params.len(), alerts = opened.len(), "run registered");
        for alert in opened {
            tracing::warn!(run_id = %run_id, kind = %alert.kind, subject = %alert.subject, "alert opened: {}", alert.title);
            self.announce(Event::Alert {
                action: AlertAction::Opened,
                alert: Box::new(alert),
            });
        }
        Ok((
            StoredRun {
                run_id: run_id.as_str().to_owned(),
                registration,
                amendments: Vec::new(),
                created_at,
                first_step: None,
                last_step: None,
                last_seen: None,
                step_count: 0,
                finished_at: None,
            },
            true,
        ))
    }

    pub async fn run(&self, run_id: &RunId) -> StoreResult<StoredRun> {
        let row: Option<RunRow> = sqlx::query_as(SELECT_RUN)
            .bind(run_id.as_str())
            .fetch_optional(&self.read)
            .await?;
        let mut run = match row {
            Some(row) => stored_run(row)?,
            None => return Err(StoreError::RunNotFound(run_id.as_str().to_owned())),
        };
        let rows: Vec<(i64, String)> = sqlx::query_as(
            "SELECT a.step, a.body FROM amendments a JOIN runs r ON r.id = a.run \
             WHERE r.run_id = ? ORDER BY a.step",
        )
        .bind(run_id.as_str())
        .fetch_all(&self.read)
        .await?;
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
        Ok(sqlx::query_as(
            "SELECT run_id, name, created_at, last_step, last_seen, step_count, finished_at \
             FROM runs ORDER BY created_at DESC, id DESC",
        )
        .fetch_all(&self.read)
        .await?)
    }

    /// Marks the run finished now (again, if it was: a resumed run may finish twice).
    pub async fn finish_run(&self, run_id: &RunId) -> StoreResult<StoredRun> {
        let mut writer = self.lock_writer().await?;
        let updated = sqlx::query("UPDATE runs SET finished_at = ? WHERE run_id = ?")
            .bind(now_seconds())
            .bind(run_id.as_str())
            .execute(&mut writer.conn)
            .await?
            .rows_affected();
        drop(writer);
        if updated == 0 {
            return Err(StoreError::RunNotFound(run_id.as_str().to_owned()));
        }
        tracing::info!(run_id = %run_id, "run finished");
        self.run(run_id).await
    }

    /// Removes the run and everything of it, and gives the space back to the file
    /// system; returns how many steps went with it.
    pub async fn delete_run(&self, run_id: &RunId) -> StoreResult<u64> {
        let mut writer = self.lock_writer().await?;
        let row: Option<(i64, i64)> =
            sqlx::query_as("SELECT id, step_count FROM runs WHERE run_id = ?")
                .bind(run_id.as_str())
                .fetch_optional(&mut writer.conn)
                .await?;
        let Some((key, step_count)) = row else {
            return Err(StoreError::RunNotFound(run_id.as_str().to_owned()));
        };
        writer.delete_run(key, run_id.as_str()).await?;
        writer.free_space().await;
        tracing::info!(run_id = %run_id, steps = step_count, "run deleted");
        Ok(step_count as u64)
    }

    /// Retention: deletes every run with nothing received since `cutoff` (Unix
    /// seconds; the registration counts for a run without steps), then frees the
    /// space. Returns the runs deleted with their step counts.
    pub async fn expire_runs(&self, cutoff: f64) -> StoreResult<Vec<(String, u64)>> {
        let mut writer = self.lock_writer().await?;
        let expired: Vec<(i64, String, i64)> = sqlx::query_as(
            "SELECT id, run_id, step_count FROM runs \
             WHERE coalesce(last_seen, created_at) < ? ORDER BY id",
        )
        .bind(cutoff)
        .fetch_all(&mut writer.conn)
        .await?;
        let mut deleted = Vec::with_capacity(expired.len());
        for (key, run_id, step_count) in expired {
            writer.delete_run(key, &run_id).await?;
            tracing::info!(run_id = %run_id, steps = step_count, "run expired (--retain-days)");
            deleted.push((run_id, step_count as u64));
        }
        if !deleted.is_empty() {
            writer.free_space().await;
        }
        Ok(deleted)
    }
}

impl Writer {
    /// Deletes run `key` and all of its rows in one transaction.
    async fn delete_run(&mut self, key: i64, run_id: &str) -> StoreResult<()> {
        let mut tx = self.conn.begin().await?;
        for table in [
            "alerts",
            "detector_state",
            "rollups",
            "steps",
            "columns",
            "amendments",
        ] {
            sqlx::query(&format!("DELETE FROM {table} WHERE run = ?"))
                .bind(key)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query("DELETE FROM runs WHERE id = ?")
            .bind(key)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        self.runs.remove(run_id);
        Ok(())
    }

    /// Returns free pages to the file system: the database is created with
    /// `auto_vacuum = INCREMENTAL`, so `incremental_vacuum` moves pages down and
    /// truncates, and a checkpoint carries the smaller file out of the WAL. Best
    /// effort: the pages stay reusable if it cannot run now (a reader holds the WAL).
    async fn free_space(&mut self) {
        for pragma in [
            "PRAGMA incremental_vacuum",
            "PRAGMA wal_checkpoint(TRUNCATE)",
        ] {
            if let Err(error) = sqlx::query(pragma).execute(&mut self.conn).await {
                tracing::warn!(%error, pragma, "could not free the space of deleted runs yet");
            }
        }
    }
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
    conn: &mut sqlx::SqliteConnection,
    key: i64,
) -> StoreResult<Vec<(u64, Amendment)>> {
    let rows: Vec<(i64, String)> =
        sqlx::query_as("SELECT step, body FROM amendments WHERE run = ? ORDER BY step")
            .bind(key)
            .fetch_all(conn)
            .await?;
    decode_amendments(rows, &format!("#{key}"))
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

fn stored_canonical(run: &StoredRun) -> StoreResult<String> {
    Ok(serde_json::to_string(&run.registration).context("serializing a registration")?)
}

/// The path of the first place where two JSON values differ, in the protocol's path
/// notation (`params[3].dtype`), or `None` when they are equal.
fn first_difference(a: &Value, b: &Value, path: String) -> Option<String> {
    let join = |key: &str| {
        if path.is_empty() {
            key.to_owned()
        } else {
            format!("{path}.{key}")
        }
    };
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter()
                .find_map(|key| match (x.get(key), y.get(key)) {
                    (Some(u), Some(v)) => first_difference(u, v, join(key)),
                    _ => Some(join(key)),
                })
        }
        (Value::Array(x), Value::Array(y)) => {
            let common = x
                .iter()
                .zip(y)
                .enumerate()
                .find_map(|(i, (u, v))| first_difference(u, v, format!("{path}[{i}]")));
            common.or_else(|| {
                (x.len() != y.len()).then(|| format!("{path}[{}]", x.len().min(y.len())))
            })
        }
        _ => (a != b).then_some(path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn first_difference_names_the_field() {
        let a = json!({"params": [{"name": "a", "dtype": "f32"}], "name": "x"});
        let b = json!({"params": [{"name": "a", "dtype": "bf16"}], "name": "x"});
        assert_eq!(first_difference(&a, &a, String::new()), None);
        assert_eq!(
            first_difference(&a, &b, String::new()).as_deref(),
            Some("params[0].dtype")
        );
        let c = json!({"params": [{"name": "a", "dtype": "f32"}, {"name": "b"}], "name": "x"});
        assert_eq!(
            first_difference(&a, &c, String::new()).as_deref(),
            Some("params[1]")
        );
        let d = json!({"params": [{"name": "a", "dtype": "f32"}]});
        assert_eq!(
            first_difference(&a, &d, String::new()).as_deref(),
            Some("name")
        );
    }
}
