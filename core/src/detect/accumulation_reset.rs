//! `accumulation_reset` (gradflow's own kind): gradient accumulation that keeps only
//! the last micro-batch, because the gradients are reset between the backward
//! passes of one optimizer step (`zero_grad()` inside the micro-batch loop).
//!
//! # The rule
//!
//! The Python client counts, before each backward pass after the first of an
//! optimizer step, whether the gradient it probes was reset (set to None or zeroed)
//! since the previous backward, and sends the count as the metric
//! [`METRIC`] on steps with two or more backward passes. The alert opens when the
//! count is at least 1 on [`PERSIST`] reported steps running, and resolves on a
//! reported step where it is 0. Steps without the metric (one backward pass, or a
//! client that does not measure it) change nothing.
//!
//! # Why
//!
//! Nothing looks wrong: each step still has a gradient, of one micro-batch instead
//! of N, so the effective batch is N times smaller than configured and the loss is
//! noisier. Intended accumulation resets only after the optimizer step and reports
//! 0. On a step whose first backward pass found the previous step's gradients still
//! there (`grads_carried_over`), the first reset is the loop's own `zero_grad` for
//! this step, coming after another model's backward pass (the PyTorch DCGAN
//! example: the generator's loss reaches the discriminator after the
//! discriminator's step, and `netD.zero_grad()` clears it at the next iteration);
//! only the resets after it count. A loop that zeroes on purpose between two backward passes of one step (a GAN
//! whose discriminator loss reaches the generator) looks the same to the numbers,
//! which is why this is a warning whose text names that case.

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::view::{StepView, metric};
use super::wording::step_range;
use crate::model::alert::{AlertKind, Opened, Severity};
use crate::model::metric::DetectorMetric;
use gradflow_protocol::StepRecord;

/// The metric the Python client sends: backward passes after the first of one
/// optimizer step that found the gradient reset.
pub const METRIC: &str = DetectorMetric::GradsResetBetweenBackwards.as_str();
/// Reported steps running with a reset that open the alert.
pub const PERSIST: u32 = 3;
/// The alert's subject: the run's gradients.
pub const SUBJECT: &str = "gradients";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AccumulationReset {
    streak: Streak,
}

impl AccumulationReset {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let record = view.record;
        let Some(resets) = own_resets(record) else {
            return;
        };
        let (kind, reset) = (AlertKind::AccumulationReset, resets >= 1.0);
        if alerts.observe(kind, SUBJECT, &mut self.streak, reset, |s| {
            s.reports(PERSIST)
        }) {
            alerts.open(self.opened(record, resets));
        }
    }

    fn opened(&self, record: &StepRecord, resets: f64) -> Opened {
        let first = self.streak.first_step(record.step);
        let passes = resets as u64 + 1;
        Opened {
            kind: AlertKind::AccumulationReset,
            subject: SUBJECT.into(),
            severity: Severity::Warning,
            first_step: Some(first),
            step: Some(record.step),
            title: "Gradient accumulation keeps only the last micro-batch".into(),
            detail: format!(
                "On each of the {} reported steps {}, the gradients were reset between the \
                 backward passes of one optimizer step ({} of the backward passes after the \
                 first found them reset at step {}): the optimizer steps on the last \
                 micro-batch's gradient alone, so the effective batch is about {passes} \
                 times smaller than the one accumulated, and the loss is as noisy as that \
                 batch.",
                self.streak.count,
                step_range(first, record.step),
                resets,
                record.step,
            ),
            fix: "Call optimizer.zero_grad() once per optimizer step, after optimizer.step() \
                  (or before the first micro-batch), never inside the micro-batch loop. If \
                  the earlier backward passes are not meant to reach these parameters (a \
                  GAN's discriminator loss), detach their input instead of clearing the \
                  gradients afterwards."
                .into(),
            evidence: json!({
                "cause": "reset_between_backwards",
                "steps": self.streak.count,
                "first_step": first,
                "resets": resets,
            }),
        }
    }
}

/// The backward passes after the first of this optimizer step that found the
/// gradient reset, as the client counts them; `None` when not measured.
fn resets(record: &StepRecord) -> Option<f64> {
    let resets = metric(record, METRIC)?;
    resets.is_finite().then_some(resets)
}

/// Whether gradients added after the previous optimizer step were cleared before
/// this one: the step's first backward pass found the previous step's gradients
/// still there (`grads_carried_over`), and a later one found them reset. A GAN's
/// generator step adds to the discriminator's gradients after the discriminator's
/// optimizer stepped, and the next `netD.zero_grad()` clears them before its own
/// backward passes (the PyTorch DCGAN example): nothing reaches the discriminator's
/// next step, so nothing was carried over.
pub fn cleared_before_step(record: &StepRecord) -> bool {
    record.grads_carried_over == Some(true) && resets(record).is_some_and(|r| r >= 1.0)
}

/// The resets that discarded this step's own gradients. When the first backward
/// pass found the previous step's gradients still there, the passes before the
/// first reset ran before the loop zeroed for this step (another model's backward,
/// in a GAN), and that reset is the loop's own zero_grad, not a lost micro-batch.
fn own_resets(record: &StepRecord) -> Option<f64> {
    let resets = resets(record)?;
    Some(if cleared_before_step(record) {
        resets - 1.0
    } else {
        resets
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::{record, viewed};
    use crate::model::alert::Transition;

    fn step(step: u64, resets: Option<f64>) -> StepRecord {
        match resets {
            Some(r) => record(json!({"step": step, "metrics": {METRIC: r}})),
            None => record(json!({"step": step})),
        }
    }

    #[test]
    fn resets_on_three_steps_running_open_and_a_step_without_resolves() {
        let mut detector = AccumulationReset::default();
        let records: Vec<StepRecord> = (1..6)
            .map(|s| step(s, Some(3.0)))
            .chain([step(6, Some(0.0))])
            .collect();
        let t = viewed(&records, |v, out| detector.on_step(v, out));
        assert_eq!(t.len(), 2, "{t:?}");
        let (3, Transition::Open(opened)) = &t[0] else {
            panic!("{t:?}")
        };
        assert_eq!(opened.first_step, Some(1));
        assert_eq!(opened.evidence["cause"], "reset_between_backwards");
        assert!(
            opened.detail.contains("about 4 times smaller"),
            "{}",
            opened.detail
        );
        assert!(matches!(t[1], (6, Transition::Resolve { .. })));
    }

    #[test]
    fn intended_accumulation_one_backward_and_one_off_resets_stay_silent() {
        let mut detector = AccumulationReset::default();
        // Intended accumulation reports 0; one backward a step reports nothing; a
        // reset on two steps, then none, is not a habit.
        let records: Vec<StepRecord> = (0..20)
            .map(|s| step(s, Some(0.0)))
            .chain((20..40).map(|s| step(s, None)))
            .chain([
                step(40, Some(1.0)),
                step(41, Some(1.0)),
                step(42, Some(0.0)),
            ])
            .collect();
        assert!(viewed(&records, |v, out| detector.on_step(v, out)).is_empty());
    }

    #[test]
    fn a_gan_s_zero_grad_after_the_generator_s_backward_is_the_loop_s_own() {
        // The DCGAN loop, seen by the discriminator's watcher: errG's backward (after
        // the discriminator's step, gradients still there), netD.zero_grad(), then
        // errD_real's and errD_fake's: carried over, one reset.
        let gan = |s: u64, resets: f64| {
            record(json!({"step": s, "grads_carried_over": true,
                          "metrics": {METRIC: resets}}))
        };
        let mut detector = AccumulationReset::default();
        let records: Vec<StepRecord> = (1..30).map(|s| gan(s, 1.0)).collect();
        assert!(viewed(&records, |v, out| detector.on_step(v, out)).is_empty());
        assert!(cleared_before_step(&records[0]));
        // Zeroed inside the micro-batch loop as well: the resets after the first count.
        let mut detector = AccumulationReset::default();
        let records: Vec<StepRecord> = (1..6).map(|s| gan(s, 3.0)).collect();
        let t = viewed(&records, |v, out| detector.on_step(v, out));
        assert!(matches!(t[..], [(3, Transition::Open(_))]), "{t:?}");
    }
}
