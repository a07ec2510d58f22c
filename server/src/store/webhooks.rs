//! Webhook receivers and the delivery queue, as stored.
//!
//! A delivery row is written in the transaction that opens or resolves an alert
//! (`enqueue_opened`, `enqueue_resolved`, called by the batch write beside
//! `alerts::insert_opened` and `alerts::resolve`), so an alert
//! that committed is always notified, even across a crash, and a rolled-back one
//! never is. The sender (`crate::webhooks`) claims due rows, POSTs them and records
//! each attempt here; with several replicas on one database, a claim keeps two of
//! them from sending the same delivery at once. The queue is bounded: past [`MAX_PENDING`] waiting deliveries
//! the oldest is dropped (and says so in the log), so a receiver that is down for
//! days cannot grow the database without end.

use anyhow::Context;
use gradflow_protocol::{AlertSeverity, Webhook, WebhookFormat, redact_webhook_url};
use serde::Serialize;

use super::alerts::Alert;
use super::{Store, StoreResult, Tx, now_seconds, on_tx, with_reader};
use gradflow_core::model::alert::Opened;

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

/// The `min_severity` values that let an alert of `severity` through: its own and
/// every milder one.
fn thresholds_admitting(severity: AlertSeverity) -> Vec<&'static str> {
    AlertSeverity::ALL
        .into_iter()
        .filter(|threshold| *threshold >= severity)
        .map(AlertSeverity::as_str)
        .collect()
}

/// Adds a run's own receivers (from its registration).
pub(super) async fn add_run_targets(
    tx: &mut Tx,
    run: i64,
    webhooks: &[Webhook],
) -> StoreResult<()> {
    for webhook in webhooks {
        insert_target(tx, Some(run), webhook).await?;
    }
    Ok(())
}

async fn insert_target(tx: &mut Tx, run: Option<i64>, webhook: &Webhook) -> StoreResult<()> {
    on_tx!(tx, |c| {
        sqlx::query(
            "INSERT INTO webhook_targets (run, url, format, min_severity) VALUES ($1, $2, $3, $4)",
        )
        .bind(run)
        .bind(&webhook.url)
        .bind(webhook.format.as_str())
        .bind(
            webhook
                .min_severity
                .unwrap_or(AlertSeverity::Warning)
                .as_str(),
        )
        .execute(&mut *c)
        .await?;
    });
    Ok(())
}

/// Queues the notification of an alert just opened, to every receiver of its run
/// that wants its severity.
pub(super) async fn enqueue_opened(
    tx: &mut Tx,
    run: i64,
    run_id: &str,
    id: i64,
    opened: &Opened,
) -> StoreResult<()> {
    if !has_targets(tx, run).await? {
        return Ok(());
    }
    let alert = Alert::from_opened(id, run_id, opened);
    enqueue(tx, run, &alert, "opened").await
}

/// Queues the notification of an alert just resolved (its row already updated).
pub(super) async fn enqueue_resolved(tx: &mut Tx, run: i64, id: i64) -> StoreResult<()> {
    if !has_targets(tx, run).await? {
        return Ok(());
    }
    let alert = super::alerts::read_one(tx, id)
        .await?
        .with_context(|| format!("alert {id} vanished while being resolved"))?;
    enqueue(tx, run, &alert, "resolved").await
}

async fn has_targets(tx: &mut Tx, run: i64) -> StoreResult<bool> {
    let any: Option<i64> = on_tx!(tx, |c| {
        sqlx::query_scalar("SELECT id FROM webhook_targets WHERE run IS NULL OR run = $1 LIMIT 1")
            .bind(run)
            .fetch_optional(&mut *c)
            .await?
    });
    Ok(any.is_some())
}

async fn enqueue(tx: &mut Tx, run: i64, alert: &Alert, action: &str) -> StoreResult<()> {
    let payload = serde_json::to_string(alert).context("encoding an alert for a webhook")?;
    let admitting = thresholds_admitting(alert.severity);
    let now = now_seconds();
    let added = on_tx!(tx, |c| {
        sqlx::query(
            "INSERT INTO webhook_deliveries (run, alert, action, url, format, payload, status, \
             created_at, next_attempt_at) \
             SELECT $1, $2, $3, url, format, $4, 'pending', $5, $5 FROM webhook_targets \
             WHERE (run IS NULL OR run = $1) AND min_severity IN ($6, $7, $8) ORDER BY id",
        )
        .bind(run)
        .bind(alert.id)
        .bind(action)
        .bind(payload)
        .bind(now)
        .bind(admitting[0])
        .bind(admitting.get(1).copied().unwrap_or(admitting[0]))
        .bind(admitting.get(2).copied().unwrap_or(admitting[0]))
        .execute(&mut *c)
        .await?
        .rows_affected()
    });
    if added == 0 {
        return Ok(());
    }
    // Bounded: the oldest waiting deliveries make room for the new ones.
    let dropped = on_tx!(tx, |c| {
        sqlx::query(&format!(
            "UPDATE webhook_deliveries SET status = 'dropped', next_attempt_at = $1, \
             last_error = 'dropped unsent: more than {MAX_PENDING} deliveries were waiting' \
             WHERE id IN (SELECT id FROM webhook_deliveries WHERE status = 'pending' \
             ORDER BY id DESC LIMIT {ALL_ROWS} OFFSET {MAX_PENDING})"
        ))
        .bind(now)
        .execute(&mut *c)
        .await?
        .rows_affected()
    });
    if dropped > 0 {
        tracing::warn!(
            dropped,
            "webhook queue full: dropped the oldest undelivered notifications"
        );
    }
    Ok(())
}

/// A `LIMIT` both databases read as "no limit" before an `OFFSET`.
const ALL_ROWS: i64 = i64::MAX;

/// How long a claimed delivery is reserved for the server that claimed it: another
/// replica may take it over after that, if the first died mid-attempt (an attempt
/// itself gives up after 10 s).
const CLAIM_SECONDS: f64 = 30.0;

impl Store {
    /// Replaces the server's own receivers (`--webhook`, `--slack-webhook`) with
    /// `webhooks`. Deliveries already queued keep their URL. Every replica of a
    /// database shares the receivers, so replicas should be started with the same
    /// flags.
    pub async fn set_server_webhooks(&self, webhooks: &[Webhook]) -> StoreResult<()> {
        let mut tx = self.begin().await?;
        on_tx!(&mut tx, |c| {
            sqlx::query("DELETE FROM webhook_targets WHERE run IS NULL")
                .execute(&mut *c)
                .await?;
        });
        for webhook in webhooks {
            insert_target(&mut tx, None, webhook).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Claims, for the server `claimant`, up to `limit` pending deliveries due by
    /// `now`, oldest first: a claimed delivery is not handed to another replica for
    /// [`CLAIM_SECONDS`] (or until released), so two servers on one database do not
    /// both send it.
    pub async fn claim_due_deliveries(
        &self,
        claimant: &str,
        now: f64,
        limit: u32,
    ) -> StoreResult<Vec<DueDelivery>> {
        let mut tx = self.begin().await?;
        let dialect = tx.dialect();
        let due: Vec<DueDelivery> = on_tx!(&mut tx, |c| {
            sqlx::query_as(&format!(
                "UPDATE webhook_deliveries \
                 SET claimed_by = $3, claimed_until = $1 + {CLAIM_SECONDS} \
                 WHERE id IN (SELECT id FROM webhook_deliveries \
                 WHERE status = 'pending' AND next_attempt_at <= $1 \
                 AND (claimed_until IS NULL OR claimed_until < $1) \
                 ORDER BY next_attempt_at, id LIMIT $2{}) \
                 RETURNING id, url, format, action, payload, attempts",
                dialect.skip_locked()
            ))
            .bind(now)
            .bind(i64::from(limit))
            .bind(claimant)
            .fetch_all(&mut *c)
            .await?
        });
        tx.commit().await?;
        Ok(due)
    }

    /// Releases the claims `claimant` still holds (a server stopping mid-attempt),
    /// or every claim (`None`: SQLite at start, whose file one server uses at a
    /// time, so any claim left is a dead server's).
    pub async fn release_claims(&self, claimant: Option<&str>) -> StoreResult<()> {
        let mut tx = self.begin().await?;
        on_tx!(&mut tx, |c| {
            sqlx::query(
                "UPDATE webhook_deliveries SET claimed_by = NULL, claimed_until = NULL \
                 WHERE claimed_by IS NOT NULL \
                 AND (CAST($1 AS TEXT) IS NULL OR claimed_by = $1)",
            )
            .bind(claimant)
            .execute(&mut *c)
            .await?;
        });
        tx.commit().await?;
        Ok(())
    }

    /// When the earliest pending delivery is due, if any is pending.
    pub async fn next_delivery_due(&self) -> StoreResult<Option<f64>> {
        self.check_ready()?;
        Ok(with_reader!(self, |pool| {
            sqlx::query_scalar(
                "SELECT min(next_attempt_at) FROM webhook_deliveries WHERE status = 'pending'",
            )
            .fetch_one(pool)
            .await?
        }))
    }

    /// Records an attempt of delivery `id`, and releases its claim. A delivery no
    /// longer pending (dropped meanwhile, or its run deleted) is left as it is.
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
        let mut tx = self.begin().await?;
        on_tx!(&mut tx, |c| {
            sqlx::query(
                "UPDATE webhook_deliveries SET status = $1, attempts = attempts + 1, \
                 last_attempt_at = $2, last_status = $3, last_error = $4, next_attempt_at = $5, \
                 delivered_at = $6, claimed_by = NULL, claimed_until = NULL \
                 WHERE id = $7 AND status = 'pending'",
            )
            .bind(status.as_str())
            .bind(now)
            .bind(http.map(i64::from))
            .bind(error)
            .bind(next)
            .bind(delivered)
            .bind(id)
            .execute(&mut *c)
            .await?;
        });
        tx.commit().await?;
        Ok(())
    }

    /// Deletes all but the newest [`MAX_FINISHED`] finished deliveries.
    pub async fn prune_deliveries(&self) -> StoreResult<u64> {
        let mut tx = self.begin().await?;
        let pruned = on_tx!(&mut tx, |c| {
            sqlx::query(&format!(
                "DELETE FROM webhook_deliveries WHERE id IN (SELECT id FROM webhook_deliveries \
                 WHERE status != 'pending' ORDER BY id DESC LIMIT {ALL_ROWS} OFFSET {MAX_FINISHED})"
            ))
            .execute(&mut *c)
            .await?
            .rows_affected()
        });
        tx.commit().await?;
        Ok(pruned)
    }

    /// The delivery log, newest first.
    pub async fn deliveries(&self, filter: &DeliveryFilter) -> StoreResult<Vec<WebhookDelivery>> {
        self.check_ready()?;
        if let Some(run_id) = &filter.run_id {
            self.require_run(run_id).await?;
        }
        let mut rows: Vec<WebhookDelivery> = with_reader!(self, |pool| {
            sqlx::query_as(
                "SELECT d.id, r.run_id, d.alert AS alert_id, d.action, d.url, d.format, d.status, \
                 d.attempts, d.created_at, \
                 CASE WHEN d.status = 'pending' THEN d.next_attempt_at END AS next_attempt_at, \
                 d.last_attempt_at, d.last_status, d.last_error, d.delivered_at \
                 FROM webhook_deliveries d JOIN runs r ON r.id = d.run \
                 WHERE (CAST($1 AS TEXT) IS NULL OR r.run_id = $1) \
                 AND (CAST($2 AS TEXT) IS NULL OR d.status = $2) \
                 ORDER BY d.id DESC LIMIT $3",
            )
            .bind(filter.run_id.as_deref())
            .bind(filter.status.map(DeliveryStatus::as_str))
            .bind(i64::from(filter.limit))
            .fetch_all(pool)
            .await?
        });
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
        assert_eq!(thresholds_admitting(AlertSeverity::Info), ["info"]);
        assert_eq!(
            thresholds_admitting(AlertSeverity::Warning),
            ["warning", "info"]
        );
        assert_eq!(thresholds_admitting(AlertSeverity::Critical).len(), 3);
    }
}
