//! One bad value in a batch costs that record only: the reporter of the bundled
//! trainer resends the halves of a batch the real server refused until only the
//! invalid records are left out (as a NaN weight once produced a drift of −Infinity
//! on CUDA, and the server's 400 cost the 30 healthy steps batched with it). And a
//! non-finite reading is data: the trainer whose weights go NaN sends NaN, and the
//! server stores every step of it.

use std::process::Command;
use std::time::Duration;

use gradflow_e2e::{ServerProcess, binary};
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
            ..Default::default()
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

fn series(server: &ServerProcess, run: &str, query: &str) -> Vec<Value> {
    let url = server.url(&format!("/api/v1/runs/{run}/series?{query}"));
    let body: Value = reqwest::blocking::get(url).unwrap().json().unwrap();
    body["points"].as_array().unwrap().clone()
}

#[test]
fn a_nan_gradient_run_delivers_every_step_with_nan_readings() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("g.db"), &[]);
    let output = Command::new(binary("gradflow-trainer"))
        .args(["--server", &server.base, "--scenario", "nan-gradient"])
        .args(["--run-id", "nan", "--steps", "40", "--quiet"])
        .arg("--spool-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stderr).into_owned()
        + &String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{text}");
    assert!(text.contains("delivered 40 steps"), "{text}");

    let steps: Vec<u64> = series(&server, "nan", "metric=loss")
        .iter()
        .map(|p| p[0].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (0..40).collect::<Vec<_>>(), "every step stored");
    // The NaN gradient of step 30 reaches every weight through AdamW by the next
    // step: from then on the norm weights' drift and updates are NaN, never a
    // negative or infinite number a reduction made of them.
    for metric in [
        "drift",
        "update_norm",
        "intended_update_norm",
        "intended_update_max_ulp",
    ] {
        let points = series(
            &server,
            "nan",
            &format!("metric={metric}&subject=qwen.norm.weight"),
        );
        // Measured on the first 4 steps, then every 4th (`--norm-weights-every`).
        let measured: Vec<u64> = (0..40).filter(|s| *s < 4 || s % 4 == 0).collect();
        let at: Vec<u64> = points.iter().map(|p| p[0].as_u64().unwrap()).collect();
        assert_eq!(at, measured, "{metric}: {points:?}");
        for point in &points {
            let step = point[0].as_u64().unwrap();
            match &point[1] {
                Value::Number(n) => {
                    assert!(step < 31, "{metric} at step {step}: {n}, not NaN");
                    assert!(n.as_f64().unwrap() >= 0.0, "{metric} at step {step}: {n}");
                }
                Value::String(s) => {
                    assert_eq!(s, "NaN", "{metric} at step {step}");
                    assert!(step >= 30, "{metric} at step {step}: NaN before the fault");
                }
                other => panic!("{metric} at step {step}: {other}"),
            }
        }
    }
}
