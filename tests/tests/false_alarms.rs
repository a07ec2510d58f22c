//! No false alarms: healthy training, as the real trainer binary runs it against the
//! real server, raises no warning and no critical alert — over 300+ steps, at several
//! seeds, with prompt caching, a warm-up + cosine schedule, fp16 with the loss
//! scaler overflowing now and then, and the `small` preset — while a learning rate
//! far too high is caught within a few steps. (That each failure scenario raises
//! exactly its own alerts is `trainer.rs`'s test.)

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use gradflow_e2e::{ServerProcess, binary, wait_for_exit};
use serde_json::Value;

/// A healthy pattern: a run id and the trainer flags that make it.
struct Healthy {
    run_id: String,
    args: Vec<String>,
}

fn healthy(run_id: &str, args: &[&str]) -> Healthy {
    Healthy {
        run_id: run_id.to_owned(),
        args: args.iter().map(|a| (*a).to_owned()).collect(),
    }
}

fn spawn(server: &ServerProcess, run: &Healthy) -> Child {
    Command::new(binary("gradflow-trainer"))
        .args(["--server", &server.base, "--run-id", &run.run_id, "--quiet"])
        .args(&run.args)
        .env("RUST_LOG", "gradflow_trainer=warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("gradflow-trainer starts")
}

fn get(server: &ServerProcess, path: &str) -> Value {
    reqwest::blocking::get(server.url(path))
        .unwrap()
        .json()
        .unwrap()
}

/// The run's alerts of severity warning or critical, as lines a person can read.
fn loud_alerts(server: &ServerProcess, run_id: &str) -> Vec<String> {
    let body = get(server, &format!("/api/v1/runs/{run_id}/alerts"));
    body["alerts"]
        .as_array()
        .expect("alerts")
        .iter()
        .filter(|a| a["severity"] != "info")
        .map(|a| {
            format!(
                "{} {} on {} from step {}: {}",
                a["severity"], a["kind"], a["subject"], a["first_step"], a["detail"]
            )
        })
        .collect()
}

#[test]
fn healthy_training_raises_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("g.db"), &["--sync", "normal"]);
    let mut runs = Vec::new();
    for seed in ["0", "1", "2"] {
        runs.push(healthy(
            &format!("healthy-{seed}"),
            &["--scenario", "healthy", "--steps", "320", "--seed", seed],
        ));
        runs.push(healthy(
            &format!("prompt-caching-{seed}"),
            &[
                "--scenario",
                "prompt-caching",
                "--steps",
                "320",
                "--seed",
                seed,
            ],
        ));
    }
    runs.push(healthy(
        "warmup-cosine",
        &[
            "--steps",
            "320",
            "--lr",
            "1e-3",
            "--lr-schedule",
            "warmup-cosine",
            "--warmup-steps",
            "50",
        ],
    ));
    // fp16 compute under a dynamic loss scaler that grows every 20 clean steps: the
    // scale climbs until a step overflows, halves, and climbs again.
    runs.push(healthy(
        "fp16-scaler",
        &[
            "--steps",
            "320",
            "--param-dtype",
            "f32",
            "--compute-dtype",
            "f16",
            "--loss-scaler",
            "dynamic",
            "--scaler-growth-interval",
            "20",
        ],
    ));
    // A client that reports every 10th step.
    runs.push(healthy(
        "sparse-reports",
        &["--steps", "320", "--report-every", "10"],
    ));
    runs.push(healthy("small", &["--preset", "small", "--steps", "60"]));

    // Two trainers at a time: the machine has two cores.
    for pair in runs.chunks(2) {
        let mut children: Vec<(Child, &Healthy)> =
            pair.iter().map(|run| (spawn(&server, run), run)).collect();
        for (child, run) in &mut children {
            let status = wait_for_exit(child, Duration::from_secs(600), &run.run_id);
            assert!(status.success(), "{} failed: {status}", run.run_id);
        }
    }

    let mut found = Vec::new();
    for run in &runs {
        for alert in loud_alerts(&server, &run.run_id) {
            found.push(format!("{}: {alert}", run.run_id));
        }
    }
    assert!(
        found.is_empty(),
        "healthy runs raised alerts:\n{}",
        found.join("\n")
    );

    // The fp16 run really overflowed now and then, so its silence means something.
    let overflows = get(&server, "/api/v1/runs/fp16-scaler/series?metric=found_inf");
    let overflowed = overflows["points"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p[1].as_f64() == Some(1.0))
        .count();
    assert!(
        overflowed >= 2,
        "the fp16 run never overflowed: {overflows}"
    );
    // And every run delivered what it trained.
    for run in &runs {
        let stored = get(&server, &format!("/api/v1/runs/{}", run.run_id));
        assert!(
            stored["step_count"].as_u64().unwrap() > 0,
            "{}: {stored}",
            run.run_id
        );
    }
}

#[test]
fn a_learning_rate_far_too_high_is_caught_within_a_few_steps() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("g.db"), &["--sync", "normal"]);
    let run = healthy("too-high", &["--scenario", "lr-too-high", "--steps", "20"]);
    let mut child = spawn(&server, &run);
    let status = wait_for_exit(&mut child, Duration::from_secs(300), "lr-too-high");
    assert!(status.success());
    let body = get(&server, "/api/v1/runs/too-high/alerts?kind=loss_divergence");
    let alerts = body["alerts"].as_array().unwrap();
    assert_eq!(alerts.len(), 1, "{body}");
    let opened = alerts[0]["opened_step"].as_u64().unwrap();
    assert!(opened <= 5, "loss_divergence opened only on step {opened}");
    assert_eq!(alerts[0]["evidence"]["cause"], "divergence");
}
