//! The gradient-flow chart of a 100,000-step, 200-module run (issue target: 300 ms),
//! and what its one-pass matrix read saves: in one process, interleaved, the median
//! of (a) reading the 200 module series one at a time, as the chart used to, (b) the
//! one-pass read of all of them, (c) the whole chart (read, then draw the SVG at the
//! dashboard's 1,200 px), and (d) the same chart as PNG.
//!
//! Run: `cargo bench -p gradflow-server --bench chart_render`
//! (`GRADFLOW_BENCH_STEPS` shortens the run for a smoke test).

use std::sync::Arc;
use std::time::Instant;

use gradflow_core::detect::{Detection, Thresholds};
use gradflow_core::model::series_kind::SeriesKind;
use gradflow_core::series::Buckets;
use gradflow_protocol::{Float, ModuleStep, RunId, RunRegistration, StepRecord};
use gradflow_server::charts::{self, ChartKind, Format};
use gradflow_server::ingest::Ingest;
use gradflow_server::store::{DatabaseUrl, SeriesRequest, Store, StoreConfig, SyncMode};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const MODULES: usize = 200;
const BATCH: u64 = 500;
const ROUNDS: usize = 7;
/// The dashboard draws the heatmap 1,200 px wide.
const WIDTH: u32 = 1200;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn batch(first: u64, last: u64, noise: &mut impl FnMut() -> f64) -> Vec<StepRecord> {
    (first..last)
        .map(|step| StepRecord {
            step,
            loss: Some(Float(2.0 + noise())),
            modules: (0..MODULES)
                .map(|m| ModuleStep {
                    // The first 80 modules are a cut-off Qwen: no gradient at all.
                    module: if m < 80 {
                        format!("qwen.layers.{m}")
                    } else {
                        format!("agent.layers.{m}")
                    },
                    grad_norm: (m >= 80).then(|| Float(1e-4 + noise())),
                    hook_hits: Some(u32::from(m >= 80)),
                    ..Default::default()
                })
                .collect(),
            ..StepRecord::default()
        })
        .collect()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let steps: u64 = std::env::var("GRADFLOW_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let dir = tempfile::tempdir().unwrap();
    let detection = Detection {
        enabled: false,
        thresholds: Thresholds::default(),
    };
    let store = Arc::new(
        Store::open(&StoreConfig {
            database: DatabaseUrl::Sqlite(dir.path().join("bench.db")),
            sync: SyncMode::Normal,
        })
        .await
        .unwrap(),
    );
    let ingest = Ingest::standalone(store.clone(), detection);
    let run = RunId::parse("bench").unwrap();
    let registration: RunRegistration =
        serde_json::from_value(serde_json::json!({"params": []})).unwrap();
    ingest.register_run(&run, registration).await.unwrap();
    // Uniform on [0, 1), from a fixed seed so every run sees the same data.
    let mut rng = StdRng::seed_from_u64(0x2545_f491_4f6c_dd1du64);
    let mut noise = move || rng.gen_range(0.0..1.0);
    let started = Instant::now();
    let mut first = 0;
    while first < steps {
        let last = (first + BATCH).min(steps);
        ingest
            .ingest(&run, &batch(first, last, &mut noise))
            .await
            .unwrap();
        first = last;
    }
    println!(
        "built a run of {steps} steps x {MODULES} modules in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let stored = store.run(&run).await.unwrap();
    // The route's arithmetic: a heatmap cell every 3 px of the plot's 2/3 of the width.
    let points = (WIDTH as usize * 2 / 3) / 3;
    let window = charts::data::window(&stored, None, None, points);
    let max_points = 2 * points;
    let (mut one_by_one, mut one_pass, mut svg, mut png) = (vec![], vec![], vec![], vec![]);
    for _ in 0..ROUNDS {
        let t = Instant::now();
        let subjects = store
            .subjects(&run, SeriesKind::ModuleGradNorm)
            .await
            .unwrap();
        for subject in subjects {
            let request = SeriesRequest {
                candidates: vec![(SeriesKind::ModuleGradNorm, subject)],
                from: window.from,
                to: window.to,
                max_points: Some(max_points),
                stream: gradflow_server::store::RUN_STREAM,
            };
            store.series(&run, &request).await.unwrap();
        }
        one_by_one.push(t.elapsed().as_secs_f64());

        let t = Instant::now();
        store
            .series_of_every_subject(
                &run,
                SeriesKind::ModuleGradNorm,
                Buckets::new(window.from, window.to, max_points / 2),
            )
            .await
            .unwrap();
        one_pass.push(t.elapsed().as_secs_f64());

        for (format, times) in [(Format::Svg, &mut svg), (Format::Png, &mut png)] {
            let t = Instant::now();
            let stored = store.run(&run).await.unwrap();
            let data = charts::data::gather(&store, &run, &stored, ChartKind::GradFlow, window)
                .await
                .unwrap();
            let height = match &data {
                charts::ChartData::GradFlow(flow) => {
                    charts::grad_flow::natural_height(flow.modules.len())
                }
                _ => unreachable!("a grad-flow chart"),
            };
            let bytes = tokio::task::spawn_blocking(move || {
                charts::render(&data, format, WIDTH, height).unwrap()
            })
            .await
            .unwrap();
            assert!(bytes.len() > 1000);
            times.push(t.elapsed().as_secs_f64());
        }
    }
    let ms = |xs: Vec<f64>| median(xs) * 1e3;
    let (a, b) = (ms(one_by_one), ms(one_pass));
    println!("median of {ROUNDS} rounds, {steps} steps x {MODULES} modules, {points} columns:");
    println!("  200 series read one at a time   {a:8.1} ms");
    println!(
        "  one-pass read of all 200        {b:8.1} ms   ({:.1}x faster)",
        a / b
    );
    println!(
        "  grad-flow chart, SVG {WIDTH} px    {:8.1} ms   (target 300 ms)",
        ms(svg)
    );
    println!("  grad-flow chart, PNG {WIDTH} px    {:8.1} ms", ms(png));
    store.close().await.unwrap();
}
