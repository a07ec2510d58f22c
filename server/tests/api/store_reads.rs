//! Reading every subject of a kind in one pass gives exactly what reading each
//! subject on its own gives, raw or reduced, across rollup chunks and ragged ends.

use gradflow_core::detect::{Detection, Thresholds};
use gradflow_core::model::series_kind::SeriesKind;
use gradflow_core::series::Buckets;
use gradflow_protocol::{RunId, RunRegistration, StepRecord};
use gradflow_server::store::SeriesRequest;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

/// More modules than one rollup chunk holds (64), so the read spans two chunks.
const MODULES: usize = 70;
const STEPS: u64 = 9_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_pass_matches_one_series_at_a_time() {
    let detection = Detection {
        enabled: false,
        thresholds: Thresholds::default(),
    };
    let test = crate::common::TestStore::open(detection).await;
    let (store, ingest) = (&test.store, &test.ingest);
    let run = RunId::parse("r").unwrap();
    let registration: RunRegistration = serde_json::from_value(json!({"params": []})).unwrap();
    ingest.register_run(&run, registration).await.unwrap();
    // Uniform on [0, 1), from a fixed seed so every run sees the same data.
    let mut rng = StdRng::seed_from_u64(0x9e37_79b9_7f4a_7c15u64);
    let mut noise = move || rng.gen_range(0.0..1.0);
    let records: Vec<StepRecord> = (0..STEPS)
        // Gaps in the steps, so some ranges hold fewer rows than steps.
        .filter(|s| s % 97 != 5)
        .map(|s| {
            let modules: Vec<Value> = (0..MODULES)
                // Module 3 appears late; module 5 is null (no gradient) every 11th
                // step; module 8 goes NaN once.
                .filter(|m| *m != 3 || s > 4_000)
                .map(|m| {
                    let grad = match (m, s) {
                        (5, s) if s % 11 == 0 => Value::Null,
                        (8, 6_001) => json!("NaN"),
                        _ => json!(noise() * (m + 1) as f64),
                    };
                    json!({"module": format!("m.{m}"), "grad_norm": grad, "hook_hits": 1})
                })
                .collect();
            serde_json::from_value(json!({"step": s, "modules": modules})).unwrap()
        })
        .collect();
    for batch in records.chunks(500) {
        ingest.ingest(&run, batch).await.unwrap();
    }

    for (from, to, max_points) in [
        (0, STEPS, 300),
        (0, STEPS, 20_000),
        (123, 4_567, 100),
        (4_000, 4_100, 1_000),
        (65, 8_999, 64),
        (5_000, 5_000, 2),
    ] {
        // The buckets one series reads: over the stored steps of the range.
        let buckets = Buckets::new(from, to.min(STEPS - 1), max_points / 2);
        let all = store
            .series_of_every_subject(&run, SeriesKind::ModuleGradNorm, buckets)
            .await
            .unwrap();
        assert_eq!(all.len(), MODULES);
        for (subject, points) in &all {
            let one = store
                .series(
                    &run,
                    &SeriesRequest {
                        candidates: vec![(SeriesKind::ModuleGradNorm, subject.clone())],
                        from,
                        to,
                        max_points: Some(max_points),
                        stream: gradflow_server::store::RUN_STREAM,
                    },
                )
                .await
                .unwrap();
            // NaN != NaN: compare the bits.
            let bits = |p: &[(u64, gradflow_core::model::cell::Cell)]| {
                p.iter().map(|(s, c)| (*s, c.to_bits())).collect::<Vec<_>>()
            };
            assert_eq!(
                bits(points),
                bits(&one.points),
                "{subject} over {from}..={to}, {max_points} points"
            );
            assert!(!points.is_empty() || from > 4_000 || subject != "m.3");
        }
    }
    store.close().await.unwrap();
}
