//! Webhook receivers and the delivery queue, as stored.
//!
//! A delivery row is written in the transaction that opens or resolves an alert
//! (`enqueue_opened`, `enqueue_resolved`, called by the writer beside
//! `alerts::insert_opened` and `alerts::resolve`), so an alert
//! that committed is always notified, even across a crash, and a rolled-back one
//! never is. The sender (`crate::webhooks`) claims due rows, POSTs them and records
//! each attempt here. The queue is bounded: past [`MAX_PENDING`] waiting deliveries
//! the oldest is dropped (and says so in the log), so a receiver that is down for
//! days cannot grow the database without end.

use anyhow::Context;
use gradflow_protocol::{AlertSeverity, Webhook, WebhookFormat, redact_webhook_url};
use serde::Serialize;
use sqlx::SqliteConnection;

use super::alerts::Alert;
use super::{Store, StoreError, StoreResult, now_seconds};
use crate::detect::Opened;

/// Most deliveries waiting at once; past it the oldest waiting one is dropped.
pub const MAX_PENDING: i64 = 10_000;
/// Finished deliveries (delivered, failed, dropped) kept in the log.
pub const MAX_FINISHED: i64 = 10_000;

/// Where a delivery stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeliveryStatus {
    /// Not delivered yet; attempted again at `next_attempt_at`.
    Pending,
    /// The receiver answered 2xx.
    Delivered,
    /// Given up: the receiver refused it (a 4xx other than 408 or 429) or every
    /// attempt failed.
    Failed,
    /// Dropped unsent because the queue was full.
    Dropped,
}

impl DeliveryStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Failed => "failed",
            DeliveryStatus::Dropped => "dropped",
        }
    }

    pub fn parse(text: &str) -> Option<DeliveryStatus> {
        Some(match text {
            "pending" => DeliveryStatus::Pending,
            "delivered" => DeliveryStatus::Delivered,
            "failed" => DeliveryStatus::Failed,
            "dropped" => DeliveryStatus::Dropped,
            _ => return None,
        })
    }
}

/// One delivery as the API shows it (`GET /api/v1/webhooks/deliveries`).
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct WebhookDelivery {
    pub id: i64,
    pub run_id: String,
    pub alert_id: i64,
    /// `opened` or `resolved`.
    pub action: String,
    /// The receiver's scheme, host and port: the path is left out, since webhook
    /// URLs (Slack's, for one) carry their secret there.
    #[sqlx(rename = "url")]
    #[serde(rename = "target")]
    pub target: String,
    /// `generic` or `slack`.
    pub format: String,
    /// `pending`, `delivered`, `failed` or `dropped`.
    pub status: String,
    pub attempts: i64,
    /// Server clock, Unix seconds.
    pub created_at: f64,
    /// When the next attempt is due (pending deliveries only).
    pub next_attempt_at: Option<f64>,
    pub last_attempt_at: Option<f64>,
    /// The HTTP status of the last attempt, when the receiver answered.
    pub last_status: Option<i64>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    pub delivered_at: Option<f64>,
}

/// A delivery the sender is to attempt.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct DueDelivery {
    pub id: i64,
    pub url: String,
    pub format: String,
    pub action: String,
    /// The API's alert object at the transition, as JSON.
    pub payload: String,
    pub attempts: i64,
}

/// What one attempt came to.
#[derive(Debug, Clone, PartialEq)]
pub enum Attempt {
    Delivered {
        status: u16,
    },
    /// Failed for now; try again at `retry_at` (server clock).
    Retry {
        status: Option<u16>,
        error: String,
        retry_at: f64,
    },
    /// Failed for good.
    Failed {
        status: Option<u16>,
        error: String,
    },
}

/// Which deliveries to list, newest first.
#[derive(Debug, Clone, Default)]
pub struct DeliveryFilter {
    pub run_id: Option<String>,
    pub status: Option<DeliveryStatus>,
    pub limit: u32,
}

fn severity_rank(severity: &str) -> u8 {
    match severity {
        "critical" => 0,
        "warning" => 1,
        _ => 2,
    }
}

/// The `min_severity` values that let an alert of `severity` through.
fn thresholds_admitting(severity: &str) -> &'static [&'static str] {
    match severity_rank(severity) {
        0 => &["critical", "warning", "info"],
        1 => &["warning", "info"],
        _ => &["info"],
    }
}

/// Adds a run's own receivers (from its registration).
pub(super) async fn add_run_targets(
    conn: &mut SqliteConnection,
    run: i64,
    webhooks: &[Webhook],
) -> StoreResult<()> {
    for webhook in webhooks {
        insert_target(conn, Some(run), webhook).await?;
    }
    Ok(())
}

async fn insert_target(
    conn: &mut SqliteConnection,
    run: Option<i64>,
    webhook: &Webhook,
) -> StoreResult<()> {
    sqlx::query("INSERT INTO webhook_targets (run, url, format, min_severity) VALUES (?, ?, ?, ?)")
        .bind(run)
        .bind(&webhook.url)
        .bind(webhook.format.as_str())
        .bind(
            webhook
                .min_severity
                .unwrap_or(AlertSeverity::Warning)
                .as_str(),
        )
        .execute(conn)
        .await?;
    Ok(())
}

/// Queues the notification of an alert just opened, to every receiver of its run
/// that wants its severity.
pub(super) async fn enqueue_opened(
    conn: &mut SqliteConnection,
    run: i64,
    id: i64,
    opened: &Opened,
) -> StoreResult<()> {
    if !has_targets(conn, run).await? {
        return Ok(());
    }
    let run_id: String = sqlx::query_scalar("SELECT run_id FROM runs WHERE id = ?")
        .bind(run)
        .fetch_one(&mut *conn)
        .await?;
    let alert = Alert::from_opened(id, &run_id, opened);
    enqueue(conn, run, &alert, "opened").await
}

/// Queues the notification of an alert just resolved (its row already updated).
pub(super) async fn enqueue_resolved(conn: &mut SqliteConnection, id: i64) -> StoreResult<()> {
    let run: i64 = sqlx::query_scalar("SELECT run FROM alerts WHERE id = ?")
        .bind(id)
        .fetch_one(&mut *conn)
        .await?;
    if !has_targets(conn, run).await? {
        return Ok(());
    }
    let alert = super::alerts::read_one(conn, id)
        .await?
        .with_context(|| format!("alert {id} vanished while being resolved"))?;
    enqueue(conn, run, &alert, "resolved").await
}

async fn has_targets(conn: &mut SqliteConnection, run: i64) -> StoreResult<bool> {
    let any: Option<i64> =
        sqlx::query_scalar("SELECT 1 FROM webhook_targets WHERE run IS NULL OR run = ? LIMIT 1")
            .bind(run)
            .fetch_optional(conn)
            .await?;
    Ok(any.is_some())
}

async fn enqueue(
    conn: &mut SqliteConnection,
    run: i64,
    alert: &Alert,
    action: &str,
) -> StoreResult<()> {
    let payload = serde_json::to_string(alert).context("encoding an alert for a webhook")?;
    let admitting = thresholds_admitting(&alert.severity);
    let now = now_seconds();
    let added = sqlx::query(
        "INSERT INTO webhook_deliveries (run, alert, action, url, format, payload, status, \
         created_at, next_attempt_at) \
         SELECT ?1, ?2, ?3, url, format, ?4, 'pending', ?5, ?5 FROM webhook_targets \
         WHERE (run IS NULL OR run = ?1) AND min_severity IN (?6, ?7, ?8) ORDER BY id",
    )
    .bind(run)
    .bind(alert.id)
    .bind(action)
    .bind(payload)
    .bind(now)
    .bind(admitting[0])
    .bind(admitting.get(1).copied().unwrap_or(admitting[0]))
    .bind(admitting.get(2).copied().unwrap_or(admitting[0]))
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if added == 0 {
        return Ok(());
    }
    // Bounded: the oldest waiting deliveries make room for the new ones.
    let dropped = sqlx::query(
        "UPDATE webhook_deliveries SET status = 'dropped', next_attempt_at = ?2, \
         last_error = 'dropped unsent: more than ' || ?1 || ' deliveries were waiting' \
         WHERE id IN (SELECT id FROM webhook_deliveries WHERE status = 'pending' \
         ORDER BY id DESC LIMIT -1 OFFSET ?1)",
    )
    .bind(MAX_PENDING)
    .bind(now)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if dropped > 0 {
        tracing::warn!(
            dropped,
            "webhook queue full: dropped the oldest undelivered notifications"
        );
    }
    Ok(())
}

impl Store {
    /// Replaces the server's own receivers (`--webhook`, `--slack-webhook`) with
    /// `webhooks`. Deliveries already queued keep their URL.
    pub async fn set_server_webhooks(&self, webhooks: &[Webhook]) -> StoreResult<()> {
        let mut writer = self.lock_writer().await?;
        let mut tx = sqlx::Connection::begin(&mut writer.conn).await?;
        sqlx::query("DELETE FROM webhook_targets WHERE run IS NULL")
            .execute(&mut *tx)
            .await?;
        for webhook in webhooks {
            insert_target(&mut tx, None, webhook).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Up to `limit` pending deliveries due by `now`, oldest first.
    pub async fn due_deliveries(&self, now: f64, limit: u32) -> StoreResult<Vec<DueDelivery>> {
        Ok(sqlx::query_as(
            "SELECT id, url, format, action, payload, attempts FROM webhook_deliveries \
             WHERE status = 'pending' AND next_attempt_at <= ? ORDER BY next_attempt_at, id \
             LIMIT ?",
        )
        .bind(now)
        .bind(limit)
        .fetch_all(&self.read)
        .await?)
    }

    /// When the earliest pending delivery is due, if any is pending.
    pub async fn next_delivery_due(&self) -> StoreResult<Option<f64>> {
        Ok(sqlx::query_scalar(
            "SELECT min(next_attempt_at) FROM webhook_deliveries WHERE status = 'pending'",
        )
        .fetch_one(&self.read)
        .await?)
    }

    /// Records an attempt of delivery `id`. A delivery no longer pending (dropped
    /// meanwhile, or its run deleted) is left as it is.
    pub async fn record_attempt(&self, id: i64, attempt: &Attempt) -> StoreResult<()> {
        let now = now_seconds();
        let (status, http, error, next, delivered) = match attempt {
            Attempt::Delivered { status } => (
                DeliveryStatus::Delivered,
                Some(*status),
                None,
                now,
                Some(now),
            ),
            Attempt::Retry {
                status,
                error,
                retry_at,
            } => (
                DeliveryStatus::Pending,
                *status,
                Some(error.as_str()),
                *retry_at,
                None,
            ),
            Attempt::Failed { status, error } => (
                DeliveryStatus::Failed,
                *status,
                Some(error.as_str()),
                now,
                None,
            ),
        };
        let mut writer = self.lock_writer().await?;
        sqlx::query(
            "UPDATE webhook_deliveries SET status = ?, attempts = attempts + 1, \
             last_attempt_at = ?, last_status = ?, last_error = ?, next_attempt_at = ?, \
             delivered_at = ? WHERE id = ? AND status = 'pending'",
        )
        .bind(status.as_str())
        .bind(now)
        .bind(http.map(i64::from))
        .bind(error)
        .bind(next)
        .bind(delivered)
        .bind(id)
        .execute(&mut writer.conn)
        .await?;
        Ok(())
    }

    /// Deletes all but the newest [`MAX_FINISHED`] finished deliveries.
    pub async fn prune_deliveries(&self) -> StoreResult<u64> {
        let mut writer = self.lock_writer().await?;
        Ok(sqlx::query(
            "DELETE FROM webhook_deliveries WHERE id IN (SELECT id FROM webhook_deliveries \
             WHERE status != 'pending' ORDER BY id DESC LIMIT -1 OFFSET ?)",
        )
        .bind(MAX_FINISHED)
        .execute(&mut writer.conn)
        .await?
        .rows_affected())
    }

    /// The delivery log, newest first.
    pub async fn deliveries(&self, filter: &DeliveryFilter) -> StoreResult<Vec<WebhookDelivery>> {
        if let Some(run_id) = &filter.run_id {
            let exists: Option<i64> = sqlx::query_scalar("SELECT id FROM runs WHERE run_id = ?")
                .bind(run_id)
                .fetch_optional(&self.read)
                .await?;
            if exists.is_none() {
                return Err(StoreError::RunNotFound(run_id.clone()));
            }
        }
        let mut rows: Vec<WebhookDelivery> = sqlx::query_as(
            "SELECT d.id, r.run_id, d.alert AS alert_id, d.action, d.url, d.format, d.status, \
             d.attempts, d.created_at, \
             CASE WHEN d.status = 'pending' THEN d.next_attempt_at END AS next_attempt_at, \
             d.last_attempt_at, d.last_status, d.last_error, d.delivered_at \
             FROM webhook_deliveries d JOIN runs r ON r.id = d.run \
             WHERE (?1 IS NULL OR r.run_id = ?1) AND (?2 IS NULL OR d.status = ?2) \
             ORDER BY d.id DESC LIMIT ?3",
        )
        .bind(filter.run_id.as_deref())
        .bind(filter.status.map(DeliveryStatus::as_str))
        .bind(filter.limit)
        .fetch_all(&self.read)
        .await?;
        for row in &mut rows {
            row.target = redact_webhook_url(&row.target);
        }
        Ok(rows)
    }
}

/// The format column as stored, back to its type.
pub fn parse_format(format: &str) -> WebhookFormat {
    match format {
        "slack" => WebhookFormat::Slack,
        _ => WebhookFormat::Generic,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn severities_pass_thresholds_at_or_below_them() {
        assert_eq!(thresholds_admitting("info"), ["info"]);
        assert_eq!(thresholds_admitting("warning"), ["warning", "info"]);
        assert_eq!(thresholds_admitting("critical").len(), 3);
    }
}
