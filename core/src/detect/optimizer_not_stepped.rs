//! `optimizer_not_stepped`: backward reaches the watched model on every report, and
//! the watched optimizer has not stepped once in [`REPORTS`] reports running
//! (`optimizer_steps` 0, protocol v1.9): no weight changes.
//!
//! # The rule
//!
//! A report counts when it carries `optimizer_steps` = 0 and some trainable module's
//! backward hooks fired or its gradient is non-zero (the loop computes gradients for
//! this model). The alert opens on [`REPORTS`] such reports running; a report with a
//! step resolves it. A report whose loss scaler found inf is passed over: the scaler
//! skipped that step on purpose (`scaler_overflow_streak` judges a scaler that skips
//! them all). Records without the count (an older client, or no optimizer hooks)
//! change nothing.
//!
//! # Why
//!
//! A discriminator whose `optimizer_d.step()` was left out (zhaoyuzhi/deepfillv2#6),
//! or `scheduler.step()` called where `optimizer.step()` should be
//! (ClementPinard/SfmLearner-Pytorch#5): the gradients arrive every step, so no
//! gradient rule speaks, and the weights never move. The healthy loops that report
//! without an optimizer step step again within a few reports: `gf.step` after each
//! of k micro-batches (a step every k reports), a generator stepped once per five
//! critic steps. Twenty reports running is beyond any accumulation a loop reports
//! through, and early enough to save the run.

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::view::StepView;
use super::wording::step_range;
use crate::model::alert::{AlertKind, Opened, Severity};

const KIND: AlertKind = AlertKind::OptimizerNotStepped;
const SUBJECT: &str = "optimizer";

/// Reports running without an optimizer step, with gradients, that open the alert.
pub const REPORTS: u32 = 20;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct OptimizerNotStepped {
    streak: Streak,
}

impl OptimizerNotStepped {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let Some(steps) = view.record.optimizer_steps else {
            return;
        };
        if view.found_inf() {
            return;
        }
        let idle = steps == 0 && gradients_arrived(view);
        if alerts.observe(KIND, SUBJECT, &mut self.streak, idle, |s| {
            s.reports(REPORTS)
        }) {
            alerts.open(self.opened(view.record.step));
        }
    }

    fn opened(&self, step: u64) -> Opened {
        let first = self.streak.first_step(step);
        let reports = self.streak.count;
        Opened {
            kind: KIND,
            subject: SUBJECT.to_owned(),
            severity: Severity::Critical,
            first_step: Some(first),
            step: Some(step),
            title: format!("optimizer.step() has not run in {reports} reports: no weight changes"),
            detail: format!(
                "On each of the last {reports} reports ({}) backward reached the model and \
                 the watched optimizer stepped 0 times since the report before. The \
                 gradients are computed and thrown away: the model does not train, and no \
                 gradient rule can see it, because the gradients themselves look healthy.",
                step_range(first, step)
            ),
            fix: "Call optimizer.step() after loss.backward() in every iteration (or in \
                  the branch that ends a gradient accumulation), then gf.step(loss=loss). \
                  Look for a step left out, or a scheduler.step() where optimizer.step() \
                  was meant; if another optimizer trains this model, watch that one."
                .to_owned(),
            evidence: json!({
                "cause": "never_stepped",
                "reports": reports,
                "first_step": first,
            }),
        }
    }
}

/// Some trainable module's backward hooks fired or its gradient is non-zero.
fn gradients_arrived(view: &StepView<'_>) -> bool {
    view.trainable_modules().any(|(module, _)| {
        module.hook_hits.is_some_and(|hits| hits > 0)
            || module.grad_norm.is_some_and(|n| n.get() > 0.0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::{record, transitions};
    use crate::detect::{RunContext, Thresholds};
    use crate::model::alert::Transition;
    use serde_json::Value;

    fn report(step: u64, steps: Option<u32>, found_inf: bool) -> Value {
        let mut r = json!({"step": step, "loss": 1.0,
            "modules": [{"module": "a", "grad_norm": 0.5, "hook_hits": 1}]});
        if let Some(n) = steps {
            r["optimizer_steps"] = json!(n);
        }
        if found_inf {
            r["scaler"] = json!({"scale": 1024.0, "found_inf": true});
        }
        r
    }

    fn run(reports: Vec<Value>) -> Vec<(u64, Transition)> {
        let registration =
            serde_json::from_value(json!({"params": [{"name": "a.weight", "group": "model"}]}))
                .unwrap();
        let context = RunContext::new(&registration, Thresholds::default());
        let mut detector = OptimizerNotStepped::default();
        transitions(reports.into_iter().map(record), |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        })
    }

    #[test]
    fn gradients_without_a_step_for_twenty_reports_open_it() {
        let t = run((0..30).map(|s| report(s, Some(0), false)).collect());
        assert_eq!(t.len(), 1, "{t:?}");
        assert_eq!(t[0].0, u64::from(REPORTS) - 1);
        let Transition::Open(o) = &t[0].1 else {
            panic!("{t:?}")
        };
        assert_eq!(o.severity, Severity::Critical);
        assert_eq!(o.subject, "optimizer");
        assert_eq!(o.evidence["cause"], "never_stepped");
        assert_eq!(o.first_step, Some(0));
    }

    #[test]
    fn accumulation_reported_per_micro_batch_and_skipped_steps_stay_silent() {
        // gf.step after each of 8 micro-batches: a step on every eighth report.
        let micro: Vec<_> = (0..100).map(|s| report(s, Some(u32::from(s % 8 == 7)), false)).collect();
        assert!(run(micro).is_empty());
        // A scaler skipping every step is the overflow rule's to judge.
        let skipped: Vec<_> = (0..100).map(|s| report(s, Some(0), true)).collect();
        assert!(run(skipped).is_empty());
        // No count: nothing is known.
        let uncounted: Vec<_> = (0..100).map(|s| report(s, None, false)).collect();
        assert!(run(uncounted).is_empty());
    }

    #[test]
    fn a_step_resolves_it() {
        let mut reports: Vec<_> = (0..25).map(|s| report(s, Some(0), false)).collect();
        reports.push(report(25, Some(1), false));
        let t = run(reports);
        assert_eq!(t.len(), 2, "{t:?}");
        assert!(matches!(t[1].1, Transition::Resolve { .. }), "{t:?}");
    }
}
