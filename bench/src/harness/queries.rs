//! Read latency over HTTP against a server holding one long run and many short
//! ones: 1,000-point series out of the long run, its `grad-flow` chart, the runs
//! list and the alerts across every run. Each request is timed from send to the last
//! byte of the answer, on a kept-alive connection, after two unmeasured warm-ups.

use std::time::{Duration, Instant};

use anyhow::Context;
use gradflow_e2e::ServerProcess;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Value, json};

use super::alarms::WorkloadAlarms;
use crate::stats::{ms, quantile};
use crate::workload::{BatchWriter, Generator, Shape};

#[derive(Debug, Clone)]
pub struct QuerySpec {
    /// Steps of the long run.
    pub long_steps: u64,
    /// Modules of the long run (the chart draws one row per module).
    pub long_modules: usize,
    /// Runs in all, the long one included.
    pub runs: usize,
    /// Timed requests per query.
    pub repeats: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QueryTiming {
    pub name: String,
    pub path: String,
    pub median_ms: f64,
    /// NaN (JSON null) in results written before the reads during ingest kept
    /// their maximum (docs/benchmarks/results.json among them).
    #[serde(deserialize_with = "nan_if_null")]
    pub max_ms: f64,
    pub response_bytes: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct QueryResult {
    pub long_steps: u64,
    pub long_modules: usize,
    pub runs: usize,
    pub alerts: usize,
    /// Alerts by kind and subject, to show what the reads had to return.
    pub alert_kinds: std::collections::BTreeMap<String, usize>,
    /// What each workload raised, labelled: the long run (healthy by construction,
    /// but registering the norm weights of one more layer than it reports modules
    /// of) and the short runs (one dead module each, every other module healthy).
    pub alarms: Vec<WorkloadAlarms>,
    pub build_seconds: f64,
    pub timings: Vec<QueryTiming>,
}

const LONG_RUN: &str = "long";

/// serde_json writes NaN as null; read it back as NaN.
fn nan_if_null<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(deserializer)?.unwrap_or(f64::NAN))
}

/// Builds the data set on a fresh server, then times the reads.
pub async fn run(spec: &QuerySpec) -> anyhow::Result<QueryResult> {
    let dir = tempfile::tempdir().context("a temporary directory")?;
    let server = ServerProcess::start(&dir.path().join("queries.db"), &[]);
    let client = reqwest::Client::new();
    let started = Instant::now();
    let shape = Shape::with_modules(spec.long_modules);
    stream_run(&client, &server, LONG_RUN, shape, spec.long_steps, 500).await?;
    add_short_runs(&client, &server, spec.runs.saturating_sub(1)).await?;
    let build_seconds = started.elapsed().as_secs_f64();

    let alert_list = alerts_at(&client, &server, "/api/v1/alerts").await?;
    let mut alert_kinds = std::collections::BTreeMap::new();
    for a in &alert_list {
        let key = format!(
            "{} on {}",
            a["kind"].as_str().unwrap_or("?"),
            a["subject"].as_str().unwrap_or("?")
        );
        *alert_kinds.entry(key).or_insert(0) += 1;
    }
    let (long, short): (Vec<Value>, Vec<Value>) = alert_list
        .iter()
        .cloned()
        .partition(|a| a["run_id"] == LONG_RUN);
    let short_runs = spec.runs.saturating_sub(1);
    let alarms = vec![
        WorkloadAlarms::label(
            &format!(
                "queries: the long run ({} i.i.d. healthy steps × {} modules)",
                spec.long_steps, spec.long_modules
            ),
            spec.long_steps,
            &long,
            // The server is right to say the unreported layer's modules never report.
            |a| {
                shape.registers_unreported_layer()
                    && a["kind"] == "unused_parameters"
                    && a["subject"] == "qwen"
            },
        ),
        WorkloadAlarms::label(
            &format!("queries: {short_runs} short runs (60 steps, {DEAD_MODULE} dead)"),
            60 * short_runs as u64,
            &short,
            |a| a["kind"] == "grad_stuck_zero" && a["subject"] == DEAD_MODULE,
        ),
    ];
    let module = &shape.module_names()[17];
    let queries = [
        (
            "series: loss, 1,000 points",
            format!("/api/v1/runs/{LONG_RUN}/series?metric=loss&max_points=1000"),
        ),
        (
            "series: a module's grad_norm, 1,000 points",
            format!(
                "/api/v1/runs/{LONG_RUN}/series?metric=grad_norm&subject={module}&max_points=1000"
            ),
        ),
        (
            "grad-flow chart (SVG)",
            format!("/api/v1/runs/{LONG_RUN}/charts/grad-flow.svg"),
        ),
        (
            "grad-flow chart (PNG)",
            format!("/api/v1/runs/{LONG_RUN}/charts/grad-flow.png"),
        ),
        ("runs list", "/api/v1/runs".to_owned()),
        ("alerts, every run", "/api/v1/alerts".to_owned()),
        (
            "open alerts, every run",
            "/api/v1/alerts?status=open".to_owned(),
        ),
    ];
    let mut timings = Vec::new();
    for (name, path) in queries {
        timings.push(time_get(&client, &server, name, &path, spec.repeats).await?);
    }
    let status = server.terminate();
    anyhow::ensure!(status.success(), "the server stopped with {status}");
    Ok(QueryResult {
        long_steps: spec.long_steps,
        long_modules: spec.long_modules,
        runs: spec.runs,
        alerts: alert_list.len(),
        alert_kinds,
        alarms,
        build_seconds,
        timings,
    })
}

impl QueryTiming {
    /// The median and maximum of `times`, in any order.
    pub fn of(
        name: &str,
        path: &str,
        mut times: Vec<Duration>,
        response_bytes: usize,
    ) -> QueryTiming {
        times.sort();
        QueryTiming {
            name: name.to_owned(),
            path: path.to_owned(),
            median_ms: ms(quantile(&times, 0.5)),
            max_ms: ms(quantile(&times, 1.0)),
            response_bytes,
        }
    }
}

/// One GET of `url`, timed from send to the last byte; the answer must be 200.
/// Returns the time and the answer's length.
pub async fn timed_get(client: &reqwest::Client, url: &str) -> anyhow::Result<(Duration, usize)> {
    let sent = Instant::now();
    let response = client.get(url).send().await?;
    anyhow::ensure!(
        response.status() == 200,
        "{url}: HTTP {}",
        response.status()
    );
    let body = response.bytes().await?;
    Ok((sent.elapsed(), body.len()))
}

/// Times `repeats` GETs of `path` after two unmeasured warm-ups.
pub async fn time_get(
    client: &reqwest::Client,
    server: &ServerProcess,
    name: &str,
    path: &str,
    repeats: usize,
) -> anyhow::Result<QueryTiming> {
    let url = server.url(path);
    let mut times = Vec::with_capacity(repeats);
    let mut response_bytes = 0;
    for i in 0..repeats + 2 {
        let (time, bytes) = timed_get(client, &url).await?;
        if i >= 2 {
            times.push(time);
        }
        response_bytes = bytes;
    }
    Ok(QueryTiming::of(name, path, times, response_bytes))
}

/// Registers `run` and streams `steps` healthy steps of `shape` into it.
pub async fn stream_run(
    client: &reqwest::Client,
    server: &ServerProcess,
    run: &str,
    shape: Shape,
    steps: u64,
    batch: u64,
) -> anyhow::Result<()> {
    register(client, server, run, &shape.registration(run)).await?;
    stream_steps(client, server, run, shape, 0..steps, batch).await
}

/// Streams the healthy steps `range` of `shape` into the registered `run`, `batch`
/// steps a request. Bodies are built on a separate thread while earlier ones are
/// in flight.
pub async fn stream_steps(
    client: &reqwest::Client,
    server: &ServerProcess,
    run: &str,
    shape: Shape,
    range: std::ops::Range<u64>,
    batch: u64,
) -> anyhow::Result<()> {
    let (sender, mut receiver) = tokio::sync::mpsc::channel::<Vec<u8>>(2);
    let builder = std::thread::spawn(move || {
        let writer = BatchWriter::new(shape);
        let mut generator = Generator::new(shape, range.start);
        for first in range.clone().step_by(batch as usize) {
            let body = writer.batch(&generator.steps(first, batch.min(range.end - first)));
            if sender.blocking_send(body).is_err() {
                return;
            }
        }
    });
    let url = server.url(&format!("/api/v1/runs/{run}/steps"));
    while let Some(body) = receiver.recv().await {
        post(client, &url, body).await?;
    }
    builder
        .join()
        .map_err(|_| anyhow::anyhow!("the body builder panicked"))?;
    Ok(())
}

/// The module the short runs leave without a gradient.
const DEAD_MODULE: &str = "agent.head";

/// Short runs of 60 steps in which one module never gets a gradient: each opens a
/// `grad_stuck_zero` alert on its 50th step, and every other run's resolves on step 55.
async fn add_short_runs(
    client: &reqwest::Client,
    server: &ServerProcess,
    count: usize,
) -> anyhow::Result<()> {
    let modules = ["agent.encoder", "agent.policy", "agent.value", DEAD_MODULE];
    let registration = json!({
        "precision": {"param_dtype": "f32"},
        "params": modules.iter().map(|m| json!({"name": format!("{m}.weight"), "role": "linear", "dtype": "f32"})).collect::<Vec<_>>(),
    });
    let steps = |resolves: bool| -> Vec<u8> {
        let records: Vec<Value> = (0..60u64)
            .map(|step| {
                let dead = !(resolves && step >= 55);
                json!({
                    "step": step, "loss": 2.0 - step as f64 * 0.01, "lr": 1e-3,
                    "modules": modules.iter().enumerate().map(|(i, m)| {
                        if i == 3 && dead {
                            json!({"module": m, "grad_norm": 0.0, "hook_hits": 0})
                        } else {
                            json!({"module": m, "grad_norm": 0.01 * (i + 1) as f64 + step as f64 * 1e-4, "hook_hits": 1})
                        }
                    }).collect::<Vec<_>>(),
                })
            })
            .collect();
        serde_json::to_vec(&records).expect("JSON")
    };
    let bodies = [steps(false), steps(true)];
    let workers = 4;
    let tasks: Vec<_> = (0..workers)
        .map(|w| {
            let (client, registration, bodies) =
                (client.clone(), registration.clone(), bodies.clone());
            let base = server.base.clone();
            tokio::spawn(async move {
                for i in (w..count).step_by(workers) {
                    let run = format!("short-{i:04}");
                    let url = format!("{base}/api/v1/runs/{run}");
                    let response = client.put(&url).json(&registration).send().await?;
                    anyhow::ensure!(
                        response.status().is_success(),
                        "{url}: HTTP {}",
                        response.status()
                    );
                    post(&client, &format!("{url}/steps"), bodies[i % 2].clone()).await?;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok(())
}

/// The alerts `server` answers at `path` (`/api/v1/alerts`, or a run's), as the
/// JSON objects of its `alerts` array.
pub async fn alerts_at(
    client: &reqwest::Client,
    server: &ServerProcess,
    path: &str,
) -> anyhow::Result<Vec<Value>> {
    let mut body: Value = client.get(server.url(path)).send().await?.json().await?;
    match body["alerts"].take() {
        Value::Array(alerts) => Ok(alerts),
        other => anyhow::bail!("GET {path}: no alerts array, but {other}"),
    }
}

pub async fn register(
    client: &reqwest::Client,
    server: &ServerProcess,
    run: &str,
    body: &Value,
) -> anyhow::Result<()> {
    let url = server.url(&format!("/api/v1/runs/{run}"));
    let response = client.put(&url).json(body).send().await?;
    anyhow::ensure!(
        response.status().is_success(),
        "{url}: HTTP {}",
        response.status()
    );
    Ok(())
}

pub async fn post(client: &reqwest::Client, url: &str, body: Vec<u8>) -> anyhow::Result<()> {
    post_as(client, url, "application/json", body).await
}

/// [`post`] with another `Content-Type` (`application/cbor`).
pub async fn post_as(
    client: &reqwest::Client,
    url: &str,
    content_type: &str,
    body: Vec<u8>,
) -> anyhow::Result<()> {
    let response = client
        .post(url)
        .header("content-type", content_type)
        .body(body)
        .send()
        .await?;
    let status = response.status();
    anyhow::ensure!(
        status == 200,
        "{url}: HTTP {status}: {}",
        response.text().await?
    );
    Ok(())
}
