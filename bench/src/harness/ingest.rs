//! Ingest through the real HTTP API: `clients` concurrent clients, each streaming
//! its own run in batches to a fresh `gradflow-server` (or to two replicas of it on
//! one PostgreSQL database), bodies built before the clock starts. Throughput counts
//! module gradient norms persisted (answered 200, hence durable) per second; the
//! database is measured after the servers stop.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gradflow_e2e::ServerProcess;
use serde::Serialize;

use super::alarms::WorkloadAlarms;
use super::backend::{Backend, Database};
use super::queries::{QueryTiming, alerts_at, post_as, register, time_get, timed_get};
use crate::server::cpu_seconds;
use crate::stats::{ms, quantile};
use crate::workload::{BatchWriter, Generator, Shape, Trace};

#[derive(Debug, Clone)]
pub struct IngestSpec {
    pub clients: usize,
    pub steps_per_client: u64,
    pub batch_steps: u64,
    pub shape: Shape,
    /// The telemetry the clients send.
    pub trace: Trace,
    /// Where the servers keep it: a fresh database either way.
    pub backend: Backend,
    /// How many servers share the database, and which one a batch goes to.
    pub replicas: Replicas,
    /// Flags for the server (e.g. `--disable-detectors`).
    pub server_args: Vec<String>,
    /// While ingesting, read a 1,000-point series of the first run every 50 ms and
    /// report those latencies too.
    pub probe_queries: bool,
    /// Reads timed after the ingest, before the server stops: (name, path).
    pub queries_after: Vec<(String, String)>,
    /// Timed requests per read in `queries_after`.
    pub query_repeats: usize,
    /// How the bodies are encoded.
    pub body: BodyType,
}

/// The `Content-Type` of the step batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BodyType {
    /// `application/json`, as the Python client sends.
    Json,
    /// `application/cbor` (protocol v1.6), as the Rust trainer sends: the same
    /// records, encoded from the typed `StepRecord`s.
    Cbor,
}

impl BodyType {
    pub fn content_type(self) -> &'static str {
        match self {
            BodyType::Json => "application/json",
            BodyType::Cbor => gradflow_protocol::CBOR_CONTENT_TYPE,
        }
    }

    /// The batch `json` in this encoding.
    fn encode(self, json: Vec<u8>) -> anyhow::Result<Vec<u8>> {
        Ok(match self {
            BodyType::Json => json,
            BodyType::Cbor => {
                let records: Vec<gradflow_protocol::StepRecord> = serde_json::from_slice(&json)?;
                gradflow_protocol::to_cbor(&records)
            }
        })
    }
}

/// The servers of a measurement, and the one each batch goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Replicas {
    /// One server.
    One,
    /// Two servers on one PostgreSQL database; client `c` sends every batch to
    /// server `c mod 2` (clients 0 and 2 to A, 1 and 3 to B).
    ByClient,
    /// Two servers on one PostgreSQL database; batch `b` of client `c` goes to server
    /// `(c + b) mod 2`, so every batch of a run finds it moved on by the other
    /// server: the run's row lock, and its state read back, on every batch.
    Alternating,
}

impl Replicas {
    pub fn servers(self) -> usize {
        match self {
            Replicas::One => 1,
            Replicas::ByClient | Replicas::Alternating => 2,
        }
    }

    /// The server batch `batch` of client `client` goes to.
    fn server_of(self, client: usize, batch: usize) -> usize {
        match self {
            Replicas::One => 0,
            Replicas::ByClient => client % 2,
            Replicas::Alternating => (client + batch) % 2,
        }
    }
}

impl IngestSpec {
    /// The ingest target: 4 clients of the i.i.d. trace, one server on SQLite.
    pub fn target(steps_per_client: u64) -> IngestSpec {
        IngestSpec {
            clients: 4,
            steps_per_client,
            batch_steps: 50,
            shape: Shape::QWEN_1_5B,
            trace: Trace::Iid,
            backend: Backend::Sqlite,
            replicas: Replicas::One,
            server_args: Vec::new(),
            probe_queries: false,
            queries_after: Vec::new(),
            query_repeats: 9,
            body: BodyType::Json,
        }
    }

    pub fn module_values(&self) -> u64 {
        self.clients as u64 * self.steps_per_client * self.shape.modules as u64
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct IngestResult {
    /// `SQLite` or `PostgreSQL`.
    pub backend: &'static str,
    /// `i.i.d.` or `realistic`.
    pub trace: &'static str,
    pub replicas: Replicas,
    pub module_values: u64,
    pub values: u64,
    pub seconds: f64,
    pub module_values_per_second: f64,
    pub values_per_second: f64,
    pub batch_latency_p50_ms: f64,
    pub batch_latency_p99_ms: f64,
    /// CPU the servers used while the clients posted, in seconds (÷ `seconds`: how
    /// many cores they kept busy).
    pub server_cpu_seconds: f64,
    /// The database after the servers stopped: SQLite's file and WAL, PostgreSQL's
    /// tables with their TOAST and indexes (see `Database::bytes`).
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

/// Runs one measurement on a fresh database and fresh servers.
pub async fn http(spec: &IngestSpec) -> anyhow::Result<IngestResult> {
    anyhow::ensure!(
        spec.replicas == Replicas::One || matches!(spec.backend, Backend::Postgres(_)),
        "replicas share a PostgreSQL database, not a SQLite file"
    );
    let database = Database::fresh(&spec.backend).await?;
    let mut servers = Vec::with_capacity(spec.replicas.servers());
    // One after the other: the first migrates the fresh database.
    for _ in 0..spec.replicas.servers() {
        servers.push(database.start(&spec.server_args).await?);
    }
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(spec.clients + 1)
        .build()?;

    let writer = BatchWriter::new(spec.shape);
    let mut bodies = Vec::with_capacity(spec.clients);
    for c in 0..spec.clients {
        let run = format!("bench-{c}");
        let home = &servers[spec.replicas.server_of(c, 0)];
        register(&client, home, &run, &spec.shape.registration(&run)).await?;
        let mut generator = Generator::with_trace(spec.shape, c as u64, spec.trace);
        let urls: Vec<String> = servers
            .iter()
            .map(|s| s.url(&format!("/api/v1/runs/{run}/steps")))
            .collect();
        let batches: Vec<(String, Vec<u8>)> = (0..spec.steps_per_client)
            .step_by(spec.batch_steps as usize)
            .enumerate()
            .map(|(b, first)| {
                let count = spec.batch_steps.min(spec.steps_per_client - first);
                let url = urls[spec.replicas.server_of(c, b)].clone();
                let body = spec
                    .body
                    .encode(writer.batch(&generator.steps(first, count)))?;
                anyhow::Ok((url, body))
            })
            .collect::<anyhow::Result<_>>()?;
        bodies.push(batches);
    }

    let stop_probe = Arc::new(AtomicBool::new(false));
    let probe = spec.probe_queries.then(|| {
        tokio::spawn(probe(
            client.clone(),
            servers[0].base.clone(),
            stop_probe.clone(),
        ))
    });
    let server_cpu = || -> f64 { servers.iter().filter_map(|s| cpu_seconds(s.pid())).sum() };
    let cpu_before = server_cpu();
    let started = Instant::now();
    let tasks: Vec<_> = bodies
        .into_iter()
        .map(|batches| {
            let client = client.clone();
            let content_type = spec.body.content_type();
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(batches.len());
                for (url, body) in batches {
                    let sent = Instant::now();
                    post_as(&client, &url, content_type, body).await?;
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
    let server_cpu_seconds = server_cpu() - cpu_before;
    stop_probe.store(true, Ordering::Relaxed);
    let probe = match probe {
        Some(task) => Some(task.await??),
        None => None,
    };
    let mut queries = Vec::new();
    for (name, path) in &spec.queries_after {
        queries.push(time_get(&client, &servers[0], name, path, spec.query_repeats).await?);
    }
    let detectors_on = !spec.server_args.iter().any(|a| a == "--disable-detectors");
    let alarms = if detectors_on {
        Some(alarms(&client, &servers[0], spec).await?)
    } else {
        None
    };
    for server in servers {
        let status = server.terminate();
        anyhow::ensure!(status.success(), "the server stopped with {status}");
    }
    latencies.sort();

    let module_values = spec.module_values();
    let values = spec.clients as u64 * spec.steps_per_client * spec.shape.values_per_step() as u64;
    let bytes = database.bytes().await?;
    database.remove().await?;
    Ok(IngestResult {
        backend: spec.backend.name(),
        trace: spec.trace.name(),
        replicas: spec.replicas,
        module_values,
        values,
        seconds,
        module_values_per_second: module_values as f64 / seconds,
        values_per_second: values as f64 / seconds,
        batch_latency_p50_ms: ms(quantile(&latencies, 0.5)),
        batch_latency_p99_ms: ms(quantile(&latencies, 0.99)),
        server_cpu_seconds,
        bytes_on_disk: bytes,
        bytes_per_module_value: bytes as f64 / module_values as f64,
        bytes_per_value: bytes as f64 / values as f64,
        probe,
        queries,
        alarms,
    })
}

/// What the detectors raised on the clients' healthy runs, labelled.
async fn alarms(
    client: &reqwest::Client,
    server: &ServerProcess,
    spec: &IngestSpec,
) -> anyhow::Result<WorkloadAlarms> {
    let alerts = alerts_at(client, server, "/api/v1/alerts").await?;
    Ok(WorkloadAlarms::label(
        &format!(
            "{} runs × {} {} healthy steps × {} modules",
            spec.clients,
            spec.steps_per_client,
            spec.trace.name(),
            spec.shape.modules
        ),
        spec.clients as u64 * spec.steps_per_client,
        &alerts,
        // The server is right to say the unreported layer's modules never report.
        |a| {
            spec.shape.registers_unreported_layer()
                && a["kind"] == "unused_parameters"
                && a["subject"] == "qwen"
        },
    ))
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
