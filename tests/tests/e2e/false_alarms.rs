//! No false alarms: healthy training, as the real trainer binary runs it against the
//! real server, raises no warning and no critical alert — over 300+ steps, at several
//! seeds, with prompt caching, a warm-up + cosine schedule, fp16 with the loss
//! scaler overflowing now and then, a client reporting every 10th step and the
//! `small` preset. Each failure scenario, trained as long, raises its own verdicts
//! and nothing else at warning or above; a learning rate far too high is caught
//! within a few steps.
//!
//! (`trainer.rs` checks each scenario's alerts after the fewest steps that show
//! them; here they run 320 steps, long enough for the rise of Qwen's gradient norm
//! around step 150 that a naive explosion rule mistakes for a blow-up.)

use std::collections::{BTreeSet, VecDeque};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gradflow_e2e::{ServerProcess, binary, wait_for_exit};
use gradflow_trainer::scenario::SCENARIOS;
use serde_json::Value;

/// Steps of every long run.
const STEPS: u64 = 320;

/// One trainer run: its id, its flags, and what it must end with.
#[derive(Clone)]
struct Job {
    run_id: String,
    args: Vec<String>,
    /// Step records the server must hold at the end (`None`: the trainer stops
    /// before its first step, on purpose).
    records: Option<u64>,
}

fn job(run_id: &str, args: &[&str], records: Option<u64>) -> Job {
    Job {
        run_id: run_id.to_owned(),
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        records,
    }
}

/// Runs every job against `server`, two trainers at a time (the machine has two
/// cores), each slot taking the next job as soon as its trainer exits.
fn run_all(server: &ServerProcess, jobs: &[Job]) {
    let queue = Mutex::new(jobs.iter().collect::<VecDeque<_>>());
    std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| {
                loop {
                    let Some(job) = queue.lock().unwrap().pop_front() else {
                        return;
                    };
                    let mut child = Command::new(binary("gradflow-trainer"))
                        .args(["--server", &server.base, "--run-id", &job.run_id])
                        .args(["--step-delay-ms", "0", "--quiet"])
                        .args(&job.args)
                        .env("RUST_LOG", "gradflow_trainer=warn")
                        .stdout(Stdio::null())
                        .stderr(Stdio::inherit())
                        .spawn()
                        .expect("gradflow-trainer starts");
                    let status = wait_for_exit(&mut child, Duration::from_secs(600), &job.run_id);
                    assert_eq!(
                        status.success(),
                        job.records.is_some(),
                        "{} {:?} exited with {status}",
                        job.run_id,
                        job.args
                    );
                }
            });
        }
    });
}

fn get(server: &ServerProcess, path: &str) -> Value {
    reqwest::blocking::get(server.url(path))
        .and_then(reqwest::blocking::Response::error_for_status)
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
        .json()
        .unwrap()
}

/// The run's alerts of severity warning or critical, as (kind, a line a person can
/// read).
fn loud_alerts(server: &ServerProcess, run_id: &str) -> Vec<(String, String)> {
    let body = get(server, &format!("/api/v1/runs/{run_id}/alerts"));
    body["alerts"]
        .as_array()
        .unwrap_or_else(|| panic!("no alerts list for {run_id}: {body}"))
        .iter()
        .filter(|a| a["severity"] != "info")
        .map(|a| {
            let kind = a["kind"].as_str().expect("an alert kind").to_owned();
            let line = format!(
                "{run_id}: {} {kind} on {} from step {}: {}",
                a["severity"], a["subject"], a["first_step"], a["detail"]
            );
            (kind, line)
        })
        .collect()
}

/// Every stored record arrived: what the trainer trained is what the detectors saw.
fn assert_delivered(server: &ServerProcess, jobs: &[Job]) {
    for job in jobs {
        let Some(records) = job.records else { continue };
        let run = get(server, &format!("/api/v1/runs/{}", job.run_id));
        assert_eq!(run["step_count"], records, "{}: {run}", job.run_id);
    }
}

fn steps() -> String {
    STEPS.to_string()
}

#[test]
fn healthy_training_raises_nothing_and_each_failure_only_its_own_verdicts() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("g.db"), &["--sync", "normal"]);
    let steps = steps();
    let all = Some(STEPS);

    // The `small` preset costs ~4 CPU-seconds a step (the tiny one ~20 ms), so it
    // runs 30 steps, not 320: past every detector's warm-up (20 steps), and its four
    // layers are the only ones here that the vanishing-gradient rule judges. It
    // starts first, so that the tiny runs fill the other core meanwhile.
    let mut healthy = vec![job(
        "small",
        &["--preset", "small", "--steps", "30"],
        Some(30),
    )];
    for seed in ["0", "1", "2"] {
        for scenario in ["healthy", "prompt-caching"] {
            healthy.push(job(
                &format!("{scenario}-{seed}"),
                &["--scenario", scenario, "--steps", &steps, "--seed", seed],
                all,
            ));
        }
    }
    healthy.push(job(
        "warmup-cosine",
        &[
            "--steps",
            &steps,
            "--lr",
            "1e-3",
            "--lr-schedule",
            "warmup-cosine",
            "--warmup-steps",
            "50",
        ],
        all,
    ));
    // fp16 compute under a dynamic loss scaler that grows every 20 clean steps: the
    // scale climbs until a step overflows, halves, and climbs again.
    healthy.push(job(
        "fp16-scaler",
        &[
            "--steps",
            &steps,
            "--param-dtype",
            "f32",
            "--compute-dtype",
            "f16",
            "--loss-scaler",
            "dynamic",
            "--scaler-growth-interval",
            "20",
        ],
        all,
    ));
    // A client that reports every 10th step.
    healthy.push(job(
        "sparse-reports",
        &["--steps", &steps, "--report-every", "10"],
        Some(STEPS / 10),
    ));

    let failures: Vec<(Job, BTreeSet<&str>)> = SCENARIOS
        .iter()
        .filter(|s| !s.alerts.is_empty())
        .map(|s| {
            let records = (!s.stops_at_once).then_some(STEPS);
            let run = job(
                &format!("scenario-{}", s.name),
                &["--scenario", s.name, "--steps", &steps],
                records,
            );
            (run, s.alerts.iter().copied().collect())
        })
        .collect();

    let mut jobs = healthy;
    let healthy_count = jobs.len();
    jobs.extend(failures.iter().map(|(run, _)| run.clone()));
    run_all(&server, &jobs);
    assert_delivered(&server, &jobs);

    // Healthy runs: not one warning.
    let mut found = Vec::new();
    for run in &jobs[..healthy_count] {
        found.extend(
            loud_alerts(&server, &run.run_id)
                .into_iter()
                .map(|(_, line)| line),
        );
    }
    // Failure runs: exactly their own kinds.
    let mut wrong = Vec::new();
    for (run, expected) in &failures {
        let alerts = loud_alerts(&server, &run.run_id);
        let kinds: BTreeSet<&str> = alerts.iter().map(|(kind, _)| kind.as_str()).collect();
        if &kinds != expected {
            wrong.push(format!(
                "{}: expected {expected:?}, raised {kinds:?}:\n  {}",
                run.run_id,
                alerts
                    .iter()
                    .map(|(_, line)| line.as_str())
                    .collect::<Vec<_>>()
                    .join("\n  ")
            ));
        }
    }
    eprintln!(
        "false_alarms: {} trainer runs in {:.0?}",
        jobs.len(),
        started.elapsed()
    );
    assert!(
        found.is_empty() && wrong.is_empty(),
        "healthy runs raised alerts:\n{}\nfailure scenarios raised other verdicts than their own:\n{}",
        found.join("\n"),
        wrong.join("\n")
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
        "the fp16 run overflowed {overflowed} times, not now and then: {overflows}"
    );
}

#[test]
fn a_learning_rate_far_too_high_is_caught_within_a_few_steps() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("g.db"), &["--sync", "normal"]);
    let jobs = [job(
        "too-high",
        &["--scenario", "lr-too-high", "--steps", "20"],
        Some(20),
    )];
    run_all(&server, &jobs);
    let body = get(&server, "/api/v1/runs/too-high/alerts?kind=loss_divergence");
    let alerts = body["alerts"].as_array().unwrap();
    assert_eq!(alerts.len(), 1, "{body}");
    let opened = alerts[0]["opened_step"].as_u64().unwrap();
    assert!(
        opened <= 5,
        "loss_divergence opened only on step {opened}: {body}"
    );
    assert_eq!(alerts[0]["evidence"]["cause"], "divergence", "{body}");
}
