//! Everything one harness run measured, as JSON (`results.json`) and as the
//! Markdown tables BENCHMARKS.md quotes (`report.md`), each figure beside its target.

use std::fmt::Write;

use gradflow_trainer::overhead::Overhead;
use serde::Serialize;

use super::Machine;
use super::alarms::{FalseAlarms, WorkloadAlarms};
use super::baseline::BaselineResult;
use super::ingest::IngestResult;
use super::latency::Detection;
use super::queries::QueryResult;
use super::scaling::Sweep;
use crate::stats::median;
use crate::workload::Shape;

/// One round of the ingest comparison: the three, run back to back.
#[derive(Debug, Clone, Serialize)]
pub struct IngestRound {
    pub detectors_on: IngestResult,
    pub detectors_off: IngestResult,
    pub baseline: BaselineResult,
}

#[derive(Debug, Clone, Serialize)]
pub struct IngestReport {
    pub clients: usize,
    pub steps_per_client: u64,
    pub modules: usize,
    pub norm_params: usize,
    pub batch_steps: u64,
    pub rounds: Vec<IngestRound>,
}

impl IngestReport {
    pub fn median_rate(&self, pick: impl Fn(&IngestRound) -> f64) -> f64 {
        median(self.rounds.iter().map(pick))
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub machine: Option<Machine>,
    pub quick: bool,
    pub ingest: Option<IngestReport>,
    pub queries: Option<QueryResult>,
    pub overhead: Option<Overhead>,
    pub latency: Option<Vec<Detection>>,
    /// What the latency part's runs raised, healthy scenarios included, labelled.
    #[serde(skip)]
    pub latency_alarms: Option<Vec<WorkloadAlarms>>,
    pub scaling: Option<Vec<Sweep>>,
    /// What every workload above raised, labelled; false alarms on the healthy ones.
    pub false_alarms: Option<FalseAlarms>,
    /// `scripts/mlflow_reference.py`'s figures, when MLflow is installed.
    pub mlflow: Option<serde_json::Value>,
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "**not met**" }
}

fn thousands(x: f64) -> String {
    let digits = format!("{:.0}", x);
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

impl Report {
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        if let Some(m) = &self.machine {
            let _ = writeln!(
                md,
                "Machine: {}, {} cores, {} GiB.{}\n",
                m.cpu,
                m.cores,
                m.memory_gib,
                if self.quick {
                    " Quick (smoke) sizes: not the recorded figures."
                } else {
                    ""
                }
            );
        }
        if let Some(ingest) = &self.ingest {
            self.ingest_tables(&mut md, ingest);
        }
        if let Some(q) = &self.queries {
            let _ = writeln!(
                md,
                "### Queries\n\n{} runs ({} alerts: {} expected by construction, {} false \
                alarms; see the false-alarm table); the long run: {} \
                steps × {} modules. Median of the timed requests over HTTP, end to end.\n",
                q.runs,
                q.alerts,
                q.alarms
                    .iter()
                    .flat_map(|w| w.expected.values())
                    .sum::<usize>(),
                q.alarms
                    .iter()
                    .flat_map(|w| w.unexpected.values())
                    .sum::<usize>(),
                thousands(q.long_steps as f64),
                q.long_modules
            );
            let _ = writeln!(
                md,
                "| query | median | max | answer | target |\n| --- | --- | --- | --- | --- |"
            );
            for t in &q.timings {
                let target = match t.name.as_str() {
                    n if n.starts_with("series") => Some(20.0),
                    "grad-flow chart (SVG)" => Some(300.0),
                    "runs list" | "alerts, every run" => Some(50.0),
                    _ => None,
                };
                let target = target.map_or_else(String::new, |ms| {
                    format!("≤ {ms} ms: {}", verdict(t.median_ms <= ms))
                });
                let _ = writeln!(
                    md,
                    "| {} | {:.1} ms | {:.1} ms | {} B | {} |",
                    t.name,
                    t.median_ms,
                    t.max_ms,
                    thousands(t.response_bytes as f64),
                    target
                );
            }
            md.push('\n');
        }
        if let Some(o) = &self.overhead {
            let _ = writeln!(
                md,
                "### Trainer overhead\n\n| preset | device | params | steps | instrumented | `--no-instrument` | overhead | target |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
            );
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {:.2} ms | {:.2} ms | {:+.2} % | ≤ 3 %: {} |\n",
                o.preset,
                o.device,
                thousands(o.params as f64),
                o.steps,
                o.instrumented_ms,
                o.uninstrumented_ms,
                o.percent(),
                verdict(o.percent() <= 3.0)
            );
        }
        if let Some(detections) = &self.latency {
            let _ = writeln!(
                md,
                "### Detection latency\n\nThe fault's first step is read back from the stored telemetry where it shows \
                there directly (`telemetry`), and taken from where the scenario injects it otherwise \
                (`construction`).\n\n| scenario | alert | subject | fault from step | threshold | earliest allowed | opened on | late by |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
            );
            for d in detections {
                let step =
                    |s: Option<u64>| s.map_or_else(|| "registration".to_owned(), |s| s.to_string());
                let late = d.steps_late.map_or_else(
                    || "0 (at registration)".to_owned(),
                    |l| format!("{l} steps"),
                );
                let _ = writeln!(
                    md,
                    "| {} | `{}` | {} | {} | {} | {} | {} | {} |",
                    d.scenario,
                    d.kind,
                    d.subject,
                    match d.fault_step {
                        Some(s) => format!("{s} ({})", d.fault_step_from),
                        None => step(None),
                    },
                    d.threshold_steps,
                    step(d.earliest_step),
                    step(d.opened_step),
                    late
                );
            }
            md.push('\n');
        }
        if let Some(alarms) = &self.false_alarms {
            false_alarm_table(&mut md, alarms);
        }
        if let Some(sweeps) = &self.scaling {
            for s in sweeps {
                let _ = writeln!(md, "### Scaling: {}\n\n{}.\n", s.axis, s.method);
                let names: Vec<&str> = s
                    .points
                    .first()
                    .map(|p| p.queries.iter().map(|q| q.name.as_str()).collect())
                    .unwrap_or_default();
                let _ = write!(
                    md,
                    "| {} | M module values/s | B per module value | batch p50 |",
                    s.axis
                );
                for n in &names {
                    let _ = write!(md, " {n} |");
                }
                let _ = write!(md, "\n| --- | --- | --- | --- |");
                md.push_str(&" --- |".repeat(names.len()));
                md.push('\n');
                for p in &s.points {
                    let _ = write!(
                        md,
                        "| {} | {:.2} | {} | {} |",
                        thousands(p.x as f64),
                        p.module_values_per_second / 1e6,
                        p.bytes_per_module_value
                            .map_or("".into(), |b| format!("{b:.2}")),
                        p.batch_latency_p50_ms
                            .map_or("".into(), |l| format!("{l:.1} ms"))
                    );
                    for q in &p.queries {
                        let _ = write!(md, " {:.1} ms |", q.median_ms);
                    }
                    md.push('\n');
                }
                md.push('\n');
            }
        }
        if let Some(m) = &self.mlflow {
            let _ = writeln!(
                md,
                "### For reference: MLflow\n\n```json\n{}\n```\n",
                serde_json::to_string_pretty(m).unwrap_or_default()
            );
        }
        md
    }

    fn ingest_tables(&self, md: &mut String, ingest: &IngestReport) {
        let on = ingest.median_rate(|r| r.detectors_on.module_values_per_second);
        let off = ingest.median_rate(|r| r.detectors_off.module_values_per_second);
        let base = ingest.median_rate(|r| r.baseline.module_values_per_second);
        let base_rows = ingest.median_rate(|r| r.baseline.rows_per_second);
        let ratio = ingest.median_rate(|r| {
            r.detectors_on.module_values_per_second / r.baseline.module_values_per_second
        });
        let cost = ingest.median_rate(|r| {
            1.0 - r.detectors_on.module_values_per_second / r.detectors_off.module_values_per_second
        }) * 100.0;
        let bytes = ingest.median_rate(|r| r.detectors_on.bytes_per_module_value);
        let bytes_all = ingest.median_rate(|r| r.detectors_on.bytes_per_value);
        let base_bytes = ingest.median_rate(|r| r.baseline.bytes_per_module_value);
        let _ = writeln!(
            md,
            "### Ingest and storage\n\n{} clients × {} steps × ({} modules + {} norm weights), {} steps a batch, \
            {} rounds; in each round the server with detectors, the server without, and the bare-SQLite baseline run back \
            to back. Medians over the rounds; the ratios are medians of the per-round ratios.\n",
            ingest.clients,
            thousands(ingest.steps_per_client as f64),
            ingest.modules,
            ingest.norm_params,
            ingest.batch_steps,
            ingest.rounds.len()
        );
        let _ = writeln!(md, "| figure | value | target |\n| --- | --- | --- |");
        let _ = writeln!(
            md,
            "| ingest over HTTP, detectors on | {} module values/s | ≥ 2,000,000: {} |",
            thousands(on),
            verdict(on >= 2e6)
        );
        let _ = writeln!(
            md,
            "| bare SQLite, one row per value | {} module values/s ({} rows/s) | |",
            thousands(base),
            thousands(base_rows)
        );
        let _ = writeln!(
            md,
            "| HTTP ingest ÷ bare SQLite | {:.2}× | ≥ 2×: {} |",
            ratio,
            verdict(ratio >= 2.0)
        );
        let _ = writeln!(
            md,
            "| ingest over HTTP, detectors off | {} module values/s | |",
            thousands(off)
        );
        let _ = writeln!(
            md,
            "| detectors' cost | {:.1} % slower | ≤ 10 %: {} |",
            cost,
            verdict(cost <= 10.0)
        );
        let _ = writeln!(
            md,
            "| bytes on disk per module value | {:.2} B (bare SQLite: {:.1} B) | ≤ 5: {} |",
            bytes,
            base_bytes,
            verdict(bytes <= 5.0)
        );
        let _ = writeln!(
            md,
            "| bytes on disk per stored value ({} a step) | {:.2} B | |",
            Shape {
                modules: ingest.modules,
                norm_params: ingest.norm_params
            }
            .values_per_step(),
            bytes_all
        );
        let latency = ingest.median_rate(|r| r.detectors_on.batch_latency_p50_ms);
        let _ = writeln!(md, "| batch latency p50 | {:.1} ms | |\n", latency);
        let _ = writeln!(
            md,
            "| round | detectors on | detectors off | bare SQLite | ratio |\n| --- | --- | --- | --- | --- |"
        );
        for (i, r) in ingest.rounds.iter().enumerate() {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {:.2}× |",
                i + 1,
                thousands(r.detectors_on.module_values_per_second),
                thousands(r.detectors_off.module_values_per_second),
                thousands(r.baseline.module_values_per_second),
                r.detectors_on.module_values_per_second / r.baseline.module_values_per_second
            );
        }
        md.push('\n');
    }
}

/// "n × key, …", or "none".
fn counts(map: &std::collections::BTreeMap<String, usize>) -> String {
    if map.is_empty() {
        return "none".to_owned();
    }
    map.iter()
        .map(|(key, n)| format!("{n} × `{key}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn false_alarm_table(md: &mut String, alarms: &FalseAlarms) {
    let _ = writeln!(
        md,
        "### False alarms

Every alert of warning or critical severity that the workloads above raised, \
        labelled expected (the workload is built to raise it) or not. An unexpected alert on a workload \
        healthy by construction is a false alarm: **{} in {} healthy steps, {:.3} per 1,000 steps**{}.\n",
        alarms.false_alarms,
        thousands(alarms.healthy_steps as f64),
        alarms.per_1000_steps,
        if alarms.by_kind.is_empty() {
            String::new()
        } else {
            format!(
                " ({})",
                alarms
                    .by_kind
                    .iter()
                    .map(|(kind, n)| format!("{n} × `{kind}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    );
    let _ = writeln!(
        md,
        "| workload | healthy steps | expected | unexpected | false alarms per 1,000 healthy steps |\n\
        | --- | --- | --- | --- | --- |"
    );
    for w in &alarms.workloads {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} |",
            w.workload,
            thousands(w.healthy_steps as f64),
            counts(&w.expected),
            counts(&w.unexpected),
            w.false_alarms_per_1000_steps
                .map_or_else(|| "(a failure scenario)".to_owned(), |r| format!("{r:.3}"))
        );
    }
    md.push('\n');
}

/// Every workload's labelled alerts out of `report`, the ingest rounds folded into one.
pub fn gather_alarms(report: &Report) -> Vec<WorkloadAlarms> {
    let mut all = Vec::new();
    if let Some(ingest) = &report.ingest {
        let mut rounds = ingest
            .rounds
            .iter()
            .filter_map(|r| r.detectors_on.alarms.clone());
        if let Some(mut first) = rounds.next() {
            for round in rounds {
                first.merge(&round);
            }
            first.workload = format!("ingest, {} rounds: {}", ingest.rounds.len(), first.workload);
            all.push(first);
        }
    }
    if let Some(queries) = &report.queries {
        all.extend(queries.alarms.iter().cloned());
    }
    if let Some(latency) = &report.latency_alarms {
        all.extend(latency.iter().cloned());
    }
    for sweep in report.scaling.iter().flatten() {
        all.extend(sweep.alarms.iter().map(|w| WorkloadAlarms {
            workload: format!("scaling ({}): {}", sweep.axis, w.workload),
            ..w.clone()
        }));
    }
    all
}

#[cfg(test)]
mod tests {
    use super::thousands;

    #[test]
    fn groups_digits() {
        assert_eq!(thousands(1234567.4), "1,234,567");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(1000.0), "1,000");
    }
}
