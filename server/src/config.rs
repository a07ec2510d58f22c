//! Command-line flags, each also read from a `GRADFLOW_*` environment variable.

use std::path::PathBuf;

use std::time::Duration;

use clap::Parser;
use gradflow_protocol::{AlertSeverity, Webhook, WebhookFormat};

use crate::store::{DatabaseUrl, StoreConfig, SyncMode};
use crate::webhooks::WebhookSettings;
use gradflow_core::detect::{Detection, Thresholds};

/// gradflow-server: stores gradient-flow telemetry from instrumented trainers in
/// SQLite or PostgreSQL and serves it back over HTTP (protocol v1 under /api/v1).
#[derive(Debug, Clone, Parser)]
#[command(name = "gradflow-server", version, about, long_about = None)]
pub struct ServerConfig {
    /// Address to listen on (host:port; port 0 picks a free one).
    #[arg(long, env = "GRADFLOW_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: String,

    /// SQLite database file; created (with its WAL) if missing. `--database` takes
    /// precedence.
    #[arg(long, env = "GRADFLOW_DB", default_value = "./gradflow.db")]
    pub db: PathBuf,

    /// Where the data lives: `postgres://user:password@host:port/db` for a
    /// PostgreSQL database (several servers may share one), or a SQLite file's path
    /// (`sqlite://path` or a bare path). Without it, `--db`.
    // Read as text and checked after parsing, so that a refused URL is never echoed
    // with its password (clap quotes the value it refuses).
    #[arg(long, env = "GRADFLOW_DATABASE_URL", hide_env_values = true)]
    pub database: Option<String>,

    /// Seconds a step of a multi-rank run waits for its last ranks' records before it
    /// is completed without them (and `rank_missing` opens). A rank more than 256
    /// steps behind the others is not waited for either.
    #[arg(long, env = "GRADFLOW_RANK_TIMEOUT_SECS", default_value_t = 60.0, value_parser = parse_positive_secs)]
    pub rank_timeout_secs: f64,

    /// Runs whose ingest state (column dictionary, detectors, open alerts) a server
    /// keeps in memory; the least recently used is read back from the database when
    /// its next batch comes.
    #[arg(long, env = "GRADFLOW_CACHED_RUNS", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub cached_runs: u32,

    /// Token every write (PUT, POST, DELETE) must present as `Authorization: Bearer
    /// <token>`; without it, writes are open to whoever can reach the address.
    #[arg(long, env = "GRADFLOW_INGEST_TOKEN", hide_env_values = true)]
    pub ingest_token: Option<String>,

    /// Token every read (the API's GETs, /metrics, the dashboard) must present, as
    /// `Authorization: Bearer <token>` or through the dashboard's login page; the
    /// ingest token is accepted too. Without it, reads are open.
    #[arg(long, env = "GRADFLOW_READ_TOKEN", hide_env_values = true)]
    pub read_token: Option<String>,

    /// An origin (scheme://host[:port], or `*`) whose pages may call the API from a
    /// browser; repeat, or separate with commas. Without it no CORS headers are sent.
    #[arg(long = "cors-origin", env = "GRADFLOW_CORS_ORIGINS", value_delimiter = ',', value_parser = crate::routes::cors::parse_origin)]
    pub cors_origins: Vec<String>,

    /// Largest request body in bytes, checked before and after gzip decompression;
    /// larger bodies get 413.
    #[arg(long, env = "GRADFLOW_MAX_BODY_BYTES", default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,

    /// When a SQLite commit reaches the disk: `full` fsyncs every batch (survives a
    /// power cut), `normal` only at checkpoints (survives a killed server).
    /// PostgreSQL follows its own `synchronous_commit`.
    #[arg(long, env = "GRADFLOW_SYNC", default_value = "full", value_parser = parse_sync)]
    pub sync: SyncMode,

    /// grad_stuck_zero opens after this many consecutive steps with a gradient norm of
    /// exactly 0 (or none); a run's registration may override it.
    #[arg(long, env = "GRADFLOW_STUCK_ZERO_STEPS", default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
    pub stuck_zero_steps: u32,

    /// norm_weight_frozen opens after this many consecutive steps where norm weights
    /// had a gradient but an update of exactly 0.
    #[arg(long, env = "GRADFLOW_FROZEN_NORM_STEPS", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub frozen_norm_steps: u32,

    /// scaler_overflow_streak opens after this many consecutive steps with found_inf.
    #[arg(long, env = "GRADFLOW_OVERFLOW_STREAK_STEPS", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub overflow_streak_steps: u32,

    /// A request not answered within this many seconds (a client sending its body
    /// too slowly, above all) gets 408 and holds nothing any longer.
    #[arg(long, env = "GRADFLOW_REQUEST_TIMEOUT_SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub request_timeout_secs: u64,

    /// Requests handled at once; more get 503 with Retry-After instead of queueing
    /// without bound. (Open event streams do not count once their headers are sent.)
    #[arg(long, env = "GRADFLOW_MAX_CONCURRENT_REQUESTS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_concurrent_requests: u32,

    /// Delete runs that have received nothing for this many days (checked at startup
    /// and every hour), and give their space back to the file system. Without it,
    /// runs are kept until deleted.
    #[arg(long, env = "GRADFLOW_RETAIN_DAYS", value_parser = clap::value_parser!(u32).range(1..))]
    pub retain_days: Option<u32>,

    /// Store telemetry without running the detectors (no alerts are opened). Meant
    /// for measuring what detection costs, not for production.
    #[arg(long, env = "GRADFLOW_DISABLE_DETECTORS")]
    pub disable_detectors: bool,

    #[command(flatten)]
    pub webhooks: WebhookFlags,
}

/// Where alert notifications go (docs/PROTOCOL.md, "Webhooks"); runs may add their
/// own receivers in their registration.
#[derive(Debug, Clone, clap::Args)]
pub struct WebhookFlags {
    /// POST every alert opened and resolved, as JSON, to this URL; repeat, or
    /// separate with commas.
    #[arg(long = "webhook", env = "GRADFLOW_WEBHOOKS", value_delimiter = ',', value_parser = parse_webhook_url)]
    pub generic: Vec<String>,

    /// As --webhook, with a Slack-compatible `{"text": ...}` body (Slack's incoming
    /// webhooks, Mattermost, Discord's `/slack` endpoint).
    #[arg(long = "slack-webhook", env = "GRADFLOW_SLACK_WEBHOOKS", value_delimiter = ',', value_parser = parse_webhook_url)]
    pub slack: Vec<String>,

    /// The least severe alert the server's webhooks receive: critical, warning or
    /// info (the hints of a run's first steps).
    #[arg(long = "webhook-min-severity", env = "GRADFLOW_WEBHOOK_MIN_SEVERITY", default_value = "warning", value_parser = crate::webhooks::parse_severity)]
    pub min_severity: AlertSeverity,

    /// Attempts per notification before it is given up.
    #[arg(long = "webhook-max-attempts", env = "GRADFLOW_WEBHOOK_MAX_ATTEMPTS", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_attempts: u32,

    /// Seconds before a failed notification is retried; each further retry waits
    /// twice as long, up to 10 minutes.
    #[arg(long = "webhook-retry-secs", env = "GRADFLOW_WEBHOOK_RETRY_SECS", default_value_t = 1.0, value_parser = parse_positive_secs)]
    pub retry_secs: f64,

    /// The dashboard's address as users reach it (e.g. https://gradflow.example.com):
    /// notifications then link to the run's page.
    #[arg(long = "public-url", env = "GRADFLOW_PUBLIC_URL", value_parser = parse_webhook_url)]
    pub public_url: Option<String>,
}

impl Default for WebhookFlags {
    fn default() -> Self {
        WebhookFlags {
            generic: Vec::new(),
            slack: Vec::new(),
            min_severity: AlertSeverity::Warning,
            max_attempts: 10,
            retry_secs: 1.0,
            public_url: None,
        }
    }
}

impl WebhookFlags {
    /// What the webhook sender needs.
    pub fn settings(&self) -> WebhookSettings {
        let target = |url: &String, format| Webhook {
            url: url.clone(),
            format,
            min_severity: Some(self.min_severity),
        };
        WebhookSettings {
            webhooks: self
                .generic
                .iter()
                .map(|url| target(url, WebhookFormat::Generic))
                .chain(
                    self.slack
                        .iter()
                        .map(|url| target(url, WebhookFormat::Slack)),
                )
                .collect(),
            max_attempts: self.max_attempts,
            first_retry: Duration::from_secs_f64(self.retry_secs),
            public_url: self.public_url.clone(),
        }
    }
}

fn parse_sync(text: &str) -> Result<SyncMode, String> {
    match text {
        "full" => Ok(SyncMode::Full),
        "normal" => Ok(SyncMode::Normal),
        _ => Err(format!("{text:?} is not a sync mode: full or normal")),
    }
}

fn parse_webhook_url(url: &str) -> Result<String, String> {
    gradflow_protocol::check_webhook_url(url)?;
    Ok(url.to_owned())
}

fn parse_positive_secs(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs > 0.0 && secs <= 3600.0 => Ok(secs),
        _ => Err(format!("{text:?} is not a number of seconds in (0, 3600]")),
    }
}

impl ServerConfig {
    /// The database these flags name: `--database`, else `--db`. The error says
    /// what is wrong with the URL, its password hidden.
    pub fn database_url(&self) -> anyhow::Result<DatabaseUrl> {
        match &self.database {
            Some(url) => DatabaseUrl::parse(url)
                .map_err(|error| anyhow::anyhow!("--database (GRADFLOW_DATABASE_URL): {error}")),
            None => Ok(DatabaseUrl::Sqlite(self.db.clone())),
        }
    }

    /// How to open the store.
    pub fn store(&self) -> anyhow::Result<StoreConfig> {
        Ok(StoreConfig {
            database: self.database_url()?,
            sync: self.sync,
        })
    }

    /// How the ingest service runs.
    pub fn ingest(&self) -> crate::ingest::IngestSettings {
        crate::ingest::IngestSettings {
            detection: self.detection(),
            cached_runs: self.cached_runs as usize,
            rank_timeout: Duration::from_secs_f64(self.rank_timeout_secs),
        }
    }

    /// The detector settings these flags ask for.
    pub fn detection(&self) -> Detection {
        Detection {
            enabled: !self.disable_detectors,
            thresholds: self.thresholds(),
        }
    }

    pub fn thresholds(&self) -> Thresholds {
        Thresholds {
            stuck_zero_steps: self.stuck_zero_steps,
            frozen_norm_steps: self.frozen_norm_steps,
            overflow_streak_steps: self.overflow_streak_steps,
        }
    }
}
