//! A multi-rank run (protocol v1.4) through the real HTTP API: one run of
//! `world_size` ranks, every module and norm weight laid out `sharded` across all of
//! them (as FSDP2 or ZeRO-3 split them), so that each step's records are combined
//! from every rank's partial sums (`grad_sumsq`, `numel`). Each rank is a
//! concurrent client posting its own records in batches of the same steps, bodies
//! built before the clock starts; the server's resident memory is sampled
//! throughout.
//!
//! With `lag_batches` > 0 the last rank holds each batch back until every other
//! rank has sent that many batches more: once the others are more than 256 steps
//! ahead the server completes a step without it (`rank_missing`), so what it keeps
//! of steps waiting for their ranks stays bounded however far the rank falls behind.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use gradflow_e2e::ServerProcess;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{Value, json};

use super::alarms::WorkloadAlarms;
use super::backend::{Backend, Database};
use super::queries::{alerts_at, post, register};
use crate::server::{cpu_seconds, memory};
use crate::stats::{ms, quantile};
use crate::workload::{Generator, Shape, Step};

/// The elements of a linear module's weight, and of a norm weight (Qwen2.5-1.5B's
/// hidden size), split evenly across the ranks.
const LINEAR_NUMEL: u64 = 1536 * 1536;
const NORM_NUMEL: u64 = 1536;

#[derive(Debug, Clone)]
pub struct RankSpec {
    pub world_size: u32,
    /// Steps of the run; every rank sends a record of each.
    pub steps: u64,
    pub batch_steps: u64,
    pub shape: Shape,
    /// Batches the last rank stays behind every other rank (0: none held back).
    pub lag_batches: usize,
    /// Flags for the server.
    pub server_args: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RankResult {
    pub world_size: u32,
    pub steps: u64,
    pub batch_steps: u64,
    pub modules: usize,
    /// Steps the last rank was held behind the others (0: none held back).
    pub lag_steps: u64,
    /// Step records posted, every rank's.
    pub rank_records: u64,
    /// Module records posted, every rank's: what the single-rank comparison posts too.
    pub rank_module_records: u64,
    /// The run's module values: one a combined step and module.
    pub module_values: u64,
    pub seconds: f64,
    pub module_values_per_second: f64,
    pub rank_records_per_second: f64,
    pub rank_module_records_per_second: f64,
    pub batch_latency_p50_ms: f64,
    pub batch_latency_p99_ms: f64,
    /// CPU the server used while the ranks posted, in seconds (÷ `seconds`: how many
    /// cores it kept busy).
    pub server_cpu_seconds: f64,
    /// The server's resident memory once every rank had registered, before the clock.
    pub resident_before_bytes: u64,
    /// The most resident memory sampled (every 10 ms) while the ranks posted.
    pub resident_peak_bytes: u64,
    /// The server's peak resident memory over its life (`VmHWM`), read at the end.
    pub peak_bytes: u64,
    /// The run's steps once every rank was done (all of them: the last ones wait for
    /// the lagging rank, and combine with it).
    pub combined_steps: u64,
    /// What the detectors raised (`rank_missing` on the lagging rank is expected).
    pub alarms: WorkloadAlarms,
}

const RUN: &str = "ranks";

/// The registration every rank sends: each reported module's own weight and every
/// norm weight, all sharded across every rank.
fn registration(shape: Shape, world_size: u32, rank: u32) -> Value {
    let norms = shape.param_names();
    let norm_modules: HashSet<&str> = norms
        .iter()
        .filter_map(|n| n.strip_suffix(".weight"))
        .collect();
    let mut params: Vec<Value> = norms
        .iter()
        .map(|name| {
            json!({"name": name, "role": "norm", "dtype": "f32", "shape": [NORM_NUMEL],
                   "layout": "sharded"})
        })
        .collect();
    for module in shape.module_names() {
        if !norm_modules.contains(module.as_str()) {
            params.push(json!({"name": format!("{module}.weight"), "role": "linear",
                "dtype": "f32", "shape": [1536, 1536], "layout": "sharded"}));
        }
    }
    json!({
        "name": format!("{world_size} ranks, sharded"),
        "world_size": world_size, "rank": rank, "host": format!("node-{}", rank / 8),
        "precision": {"param_dtype": "f32", "compute_dtype": "bf16", "loss_scaler": "none"},
        "optimizer": {"name": "adamw", "lr": 3e-4},
        "params": params,
    })
}

/// One rank's records as JSON, written by hand as `BatchWriter` writes them.
struct RankWriter {
    rank: u32,
    /// (name, elements this rank holds) per module.
    modules: Vec<(String, u64)>,
    params: Vec<String>,
    /// What a rank's part of a whole-model norm is: `1 / √world_size`.
    part: f64,
    norm_numel: u64,
}

impl RankWriter {
    fn new(shape: Shape, world_size: u32, rank: u32) -> RankWriter {
        let world = u64::from(world_size);
        let modules = shape
            .module_names()
            .into_iter()
            .map(|m| {
                let numel = if m.ends_with("layernorm") {
                    NORM_NUMEL
                } else {
                    LINEAR_NUMEL
                };
                (m, numel / world)
            })
            .collect();
        RankWriter {
            rank,
            modules,
            params: shape.param_names(),
            part: 1.0 / f64::from(world_size).sqrt(),
            norm_numel: NORM_NUMEL / world,
        }
    }

    /// `steps` as this rank's records: its shard's sum of squares of each module (a
    /// `world_size`-th of the whole's), its share of each norm weight's gradient and
    /// update norms, the weight's drift and mean on its shard.
    fn batch(&self, steps: &[Step], step_time: &mut impl FnMut() -> f64) -> Vec<u8> {
        use std::fmt::Write;
        let mut body = String::with_capacity(steps.len() * (self.modules.len() * 90 + 1024));
        body.push('[');
        for (i, s) in steps.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            let _ = write!(
                body,
                r#"{{"step":{},"rank":{},"loss":{},"lr":{},"step_time":{:.4},"modules":["#,
                s.step,
                self.rank,
                s.loss,
                s.lr,
                step_time()
            );
            for (m, ((name, numel), norm)) in
                self.modules.iter().zip(&s.module_grad_norms).enumerate()
            {
                if m > 0 {
                    body.push(',');
                }
                let part = f64::from(*norm) * self.part;
                let _ = write!(
                    body,
                    r#"{{"module":"{name}","grad_sumsq":{},"numel":{numel},"nonfinite":0,"hook_hits":1}}"#,
                    part * part
                );
            }
            body.push_str(r#"],"params":["#);
            for (p, (name, [grad, update, drift, mean])) in
                self.params.iter().zip(&s.params).enumerate()
            {
                if p > 0 {
                    body.push(',');
                }
                let _ = write!(
                    body,
                    r#"{{"name":"{name}","grad_norm":{},"update_norm":{},"drift":{drift},"mean":{mean},"numel":{}}}"#,
                    f64::from(*grad) * self.part,
                    f64::from(*update) * self.part,
                    self.norm_numel
                );
            }
            body.push_str("]}");
        }
        body.push(']');
        body.into_bytes()
    }
}

/// Runs one measurement on a fresh server and database: every rank registers, its
/// bodies are built, the ranks post them while the server's memory is sampled, and
/// the run is read back.
pub async fn http(spec: &RankSpec, backend: &Backend) -> anyhow::Result<RankResult> {
    anyhow::ensure!(
        spec.world_size >= 2,
        "a multi-rank run has two ranks or more"
    );
    let database = Database::fresh(backend).await?;
    let server = database.start(&spec.server_args).await?;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(spec.world_size as usize + 1)
        .build()?;
    for rank in 0..spec.world_size {
        register(
            &client,
            &server,
            RUN,
            &registration(spec.shape, spec.world_size, rank),
        )
        .await?;
    }
    let bodies = build_bodies(spec).await?;

    let pid = server.pid();
    let resident_before = memory(pid).map_or(0, |m| m.resident);
    let sampler = PeakSampler::start(pid, resident_before);
    let url = server.url(&format!("/api/v1/runs/{RUN}/steps"));
    let cpu_before = cpu_seconds(pid).unwrap_or(0.0);
    let started = Instant::now();
    let mut latencies = post_ranks(spec, &client, &url, bodies).await?;
    let seconds = started.elapsed().as_secs_f64();
    let server_cpu_seconds = cpu_seconds(pid).unwrap_or(0.0) - cpu_before;
    let resident_peak = sampler.stop().await?;
    let peak_bytes = memory(pid).map_or(0, |m| m.peak);

    let (combined_steps, alarms) = read_back(spec, &client, &server).await?;
    let status = server.terminate();
    anyhow::ensure!(status.success(), "the server stopped with {status}");
    database.remove().await?;
    anyhow::ensure!(
        combined_steps == spec.steps,
        "{combined_steps} of the run's {} steps combined",
        spec.steps
    );
    latencies.sort();

    let world = u64::from(spec.world_size);
    let modules = spec.shape.modules as u64;
    let rank_records = world * spec.steps;
    let module_values = spec.steps * modules;
    Ok(RankResult {
        world_size: spec.world_size,
        steps: spec.steps,
        batch_steps: spec.batch_steps,
        modules: spec.shape.modules,
        lag_steps: lag_steps(spec),
        rank_records,
        rank_module_records: rank_records * modules,
        module_values,
        seconds,
        module_values_per_second: module_values as f64 / seconds,
        rank_records_per_second: rank_records as f64 / seconds,
        rank_module_records_per_second: (rank_records * modules) as f64 / seconds,
        batch_latency_p50_ms: ms(quantile(&latencies, 0.5)),
        batch_latency_p99_ms: ms(quantile(&latencies, 0.99)),
        server_cpu_seconds,
        resident_before_bytes: resident_before,
        resident_peak_bytes: resident_peak,
        peak_bytes,
        combined_steps,
        alarms,
    })
}

/// Steps the last rank is held behind the others.
fn lag_steps(spec: &RankSpec) -> u64 {
    spec.lag_batches as u64 * spec.batch_steps
}

/// Every rank's bodies, on every core: seeded per rank, so each round sends the
/// same records.
async fn build_bodies(spec: &RankSpec) -> anyhow::Result<Vec<Vec<Vec<u8>>>> {
    let builders: Vec<_> = (0..spec.world_size)
        .map(|rank| {
            let spec = spec.clone();
            tokio::task::spawn_blocking(move || {
                let writer = RankWriter::new(spec.shape, spec.world_size, rank);
                let mut generator = Generator::new(spec.shape, 1_000 + u64::from(rank));
                let mut rng = StdRng::seed_from_u64(2_000 + u64::from(rank));
                // A rank's own work, ~0.2 s a step and within a few percent of the
                // others': no straggler among them.
                let mut step_time = move || 0.2 * (1.0 + 0.02 * rng.r#gen::<f64>());
                (0..spec.steps)
                    .step_by(spec.batch_steps as usize)
                    .map(|first| {
                        let count = spec.batch_steps.min(spec.steps - first);
                        writer.batch(&generator.steps(first, count), &mut step_time)
                    })
                    .collect::<Vec<Vec<u8>>>()
            })
        })
        .collect();
    let mut bodies = Vec::with_capacity(builders.len());
    for builder in builders {
        bodies.push(builder.await?);
    }
    Ok(bodies)
}

/// The server's resident memory, sampled every 10 ms until stopped.
struct PeakSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl PeakSampler {
    fn start(pid: u32, resident_before: u64) -> PeakSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(resident_before));
        let task = {
            let (stop, peak) = (stop.clone(), peak.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(m) = memory(pid) {
                        peak.fetch_max(m.resident, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
        };
        PeakSampler { stop, peak, task }
    }

    /// Stops sampling; the most resident memory sampled.
    async fn stop(self) -> anyhow::Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await?;
        Ok(self.peak.load(Ordering::Relaxed))
    }
}

/// Every rank posts its batches concurrently, the last one held `lag_batches`
/// behind the others; the latency of every batch.
async fn post_ranks(
    spec: &RankSpec,
    client: &reqwest::Client,
    url: &str,
    bodies: Vec<Vec<Vec<u8>>>,
) -> anyhow::Result<Vec<Duration>> {
    // Batches each rank has had answered.
    let done: Arc<Vec<AtomicUsize>> =
        Arc::new((0..spec.world_size).map(|_| AtomicUsize::new(0)).collect());
    let lagging = spec.world_size - 1;
    let tasks: Vec<_> = bodies
        .into_iter()
        .enumerate()
        .map(|(rank, batches)| {
            let (client, url, done) = (client.clone(), url.to_owned(), done.clone());
            let lag = if rank as u32 == lagging {
                spec.lag_batches
            } else {
                0
            };
            tokio::spawn(async move {
                let total = batches.len();
                let mut latencies = Vec::with_capacity(total);
                for (i, body) in batches.into_iter().enumerate() {
                    if lag > 0 {
                        // Until every other rank has sent `lag` batches more (or all).
                        let wanted = (i + lag).min(total);
                        while done[..lagging as usize]
                            .iter()
                            .any(|d| d.load(Ordering::Acquire) < wanted)
                        {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                    let sent = Instant::now();
                    post(&client, &url, body).await?;
                    latencies.push(sent.elapsed());
                    done[rank].fetch_add(1, Ordering::Release);
                }
                anyhow::Ok(latencies)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await??);
    }
    Ok(latencies)
}

/// The run's combined steps and what the detectors raised on it, labelled
/// (`rank_missing` on a lagging rank is expected).
async fn read_back(
    spec: &RankSpec,
    client: &reqwest::Client,
    server: &ServerProcess,
) -> anyhow::Result<(u64, WorkloadAlarms)> {
    let run: Value = client
        .get(server.url(&format!("/api/v1/runs/{RUN}")))
        .send()
        .await?
        .json()
        .await?;
    let combined_steps = run["step_count"].as_u64().unwrap_or(0);
    let alerts = alerts_at(client, server, &format!("/api/v1/runs/{RUN}/alerts")).await?;
    let lagging = spec.world_size - 1;
    let lag_steps = lag_steps(spec);
    let workload = if lag_steps > 0 {
        format!(
            "{} ranks × {} i.i.d. healthy steps × {} sharded modules, rank {lagging} {lag_steps} steps behind",
            spec.world_size, spec.steps, spec.shape.modules
        )
    } else {
        format!(
            "{} ranks × {} i.i.d. healthy steps × {} sharded modules",
            spec.world_size, spec.steps, spec.shape.modules
        )
    };
    let lagging_subject = format!("rank {lagging}");
    let alarms = WorkloadAlarms::label(&workload, spec.steps, &alerts, |a| {
        (spec.shape.registers_unreported_layer()
            && a["kind"] == "unused_parameters"
            && a["subject"] == "qwen")
            || (lag_steps > 0 && a["kind"] == "rank_missing" && a["subject"] == *lagging_subject)
    });
    Ok((combined_steps, alarms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reported_module_is_registered_sharded_once() {
        let shape = Shape::QWEN_1_5B;
        let body = registration(shape, 64, 5);
        let params = body["params"].as_array().unwrap();
        let names: HashSet<&str> = params.iter().map(|p| p["name"].as_str().unwrap()).collect();
        assert_eq!(names.len(), params.len(), "names are distinct");
        assert!(params.iter().all(|p| p["layout"] == "sharded"));
        for module in shape.module_names() {
            assert!(
                names.contains(format!("{module}.weight").as_str()),
                "{module}"
            );
        }
        assert_eq!(body["world_size"], 64);
        assert_eq!(body["rank"], 5);
    }

    #[test]
    fn the_ranks_parts_add_up_to_the_whole() {
        let shape = Shape::with_modules(12);
        let steps = Generator::new(shape, 3).steps(10, 2);
        let writer = RankWriter::new(shape, 64, 7);
        let body = writer.batch(&steps, &mut || 0.2);
        let records: Value = serde_json::from_slice(&body).unwrap();
        let record = &records[1];
        assert_eq!(
            (record["step"].as_u64(), record["rank"].as_u64()),
            (Some(11), Some(7))
        );
        let sumsq = record["modules"][4]["grad_sumsq"].as_f64().unwrap();
        let whole = f64::from(steps[1].module_grad_norms[4]);
        assert!(((sumsq * 64.0).sqrt() / whole - 1.0).abs() < 1e-6);
        assert_eq!(record["modules"][2]["numel"], 24, "a layernorm's shard");
        assert_eq!(
            record["modules"][4]["numel"], 36_864,
            "a linear module's shard"
        );
        assert_eq!(record["params"][0]["numel"], 24);
    }
}
