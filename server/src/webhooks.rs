//! Sends alert notifications to webhooks.
//!
//! The store queues one delivery per alert transition per receiver, in the
//! transaction that made the transition (`store/webhooks.rs`); this task sends them.
//! It wakes when an alert event is announced, or when the earliest retry falls due,
//! claims what is due, POSTs it and records the attempt. A 2xx delivers; a refused
//! connection, a timeout, 408, 429 or a 5xx is retried with exponential backoff
//! (honouring `Retry-After`), any other answer fails at once, since sending the same
//! body again would be refused again. Because the queue lives in the database, a
//! restart resumes where the last process stopped; a delivery whose attempt was cut
//! short by the restart is sent again, so receivers see each notification at least
//! once (each body carries the alert's `id` and the `event`, for those that must
//! deduplicate).

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use gradflow_protocol::{AlertSeverity, Webhook, WebhookFormat};
use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};

use crate::events::{Event, EventBus};
use crate::store::webhooks::{Attempt, DueDelivery, parse_format};
use crate::store::{Store, now_seconds};

/// The longest wait between two attempts of one delivery.
const MAX_BACKOFF: Duration = Duration::from_secs(600);
/// How long one attempt may take, connection included.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// Deliveries sent at once.
const CONCURRENT_SENDS: usize = 8;
/// Deliveries claimed per round.
const CLAIM: u32 = 64;
/// How often the delivery log is trimmed.
const PRUNE_EVERY: Duration = Duration::from_secs(3600);
/// Characters of a refusing receiver's answer kept in the log.
const ERROR_BODY_CHARS: usize = 200;

/// How notifications are sent.
#[derive(Debug, Clone)]
pub struct WebhookSettings {
    /// The server's own receivers, besides those runs register.
    pub webhooks: Vec<Webhook>,
    /// Attempts per delivery before it fails.
    pub max_attempts: u32,
    /// The wait before the first retry; it doubles with each further one.
    pub first_retry: Duration,
    /// The dashboard's address as users reach it, for links to the run's page.
    pub public_url: Option<String>,
}

/// Records the server's receivers and starts the sender, which sends what falls due
/// until `shutdown` turns true. The receivers are recorded before this returns when
/// the database is up, so no alert of the first batches misses them; a database not
/// up yet (PostgreSQL starting) gets them as soon as it is.
pub async fn start(
    store: Arc<Store>,
    events: Arc<EventBus>,
    settings: WebhookSettings,
    shutdown: watch::Receiver<bool>,
) -> SenderHandle {
    let recorded = store.ready().await.is_ok()
        && match store.set_server_webhooks(&settings.webhooks).await {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(%error, "webhook sender: cannot record the server's webhooks yet; retrying");
                false
            }
        };
    if recorded && store.single_server() {
        // One server uses a SQLite file at a time: a claim left in it is the
        // previous server's, cut short by a crash.
        if let Err(error) = store.release_claims(None).await {
            tracing::warn!(%error, "webhook sender: cannot release old claims");
        }
    }
    let claimant = claimant();
    let client = reqwest::Client::builder()
        .timeout(ATTEMPT_TIMEOUT)
        .user_agent(concat!("gradflow-server/", env!("CARGO_PKG_VERSION")))
        .build()
        .expect("a client with a timeout and a user agent builds");
    let sender = Sender {
        store: store.clone(),
        settings,
        client,
        claimant: claimant.clone(),
    };
    SenderHandle {
        task: tokio::spawn(sender.run(events, recorded, shutdown)),
        store,
        claimant,
    }
}

/// The running sender.
pub struct SenderHandle {
    task: tokio::task::JoinHandle<()>,
    store: Arc<Store>,
    claimant: String,
}

impl SenderHandle {
    /// Stops the sender without waiting for attempts in flight (a receiver that
    /// hangs must not hold the shutdown up), and hands back what it had claimed: a
    /// delivery cut short stays pending, for another replica or the next start.
    pub async fn stop(self) {
        self.task.abort();
        if let Err(error) = self.store.release_claims(Some(&self.claimant)).await {
            tracing::warn!(%error, "webhook sender: cannot release its claims; they expire by themselves");
        }
    }
}

/// A name for this server's claims, unique among the replicas of a database: its
/// host, its process and a per-process random number.
fn claimant() -> String {
    use std::hash::{BuildHasher, Hasher};
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "gradflow".to_owned());
    let mut nonce = std::collections::hash_map::RandomState::new().build_hasher();
    nonce.write_u32(std::process::id());
    format!("{host}:{}:{:016x}", std::process::id(), nonce.finish())
}

struct Sender {
    store: Arc<Store>,
    settings: WebhookSettings,
    client: reqwest::Client,
    /// Who this server is, in the claims it makes.
    claimant: String,
}

impl Sender {
    async fn run(self, bus: Arc<EventBus>, recorded: bool, mut shutdown: watch::Receiver<bool>) {
        let mut events = bus.subscribe();
        // The server's receivers replace the ones the last start recorded; until the
        // database takes the write (PostgreSQL still coming up), try again.
        if !recorded {
            while let Err(error) = self
                .store
                .set_server_webhooks(&self.settings.webhooks)
                .await
            {
                tracing::debug!(%error, "webhook sender: cannot record the server's webhooks yet");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = shutdown.wait_for(|stop| *stop) => return,
                }
            }
        }
        let mut last_prune = tokio::time::Instant::now();
        loop {
            if *shutdown.borrow() {
                return;
            }
            if let Err(error) = self.send_due().await {
                tracing::warn!(%error, "webhook sender: cannot read the delivery queue");
            }
            if last_prune.elapsed() >= PRUNE_EVERY {
                last_prune = tokio::time::Instant::now();
                if let Err(error) = self.store.prune_deliveries().await {
                    tracing::warn!(%error, "webhook sender: cannot trim the delivery log");
                }
            }
            let wait = match self.store.next_delivery_due().await {
                Ok(Some(due)) => Duration::from_secs_f64((due - now_seconds()).clamp(0.0, 60.0)),
                Ok(None) => Duration::from_secs(60),
                Err(_) => Duration::from_secs(5),
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = next_alert(&mut events) => {}
                _ = shutdown.changed() => {}
            }
        }
    }

    /// Sends every delivery due now.
    async fn send_due(&self) -> anyhow::Result<()> {
        loop {
            let due = self
                .store
                .claim_due_deliveries(&self.claimant, now_seconds(), CLAIM)
                .await?;
            if due.is_empty() {
                return Ok(());
            }
            let full = due.len() == CLAIM as usize;
            futures_util::stream::iter(due)
                .for_each_concurrent(CONCURRENT_SENDS, |delivery| async move {
                    let attempt = self.attempt(&delivery).await;
                    match &attempt {
                        Attempt::Delivered { .. } => {
                            tracing::debug!(id = delivery.id, "webhook delivered")
                        }
                        Attempt::Retry { error, .. } | Attempt::Failed { error, .. } => {
                            tracing::warn!(id = delivery.id, attempts = delivery.attempts + 1, "webhook delivery failed: {error}")
                        }
                    }
                    if let Err(error) = self.store.record_attempt(delivery.id, &attempt).await {
                        tracing::warn!(%error, id = delivery.id, "webhook sender: cannot record an attempt");
                    }
                })
                .await;
            if !full {
                return Ok(());
            }
        }
    }

    async fn attempt(&self, delivery: &DueDelivery) -> Attempt {
        let attempts = delivery.attempts as u32 + 1;
        let body = match render(delivery, self.settings.public_url.as_deref()) {
            Ok(body) => body,
            Err(error) => {
                return Attempt::Failed {
                    status: None,
                    error: format!("cannot build the body: {error}"),
                };
            }
        };
        let (status, error, retry_after) =
            match self.client.post(&delivery.url).json(&body).send().await {
                Ok(response) if response.status().is_success() => {
                    return Attempt::Delivered {
                        status: response.status().as_u16(),
                    };
                }
                Ok(response) => {
                    let status = response.status();
                    let retry_after = response
                        .headers()
                        .get(reqwest::header::RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .map(Duration::from_secs);
                    let text = response.text().await.unwrap_or_default();
                    let text: String = text.chars().take(ERROR_BODY_CHARS).collect();
                    let error = format!("the receiver answered {status}: {}", text.trim());
                    let retryable = status.is_server_error()
                        || status == reqwest::StatusCode::REQUEST_TIMEOUT
                        || status == reqwest::StatusCode::TOO_MANY_REQUESTS;
                    if !retryable {
                        return Attempt::Failed {
                            status: Some(status.as_u16()),
                            error: format!(
                                "{error} (not retried: the same body would be refused again)"
                            ),
                        };
                    }
                    (Some(status.as_u16()), error, retry_after)
                }
                Err(error) => (None, describe(&error), None),
            };
        if attempts >= self.settings.max_attempts {
            return Attempt::Failed {
                status,
                error: format!("gave up after {attempts} attempts; the last: {error}"),
            };
        }
        let backoff = backoff(self.settings.first_retry, attempts);
        let wait = retry_after.map_or(backoff, |r| r.clamp(backoff, MAX_BACKOFF));
        Attempt::Retry {
            status,
            error,
            retry_at: now_seconds() + wait.as_secs_f64(),
        }
    }
}

/// Waits for an alert event (or for having missed some); step events do not wake
/// the sender.
async fn next_alert(events: &mut broadcast::Receiver<Event>) {
    loop {
        match events.recv().await {
            Ok(Event::Alert { .. }) | Err(broadcast::error::RecvError::Lagged(_)) => return,
            Ok(_) => {}
            Err(broadcast::error::RecvError::Closed) => std::future::pending::<()>().await,
        }
    }
}

/// The wait after the `attempts`-th failed attempt: `first`, doubling each time,
/// at most [`MAX_BACKOFF`].
pub fn backoff(first: Duration, attempts: u32) -> Duration {
    let factor = 2u32.saturating_pow(attempts.saturating_sub(1).min(20));
    first.saturating_mul(factor).min(MAX_BACKOFF)
}

/// reqwest's error with its causes, which say what actually went wrong ("connection
/// refused", "operation timed out").
fn describe(error: &reqwest::Error) -> String {
    let mut text = if error.is_timeout() {
        format!("no answer within {} s", ATTEMPT_TIMEOUT.as_secs())
    } else if error.is_connect() {
        "cannot connect".to_owned()
    } else {
        "the request failed".to_owned()
    };
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The body a delivery sends, in its receiver's format.
pub fn render(delivery: &DueDelivery, public_url: Option<&str>) -> anyhow::Result<Value> {
    let alert: Value = serde_json::from_str(&delivery.payload)?;
    let run_id = alert["run_id"].as_str().unwrap_or_default();
    let link = public_url.map(|base| format!("{}/runs/{run_id}", base.trim_end_matches('/')));
    Ok(match parse_format(&delivery.format) {
        WebhookFormat::Generic => json!({
            "event": format!("alert.{}", delivery.action),
            "alert": alert,
            "run_url": link,
        }),
        WebhookFormat::Slack => {
            json!({ "text": slack_text(&alert, &delivery.action, link.as_deref()) })
        }
    })
}

/// One Slack message: what happened on which run, then the detail and the fix for
/// an alert that opened.
fn slack_text(alert: &Value, action: &str, link: Option<&str>) -> String {
    let field = |name: &str| alert[name].as_str().unwrap_or_default();
    let severity = field("severity");
    let marker = match severity {
        "critical" => ":rotating_light:",
        "warning" => ":warning:",
        _ => ":information_source:",
    };
    let subject = match field("subject") {
        "" => String::new(),
        subject => format!(" on `{subject}`"),
    };
    let run = match link {
        Some(link) => format!("<{link}|{}>", field("run_id")),
        None => format!("`{}`", field("run_id")),
    };
    if action == "resolved" {
        let step = alert["resolved_step"]
            .as_i64()
            .map(|s| format!(" at step {s}"))
            .unwrap_or_default();
        return format!(
            ":white_check_mark: Resolved{step}: {} `{}`{subject}, run {run}: {}",
            severity,
            field("kind"),
            field("title")
        );
    }
    let step = alert["opened_step"]
        .as_i64()
        .map(|s| format!(" at step {s}"))
        .unwrap_or_else(|| " at registration".to_owned());
    format!(
        "{marker} *{severity}* `{}`{subject}, run {run}{step}: *{}*\n{}\n*Fix:* {}",
        field("kind"),
        field("title"),
        field("detail"),
        field("fix")
    )
}

/// The severity flag's values.
pub fn parse_severity(text: &str) -> Result<AlertSeverity, String> {
    AlertSeverity::parse(text)
        .ok_or_else(|| format!("{text:?} is not a severity: critical, warning or info"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(action: &str, format: &str) -> DueDelivery {
        DueDelivery {
            id: 1,
            url: "http://127.0.0.1:1/".into(),
            format: format.into(),
            action: action.into(),
            payload: json!({
                "id": 7, "run_id": "r1", "kind": "grad_stuck_zero", "severity": "critical",
                "subject": "qwen", "status": "open", "opened_step": 50, "resolved_step": null,
                "title": "qwen gets no gradient", "detail": "0.00e+00 for 50 steps",
                "fix": "remove the torch.no_grad()", "evidence": {}
            })
            .to_string(),
            attempts: 0,
        }
    }

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let first = Duration::from_secs(1);
        assert_eq!(backoff(first, 1), Duration::from_secs(1));
        assert_eq!(backoff(first, 2), Duration::from_secs(2));
        assert_eq!(backoff(first, 4), Duration::from_secs(8));
        assert_eq!(backoff(first, 40), MAX_BACKOFF);
    }

    #[test]
    fn bodies_take_their_receivers_shape() {
        let generic = render(&delivery("opened", "generic"), Some("https://gf.example/")).unwrap();
        assert_eq!(generic["event"], "alert.opened");
        assert_eq!(generic["alert"]["id"], 7);
        assert_eq!(generic["run_url"], "https://gf.example/runs/r1");
        let slack = render(&delivery("opened", "slack"), None).unwrap();
        let text = slack["text"].as_str().unwrap();
        assert!(
            text.contains("*critical* `grad_stuck_zero` on `qwen`, run `r1` at step 50"),
            "{text}"
        );
        assert!(text.contains("*Fix:* remove the torch.no_grad()"), "{text}");
        let resolved = render(&delivery("resolved", "slack"), None).unwrap();
        assert!(
            resolved["text"]
                .as_str()
                .unwrap()
                .starts_with(":white_check_mark: Resolved")
        );
    }
}
