//! How ingest and read costs grow along three axes: modules per step, concurrent
//! runs, and run length.

use std::time::Instant;

use anyhow::Context;
use gradflow_e2e::ServerProcess;
use serde::{Deserialize, Serialize};

use super::alarms::WorkloadAlarms;
use super::ingest::{self, IngestSpec};
use super::queries::{self, QueryTiming, alerts_at, time_get};
use crate::workload::Shape;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Point {
    pub x: u64,
    pub module_values_per_second: f64,
    pub bytes_per_module_value: Option<f64>,
    pub batch_latency_p50_ms: Option<f64>,
    pub queries: Vec<QueryTiming>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sweep {
    /// A short name, for the plot's file (`scaling-{slug}.svg`).
    pub slug: String,
    /// What varies, for the plot's x axis.
    pub axis: String,
    /// How each point was made.
    pub method: String,
    pub points: Vec<Point>,
    /// What the detectors raised on the sweep's healthy runs.
    #[serde(default)]
    pub alarms: Vec<WorkloadAlarms>,
}

fn chart_and_series(run: &str, module: &str) -> Vec<(String, String)> {
    vec![
        (
            "1,000-point series".to_owned(),
            format!("/api/v1/runs/{run}/series?metric=grad_norm&subject={module}&max_points=1000"),
        ),
        (
            "grad-flow chart".to_owned(),
            format!("/api/v1/runs/{run}/charts/grad-flow.svg"),
        ),
    ]
}

/// Modules per step, 4 clients of `steps` steps each.
pub async fn modules(widths: &[usize], steps: u64) -> anyhow::Result<Sweep> {
    let mut points = Vec::new();
    let mut alarms = Vec::new();
    for &modules in widths {
        let shape = Shape::with_modules(modules);
        let module = shape.module_names()[modules / 2].clone();
        let spec = IngestSpec {
            shape,
            queries_after: chart_and_series("bench-0", &module),
            ..IngestSpec::target(steps)
        };
        let r = ingest::http(&spec)
            .await
            .with_context(|| format!("{modules} modules"))?;
        alarms.extend(r.alarms.clone());
        points.push(Point {
            x: modules as u64,
            module_values_per_second: r.module_values_per_second,
            bytes_per_module_value: Some(r.bytes_per_module_value),
            batch_latency_p50_ms: Some(r.batch_latency_p50_ms),
            queries: r.queries,
        });
    }
    Ok(Sweep {
        slug: "modules".to_owned(),
        axis: "modules per step".to_owned(),
        method: format!(
            "4 clients × {steps} steps, 50 steps a batch, one norm weight per four modules; reads of client 0's run afterwards"
        ),
        points,
        alarms,
    })
}

/// Concurrent runs sharing `total_steps` steps of the target's shape, each streamed
/// by its own client, while a reader asks for a 1,000-point series every 50 ms.
pub async fn runs(counts: &[usize], total_steps: u64) -> anyhow::Result<Sweep> {
    let mut points = Vec::new();
    let mut alarms = Vec::new();
    for &clients in counts {
        let spec = IngestSpec {
            clients,
            steps_per_client: total_steps / clients as u64,
            probe_queries: true,
            ..IngestSpec::target(0)
        };
        let r = ingest::http(&spec)
            .await
            .with_context(|| format!("{clients} runs"))?;
        alarms.extend(r.alarms.clone());
        points.push(Point {
            x: clients as u64,
            module_values_per_second: r.module_values_per_second,
            bytes_per_module_value: Some(r.bytes_per_module_value),
            batch_latency_p50_ms: Some(r.batch_latency_p50_ms),
            queries: r.probe.into_iter().collect(),
        });
    }
    Ok(Sweep {
        slug: "runs".to_owned(),
        axis: "concurrent runs".to_owned(),
        method: format!(
            "{total_steps} steps of 230 modules + 57 norm weights split over N clients (one run each), 50 steps a batch; a reader asks for a 1,000-point series of run 0 every 50 ms meanwhile"
        ),
        points,
        alarms,
    })
}

/// One run of `modules` modules grown through `lengths` steps; at each length, the
/// ingest rate of the stretch just streamed and the reads of the run so far.
pub async fn length(lengths: &[u64], modules: usize) -> anyhow::Result<Sweep> {
    let dir = tempfile::tempdir().context("a temporary directory")?;
    let db = dir.path().join("length.db");
    let server = ServerProcess::start(&db, &[]);
    let client = reqwest::Client::new();
    let shape = Shape::with_modules(modules);
    let module = shape.module_names()[modules / 2].clone();
    queries::register(&client, &server, "long", &shape.registration("long")).await?;
    let mut points = Vec::new();
    let mut done = 0;
    for &steps in lengths {
        let started = Instant::now();
        queries::stream_steps(&client, &server, "long", shape, done..steps, 500).await?;
        let seconds = started.elapsed().as_secs_f64();
        let stretch = (steps - done) * modules as u64;
        done = steps;
        let mut timings = vec![
            time_get(
                &client,
                &server,
                "1,000-point loss series",
                "/api/v1/runs/long/series?metric=loss&max_points=1000",
                9,
            )
            .await?,
        ];
        for (name, path) in chart_and_series("long", &module) {
            timings.push(time_get(&client, &server, &name, &path, 9).await?);
        }
        points.push(Point {
            x: steps,
            module_values_per_second: stretch as f64 / seconds,
            bytes_per_module_value: Some(
                crate::server::bytes_on_disk(&db) as f64 / (steps * modules as u64) as f64,
            ),
            batch_latency_p50_ms: None,
            queries: timings,
        });
    }
    let alerts = alerts_at(&client, &server, "/api/v1/alerts").await?;
    let alarms = vec![WorkloadAlarms::label(
        &format!("one run of {done} i.i.d. healthy steps × {modules} modules"),
        done,
        &alerts,
        // The server is right to say the unreported layer's modules never report.
        |a| {
            shape.registers_unreported_layer()
                && a["kind"] == "unused_parameters"
                && a["subject"] == "qwen"
        },
    )];
    let status = server.terminate();
    anyhow::ensure!(status.success(), "the server stopped with {status}");
    Ok(Sweep {
        slug: "length".to_owned(),
        axis: "steps in the run".to_owned(),
        method: format!(
            "one run of {modules} modules + {} norm weights, one client, 500 steps a batch, bodies built on a second thread; reads after each stretch",
            modules / 4
        ),
        points,
        alarms,
    })
}
