//! Detection latency: each failure scenario of the real trainer binary against a
//! real server, and for each alert it raises, the step on which the alert opened
//! against the earliest step docs/PROTOCOL.md's threshold allows (the fault's first step
//! plus the threshold, less one). Registration checks have no step: they open
//! before the first step arrives.

use std::process::{Command, Stdio};

use anyhow::Context;
use gradflow_e2e::{ServerProcess, binary};
use gradflow_trainer::scenario::{self, SCENARIOS};
use serde::Serialize;
use serde_json::Value;

#[derive(Debug, Clone, Serialize)]
pub struct Detection {
    pub scenario: String,
    pub kind: String,
    pub subject: String,
    /// The first step the fault shows in the telemetry, by the scenario's construction.
    pub fault_step: Option<u64>,
    /// Consecutive steps the protocol requires (1: at once).
    pub threshold_steps: u64,
    pub earliest_step: Option<u64>,
    pub opened_step: Option<u64>,
    /// Steps later than the earliest allowed (0: as early as possible).
    pub steps_late: Option<i64>,
}

/// docs/PROTOCOL.md's default thresholds, given to the server explicitly so that the
/// earliest steps below are computed from the thresholds it really uses.
const STREAK_THRESHOLDS: [(&str, &str, u64); 3] = [
    ("grad_stuck_zero", "--stuck-zero-steps", 50),
    ("norm_weight_frozen", "--frozen-norm-steps", 20),
    ("scaler_overflow_streak", "--overflow-streak-steps", 10),
];

/// Consecutive steps `kind` needs before it opens (1: at once).
fn threshold_steps(kind: &str) -> u64 {
    STREAK_THRESHOLDS
        .iter()
        .find(|(k, _, _)| *k == kind)
        .map_or(
            if kind == "loss_divergence" { 2 } else { 1 },
            |(_, _, steps)| *steps,
        )
}

/// Where the fault of `scenario` first shows for `kind`; `None` for the checks made
/// at registration.
fn fault_step(name: &str, kind: &str) -> anyhow::Result<Option<u64>> {
    let settings = scenario::settings(name)?;
    Ok(match kind {
        "scaler_bf16_incompatible" | "param_not_in_optimizer" | "dtype_mismatch" => None,
        // The NaN gradient of step N poisons the weights in that step's update, so
        // the loss of step N + 1 is the first non-finite one.
        "grad_nonfinite" => Some(settings.faults.nan_grad_at.unwrap_or(0)),
        "loss_nonfinite" => Some(settings.faults.nan_grad_at.map_or(0, |s| s + 1)),
        // Step 0's update at lr 1.0 is the fault: step 1's loss is the first to show it,
        // and the blow-up zeroes a module's gradient from step 2 on.
        "loss_divergence" => Some(1),
        "grad_stuck_zero" if name == "lr-too-high" => Some(2),
        // Every other fault is there from the first step.
        _ => Some(0),
    })
}

pub async fn run() -> anyhow::Result<Vec<Detection>> {
    let dir = tempfile::tempdir().context("a temporary directory")?;
    let mut args = vec!["--sync".to_owned(), "normal".to_owned()];
    for (_, flag, steps) in STREAK_THRESHOLDS {
        args.extend([flag.to_owned(), steps.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = ServerProcess::start(&dir.path().join("latency.db"), &args);
    let client = reqwest::Client::new();
    let mut detections = Vec::new();
    for scenario in SCENARIOS.iter().filter(|s| !s.alerts.is_empty()) {
        let steps = scenario.steps_to_show_alerts();
        let output = Command::new(binary("gradflow-trainer"))
            .args([
                "--server",
                &server.base,
                "--scenario",
                scenario.name,
                "--run-id",
                scenario.name,
            ])
            .args(["--steps", &steps.to_string(), "--quiet"])
            .stdin(Stdio::null())
            .output()
            .context("running gradflow-trainer")?;
        anyhow::ensure!(
            output.status.success() || scenario.stops_at_once,
            "scenario {}: {}",
            scenario.name,
            String::from_utf8_lossy(&output.stderr)
        );
        let alerts: Value = client
            .get(server.url(&format!("/api/v1/runs/{}/alerts", scenario.name)))
            .send()
            .await?
            .json()
            .await?;
        for kind in scenario.alerts {
            let alert = alerts["alerts"]
                .as_array()
                .and_then(|all| all.iter().find(|a| a["kind"] == *kind))
                .with_context(|| {
                    format!("scenario {} raised no {kind}: {alerts}", scenario.name)
                })?;
            let fault = fault_step(scenario.name, kind)?;
            let threshold = threshold_steps(kind);
            let earliest = fault.map(|f| f + threshold - 1);
            let opened = alert["opened_step"].as_u64();
            detections.push(Detection {
                scenario: scenario.name.to_owned(),
                kind: (*kind).to_owned(),
                subject: alert["subject"].as_str().unwrap_or_default().to_owned(),
                fault_step: fault,
                threshold_steps: threshold,
                earliest_step: earliest,
                opened_step: opened,
                steps_late: earliest.zip(opened).map(|(e, o)| o as i64 - e as i64),
            });
        }
    }
    let status = server.terminate();
    anyhow::ensure!(status.success(), "the server stopped with {status}");
    Ok(detections)
}
