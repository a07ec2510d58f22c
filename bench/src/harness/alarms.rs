//! False alarms: what the server raised on each benchmark workload, each alert
//! labelled expected (the workload is built to raise it) or not. An unexpected
//! alert on a workload that is healthy by construction is a false alarm; the rate
//! per 1,000 healthy steps is the figure to keep at zero.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What one workload raised.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkloadAlarms {
    pub workload: String,
    /// Steps streamed that are healthy by construction (0 for a failure scenario).
    pub healthy_steps: u64,
    /// Alerts the workload is built to raise, by "kind on subject".
    pub expected: BTreeMap<String, usize>,
    /// Every other alert of warning or critical severity, by "kind on subject":
    /// false alarms on a healthy workload, a verdict beside the point on a failure.
    pub unexpected: BTreeMap<String, usize>,
    /// `unexpected` per 1,000 healthy steps (`None` where none was healthy).
    pub false_alarms_per_1000_steps: Option<f64>,
}

impl WorkloadAlarms {
    /// Labels `alerts` (the server's alert objects) with `is_expected`. Info alerts
    /// are notes, not alarms, and are left out.
    pub fn label(
        workload: &str,
        healthy_steps: u64,
        alerts: &[Value],
        is_expected: impl Fn(&Value) -> bool,
    ) -> WorkloadAlarms {
        let mut expected = BTreeMap::new();
        let mut unexpected = BTreeMap::new();
        for alert in alerts.iter().filter(|a| a["severity"] != "info") {
            let key = key(alert);
            let bucket = if is_expected(alert) {
                &mut expected
            } else {
                &mut unexpected
            };
            *bucket.entry(key).or_insert(0) += 1;
        }
        let count: usize = unexpected.values().sum();
        WorkloadAlarms {
            workload: workload.to_owned(),
            healthy_steps,
            expected,
            unexpected,
            false_alarms_per_1000_steps: (healthy_steps > 0)
                .then(|| count as f64 * 1000.0 / healthy_steps as f64),
        }
    }

    /// Folds `other` (the same workload measured again) into this one.
    pub fn merge(&mut self, other: &WorkloadAlarms) {
        self.healthy_steps += other.healthy_steps;
        for (into, from) in [
            (&mut self.expected, &other.expected),
            (&mut self.unexpected, &other.unexpected),
        ] {
            for (key, n) in from {
                *into.entry(key.clone()).or_insert(0) += n;
            }
        }
        let count: usize = self.unexpected.values().sum();
        self.false_alarms_per_1000_steps =
            (self.healthy_steps > 0).then(|| count as f64 * 1000.0 / self.healthy_steps as f64);
    }
}

/// "kind on subject".
fn key(alert: &Value) -> String {
    format!(
        "{} on {}",
        alert["kind"].as_str().unwrap_or("?"),
        alert["subject"].as_str().unwrap_or("?")
    )
}

/// The false alarms of every workload healthy by construction, added up.
#[derive(Debug, Clone, Serialize)]
pub struct FalseAlarms {
    pub healthy_steps: u64,
    pub false_alarms: usize,
    pub per_1000_steps: f64,
    /// False alarms by alert kind.
    pub by_kind: BTreeMap<String, usize>,
    pub workloads: Vec<WorkloadAlarms>,
}

impl FalseAlarms {
    pub fn of(workloads: Vec<WorkloadAlarms>) -> FalseAlarms {
        let healthy: Vec<&WorkloadAlarms> =
            workloads.iter().filter(|w| w.healthy_steps > 0).collect();
        let healthy_steps = healthy.iter().map(|w| w.healthy_steps).sum();
        let mut by_kind = BTreeMap::new();
        for (key, n) in healthy.iter().flat_map(|w| &w.unexpected) {
            let kind = key.split(" on ").next().unwrap_or(key);
            *by_kind.entry(kind.to_owned()).or_insert(0) += n;
        }
        let false_alarms = by_kind.values().sum();
        FalseAlarms {
            healthy_steps,
            false_alarms,
            per_1000_steps: false_alarms as f64 * 1000.0 / healthy_steps.max(1) as f64,
            by_kind,
            workloads,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn labels_and_counts_only_alarms() {
        let alerts = [
            json!({"kind": "grad_stuck_zero", "subject": "agent.head", "severity": "critical"}),
            json!({"kind": "grad_explosion", "subject": "agent", "severity": "warning"}),
            json!({"kind": "grad_explosion", "subject": "agent", "severity": "warning"}),
            json!({"kind": "note", "subject": "qwen", "severity": "info"}),
        ];
        let mut run =
            WorkloadAlarms::label("run", 2_000, &alerts, |a| a["kind"] == "grad_stuck_zero");
        assert_eq!(run.expected["grad_stuck_zero on agent.head"], 1);
        assert_eq!(run.unexpected["grad_explosion on agent"], 2);
        assert_eq!(run.unexpected.len(), 1);
        assert_eq!(run.false_alarms_per_1000_steps, Some(1.0));
        run.merge(&run.clone());
        assert_eq!(run.false_alarms_per_1000_steps, Some(1.0));
        let failure = WorkloadAlarms::label("failure", 0, &alerts, |_| false);
        assert_eq!(failure.false_alarms_per_1000_steps, None);

        // A failure's stray verdicts are labelled, but are no false alarm on healthy data.
        let all = FalseAlarms::of(vec![run, failure]);
        assert_eq!(all.healthy_steps, 4_000);
        assert_eq!(all.false_alarms, 4);
        assert_eq!(all.by_kind["grad_explosion"], 4);
    }
}
