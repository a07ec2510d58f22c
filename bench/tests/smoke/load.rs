//! The load generator, in a short form: four trainers for three seconds against the
//! real server, with no errors and a complete report. (The full run, sixteen
//! trainers for a minute, is `cargo run --release -p gradflow-bench --bin
//! gradflow-load`; RELIABILITY.md has its figures.)

use std::process::Command;

use serde_json::Value;

#[test]
fn a_short_load_run_reports_without_errors() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("load.json");
    let output = Command::new(env!("CARGO_BIN_EXE_gradflow-load"))
        .args([
            "--trainers",
            "4",
            "--modules",
            "100",
            "--duration-secs",
            "3",
        ])
        .args(["--server-arg=--sync=normal", "--json"])
        .arg(&report)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{log}");
    let report: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(report["errors"], 0, "{report}");
    assert!(report["batches"].as_u64().unwrap() >= 4, "{report}");
    let latency = &report["latency_ms"];
    assert!(latency["p50"].as_f64().unwrap() > 0.0, "{report}");
    assert!(
        latency["p50"].as_f64() <= latency["p99"].as_f64(),
        "{report}"
    );
    assert!(
        report["server_rss_mib"]["peak"].as_f64().unwrap() > 1.0,
        "{report}"
    );
    assert!(report["module_values_per_second"].as_f64().unwrap() > 0.0);
}
