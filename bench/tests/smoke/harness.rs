//! The benchmark harness at smoke sizes: every part runs against the real server,
//! trainer and SQLite, and the report holds every figure, each plausible. (The sizes
//! are too small for the figures to mean anything; BENCHMARKS.md has the full run.)

use std::process::Command;

use serde_json::Value;

const PLOTS: [&str; 3] = [
    "scaling-modules.svg",
    "scaling-runs.svg",
    "scaling-length.svg",
];

fn number(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{v} is not a number"))
}

/// One ingest measurement of 4 runs × 100 steps × 230 modules, as labelled.
fn assert_ingest(result: &Value, backend: &str, trace: &str, replicas: &str) {
    assert_eq!(result["backend"], backend, "{result}");
    assert_eq!(result["trace"], trace, "{result}");
    assert_eq!(result["replicas"], replicas, "{result}");
    assert_eq!(result["module_values"], 4 * 100 * 230, "{result}");
    assert!(
        number(&result["module_values_per_second"]) > 0.0,
        "{result}"
    );
    assert!(number(&result["values_per_second"]) > 0.0, "{result}");
    // Something is stored, and less than bare SQLite's ~60 B a value.
    let bytes = number(&result["bytes_per_module_value"]);
    assert!(bytes > 1.0 && bytes < 60.0, "{bytes}: {result}");
    for read in result["queries"].as_array().unwrap() {
        assert!(number(&read["median_ms"]) > 0.0, "{read}");
        assert!(number(&read["response_bytes"]) > 0.0, "{read}");
    }
}

#[test]
fn every_part_runs_and_reports() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_gradflow-bench"))
        .args(["all", "--quick", "--out"])
        .arg(dir.path())
        // MLflow is a reference, measured when installed; the smoke run skips it.
        .env("GRADFLOW_MLFLOW_PYTHON", "/nonexistent/python")
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{log}");
    let r: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("results.json")).unwrap()).unwrap();

    let long_run = &r["long_run"];
    assert_eq!(long_run["steps"], 5_000, "{long_run}");
    for read in long_run["reads"].as_array().unwrap() {
        assert!(number(&read["points"]) > 0.0, "{read}");
        assert!(number(&read["all_levels_ms"]) > 0.0, "{read}");
        assert!(number(&read["two_levels_ms"]) > 0.0, "{read}");
    }

    let round = &r["ingest"]["rounds"][0];
    for side in ["detectors_on", "detectors_off"] {
        assert_eq!(round[side]["module_values"], 4 * 100 * 230, "{round}");
        assert!(number(&round[side]["module_values_per_second"]) > 0.0);
        // Something is on disk, and less than bare SQLite's ~60 B a value.
        let bytes = number(&round[side]["bytes_per_module_value"]);
        assert!(bytes > 1.0 && bytes < 40.0, "{bytes}");
    }
    assert_eq!(round["baseline"]["rows"], 4 * 100 * 690, "{round}");
    assert_ingest(&round["realistic"], "SQLite", "realistic", "one");
    // The series reads after the ingest, on each database.
    let reads = round["detectors_on"]["queries"].as_array().unwrap();
    assert_eq!(reads.len(), 2, "{reads:?}");

    // PostgreSQL beside SQLite, and two replicas on one database; skipped (said on
    // stderr) only where no PostgreSQL can be started and none is required.
    let postgres = &round["postgres"];
    if postgres.is_null() {
        assert!(
            std::env::var("GRADFLOW_REQUIRE_POSTGRES").as_deref() != Ok("1"),
            "PostgreSQL is required but was skipped: {log}"
        );
        assert!(log.contains("PostgreSQL cannot be started"), "{log}");
    } else {
        assert_ingest(&postgres["iid"], "PostgreSQL", "i.i.d.", "one");
        assert_ingest(&postgres["realistic"], "PostgreSQL", "realistic", "one");
        assert_ingest(
            &postgres["replicas_by_client"],
            "PostgreSQL",
            "i.i.d.",
            "by_client",
        );
        assert_ingest(
            &postgres["replicas_alternating"],
            "PostgreSQL",
            "i.i.d.",
            "alternating",
        );
        assert_eq!(postgres["iid"]["queries"].as_array().unwrap().len(), 2);
    }

    // The 64-rank run, every step combined from every rank, beside single-rank runs
    // posting as many module records.
    let ranks = &round["ranks"];
    for single in ["single_rank", "one_run"] {
        assert_eq!(ranks[single]["module_values"], 64 * 20 * 230, "{ranks}");
    }
    for (side, lag) in [("together", 0), ("skewed", 20)] {
        let run = &ranks[side];
        assert_eq!(run["world_size"], 64, "{run}");
        assert_eq!(run["combined_steps"], 20, "{run}");
        assert_eq!(run["module_values"], 20 * 230, "{run}");
        assert_eq!(run["rank_module_records"], 64 * 20 * 230, "{run}");
        assert_eq!(run["lag_steps"], lag, "{run}");
        assert!(number(&run["module_values_per_second"]) > 0.0, "{run}");
        let (before, peak) = (
            number(&run["resident_before_bytes"]),
            number(&run["resident_peak_bytes"]),
        );
        assert!(before > 1e6 && peak >= before, "{run}");
    }

    let timings = r["queries"]["timings"].as_array().unwrap();
    assert_eq!(timings.len(), 7);
    for t in timings {
        assert!(number(&t["median_ms"]) > 0.0, "{t}");
        assert!(number(&t["response_bytes"]) > 0.0, "{t}");
    }
    // 19 short runs with a stuck module each, plus the long run.
    assert_eq!(r["queries"]["runs"], 20);
    assert_eq!(
        r["queries"]["alert_kinds"]["grad_stuck_zero on agent.head"], 19,
        "{}",
        r["queries"]
    );
    // Those are the only alerts, labelled expected: the long run's stationary norms
    // and the short runs' live modules are healthy, and nothing may be raised on them.
    let short_runs = &r["queries"]["alarms"][1];
    assert_eq!(
        short_runs["expected"],
        serde_json::json!({"grad_stuck_zero on agent.head": 19}),
        "{short_runs}"
    );

    // Every workload's alerts are labelled, and none is unexpected: no false alarm
    // on the healthy ones (the generated telemetry, and the trainer's healthy
    // scenarios), no stray verdict on a failure scenario.
    let alarms = &r["false_alarms"];
    let workloads = alarms["workloads"].as_array().unwrap();
    let names: Vec<&str> = workloads
        .iter()
        .map(|w| w["workload"].as_str().unwrap())
        .collect();
    for part in [
        "ingest, 1 rounds: 4 runs × 100 i.i.d.",
        "ingest, 1 rounds: 4 runs × 100 realistic",
        "ingest, 1 rounds: 64 ranks × 20 i.i.d. healthy steps × 230 sharded modules",
        "queries",
        "trainer: healthy-0",
        "trainer: prompt-caching-0",
        "scaling",
    ] {
        assert!(
            names.iter().any(|n| n.starts_with(part)),
            "no {part} workload in {names:?}"
        );
    }
    for w in workloads {
        assert_eq!(w["unexpected"], serde_json::json!({}), "{w}");
    }
    assert!(number(&alarms["healthy_steps"]) > 5_000.0, "{alarms}");
    assert_eq!(alarms["false_alarms"], 0, "{alarms}");
    assert_eq!(alarms["by_kind"], serde_json::json!({}), "{alarms}");

    assert!(number(&r["overhead"]["instrumented_ms"]) > 0.0);

    // Every failure scenario's alerts, each opened no earlier than allowed.
    let detections = r["latency"].as_array().unwrap();
    assert_eq!(detections.len(), 14, "{detections:?}");
    // The fault's step is read back from the telemetry where it shows there: the NaN
    // gradient injected at step 30 makes step 31's loss the first non-finite one.
    let loss_nan = detections
        .iter()
        .find(|d| d["scenario"] == "nan-gradient" && d["kind"] == "loss_nonfinite")
        .unwrap();
    assert_eq!(loss_nan["fault_step_from"], "telemetry", "{loss_nan}");
    assert_eq!(loss_nan["fault_step"], 31, "{loss_nan}");
    for d in detections {
        if let Some(late) = d["steps_late"].as_i64() {
            assert!(late >= 0, "opened before its threshold allows: {d}");
        } else {
            assert!(d["opened_step"].is_null(), "{d}");
        }
    }

    let sweeps = r["scaling"].as_array().unwrap();
    assert_eq!(sweeps.len(), 3);
    for (sweep, plot) in sweeps.iter().zip(PLOTS) {
        assert_eq!(sweep["points"].as_array().unwrap().len(), 2, "{sweep}");
        let svg = std::fs::read_to_string(dir.path().join(plot)).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("#1F77B4"),
            "{plot} has no ingest line"
        );
    }
    assert!(r["mlflow"].is_null());

    // The plots redraw from results.json alone.
    for plot in PLOTS {
        std::fs::remove_file(dir.path().join(plot)).unwrap();
    }
    let redraw = Command::new(env!("CARGO_BIN_EXE_gradflow-bench"))
        .args(["plots", "--out"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        redraw.status.success(),
        "{}",
        String::from_utf8_lossy(&redraw.stderr)
    );
    assert!(dir.path().join("scaling-runs.svg").exists());
    let report = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(
        report.contains("| ingest over HTTP, detectors on |"),
        "{report}"
    );
    assert!(
        report.contains("### Ingest by database and trace")
            && report.contains("| SQLite | realistic |")
            && report.contains("### A 64-rank run")
            && report.contains("| 64 ranks, rank 63 20 steps behind |"),
        "{report}"
    );
    if !postgres.is_null() {
        assert!(
            report.contains("| PostgreSQL | i.i.d. |")
                && report.contains("| two, batches alternating |"),
            "{report}"
        );
    }
    assert!(
        report.contains("### False alarms")
            && report.contains("| trainer: healthy-0 (200 steps) |"),
        "{report}"
    );
}
