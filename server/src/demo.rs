//! `gradflow-server demo`: the server on its usual address and database, plus a
//! demo trainer sidecar on CPU that runs a healthy run and every fault scenario one
//! after another, paced so the dashboard can be watched filling up. Ctrl-C (or
//! SIGTERM) stops the trainer in flight and then the server, cleanly.
//!
//! The trainer is the real `gradflow-trainer` binary, run as a child process: the
//! server does not link the model code (candle) and stays a small binary.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Args;
use tokio::process::Command;
use tokio::sync::watch;

use crate::config::ServerConfig;
use crate::startup::{Application, shutdown_signal};

/// The scenarios the demo runs, in order: healthy first, then each failure, then
/// prompt caching. The two healthy ones raise no warning at all; each failure raises
/// exactly the alerts its scenario names (README's table; `tests/tests/demo.rs`).
pub const SCENARIOS: [&str; 10] = [
    "healthy",
    "detached-prompt",
    "bf16-frozen-norms",
    "qwen-not-in-optimizer",
    "fp16-overflow",
    "nan-gradient",
    "lr-too-high",
    "attention-logit-growth",
    "scaler-on-bf16",
    "prompt-caching",
];

#[derive(Debug, Clone, Args)]
pub struct DemoOptions {
    /// The trainer binary; by default `gradflow-trainer` beside this binary (where
    /// `cargo build --release` puts it).
    #[arg(long, env = "GRADFLOW_TRAINER")]
    pub trainer: Option<PathBuf>,

    /// Steps of each scenario's run.
    #[arg(long, env = "GRADFLOW_DEMO_STEPS", default_value_t = 300)]
    pub steps: u64,

    /// Pause after each training step, in milliseconds, so runs can be watched live.
    #[arg(long, env = "GRADFLOW_STEP_DELAY_MS", default_value_t = 25)]
    pub step_delay_ms: u64,
}

/// Runs the demo until Ctrl-C or SIGTERM.
pub async fn run(config: &ServerConfig, options: &DemoOptions) -> anyhow::Result<()> {
    let trainer = trainer_path(options.trainer.as_deref())?;
    let app = Application::build(config).await?;
    let address = app.address();
    let base = format!("http://{address}");
    println!("gradflow demo: dashboard at {base}/   (Ctrl-C stops)");

    let (stop, stopped) = watch::channel(false);
    let mut server_stopped = stopped.clone();
    let mut server = tokio::spawn(app.run_until(async move {
        let _ = server_stopped.wait_for(|s| *s).await;
    }));
    let trainers = tokio::spawn(run_scenarios(trainer, base, options.clone(), stopped));
    tokio::select! {
        _ = shutdown_signal() => {}
        // The server stopped by itself: an error worth reporting.
        result = &mut server => {
            let _ = stop.send(true);
            trainers.await.context("the demo trainer task")??;
            return result.context("the server task")?;
        }
    }
    tracing::info!("stopping the demo");
    let _ = stop.send(true);
    trainers.await.context("the demo trainer task")??;
    server.await.context("the server task")?
}

/// Each scenario in turn, until they are done or the demo stops.
async fn run_scenarios(
    trainer: PathBuf,
    base: String,
    options: DemoOptions,
    mut stopped: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let suffix = time::OffsetDateTime::now_utc().unix_timestamp() % 1_000_000;
    for scenario in SCENARIOS {
        let run_id = format!("{scenario}-{suffix:06}");
        println!("gradflow demo: training {run_id}: {base}/runs/{run_id}");
        let mut child = Command::new(&trainer)
            .args([
                "--server",
                &base,
                "--scenario",
                scenario,
                "--run-id",
                &run_id,
            ])
            .args(["--steps", &options.steps.to_string()])
            .args(["--step-delay-ms", &options.step_delay_ms.to_string()])
            .arg("--quiet")
            .env("RUST_LOG", "gradflow_trainer=warn")
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", trainer.display()))?;
        let stop_requested = tokio::select! {
            status = child.wait() => {
                let status = status.context("waiting for the trainer")?;
                // scaler-on-bf16 stops with an error on purpose, as PyTorch would.
                if !status.success() && scenario != "scaler-on-bf16" {
                    tracing::warn!(scenario, %status, "the demo trainer failed");
                }
                false
            }
            _ = stopped.wait_for(|s| *s) => true,
        };
        if stop_requested {
            child.kill().await.ok();
            return Ok(());
        }
    }
    println!("gradflow demo: every scenario ran; the dashboard stays up at {base}/ until Ctrl-C");
    Ok(())
}

/// `--trainer`, or `gradflow-trainer` beside the running binary.
fn trainer_path(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    let path = match given {
        Some(path) => path.to_path_buf(),
        None => std::env::current_exe()
            .context("locating this binary")?
            .with_file_name(format!("gradflow-trainer{}", std::env::consts::EXE_SUFFIX)),
    };
    if !path.is_file() {
        bail!(
            "the demo trainer {} is missing: build it with `cargo build --release` \
             (it builds gradflow-trainer beside gradflow-server), or pass --trainer PATH",
            path.display()
        );
    }
    Ok(path)
}
