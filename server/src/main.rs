//! The `gradflow-server` binary: parses flags and runs the library.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gradflow_server::config::ServerConfig;
use gradflow_server::demo::{self, DemoOptions};
use gradflow_server::import::{self, ImportOptions};
use gradflow_server::startup::{Application, shutdown_signal, survive_file_size_limit};
use tracing_subscriber::EnvFilter;

// Parsing a batch allocates a string per module and frees it after the commit,
// thousands a second under load: mimalloc recycles them far faster than glibc's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// gradflow-server: stores gradient-flow telemetry from instrumented trainers in
/// SQLite or PostgreSQL, diagnoses it, and serves it back over HTTP (protocol v1
/// under /api/v1) and as a dashboard.
#[derive(Debug, Parser)]
#[command(name = "gradflow-server", version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    server: ServerConfig,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve, and run a demo trainer (CPU) through a healthy run and every fault
    /// scenario, one after another; prints the dashboard's address.
    Demo(DemoOptions),
    /// Load a client's undelivered spool (NDJSON step records) and its registration
    /// into the database (--database or --db), through the same checks and detectors
    /// as the API.
    Import(ImportOptions),
}

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
    let cli = Cli::parse();
    survive_file_size_limit();
    let result = match &cli.command {
        None => run(cli.server).await,
        Some(Command::Demo(options)) => demo::run(&cli.server, options).await,
        Some(Command::Import(options)) => import::run(&cli.server, options).await,
    };
    match result {
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
        dashboard = %format!("http://{}/", app.address()),
        database = %config.database_url()?.display(),
        ingest_token = config.ingest_token.is_some(),
        read_token = config.read_token.is_some(),
        "gradflow-server listening"
    );
    app.run_until(shutdown_signal()).await
}
