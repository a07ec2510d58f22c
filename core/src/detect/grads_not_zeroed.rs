//! `grads_not_zeroed` (gradflow's own kind): gradients are never zeroed between
//! optimizer steps, so each backward adds to everything before it.
//!
//! # The rule
//!
//! A client that can see it (the Python client probes one parameter's gradient just
//! before the first backward after each optimizer step) sends
//! `grads_carried_over: true` when that gradient still held the previous step's
//! values. The alert opens on [`PERSIST`] reported steps running with it and
//! resolves on the first reported step without it. Records without the field are
//! not measured and change nothing. A step that also reports a reset between its
//! backward passes (`grads_reset_between_backwards` ≥ 1) cleared what was carried
//! over before its optimizer stepped — gradients added after an optimizer's step
//! and cleared before that optimizer's next step (a GAN's generator loss reaching
//! the discriminator, the PyTorch DCGAN loop) — and counts as not carried over.
//!
//! # Why
//!
//! A loop that never calls `zero_grad()` keeps training and its loss often still
//! falls, so nothing looks wrong: a tiny Qwen2 + agent went from a total gradient
//! norm of 13.8 to 53 by step 79, against 13.8 → 1.2 when healthy. Gradient
//! accumulation (several backward passes, then one optimizer step, then a zero)
//! never carries over across an optimizer step and stays silent. Three steps running
//! keep a one-off (a loop that skips `zero_grad` once, on purpose) from opening it.

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::accumulation_reset::cleared_before_step;
use super::episode::{Alerts, Streak};
use super::view::StepView;
use super::wording::{sci, step_range};
use crate::model::alert::{AlertKind, Opened, Severity};
use gradflow_protocol::StepRecord;

/// Reported steps running with carried-over gradients that open the alert.
pub const PERSIST: u32 = 3;

const SUBJECT: &str = "gradients";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct GradsNotZeroed {
    /// Flattened: stored as the `since` and `count` this detector kept before it
    /// used [`Streak`], so a stored state reads back the same.
    #[serde(flatten)]
    streak: Streak,
    /// The total gradient norm on the first step of the streak.
    first_norm: Option<f64>,
}

/// The L2 norm over every module's reported gradient norm (finite ones only).
fn total_norm(record: &StepRecord) -> Option<f64> {
    let norms: Vec<f64> = record
        .modules
        .iter()
        .filter_map(|m| m.grad_norm.map(|n| n.get()))
        .filter(|n| n.is_finite())
        .collect();
    (!norms.is_empty()).then(|| norms.iter().map(|n| n * n).sum::<f64>().sqrt())
}

impl GradsNotZeroed {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let record = view.record;
        let Some(carried) = record.grads_carried_over else {
            return;
        };
        // Carried over to the first backward pass, then cleared before this
        // optimizer's step: nothing reached the step.
        let carried = carried && !cleared_before_step(record);
        if carried && self.streak.since.is_none() {
            self.first_norm = total_norm(record);
        }
        let kind = AlertKind::GradsNotZeroed;
        if alerts.observe(kind, SUBJECT, &mut self.streak, carried, |s| {
            s.reports(PERSIST)
        }) {
            alerts.open(self.opened(record));
        }
        if !carried {
            self.first_norm = None;
        }
    }

    fn opened(&self, record: &StepRecord) -> Opened {
        let first = self.streak.first_step(record.step);
        let now = total_norm(record);
        let trend = match (self.first_norm, now) {
            (Some(a), Some(b)) => format!(
                " The total gradient norm went from {} at step {first} to {} at step {}.",
                sci(a),
                sci(b),
                record.step
            ),
            _ => String::new(),
        };
        Opened {
            kind: AlertKind::GradsNotZeroed,
            subject: SUBJECT.into(),
            severity: Severity::Warning,
            first_step: Some(first),
            step: Some(record.step),
            title: format!(
                "Gradients are not zeroed between optimizer steps ({} steps running)",
                self.streak.count
            ),
            detail: format!(
                "On each of the {} reported steps {}, the first backward pass added its \
                 gradients to those of the previous optimizer step: nothing zeroed them in \
                 between. Every update then applies the sum of all gradients so far, so \
                 the step grows as training goes on, even while the loss still falls.{trend}",
                self.streak.count,
                step_range(first, record.step),
            ),
            fix: "Call optimizer.zero_grad(set_to_none=True) once per optimizer step: before \
                  the backward pass, or right after optimizer.step(). For gradient \
                  accumulation, zero after the optimizer step that consumes the accumulated \
                  gradients (several backward passes between two optimizer steps are not \
                  this alert)."
                .into(),
            evidence: json!({
                "cause": "not_zeroed",
                "steps": self.streak.count,
                "first_step": first,
                "total_grad_norm_first": self.first_norm,
                "total_grad_norm_now": now,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::alert::Transition;

    #[test]
    fn a_state_stored_before_the_shared_streak_reads_back_and_continues() {
        let mut detector: GradsNotZeroed = serde_json::from_value(serde_json::json!({
            "since": 4, "count": 2, "first_norm": 1.5, "open": false
        }))
        .unwrap();
        let out = viewed([record(6, Some(true), 2.0)], |v, out| {
            detector.on_step(v, out)
        });
        let [(6, Transition::Open(opened))] = out.as_slice() else {
            panic!("{out:?}")
        };
        assert_eq!(opened.first_step, Some(4));
        assert_eq!(opened.evidence["steps"], 3);
    }
    use crate::detect::testing::viewed;
    use serde_json::Value;

    fn record(step: u64, carried: Option<bool>, norm: f64) -> StepRecord {
        let mut value = json!({"step": step, "modules": [{"module": "m", "grad_norm": norm}]});
        if let Some(carried) = carried {
            value["grads_carried_over"] = Value::Bool(carried);
        }
        serde_json::from_value(value).unwrap()
    }

    fn run(records: &[StepRecord]) -> Vec<(u64, Transition)> {
        let mut detector = GradsNotZeroed::default();
        viewed(records, |v, out| detector.on_step(v, out))
    }

    #[test]
    fn opens_on_the_third_step_running_and_resolves_when_zeroed_again() {
        let mut records: Vec<StepRecord> = (0..6)
            .map(|s| record(s, Some(s > 0), 10.0 + s as f64))
            .collect();
        records.push(record(6, Some(false), 1.0));
        let t = run(&records);
        assert_eq!(t.len(), 2, "{t:?}");
        assert_eq!(t[0].0, 3);
        let Transition::Open(o) = &t[0].1 else {
            panic!("{t:?}")
        };
        assert_eq!(o.first_step, Some(1));
        assert_eq!(o.severity, Severity::Warning);
        assert!(
            o.detail
                .contains("went from 1.10e1 at step 1 to 1.30e1 at step 3"),
            "{}",
            o.detail
        );
        assert!(matches!(t[1], (6, Transition::Resolve { .. })));
    }

    #[test]
    fn accumulation_one_off_skips_and_unmeasured_steps_stay_silent() {
        // Carried over twice, zeroed, twice again; steps without the field between.
        let records = [
            record(0, Some(false), 1.0),
            record(1, Some(true), 1.0),
            record(2, Some(true), 1.0),
            record(3, Some(false), 1.0),
            record(4, None, 1.0),
            record(5, Some(true), 1.0),
            record(6, None, 1.0),
            record(7, Some(true), 1.0),
            record(8, Some(false), 1.0),
        ];
        assert!(run(&records).is_empty());
    }

    #[test]
    fn gradients_cleared_before_the_optimizer_s_next_step_were_not_carried_over() {
        // A GAN's discriminator: the generator's backward adds to its gradients after
        // its step, netD.zero_grad() clears them before its own backward passes.
        let cleared = |s: u64| {
            let mut r = record(s, Some(true), 1.0);
            r.metrics.insert(
                crate::detect::accumulation_reset::METRIC.into(),
                serde_json::from_value(json!(1.0)).unwrap(),
            );
            r
        };
        let records: Vec<StepRecord> = (0..20).map(cleared).collect();
        assert!(run(&records).is_empty());
        // Never zeroed at all: carried over with one backward a step, still opens.
        let records: Vec<StepRecord> = (0..5).map(|s| record(s, Some(true), 1.0)).collect();
        assert!(matches!(run(&records)[..], [(2, Transition::Open(_))]));
    }
}
