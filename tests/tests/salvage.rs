//! One bad value in a batch costs that record only: the reporter of the bundled
//! trainer resends the halves of a batch the real server refused until only the
//! invalid records are left out (as a NaN weight once produced a drift of −Infinity
//! on CUDA, and the server's 400 cost the 30 healthy steps batched with it).

use std::time::Duration;

use gradflow_e2e::ServerProcess;
use gradflow_protocol::{Float, ModuleStep, ParamStep, RunRegistration, StepRecord};
use gradflow_trainer::reporter::{Reporter, ReporterConfig};
use serde_json::{Value, json};

fn record(step: u64, drift: f64) -> StepRecord {
    StepRecord {
        step,
        loss: Some(Float(2.0)),
        modules: vec![ModuleStep {
            module: "qwen.norm".into(),
            grad_norm: Some(Float(0.1)),
            hook_hits: Some(1),
        }],
        params: vec![ParamStep {
            name: "qwen.norm.weight".into(),
            grad_norm: Some(Float(0.1)),
            update_norm: Some(Float(1e-4)),
            drift: Some(Float(drift)),
            mean: Some(Float(1.0)),
            ..Default::default()
        }],
        ..Default::default()
    }
}

#[test]
fn a_refused_batch_loses_only_its_invalid_records() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("g.db"), &[]);
    let registration: RunRegistration = serde_json::from_value(json!({
        "params": [{"name": "qwen.norm.weight", "role": "norm"}]
    }))
    .unwrap();
    let mut config = ReporterConfig::new(&server.base, "salvage");
    config.batch_size = 40;
    config.batch_interval = Duration::from_secs(30);
    config.spool_path = dir.path().join("spool.ndjson");
    let reporter = Reporter::start(config, registration).unwrap();
    for step in 0..40 {
        // A reduction gone wrong: a drift no norm can have.
        let drift = if step == 31 { f64::NEG_INFINITY } else { 1e-3 };
        reporter.report(record(step, drift));
    }
    let summary = reporter.finish(Duration::from_secs(20));
    assert_eq!(summary.delivered, 39, "{summary:?}");
    assert_eq!(summary.rejected, 1, "{summary:?}");
    assert_eq!(summary.undelivered, 0, "{summary:?}");

    let body: Value = reqwest::blocking::get(server.url("/api/v1/runs/salvage/series?metric=loss"))
        .unwrap()
        .json()
        .unwrap();
    let steps: Vec<u64> = body["points"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_u64().unwrap())
        .collect();
    let expected: Vec<u64> = (0..40).filter(|s| *s != 31).collect();
    assert_eq!(steps, expected, "every valid step stored, in order");
}
