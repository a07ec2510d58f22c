//! gradflow-load: many simulated trainers stream step batches into a real
//! `gradflow-server` for a fixed time, then report ingest latency (p50, p99, max),
//! throughput, errors and the server's memory and file size. It stops by itself.
//!
//! Each simulated trainer registers a run with one norm parameter per module and
//! sends, in a closed loop (the next batch as soon as the last was answered), batches
//! of `--batch-steps` step records with `--modules` modules each: the heaviest load a
//! trainer can put on the server, not a paced one.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use gradflow_bench::server::{bytes_on_disk, memory};
use gradflow_bench::stats::quantile;
use gradflow_e2e::ServerProcess;
use serde_json::{Value, json};

#[derive(Debug, Parser)]
#[command(name = "gradflow-load", version, about)]
struct Args {
    /// Concurrent simulated trainers, one run each.
    #[arg(long, default_value_t = 16)]
    trainers: usize,
    /// Modules in each step record.
    #[arg(long, default_value_t = 400)]
    modules: usize,
    /// Step records in each POST.
    #[arg(long, default_value_t = 50)]
    batch_steps: u64,
    /// How long to stream, in seconds.
    #[arg(long, default_value_t = 60)]
    duration_secs: u64,
    /// Write the report as JSON here too.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Server flags passed through (e.g. `--server-arg=--sync=normal`).
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    server_args: Vec<String>,
}

/// What one simulated trainer saw.
#[derive(Default)]
struct TrainerResult {
    latencies: Vec<Duration>,
    steps: u64,
    errors: u64,
    first_error: Option<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir().context("a temporary directory for the database")?;
    let server_args: Vec<&str> = args.server_args.iter().map(String::as_str).collect();
    let db = dir.path().join("load.db");
    let server = Arc::new(ServerProcess::start(&db, &server_args));
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.trainers)
        .build()?;
    eprintln!(
        "gradflow-load: {} trainers × {} modules, {} steps a batch, for {} s against {}",
        args.trainers, args.modules, args.batch_steps, args.duration_secs, server.base
    );

    let stop = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(sample_memory(server.clone(), stop.clone()));
    let deadline = Instant::now() + Duration::from_secs(args.duration_secs);
    let trainers: Vec<_> = (0..args.trainers)
        .map(|i| {
            tokio::spawn(simulate_trainer(
                client.clone(),
                server.base.clone(),
                format!("load-{i}"),
                args.modules,
                args.batch_steps,
                deadline,
            ))
        })
        .collect();
    let started = Instant::now();
    let mut total = TrainerResult::default();
    for trainer in trainers {
        let result = trainer.await.context("a trainer task")??;
        total.latencies.extend(result.latencies);
        total.steps += result.steps;
        total.errors += result.errors;
        total.first_error = total.first_error.or(result.first_error);
    }
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let rss_samples = sampler.await.context("the memory sampler")?;
    let report = report(&args, total, elapsed, &server, &db, &rss_samples);
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if report["errors"].as_u64() != Some(0) {
        anyhow::bail!("{} requests failed", report["errors"]);
    }
    Ok(())
}

fn registration(modules: usize) -> Value {
    let params: Vec<Value> = (0..modules)
        .map(|m| json!({"name": format!("model.layers.{m}.norm.weight"), "role": "norm", "dtype": "f32", "shape": [64]}))
        .collect();
    json!({"name": "gradflow-load", "precision": {"param_dtype": "f32"}, "params": params})
}

/// The JSON of one batch. Norms vary by step and module so rows compress as real
/// telemetry does; every number is finite and every hook fired.
fn batch(first: u64, steps: u64, modules: usize) -> String {
    let mut body = String::with_capacity((steps as usize) * modules * 80);
    body.push('[');
    for step in first..first + steps {
        if step > first {
            body.push(',');
        }
        let loss = 4.0 / (1.0 + step as f64 * 1e-3);
        body.push_str(&format!(
            r#"{{"step":{step},"loss":{loss},"lr":0.0003,"modules":["#
        ));
        for m in 0..modules {
            if m > 0 {
                body.push(',');
            }
            let norm = 0.01 + ((step * 31 + m as u64 * 17) % 997) as f64 * 1e-4;
            body.push_str(&format!(
                r#"{{"module":"model.layers.{m}","grad_norm":{norm},"hook_hits":1}}"#
            ));
        }
        body.push_str("]}");
    }
    body.push(']');
    body
}

async fn simulate_trainer(
    client: reqwest::Client,
    base: String,
    run: String,
    modules: usize,
    batch_steps: u64,
    deadline: Instant,
) -> anyhow::Result<TrainerResult> {
    let response = client
        .put(format!("{base}/api/v1/runs/{run}"))
        .json(&registration(modules))
        .send()
        .await?;
    anyhow::ensure!(
        response.status().is_success(),
        "registering {run}: HTTP {}",
        response.status()
    );
    let mut result = TrainerResult::default();
    let mut next = 0;
    while Instant::now() < deadline {
        let body = batch(next, batch_steps, modules);
        let sent = Instant::now();
        let response = client
            .post(format!("{base}/api/v1/runs/{run}/steps"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await;
        let latency = sent.elapsed();
        match response {
            Ok(r) if r.status() == 200 => {
                result.latencies.push(latency);
                result.steps += batch_steps;
                next += batch_steps;
            }
            Ok(r) => {
                result.errors += 1;
                let status = r.status();
                let text = r.text().await.unwrap_or_default();
                result
                    .first_error
                    .get_or_insert(format!("HTTP {status}: {text}"));
            }
            Err(error) => {
                result.errors += 1;
                result.first_error.get_or_insert(error.to_string());
            }
        }
    }
    Ok(result)
}

/// The server's resident memory every 250 ms until `stop`.
async fn sample_memory(server: Arc<ServerProcess>, stop: Arc<AtomicBool>) -> Vec<u64> {
    let mut samples = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        if let Some(memory) = memory(server.pid()) {
            samples.push(memory.resident);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    samples
}

fn report(
    args: &Args,
    mut total: TrainerResult,
    elapsed: Duration,
    server: &ServerProcess,
    db: &Path,
    rss: &[u64],
) -> Value {
    total.latencies.sort();
    let ms = |d: Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
    let mib = |b: u64| (b as f64 / (1 << 20) as f64 * 10.0).round() / 10.0;
    let values = total.steps * args.modules as u64;
    let memory = memory(server.pid());
    // Memory in the last quarter against the second quarter: flat when bounded.
    let quarter = |i: usize| -> Option<u64> {
        let n = rss.len() / 4;
        (n > 0).then(|| rss[i * n..(i + 1) * n].iter().copied().max().unwrap_or(0))
    };
    json!({
        "trainers": args.trainers,
        "modules": args.modules,
        "batch_steps": args.batch_steps,
        "seconds": (elapsed.as_secs_f64() * 10.0).round() / 10.0,
        "batches": total.latencies.len(),
        "errors": total.errors,
        "first_error": total.first_error,
        "steps_per_second": (total.steps as f64 / elapsed.as_secs_f64()).round(),
        "module_values_per_second": (values as f64 / elapsed.as_secs_f64()).round(),
        "latency_ms": {
            "p50": ms(quantile(&total.latencies, 0.5)),
            "p99": ms(quantile(&total.latencies, 0.99)),
            "max": ms(quantile(&total.latencies, 1.0)),
        },
        "server_rss_mib": {
            "end": memory.map(|m| mib(m.resident)),
            "peak": memory.map(|m| mib(m.peak)),
            "max_second_quarter": quarter(1).map(mib),
            "max_last_quarter": quarter(3).map(mib),
        },
        "database_mib": mib(bytes_on_disk(db)),
    })
}
