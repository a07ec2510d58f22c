//! Alerts as stored: written by the batch and registration transactions from the
//! detectors' transitions (each queueing its webhook notifications in the same
//! transaction), read back with filters.

use std::collections::HashMap;

use serde::Serialize;
use serde_json::Value;

use super::{Store, StoreError, StoreResult, Tx, now_seconds, on_tx, with_reader};
use gradflow_core::model::alert::{AlertKind, AlertStatus, Opened, Severity};

/// An alert as the API shows it (docs/PROTOCOL.md's alert object), its kind, severity
/// and status typed; serialised as their names.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Alert {
    pub id: i64,
    pub run_id: String,
    #[schema(schema_with = kind_schema)]
    pub kind: AlertKind,
    pub severity: Severity,
    pub subject: String,
    #[schema(schema_with = status_schema)]
    pub status: AlertStatus,
    pub first_step: Option<i64>,
    pub last_step: Option<i64>,
    pub resolved_step: Option<i64>,
    /// The step whose arrival opened the alert (it completed the threshold).
    pub opened_step: Option<i64>,
    pub title: String,
    pub detail: String,
    pub fix: String,
    #[schema(value_type = Object)]
    pub evidence: Value,
}

/// The API document's `kind`: one of the alert table's names.
fn kind_schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    gradflow_protocol::vocabulary::names_schema::<AlertKind>()
}

/// The API document's `status`: `open` or `resolved`.
fn status_schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    gradflow_protocol::vocabulary::names_schema::<AlertStatus>()
}

/// An alert's row as stored: names where the API type has enums.
#[derive(sqlx::FromRow)]
struct AlertRow {
    id: i64,
    run_id: String,
    kind: String,
    severity: String,
    subject: String,
    status: String,
    first_step: Option<i64>,
    last_step: Option<i64>,
    resolved_step: Option<i64>,
    opened_step: Option<i64>,
    title: String,
    detail: String,
    fix: String,
    #[sqlx(json)]
    evidence: Value,
}

impl TryFrom<AlertRow> for Alert {
    type Error = StoreError;

    /// Fails only on a name this server does not know: a row a newer server wrote
    /// (read by an older replica during an upgrade) or a damaged one.
    fn try_from(row: AlertRow) -> StoreResult<Alert> {
        let unknown = |what: &str, value: &str| {
            StoreError::Internal(anyhow::anyhow!(
                "alert {} has {what} {value:?}, which this server does not know \
                 (written by a newer version?)",
                row.id
            ))
        };
        Ok(Alert {
            kind: AlertKind::parse(&row.kind).ok_or_else(|| unknown("kind", &row.kind))?,
            severity: Severity::parse(&row.severity)
                .ok_or_else(|| unknown("severity", &row.severity))?,
            status: AlertStatus::parse(&row.status)
                .ok_or_else(|| unknown("status", &row.status))?,
            id: row.id,
            run_id: row.run_id,
            subject: row.subject,
            first_step: row.first_step,
            last_step: row.last_step,
            resolved_step: row.resolved_step,
            opened_step: row.opened_step,
            title: row.title,
            detail: row.detail,
            fix: row.fix,
            evidence: row.evidence,
        })
    }
}

/// Rows into alerts (see [`Alert::try_from`]).
fn typed(rows: Vec<AlertRow>) -> StoreResult<Vec<Alert>> {
    rows.into_iter().map(Alert::try_from).collect()
}

const ALERT_COLUMNS: &str = "a.id, r.run_id, a.kind, a.severity, a.subject, a.status, \
    a.first_step, a.last_step, a.resolved_step, a.opened_step, a.title, a.detail, a.fix, \
    a.evidence";

impl Alert {
    /// The alert a detector just opened, as stored under `id`.
    pub(super) fn from_opened(id: i64, run_id: &str, opened: &Opened) -> Alert {
        let step = opened.step.map(|s| s as i64);
        Alert {
            opened_step: step,
            id,
            run_id: run_id.to_owned(),
            kind: opened.kind,
            severity: opened.severity,
            subject: opened.subject.clone(),
            status: AlertStatus::Open,
            first_step: opened.first_step.map(|s| s as i64),
            last_step: step,
            resolved_step: None,
            title: opened.title.clone(),
            detail: opened.detail.clone(),
            fix: opened.fix.clone(),
            evidence: opened.evidence.clone(),
        }
    }
}

/// Which alerts to list.
#[derive(Debug, Clone, Default)]
pub struct AlertFilter {
    pub run_id: Option<String>,
    /// `None`: open and resolved.
    pub open: Option<bool>,
    pub kind: Option<AlertKind>,
    pub severity: Option<Severity>,
}

/// Open alerts of one run by severity.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct OpenAlertCounts {
    pub critical: u64,
    pub warning: u64,
    pub info: u64,
}

impl OpenAlertCounts {
    /// Counts `n` more alerts of `severity`.
    pub fn add(&mut self, severity: Severity, n: u64) {
        match severity {
            Severity::Critical => self.critical += n,
            Severity::Warning => self.warning += n,
            Severity::Info => self.info += n,
        }
    }
}

/// Inserts a newly opened alert; returns its id.
pub(super) async fn insert_opened(tx: &mut Tx, run: i64, opened: &Opened) -> StoreResult<i64> {
    let step = opened.step.map(|s| s as i64);
    Ok(on_tx!(tx, |c| {
        sqlx::query_scalar(
            "INSERT INTO alerts (run, kind, severity, subject, status, first_step, opened_step, \
             last_step, title, detail, fix, evidence, opened_at) \
             VALUES ($1, $2, $3, $4, 'open', $5, $6, $6, $7, $8, $9, $10, $11) RETURNING id",
        )
        .bind(run)
        .bind(opened.kind.as_str())
        .bind(opened.severity.as_str())
        .bind(&opened.subject)
        .bind(opened.first_step.map(|s| s as i64))
        .bind(step)
        .bind(&opened.title)
        .bind(&opened.detail)
        .bind(&opened.fix)
        .bind(sqlx::types::Json(&opened.evidence))
        .bind(now_seconds())
        .fetch_one(&mut *c)
        .await?
    }))
}

/// Marks alert `id` resolved at `step`, with `last_step` the last step it held on.
/// An open alert: its run's key, its kind and its subject.
pub(super) type OpenAlert<'a> = (i64, AlertKind, &'a str);

/// Resolves the open alert `open`; its id (none if it was not open).
pub(super) async fn resolve(
    tx: &mut Tx,
    open: OpenAlert<'_>,
    step: u64,
    last_step: Option<u64>,
) -> StoreResult<Vec<i64>> {
    let (run, kind, subject) = open;
    Ok(on_tx!(tx, |c| {
        sqlx::query_scalar(
            "UPDATE alerts SET status = 'resolved', resolved_step = $1, last_step = $2, \
             resolved_at = $3 WHERE run = $4 AND kind = $5 AND subject = $6 \
             AND status = 'open' RETURNING id",
        )
        .bind(step as i64)
        .bind(last_step.map(|s| s as i64))
        .bind(now_seconds())
        .bind(run)
        .bind(kind.as_str())
        .bind(subject)
        .fetch_all(&mut *c)
        .await?
    }))
}

/// One alert by id, inside a transaction.
pub(super) async fn read_one(tx: &mut Tx, id: i64) -> StoreResult<Option<Alert>> {
    let row: Option<AlertRow> = on_tx!(tx, |c| {
        sqlx::query_as(&format!(
            "SELECT {ALERT_COLUMNS} FROM alerts a JOIN runs r ON r.id = a.run WHERE a.id = $1"
        ))
        .bind(id)
        .fetch_optional(&mut *c)
        .await?
    });
    row.map(Alert::try_from).transpose()
}

/// Moves an open alert's `last_step` forward.
pub(super) async fn extend(
    tx: &mut Tx,
    open: OpenAlert<'_>,
    last_step: Option<u64>,
) -> StoreResult<()> {
    let (run, kind, subject) = open;
    on_tx!(tx, |c| {
        sqlx::query(
            "UPDATE alerts SET last_step = $1 \
             WHERE run = $2 AND kind = $3 AND subject = $4 AND status = 'open'",
        )
        .bind(last_step.map(|s| s as i64))
        .bind(run)
        .bind(kind.as_str())
        .bind(subject)
        .execute(&mut *c)
        .await?;
    });
    Ok(())
}

impl Store {
    /// Alerts matching `filter`, oldest `first_step` first (registration alerts, which
    /// have none, before all others).
    pub async fn alerts(&self, filter: &AlertFilter) -> StoreResult<Vec<Alert>> {
        self.check_ready()?;
        if let Some(run_id) = &filter.run_id {
            self.require_run(run_id).await?;
        }
        let sql = format!(
            "SELECT {ALERT_COLUMNS} FROM alerts a JOIN runs r ON r.id = a.run \
             WHERE (CAST($1 AS TEXT) IS NULL OR r.run_id = $1) \
             AND (CAST($2 AS TEXT) IS NULL OR a.status = $2) \
             AND (CAST($3 AS TEXT) IS NULL OR a.kind = $3) \
             AND (CAST($4 AS TEXT) IS NULL OR a.severity = $4) \
             ORDER BY a.first_step IS NOT NULL, a.first_step, a.id"
        );
        let rows: Vec<AlertRow> = with_reader!(self, |pool| {
            sqlx::query_as(&sql)
                .bind(filter.run_id.as_deref())
                .bind(filter.open.map(|open| {
                    if open {
                        AlertStatus::Open
                    } else {
                        AlertStatus::Resolved
                    }
                    .as_str()
                }))
                .bind(filter.kind.map(AlertKind::as_str))
                .bind(filter.severity.map(Severity::as_str))
                .fetch_all(pool)
                .await?
        });
        typed(rows)
    }

    /// `RunNotFound` unless `run_id` is registered.
    pub(super) async fn require_run(&self, run_id: &str) -> StoreResult<()> {
        let exists: Option<i64> = with_reader!(self, |pool| {
            sqlx::query_scalar("SELECT id FROM runs WHERE run_id = $1")
                .bind(run_id)
                .fetch_optional(pool)
                .await?
        });
        match exists {
            Some(_) => Ok(()),
            None => Err(StoreError::RunNotFound(run_id.to_owned())),
        }
    }

    /// One alert by id.
    pub async fn alert(&self, id: i64) -> StoreResult<Option<Alert>> {
        self.check_ready()?;
        let row: Option<AlertRow> = with_reader!(self, |pool| {
            sqlx::query_as(&format!(
                "SELECT {ALERT_COLUMNS} FROM alerts a JOIN runs r ON r.id = a.run WHERE a.id = $1"
            ))
            .bind(id)
            .fetch_optional(pool)
            .await?
        });
        row.map(Alert::try_from).transpose()
    }

    /// Open alerts by severity, for every run that has any (or only `run_id`'s).
    pub async fn open_alert_counts(
        &self,
        run_id: Option<&str>,
    ) -> StoreResult<HashMap<String, OpenAlertCounts>> {
        self.check_ready()?;
        let rows: Vec<(String, String, i64)> = with_reader!(self, |pool| {
            sqlx::query_as(
                "SELECT r.run_id, a.severity, count(*) FROM alerts a JOIN runs r ON r.id = a.run \
                 WHERE a.status = 'open' AND (CAST($1 AS TEXT) IS NULL OR r.run_id = $1) \
                 GROUP BY r.run_id, a.severity",
            )
            .bind(run_id)
            .fetch_all(pool)
            .await?
        });
        let mut counts: HashMap<String, OpenAlertCounts> = HashMap::new();
        for (run_id, severity, n) in rows {
            // A severity this server does not know (a newer one's) is left out.
            if let Some(severity) = Severity::parse(&severity) {
                counts.entry(run_id).or_default().add(severity, n as u64);
            }
        }
        Ok(counts)
    }

    /// Open alerts across all runs by (kind, severity), for the server's metrics.
    pub async fn open_alerts_by_kind(&self) -> StoreResult<Vec<(String, String, u64)>> {
        self.check_ready()?;
        let rows: Vec<(String, String, i64)> = with_reader!(self, |pool| {
            sqlx::query_as(
                "SELECT kind, severity, count(*) FROM alerts WHERE status = 'open' \
                 GROUP BY kind, severity ORDER BY kind, severity",
            )
            .fetch_all(pool)
            .await?
        });
        Ok(rows
            .into_iter()
            .map(|(kind, severity, n)| (kind, severity, n as u64))
            .collect())
    }
}
