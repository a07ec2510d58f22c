//! Command-line flags, each also read from a `GRADFLOW_*` environment variable.

use std::path::PathBuf;

use clap::Parser;

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

    /// Largest request body in bytes, checked before and after gzip decompression;
    /// larger bodies get 413.
    #[arg(long, env = "GRADFLOW_MAX_BODY_BYTES", default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,

    /// When a commit reaches the disk: `full` fsyncs every batch (survives a power
    /// cut), `normal` only at checkpoints (survives a killed server).
    #[arg(long, env = "GRADFLOW_SYNC", value_enum, default_value = "full")]
    pub sync: SyncMode,
}
