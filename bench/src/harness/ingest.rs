//! Ingest through the real HTTP API: `clients` concurrent clients, each streaming
//! its own run to a fresh `gradflow-server` in batches, bodies built before the clock
//! starts. Throughput counts module gradient norms persisted (answered 200, hence
//! durable) per second; the file is measured after the server stops.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use gradflow_e2e::ServerProcess;
use serde::Serialize;

use super::alarms::WorkloadAlarms;
use super::queries::{QueryTiming, post, register, time_get, timed_get};
use crate::server::bytes_on_disk;
use crate::stats::{ms, quantile};
use crate::workload::{BatchWriter, Generator, Shape};

#[derive(Debug, Clone)]
pub struct IngestSpec {
    pub clients: usize,
    pub steps_per_client: u64,
    pub batch_steps: u64,
    pub shape: Shape,
    /// Flags for the server (e.g. `--disable-detectors`).
    pub server_args: Vec<String>,
    /// While ingesting, read a 1,000-point series of the first run every 50 ms and
    /// report those latencies too.
    pub probe_queries: bool,
    /// Reads timed after the ingest, before the server stops: (name, path).
    pub queries_after: Vec<(String, String)>,
    /// Timed requests per read in `queries_after`.
    pub query_repeats: usize,
}

impl IngestSpec {
    pub fn target(steps_per_client: u64) -> IngestSpec {
        IngestSpec {
            clients: 4,
            steps_per_client,
            batch_steps: 50,
            shape: Shape::QWEN_1_5B,
            server_args: Vec::new(),
            probe_queries: false,
            queries_after: Vec::new(),
            query_repeats: 9,
        }
    }

    pub fn module_values(&self) -> u64 {
        self.clients as u64 * self.steps_per_client * self.shape.modules as u64
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct IngestResult {
    pub module_values: u64,
    pub values: u64,
    pub seconds: f64,
    pub module_values_per_second: f64,
    pub batch_latency_p50_ms: f64,
    pub batch_latency_p99_ms: f64,
    /// The database and its WAL after the server stopped.
    pub bytes_on_disk: u64,
    pub bytes_per_module_value: f64,
    pub bytes_per_value: f64,
    /// The series reads made while ingesting (`probe_queries`).
    pub probe: Option<QueryTiming>,
    /// `queries_after`, in order.
    pub queries: Vec<QueryTiming>,
    /// What the detectors raised on these healthy runs (`None` with them off).
    pub alarms: Option<WorkloadAlarms>,
}

/// Runs one measurement on a fresh server and database.
pub async fn http(spec: &IngestSpec) -> anyhow::Result<IngestResult> {
    let dir = tempfile::tempdir().context("a temporary directory")?;
    let db: PathBuf = dir.path().join("ingest.db");
    let args: Vec<&str> = spec.server_args.iter().map(String::as_str).collect();
    let server = ServerProcess::start(&db, &args);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(spec.clients + 1)
        .build()?;

    let writer = BatchWriter::new(spec.shape);
    let mut bodies = Vec::with_capacity(spec.clients);
    for c in 0..spec.clients {
        let run = format!("bench-{c}");
        register(&client, &server, &run, &spec.shape.registration(&run)).await?;
        let mut generator = Generator::new(spec.shape, c as u64);
        let batches: Vec<Vec<u8>> = (0..spec.steps_per_client)
            .step_by(spec.batch_steps as usize)
            .map(|first| {
                let count = spec.batch_steps.min(spec.steps_per_client - first);
                writer.batch(&generator.steps(first, count))
            })
            .collect();
        bodies.push((run, batches));
    }

    let stop_probe = Arc::new(AtomicBool::new(false));
    let probe = spec.probe_queries.then(|| {
        tokio::spawn(probe(
            client.clone(),
            server.base.clone(),
            stop_probe.clone(),
        ))
    });
    let started = Instant::now();
    let tasks: Vec<_> = bodies
        .into_iter()
        .map(|(run, batches)| {
            let client = client.clone();
            let url = server.url(&format!("/api/v1/runs/{run}/steps"));
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(batches.len());
                for body in batches {
                    let sent = Instant::now();
                    post(&client, &url, body).await?;
                    latencies.push(sent.elapsed());
                }
                anyhow::Ok(latencies)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await??);
    }
    let seconds = started.elapsed().as_secs_f64();
    stop_probe.store(true, Ordering::Relaxed);
    let probe = match probe {
        Some(task) => Some(task.await??),
        None => None,
    };
    let mut queries = Vec::new();
    for (name, path) in &spec.queries_after {
        queries.push(time_get(&client, &server, name, path, spec.query_repeats).await?);
    }
    let detectors_on = !spec.server_args.iter().any(|a| a == "--disable-detectors");
    let alarms = if detectors_on {
        let alerts: serde_json::Value = client
            .get(server.url("/api/v1/alerts"))
            .send()
            .await?
            .json()
            .await?;
        Some(WorkloadAlarms::label(
            &format!(
                "{} runs × {} i.i.d. healthy steps × {} modules",
                spec.clients, spec.steps_per_client, spec.shape.modules
            ),
            spec.clients as u64 * spec.steps_per_client,
            alerts["alerts"].as_array().map_or(&[], Vec::as_slice),
            // The server is right to say the unreported layer's modules never report.
            |a| {
                spec.shape.registers_unreported_layer()
                    && a["kind"] == "unused_parameters"
                    && a["subject"] == "qwen"
            },
        ))
    } else {
        None
    };
    let status = server.terminate();
    anyhow::ensure!(status.success(), "the server stopped with {status}");
    latencies.sort();

    let module_values = spec.module_values();
    let values = spec.clients as u64 * spec.steps_per_client * spec.shape.values_per_step() as u64;
    let bytes = bytes_on_disk(&db);
    Ok(IngestResult {
        module_values,
        values,
        seconds,
        module_values_per_second: module_values as f64 / seconds,
        batch_latency_p50_ms: ms(quantile(&latencies, 0.5)),
        batch_latency_p99_ms: ms(quantile(&latencies, 0.99)),
        bytes_on_disk: bytes,
        bytes_per_module_value: bytes as f64 / module_values as f64,
        bytes_per_value: bytes as f64 / values as f64,
        probe,
        queries,
        alarms,
    })
}

/// Reads a 1,000-point series of the first run every 50 ms until `stop`.
async fn probe(
    client: reqwest::Client,
    base: String,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<QueryTiming> {
    let path = "/api/v1/runs/bench-0/series?metric=loss&max_points=1000";
    let url = format!("{base}{path}");
    let mut times = Vec::new();
    let mut response_bytes = 0;
    while !stop.load(Ordering::Relaxed) {
        // Before the first batch lands the run has no steps yet: still an answer.
        let (time, bytes) = timed_get(&client, &url).await?;
        times.push(time);
        response_bytes = bytes;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(QueryTiming::of(
        "1,000-point series during ingest",
        path,
        times,
        response_bytes,
    ))
}
