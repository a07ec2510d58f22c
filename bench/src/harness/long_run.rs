//! A long run's series reads: one run grown to 10⁶ steps over HTTP, then its
//! 1,000-point series (`loss`, and one module's `grad_norm`) read with every rollup
//! level the run has and, in the same rounds on the same database, with only the
//! levels a run registered before the 1,024-step level reads (`rollup_widths` set
//! back to `64,4096` between the reads): the read path before and after, side by
//! side.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use gradflow_e2e::ServerProcess;
use serde::{Deserialize, Serialize};

use super::queries::{self, timed_get};
use crate::stats::{median, ms};
use crate::workload::Shape;

/// What to grow and how often to read it.
#[derive(Debug, Clone, Copy)]
pub struct LongRunSpec {
    pub steps: u64,
    pub modules: usize,
    pub rounds: usize,
}

/// One read, timed with each set of levels.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LevelsTiming {
    pub name: String,
    pub path: String,
    /// Median over the rounds, every level (64, 1,024 and 4,096 steps).
    pub all_levels_ms: f64,
    /// Median over the rounds, the two levels of before (64 and 4,096 steps).
    pub two_levels_ms: f64,
    /// Median of the per-round ratios two levels ÷ all levels.
    pub speedup: f64,
    pub points: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LongRunResult {
    pub steps: u64,
    pub modules: usize,
    pub rounds: usize,
    pub ingest_seconds: f64,
    pub module_values_per_second: f64,
    pub bytes_per_module_value: f64,
    pub reads: Vec<LevelsTiming>,
}

fn set_widths(db: &Path, widths: &str) -> anyhow::Result<()> {
    let conn = rusqlite::Connection::open(db).context("opening the benchmark's database")?;
    conn.busy_timeout(Duration::from_secs(10))?;
    conn.execute(
        "UPDATE runs SET rollup_widths = ?1 WHERE run_id = 'long'",
        [widths],
    )?;
    Ok(())
}

async fn points_of(client: &reqwest::Client, url: &str) -> anyhow::Result<usize> {
    let body: serde_json::Value = client.get(url).send().await?.json().await?;
    Ok(body["points"].as_array().map_or(0, Vec::len))
}

pub async fn run(spec: &LongRunSpec) -> anyhow::Result<LongRunResult> {
    let dir = tempfile::tempdir().context("a temporary directory")?;
    let db = dir.path().join("long.db");
    let server = ServerProcess::start(&db, &[]);
    let client = reqwest::Client::new();
    let shape = Shape::with_modules(spec.modules);
    let module = shape.module_names()[spec.modules / 2].clone();
    queries::register(&client, &server, "long", &shape.registration("long")).await?;
    let started = Instant::now();
    queries::stream_steps(&client, &server, "long", shape, 0..spec.steps, 500).await?;
    let ingest_seconds = started.elapsed().as_secs_f64();
    let bytes = crate::server::bytes_on_disk(&db) as f64;
    let reads = [
        (
            "1,000-point `loss` series".to_owned(),
            "/api/v1/runs/long/series?metric=loss&max_points=1000".to_owned(),
        ),
        (
            "1,000-point series of a module".to_owned(),
            format!("/api/v1/runs/long/series?metric=grad_norm&subject={module}&max_points=1000"),
        ),
    ];
    let mut all: Vec<Vec<f64>> = vec![Vec::new(); reads.len()];
    let mut two: Vec<Vec<f64>> = vec![Vec::new(); reads.len()];
    // Two rounds of warm-up, then `rounds` timed, each reading with both sets of levels.
    for round in 0..spec.rounds + 2 {
        for (widths, times) in [("64,1024,4096", &mut all), ("64,4096", &mut two)] {
            set_widths(&db, widths)?;
            for (i, (_, path)) in reads.iter().enumerate() {
                let (time, _) = timed_get(&client, &server.url(path)).await?;
                if round >= 2 {
                    times[i].push(ms(time));
                }
            }
        }
    }
    set_widths(&db, "64,1024,4096")?;
    let mut timings = Vec::new();
    for (i, (name, path)) in reads.iter().enumerate() {
        timings.push(LevelsTiming {
            name: name.clone(),
            path: path.clone(),
            all_levels_ms: median(all[i].iter().copied()),
            two_levels_ms: median(two[i].iter().copied()),
            speedup: median(all[i].iter().zip(&two[i]).map(|(a, b)| b / a)),
            points: points_of(&client, &server.url(path)).await?,
        });
    }
    let status = server.terminate();
    anyhow::ensure!(status.success(), "the server stopped with {status}");
    Ok(LongRunResult {
        steps: spec.steps,
        modules: spec.modules,
        rounds: spec.rounds,
        ingest_seconds,
        module_values_per_second: (spec.steps * spec.modules as u64) as f64 / ingest_seconds,
        bytes_per_module_value: bytes / (spec.steps * spec.modules as u64) as f64,
        reads: timings,
    })
}
