//! Command-line flags, each also read from a `GRADFLOW_*` environment variable.

use std::path::PathBuf;

use clap::Parser;

use crate::detect::{Detection, Thresholds};
use crate::store::SyncMode;

/// gradflow-server: stores gradient-flow telemetry from instrumented trainers in
/// SQLite and serves it back over HTTP (protocol v1 under /api/v1).
#[derive(Debug, Clone, Parser)]
#[command(name = "gradflow-server", version, about, long_about = None)]
pub struct ServerConfig {
    /// Address to listen on (host:port; port 0 picks a free one).
    #[arg(long, env = "GRADFLOW_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: String,

    /// SQLite database file; created (with its WAL) if missing.
    #[arg(long, env = "GRADFLOW_DB", default_value = "./gradflow.db")]
    pub db: PathBuf,

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

    /// When a commit reaches the disk: `full` fsyncs every batch (survives a power
    /// cut), `normal` only at checkpoints (survives a killed server).
    #[arg(long, env = "GRADFLOW_SYNC", value_enum, default_value = "full")]
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
}

impl ServerConfig {
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
