//! `gradflow-server import SPOOL`: loads what a client could not deliver — its
//! on-disk spool of step records (NDJSON) and the run's registration — into the
//! database, through the same validation, storage and detectors as `POST .../steps`.
//!
//! The Python client leaves `SPOOL.registration.json` (`{"run_id", "registration"}`)
//! beside a spool it could not deliver; `--run-id` and `--registration FILE` (a bare
//! registration body) name them for any other client. Importing twice is harmless:
//! the registration is idempotent and steps already stored are duplicates. An
//! imported run is marked finished: its client has stopped.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use gradflow_protocol::{RunId, RunRegistration, parse_steps_ndjson, validate_batch};
use serde::Deserialize;

use std::sync::Arc;

use crate::config::ServerConfig;
use crate::ingest::Ingest;
use crate::store::Store;

/// Records per ingest transaction (the spool may hold a whole run).
const BATCH: usize = 1000;

#[derive(Debug, clap::Args)]
pub struct ImportOptions {
    /// The spool file: one step record per line, as the client wrote them.
    pub spool: PathBuf,
    /// The run to load into (default: from SPOOL.registration.json).
    #[arg(long)]
    pub run_id: Option<String>,
    /// A registration body (default: from SPOOL.registration.json).
    #[arg(long)]
    pub registration: Option<PathBuf>,
}

/// What the client writes beside an undelivered spool.
#[derive(Debug, Deserialize)]
struct Sidecar {
    run_id: String,
    registration: serde_json::Value,
}

/// The summary printed at the end.
#[derive(Debug, PartialEq, Eq)]
pub struct Imported {
    pub run_id: String,
    pub accepted: u64,
    pub duplicates: u64,
    pub last_step: Option<u64>,
}

pub fn sidecar_path(spool: &Path) -> PathBuf {
    let mut name = spool.as_os_str().to_owned();
    name.push(".registration.json");
    PathBuf::from(name)
}

fn registration_and_run(options: &ImportOptions) -> anyhow::Result<(RunId, RunRegistration)> {
    let sidecar_file = sidecar_path(&options.spool);
    let sidecar: Option<Sidecar> =
        if sidecar_file.exists() {
            let text = std::fs::read(&sidecar_file)
                .with_context(|| format!("reading {}", sidecar_file.display()))?;
            Some(serde_json::from_slice(&text).with_context(|| {
                format!("{} is not a registration sidecar", sidecar_file.display())
            })?)
        } else {
            None
        };
    let run_id = match (&options.run_id, &sidecar) {
        (Some(id), _) => id.clone(),
        (None, Some(s)) => s.run_id.clone(),
        (None, None) => bail!(
            "no run id: pass --run-id, or keep {} beside the spool",
            sidecar_file.display()
        ),
    };
    let run_id = RunId::parse(&run_id).map_err(|e| anyhow::anyhow!("run id {run_id:?}: {e}"))?;
    let body = match (&options.registration, sidecar) {
        (Some(path), _) => {
            std::fs::read(path).with_context(|| format!("reading {}", path.display()))?
        }
        (None, Some(s)) => serde_json::to_vec(&s.registration)?,
        (None, None) => bail!(
            "no registration: pass --registration FILE, or keep {} beside the spool",
            sidecar_file.display()
        ),
    };
    let registration = RunRegistration::from_json(&body)
        .map_err(|e| anyhow::anyhow!("the registration is invalid: {e}"))?;
    Ok((run_id, registration))
}

/// Loads the spool into the configured database.
pub async fn import(config: &ServerConfig, options: &ImportOptions) -> anyhow::Result<Imported> {
    let (run_id, registration) = registration_and_run(options)?;
    let text = std::fs::read(&options.spool)
        .with_context(|| format!("reading {}", options.spool.display()))?;
    // Every line is checked before anything is stored: a bad spool changes nothing.
    let records = parse_steps_ndjson(&text)
        .map_err(|e| anyhow::anyhow!("{}: {e}", options.spool.display()))?;
    for chunk in records.chunks(BATCH) {
        validate_batch(chunk).map_err(|e| anyhow::anyhow!("{}: {e}", options.spool.display()))?;
    }
    let store = Arc::new(Store::open(&config.store()?).await?);
    store.wait_ready().await?;
    let ingest = Ingest::standalone(store.clone(), config.detection());
    ingest
        .register_run(&run_id, registration)
        .await
        .with_context(|| format!("registering {}", run_id.as_str()))?;
    let mut imported = Imported {
        run_id: run_id.as_str().to_owned(),
        accepted: 0,
        duplicates: 0,
        last_step: None,
    };
    for chunk in records.chunks(BATCH) {
        let outcome = ingest.ingest(&run_id, chunk).await?;
        imported.accepted += outcome.accepted as u64;
        imported.duplicates += outcome.duplicates as u64;
        imported.last_step = outcome.last_step.or(imported.last_step);
    }
    // A spool is what a client left when it stopped: the run is over, not live.
    store
        .finish_run(&run_id)
        .await
        .with_context(|| format!("marking {} finished", run_id.as_str()))?;
    store.close().await?;
    Ok(imported)
}

pub async fn run(config: &ServerConfig, options: &ImportOptions) -> anyhow::Result<()> {
    let done = import(config, options).await?;
    println!(
        "imported {} step records into run {} in {} ({} already there); last step {}",
        done.accepted,
        done.run_id,
        config.database_url()?.display(),
        done.duplicates,
        done.last_step
            .map_or_else(|| "none".to_owned(), |s| s.to_string()),
    );
    Ok(())
}
