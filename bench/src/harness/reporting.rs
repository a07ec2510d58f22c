//! What reporting costs the trainer binary as a user runs it: `gradflow-trainer`
//! streaming to a release server on a fresh temporary database on the same
//! machine, beside the same command with `--no-report` (telemetry computed, nothing
//! sent), alternating which goes first, several rounds. The in-process overhead
//! (`gradflow_trainer::overhead`) cannot see this: the reporter's thread, the
//! server's share of the cores, registration and the final flush.
//!
//! The trainer prints its training loop's pace at exit, so a run splits into the
//! loop (a cost per step) and the rest (start-up, registration, the exit flush: a
//! cost per run). The server's CPU time comes from Linux `/proc`.

use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::Context;
use gradflow_e2e::{ServerProcess, binary};
use serde::Serialize;

use crate::stats::median;

/// What to run.
#[derive(Debug, Clone)]
pub struct ReportingSpec {
    pub preset: String,
    pub steps: u64,
    pub rounds: usize,
}

/// Medians over the rounds; the differences are medians of each round's own.
#[derive(Debug, Clone, Serialize)]
pub struct ReportingCost {
    pub preset: String,
    pub steps: u64,
    pub rounds: usize,
    /// The training loop's pace, reporting to the server.
    pub reporting_step_ms: f64,
    /// The training loop's pace with `--no-report`.
    pub no_report_step_ms: f64,
    /// What reporting adds to a step.
    pub extra_step_ms: f64,
    /// What reporting adds to a run outside its loop: the reporter's start,
    /// registration, the final batch and telling the server the run finished.
    pub extra_per_run_ms: f64,
    /// Whole commands, start to exit.
    pub reporting_wall_s: f64,
    pub no_report_wall_s: f64,
    /// The server's CPU time for each step it received.
    pub server_cpu_ms_per_step: f64,
}

/// One trainer command, timed.
struct Run {
    wall_s: f64,
    step_ms: f64,
}

impl Run {
    /// Wall time outside the training loop, in ms.
    fn outside_loop_ms(&self, steps: u64) -> f64 {
        self.wall_s * 1e3 - self.step_ms * steps as f64
    }
}

pub async fn run(spec: &ReportingSpec) -> anyhow::Result<ReportingCost> {
    let dir = tempfile::tempdir()?;
    let server = ServerProcess::start(&dir.path().join("gradflow.db"), &[]);
    let base = server.base.clone();
    let pid = server.pid();
    let blocking = spec.clone();
    let rounds = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let spec = blocking;
        let mut rounds = Vec::new();
        for round in 0..spec.rounds {
            let run_id = format!("reporting-{round}");
            let reporting = ["--server", base.as_str(), "--run-id", run_id.as_str()];
            // Alternate the order so that neither always runs on a warmer machine.
            let (on, off, server_s) = if round % 2 == 0 {
                let cpu = server_cpu_s(pid)?;
                let on = train(&spec, &reporting)?;
                let server_s = server_cpu_s(pid)? - cpu;
                (on, train(&spec, &["--no-report"])?, server_s)
            } else {
                let off = train(&spec, &["--no-report"])?;
                let cpu = server_cpu_s(pid)?;
                let on = train(&spec, &reporting)?;
                (on, off, server_cpu_s(pid)? - cpu)
            };
            rounds.push((on, off, server_s));
        }
        Ok(rounds)
    })
    .await??;
    let steps = spec.steps;
    let pick = |f: &dyn Fn(&(Run, Run, f64)) -> f64| median(rounds.iter().map(f));
    Ok(ReportingCost {
        preset: spec.preset.clone(),
        steps,
        rounds: rounds.len(),
        reporting_step_ms: pick(&|(on, _, _)| on.step_ms),
        no_report_step_ms: pick(&|(_, off, _)| off.step_ms),
        extra_step_ms: pick(&|(on, off, _)| on.step_ms - off.step_ms),
        extra_per_run_ms: pick(&|(on, off, _)| {
            on.outside_loop_ms(steps) - off.outside_loop_ms(steps)
        }),
        reporting_wall_s: pick(&|(on, _, _)| on.wall_s),
        no_report_wall_s: pick(&|(_, off, _)| off.wall_s),
        server_cpu_ms_per_step: pick(&|(_, _, server_s)| server_s * 1e3 / steps as f64),
    })
}

/// Runs the trainer binary once with `extra` flags.
fn train(spec: &ReportingSpec, extra: &[&str]) -> anyhow::Result<Run> {
    let started = Instant::now();
    let output = Command::new(binary("gradflow-trainer"))
        .args(["--preset", &spec.preset, "--steps", &spec.steps.to_string()])
        .arg("--quiet")
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .context("running gradflow-trainer")?;
    let wall_s = started.elapsed().as_secs_f64();
    let log = String::from_utf8_lossy(&output.stderr);
    anyhow::ensure!(
        output.status.success(),
        "gradflow-trainer {extra:?} failed: {log}"
    );
    let step_ms = step_ms(&log).with_context(|| format!("no pace in the trainer's log: {log}"))?;
    Ok(Run { wall_s, step_ms })
}

/// The pace of the trainer's exit line: `… finished: 400 steps in 1.7 s (4.123 ms a
/// step), …`.
fn step_ms(log: &str) -> Option<f64> {
    let (before, _) = log.rsplit_once(" ms a step)")?;
    before.rsplit_once('(')?.1.parse().ok()
}

/// The CPU time (user + system) process `pid` has used, in seconds.
fn server_cpu_s(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // Fields 14 and 15 (utime, stime) count clock ticks, which Linux gives user
    // space at a fixed 100 a second; the name before them may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| -> anyhow::Result<f64> {
        Ok(fields
            .get(i)
            .with_context(|| format!("/proc/{pid}/stat is short: {stat}"))?
            .parse::<f64>()?)
    };
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}

#[cfg(test)]
mod tests {
    use super::step_ms;

    #[test]
    fn reads_the_pace_of_the_exit_line() {
        let log = "INFO progress step=399\ngradflow-trainer: run r finished: 400 steps in \
                   1.7 s (4.123 ms a step), loss 2.3298 → 1.4069\ngradflow-trainer: \
                   delivered 400 steps (0 already there)\n";
        assert_eq!(step_ms(log), Some(4.123));
        assert_eq!(
            step_ms("gradflow-trainer: run r finished: 0 steps in 0.0 s, no steps"),
            None
        );
    }
}
