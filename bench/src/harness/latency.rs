//! Detection latency: each failure scenario of the real trainer binary against a
//! real server, and for each alert it raises, the step on which the alert opened
//! against the earliest step docs/PROTOCOL.md's threshold allows (the fault's first step
//! plus the threshold, less one). Registration checks have no step: they open
//! before the first step arrives.
//!
//! The fault's first step is read from the telemetry where it shows there directly
//! (a non-finite loss or gradient, an overflow, a gradient of zero), and taken from
//! the scenario's construction otherwise. The same server also trains the healthy
//! scenarios, and every run's alerts are labelled expected or not.

use std::process::{Command, Stdio};

use anyhow::Context;
use gradflow_core::detect::attention_logit_growth;
use gradflow_e2e::{ServerProcess, binary};
use gradflow_trainer::scenario::{self, SCENARIOS};
use serde::Serialize;
use serde_json::Value;

use super::alarms::WorkloadAlarms;

#[derive(Debug, Clone, Serialize)]
pub struct Detection {
    pub scenario: String,
    pub kind: String,
    pub subject: String,
    /// The first step the fault shows in the telemetry.
    pub fault_step: Option<u64>,
    /// Where `fault_step` comes from: `telemetry` (read back from the stored
    /// series), `construction` (where the scenario injects it) or `registration`.
    pub fault_step_from: &'static str,
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
            match kind {
                "loss_divergence" => 2,
                "attention_logit_growth" => u64::from(attention_logit_growth::REPORTS),
                _ => 1,
            },
            |(_, _, steps)| *steps,
        )
}

/// Where `scenario` puts the fault behind `kind`, by its construction: the figure
/// used where the telemetry does not show the fault directly. `None` for the checks
/// made at registration.
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

/// The healthy runs trained beside the failures: each healthy scenario of the
/// trainer at each seed, `steps` steps long.
#[derive(Debug, Clone)]
pub struct HealthyRuns {
    pub seeds: Vec<u64>,
    pub steps: u64,
}

/// Trains the scenario `name` into the run `run_id`; whether it succeeded.
fn train(
    server: &ServerProcess,
    name: &str,
    run_id: &str,
    args: &[String],
) -> anyhow::Result<bool> {
    let output = Command::new(binary("gradflow-trainer"))
        .args([
            "--server",
            &server.base,
            "--scenario",
            name,
            "--run-id",
            run_id,
        ])
        .args(["--step-delay-ms", "0", "--quiet"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running gradflow-trainer")?;
    anyhow::ensure!(
        output.status.success() || scenario::find(name)?.stops_at_once,
        "scenario {name}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(output.status.success())
}

async fn get(
    client: &reqwest::Client,
    server: &ServerProcess,
    path: &str,
) -> anyhow::Result<Value> {
    let response = client.get(server.url(path)).send().await?;
    anyhow::ensure!(
        response.status() == 200,
        "{path}: HTTP {}",
        response.status()
    );
    Ok(response.json().await?)
}

/// The `[step, value]` points of a stored series, every step of a short run.
async fn series(
    client: &reqwest::Client,
    server: &ServerProcess,
    run: &str,
    query: &str,
) -> anyhow::Result<Vec<(u64, Value)>> {
    let body = get(
        client,
        server,
        &format!("/api/v1/runs/{run}/series?{query}&max_points=100000"),
    )
    .await?;
    Ok(body["points"]
        .as_array()
        .map(|points| {
            points
                .iter()
                .filter_map(|p| Some((p[0].as_u64()?, p[1].clone())))
                .collect()
        })
        .unwrap_or_default())
}

/// A non-finite reading: the protocol writes NaN and infinities as strings.
fn non_finite(value: &Value) -> bool {
    value.is_string()
}

/// Where the fault behind `alert` first shows in the stored telemetry, for the
/// kinds that read one series directly; `None` where it does not.
async fn fault_in_telemetry(
    client: &reqwest::Client,
    server: &ServerProcess,
    run: &str,
    alert: &Value,
) -> anyhow::Result<Option<u64>> {
    let subject = alert["subject"].as_str().unwrap_or_default();
    let Some(opened) = alert["opened_step"].as_u64() else {
        return Ok(None);
    };
    // The first step of the streak of `holds` that reaches the opened step.
    let streak_start = |points: Vec<(u64, Value)>, holds: fn(&Value) -> bool| {
        let mut start = None;
        for (step, value) in points.into_iter().take_while(|(step, _)| *step <= opened) {
            if holds(&value) {
                start.get_or_insert(step);
            } else {
                start = None;
            }
        }
        start
    };
    let first = |points: Vec<(u64, Value)>| {
        points
            .into_iter()
            .find(|(_, value)| non_finite(value))
            .map(|(step, _)| step)
    };
    let subject_norms = format!("metric=grad_norm&subject={subject}");
    Ok(match alert["kind"].as_str().unwrap_or_default() {
        "loss_nonfinite" => first(series(client, server, run, "metric=loss").await?),
        "grad_nonfinite" => first(series(client, server, run, &subject_norms).await?),
        "scaler_overflow_streak" => streak_start(
            series(client, server, run, "metric=found_inf").await?,
            |v| v.as_f64() == Some(1.0),
        ),
        // Above QK-Clip's τ, or not finite (written as a string).
        "attention_logit_growth" => streak_start(
            series(
                client,
                server,
                run,
                &format!("metric=attn_max_logit&subject={subject}"),
            )
            .await?,
            |v| {
                non_finite(v)
                    || v.as_f64()
                        .is_some_and(|l| l > attention_logit_growth::WARN_LOGIT)
            },
        ),
        // No gradient reads as null, a zero one as 0.
        "grad_stuck_zero" => {
            streak_start(series(client, server, run, &subject_norms).await?, |v| {
                v.is_null() || v.as_f64() == Some(0.0)
            })
        }
        _ => None,
    })
}

pub async fn run(healthy: &HealthyRuns) -> anyhow::Result<(Vec<Detection>, Vec<WorkloadAlarms>)> {
    let dir = tempfile::tempdir().context("a temporary directory")?;
    let mut args = vec!["--sync".to_owned(), "normal".to_owned()];
    for (_, flag, steps) in STREAK_THRESHOLDS {
        args.extend([flag.to_owned(), steps.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = ServerProcess::start(&dir.path().join("latency.db"), &args);
    let client = reqwest::Client::new();
    let mut detections = Vec::new();
    let mut alarms = Vec::new();
    for scenario in SCENARIOS.iter().filter(|s| s.alerts.is_empty()) {
        for seed in &healthy.seeds {
            let run_id = format!("{}-{seed}", scenario.name);
            let steps = healthy.steps.to_string();
            let seed = seed.to_string();
            train(
                &server,
                scenario.name,
                &run_id,
                &["--steps".into(), steps, "--seed".into(), seed],
            )?;
            let alerts = get(&client, &server, &format!("/api/v1/runs/{run_id}/alerts")).await?;
            alarms.push(WorkloadAlarms::label(
                &format!("trainer: {run_id} ({} steps)", healthy.steps),
                healthy.steps,
                alerts["alerts"].as_array().map_or(&[], Vec::as_slice),
                |_| false,
            ));
        }
    }
    for scenario in SCENARIOS.iter().filter(|s| !s.alerts.is_empty()) {
        let steps = scenario.steps_to_show_alerts();
        train(
            &server,
            scenario.name,
            scenario.name,
            &["--steps".into(), steps.to_string()],
        )?;
        let alerts = get(
            &client,
            &server,
            &format!("/api/v1/runs/{}/alerts", scenario.name),
        )
        .await?;
        let all = alerts["alerts"].as_array().map_or(&[][..], Vec::as_slice);
        alarms.push(WorkloadAlarms::label(
            &format!("trainer: {} ({steps} steps)", scenario.name),
            0,
            all,
            |a| scenario.alerts.iter().any(|kind| a["kind"] == *kind),
        ));
        for kind in scenario.alerts {
            let alert = all.iter().find(|a| a["kind"] == *kind).with_context(|| {
                format!("scenario {} raised no {kind}: {alerts}", scenario.name)
            })?;
            let constructed = fault_step(scenario.name, kind)?;
            let measured = fault_in_telemetry(&client, &server, scenario.name, alert).await?;
            let (fault, from) = match (constructed, measured) {
                (None, _) => (None, "registration"),
                (Some(_), Some(step)) => (Some(step), "telemetry"),
                (Some(step), None) => (Some(step), "construction"),
            };
            let threshold = threshold_steps(kind);
            let earliest = fault.map(|f| f + threshold - 1);
            let opened = alert["opened_step"].as_u64();
            detections.push(Detection {
                scenario: scenario.name.to_owned(),
                kind: (*kind).to_owned(),
                subject: alert["subject"].as_str().unwrap_or_default().to_owned(),
                fault_step: fault,
                fault_step_from: from,
                threshold_steps: threshold,
                earliest_step: earliest,
                opened_step: opened,
                steps_late: earliest.zip(opened).map(|(e, o)| o as i64 - e as i64),
            });
        }
    }
    let status = server.terminate();
    anyhow::ensure!(status.success(), "the server stopped with {status}");
    Ok((detections, alarms))
}
