//! The `gradflow-server` binary: parses flags and runs the library.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use gradflow_server::config::ServerConfig;
use gradflow_server::startup::{Application, shutdown_signal};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("gradflow_server=info,tower_http=warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let config = ServerConfig::parse();
    match run(config).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("gradflow-server: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(config: ServerConfig) -> anyhow::Result<()> {
    let app = Application::build(&config).await?;
    tracing::info!(
        address = %app.address(),
        db = %config.db.display(),
        ingest_token = config.ingest_token.is_some(),
        "gradflow-server listening"
    );
    app.run_until(shutdown_signal()).await
}
