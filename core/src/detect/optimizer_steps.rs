//! `optimizer_steps_per_report`: the watched optimizer steps several times between
//! two of the client's step records (`optimizer_steps` ≥ 2, protocol v1.9), on
//! [`PERSIST`] reports running.
//!
//! # The rule
//!
//! The quickstart calls `gf.step` once per optimizer step. A loop that steps more
//! often than it reports does one of two things, and the record tells them apart by
//! what the gradients showed at the step they were read at:
//!
//! - `step_outside_accumulation` (warning): on some report of the run the optimizer
//!   stepped on gradients that were not one whole batch's: carried over from the
//!   previous optimizer step (`grads_carried_over`), or gone although backward ran
//!   (every reported trainable module's gradient 0 or missing while its backward
//!   hooks fired). That is an `optimizer.step()` outside the branch that ends a
//!   gradient accumulation (thunlp/OpenPrompt#106): the model steps on every
//!   micro-batch, on partial sums of the accumulated gradient, and once more on
//!   nothing after the branch's `zero_grad`.
//! - `steps_between_reports` (info): every read found a gradient of its own. Either
//!   `gf.step` is called once per k optimizer steps on purpose (training is fine,
//!   every verdict counted in steps counts `gf.step` calls), or the loop meant to
//!   accumulate over k micro-batches and steps on each.
//!
//! The alert resolves on a report of at most one step. Records without the field
//! are not counted and change nothing.
//!
//! # Why
//!
//! Read at one of several updates, a zero or missing gradient says nothing of the
//! others: `grad_stuck_zero` leaves such readings unmeasured, and this alert says what
//! the loop does instead of claiming that the weights do not move while they do.

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::view::StepView;
use super::wording::step_range;
use crate::model::alert::{AlertKind, Opened, Severity};

const KIND: AlertKind = AlertKind::OptimizerStepsPerReport;
const SUBJECT: &str = "optimizer";

/// Reports running with several optimizer steps each that open the alert.
pub const PERSIST: u32 = 3;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct OptimizerStepsPerReport {
    streak: Streak,
    /// The fewest and most optimizer steps of one report in the run.
    fewest: u32,
    most: u32,
    /// Reports of the run on which a step found gradients carried over from the
    /// previous optimizer step.
    carried: u32,
    /// Reports of the run whose read found no gradient although backward ran.
    emptied: u32,
}

impl OptimizerStepsPerReport {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let Some(steps) = view.record.optimizer_steps else {
            return;
        };
        let several = steps >= 2;
        if several {
            if self.streak.count == 0 {
                (self.fewest, self.most, self.carried, self.emptied) = (steps, steps, 0, 0);
            }
            self.fewest = self.fewest.min(steps);
            self.most = self.most.max(steps);
            self.carried += u32::from(view.record.grads_carried_over == Some(true));
            self.emptied += u32::from(emptied_although_reached(view));
        }
        if alerts.observe(KIND, SUBJECT, &mut self.streak, several, |s| {
            s.reports(PERSIST)
        }) {
            alerts.open(self.opened(view.record.step));
        }
    }

    fn opened(&self, step: u64) -> Opened {
        let first = self.streak.first_step(step);
        let reports = self.streak.count;
        let count = if self.fewest == self.most {
            self.most.to_string()
        } else {
            format!("{} to {}", self.fewest, self.most)
        };
        let seen = format!(
            "optimizer.step() ran {count} times between two gf.step() calls on each of the \
             last {reports} reports ({}), and the gradients of each report were read at one \
             of those steps.",
            step_range(first, step)
        );
        let partial = self.carried > 0 || self.emptied > 0;
        let (cause, severity, title, detail, fix) = if partial {
            let mut proof = Vec::new();
            if self.carried > 0 {
                proof.push(format!(
                    "on {} of them a step found the gradients of the step before it still \
                     there (nothing zeroed them in between: it stepped on a partial sum)",
                    self.carried
                ));
            }
            if self.emptied > 0 {
                proof.push(format!(
                    "on {} of them a step found no gradient at all although backward had run \
                     (it came after the zero_grad that ends the accumulation)",
                    self.emptied
                ));
            }
            (
                "step_outside_accumulation",
                Severity::Warning,
                format!("optimizer.step() runs {count} times per gf.step, outside the accumulation"),
                format!(
                    "{seen} Not every one of those steps used one whole batch's gradient: {}. \
                     This is an optimizer.step() outside the branch that ends the gradient \
                     accumulation: the model is updated on every micro-batch, on partial \
                     sums of the gradient, so the accumulation does nothing and the \
                     effective learning rate is several times the one set. The weights do \
                     move.",
                    proof.join("; ")
                ),
                "Call optimizer.step(), optimizer.zero_grad() (and scheduler.step()) only \
                 inside the branch that ends the accumulation, e.g. `if (i + 1) % accum == 0:`, \
                 and gf.step(loss=loss) once right after them. Look for a second \
                 optimizer.step() after that branch."
                    .to_owned(),
            )
        } else {
            (
                "steps_between_reports",
                Severity::Info,
                format!("optimizer.step() runs {count} times per gf.step"),
                format!(
                    "{seen} Each read found a gradient of its own, so the steps themselves \
                     look whole. If gf.step is called every {count} optimizer steps on \
                     purpose, training is fine, but every verdict counted in steps counts \
                     gf.step calls. If the loop means to accumulate gradients over {count} \
                     micro-batches, its optimizer.step() runs on every micro-batch instead."
                ),
                "Call gf.step(loss=loss) once per optimizer step, right after \
                 optimizer.step(). Under gradient accumulation, keep optimizer.step() and \
                 optimizer.zero_grad() inside the branch that ends the accumulation."
                    .to_owned(),
            )
        };
        Opened {
            kind: KIND,
            subject: SUBJECT.to_owned(),
            severity,
            first_step: Some(first),
            step: Some(step),
            title,
            detail,
            fix,
            evidence: json!({
                "cause": cause,
                "optimizer_steps_min": self.fewest,
                "optimizer_steps_max": self.most,
                "reports": reports,
                "first_step": first,
                "carried_over_reports": self.carried,
                "emptied_reports": self.emptied,
            }),
        }
    }
}

/// Every reported trainable module had a gradient of 0 or none while its backward
/// hooks fired: backward ran, and the step the read was taken at found nothing.
fn emptied_although_reached(view: &StepView<'_>) -> bool {
    let mut any = false;
    for (module, _) in view.trainable_modules() {
        let zero = module.grad_norm.is_none_or(|n| n.get() == 0.0);
        let fired = module.hook_hits.is_some_and(|hits| hits > 0);
        if !(zero && fired) {
            return false;
        }
        any = true;
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::{record, transitions};
    use crate::detect::{RunContext, Thresholds};
    use crate::model::alert::Transition;
    use serde_json::Value;

    fn report(step: u64, steps: Option<u32>, grad: Value, carried: Option<bool>) -> Value {
        let mut r = json!({"step": step, "loss": 1.0,
            "modules": [{"module": "a", "grad_norm": grad, "hook_hits": 1},
                        {"module": "b", "grad_norm": grad, "hook_hits": 1}]});
        if let Some(n) = steps {
            r["optimizer_steps"] = json!(n);
        }
        if let Some(c) = carried {
            r["grads_carried_over"] = json!(c);
        }
        r
    }

    fn run(reports: Vec<Value>) -> Vec<(u64, Transition)> {
        let registration = serde_json::from_value(json!({"params": [
            {"name": "a.weight", "group": "model"}, {"name": "b.weight", "group": "model"}]}))
        .unwrap();
        let context = RunContext::new(&registration, Thresholds::default());
        let mut detector = OptimizerStepsPerReport::default();
        transitions(reports.into_iter().map(record), |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        })
    }

    fn opened(t: &Transition) -> &Opened {
        match t {
            Transition::Open(o) => o,
            other => panic!("not an opening: {other:?}"),
        }
    }

    /// thunlp/OpenPrompt#106's shape with the accumulation branch's zero_grad: the
    /// step after the branch finds no gradient, the ones before it a partial sum.
    #[test]
    fn a_step_outside_the_accumulation_branch_is_named_with_its_count() {
        let t = run((0..4)
            .map(|s| report(s, Some(4), Value::Null, Some(s % 2 == 0)))
            .collect());
        assert_eq!(t.len(), 1, "{t:?}");
        let o = opened(&t[0].1);
        assert_eq!(t[0].0, 2, "opens on the third report");
        assert_eq!(o.severity, Severity::Warning);
        assert_eq!(o.evidence["cause"], "step_outside_accumulation");
        assert_eq!(o.evidence["optimizer_steps_max"], 4);
        assert!(o.title.contains("4 times"), "{}", o.title);
        assert!(o.detail.contains("The weights do move"), "{}", o.detail);
    }

    #[test]
    fn whole_steps_reported_every_k_are_information() {
        let t = run((0..5).map(|s| report(s, Some(3), json!(0.5), Some(false))).collect());
        let o = opened(&t[0].1);
        assert_eq!(o.severity, Severity::Info);
        assert_eq!(o.evidence["cause"], "steps_between_reports");
        assert!(o.title.contains("3 times"), "{}", o.title);
    }

    #[test]
    fn one_step_per_report_or_no_count_stays_silent_and_resolves() {
        let one: Vec<_> = (0..20).map(|s| report(s, Some(1), json!(0.5), None)).collect();
        assert!(run(one).is_empty());
        let uncounted: Vec<_> = (0..20).map(|s| report(s, None, json!(0.5), None)).collect();
        assert!(run(uncounted).is_empty());
        // A scaler-skipped step (0) and one odd report of 2 are not a loop's shape.
        let odd = vec![
            report(0, Some(1), json!(0.5), None),
            report(1, Some(0), json!(0.5), None),
            report(2, Some(2), json!(0.5), None),
            report(3, Some(1), json!(0.5), None),
        ];
        assert!(run(odd).is_empty());
        let mut fixed: Vec<_> = (0..3).map(|s| report(s, Some(2), json!(0.5), None)).collect();
        fixed.push(report(3, Some(1), json!(0.5), None));
        let t = run(fixed);
        assert!(
            matches!(&t[1], (3, Transition::Resolve { kind: KIND, .. })),
            "{t:?}"
        );
    }
}
