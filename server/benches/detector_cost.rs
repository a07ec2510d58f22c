//! What the detectors add to ingestion: `Ingest::ingest` of the same batches with
//! detectors on and off, interleaved in one process, fresh database each run; the
//! median of each and their ratio. JSON parsing is left out, which makes the
//! detectors' share look larger than it is over HTTP.
//!
//! Run: `cargo bench -p gradflow-server --bench detector_cost`

use std::sync::Arc;
use std::time::Instant;

use gradflow_core::detect::{Detection, DetectorSet, RunContext, Thresholds};
use gradflow_protocol::{RunId, RunRegistration, StepRecord};
use gradflow_server::ingest::Ingest;
use gradflow_server::store::{DatabaseUrl, Store, StoreConfig, SyncMode};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

const MODULES: usize = 230;
const NORMS: usize = 57;
const STEPS: u64 = 2_000;
const BATCH: usize = 50;
const ROUNDS: usize = 5;

/// Module names: the norm weights' modules, then linear layers, `MODULES` in all.
fn module_name(i: usize) -> String {
    if i < NORMS {
        format!("qwen.layers.{i}.input_layernorm")
    } else {
        format!("qwen.m{i}")
    }
}

fn registration() -> RunRegistration {
    let params: Vec<Value> = (0..NORMS)
        .map(|i| json!({"name": format!("qwen.layers.{i}.input_layernorm.weight"), "role": "norm", "dtype": "f32", "shape": [1536]}))
                .chain((NORMS..MODULES).map(|i| json!({"name": format!("{}.weight", module_name(i)), "role": "linear"})))
        .collect();
    serde_json::from_value(json!({"optimizer": {"name": "adamw", "lr": 3e-4}, "params": params}))
        .unwrap()
}

fn records() -> Vec<Vec<StepRecord>> {
    // Uniform on [0, 1), from a fixed seed so every run sees the same data.
    let mut rng = StdRng::seed_from_u64(0x2545_f491_4f6c_dd1du64);
    let mut noise = move || rng.gen_range(0.0..1.0);
    let steps: Vec<StepRecord> = (0..STEPS)
        .map(|s| {
            let modules: Vec<Value> = (0..MODULES)
                .map(|i| json!({"module": module_name(i), "grad_norm": 1e-3 + noise(), "hook_hits": 1}))
                .collect();
            let params: Vec<Value> = (0..NORMS)
                .map(|i| json!({"name": format!("qwen.layers.{i}.input_layernorm.weight"),
                                "grad_norm": 1e-3 + noise(), "update_norm": 1e-4, "drift": 1e-3, "mean": 1.0}))
                .collect();
            serde_json::from_value(json!({"step": s, "loss": 2.0 + noise(), "lr": 3e-4, "modules": modules, "params": params})).unwrap()
        })
        .collect();
    steps.chunks(BATCH).map(<[StepRecord]>::to_vec).collect()
}

async fn ingest_seconds(enabled: bool, batches: &[Vec<StepRecord>]) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let detection = Detection {
        enabled,
        thresholds: Thresholds::default(),
    };
    let store = Arc::new(
        Store::open(&StoreConfig {
            database: DatabaseUrl::Sqlite(dir.path().join("bench.db")),
            sync: SyncMode::Full,
        })
        .await
        .unwrap(),
    );
    let ingest = Ingest::standalone(store.clone(), detection);
    let run = RunId::parse("bench").unwrap();
    ingest.register_run(&run, registration()).await.unwrap();
    let start = Instant::now();
    for batch in batches {
        ingest.ingest(&run, batch).await.unwrap();
    }
    let seconds = start.elapsed().as_secs_f64();
    store.close().await.unwrap();
    seconds
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The detectors alone, per step, over the same records.
fn detectors_alone_seconds(batches: &[Vec<StepRecord>]) -> f64 {
    let context = RunContext::new(&registration(), Thresholds::default());
    let mut detectors = DetectorSet::default();
    let start = Instant::now();
    let mut transitions = 0;
    for batch in batches {
        for record in batch {
            transitions += detectors.on_step(&context, record, None, None).len();
        }
    }
    assert_eq!(transitions, 0, "the bench stream is healthy");
    start.elapsed().as_secs_f64()
}

fn main() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let batches = records();
    let alone = median(
        (0..ROUNDS)
            .map(|_| detectors_alone_seconds(&batches))
            .collect(),
    );
    let (mut on, mut off) = (Vec::new(), Vec::new());
    runtime.block_on(async {
        ingest_seconds(true, &batches).await; // warm-up
        for _ in 0..ROUNDS {
            on.push(ingest_seconds(true, &batches).await);
            off.push(ingest_seconds(false, &batches).await);
        }
    });
    let values = (STEPS as usize * MODULES) as f64;
    let (on, off) = (median(on), median(off));
    println!(
        "ingest of {STEPS} steps x {MODULES} modules + {NORMS} norm params, {BATCH} steps a batch, {ROUNDS} interleaved rounds, medians:"
    );
    println!(
        "  detectors on : {:.3} s  ({:.0} module values/s)",
        on,
        values / on
    );
    println!(
        "  detectors off: {:.3} s  ({:.0} module values/s)",
        off,
        values / off
    );
    println!(
        "  detectors add {:+.1}% to ingest time",
        (on / off - 1.0) * 100.0
    );
    println!(
        "  detectors alone: {:.1} µs a step ({:.1} µs a step for the whole ingest without them)",
        alone / STEPS as f64 * 1e6,
        off / STEPS as f64 * 1e6
    );
}
