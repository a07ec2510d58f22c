//! `loss_divergence` (gradflow's own kind): the loss runs away from where training
//! started — the learning rate far too high, a broken loss, a bad initialisation.
//!
//! # The rule
//!
//! The starting level is the lowest of the run's first [`START_STEPS`] finite
//! losses. The alert opens when the loss stays above [`FACTOR`] times that level on
//! [`PERSIST`] reported steps running, and resolves on the first step back under it.
//! Only a positive starting level is judged (a loss that is a negated reward, or one
//! that starts at 0, has no scale to compare with).
//!
//! # Why these numbers
//!
//! A cross-entropy loss starts near ln(vocabulary) and falls; healthy noise, a
//! warm-up bump or the early rise of a few percent stay far below 3× the start. A
//! too-high learning rate does not: with AdamW at lr 1.0, a tiny Qwen2 + agent went
//! from 2.3 to 63 by step 3 and stayed above 19 through step 18, and gradflow's own
//! trainer (`--scenario lr-too-high`) goes from 2.33 to 25 on step 1. Two steps
//! running keep one odd batch from opening it, and still answer by step 2–3, long
//! before the loss (if ever) goes non-finite. The start, not a running minimum, is
//! the reference: near convergence a loss of 1e-3 moving to 4e-3 is noise, not
//! divergence. A run may override [`FACTOR`] (`detectors.divergence_factor`).

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::view::StepView;
use super::wording::sci;
use crate::model::alert::{AlertKind, Opened, Severity};

/// How many times its starting level the loss must stay.
pub const FACTOR: f64 = 3.0;
/// Steps running the loss must stay above the bar.
pub const PERSIST: u32 = 2;
/// The starting level is the lowest of this many first finite losses.
pub const START_STEPS: usize = 5;

const SUBJECT: &str = "loss";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LossDivergence {
    /// The first finite losses, up to [`START_STEPS`].
    start: Vec<f64>,
    /// Steps running above the bar. Flattened, as stored before this detector used
    /// [`Streak`]; a streak still counting when a server of the older layout stopped
    /// starts its count again.
    #[serde(flatten)]
    above: Streak,
}

impl LossDivergence {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let (context, record) = (view.context, view.record);
        let Some(loss) = record.loss.map(|l| l.get()).filter(|l| l.is_finite()) else {
            return;
        };
        if self.start.len() < START_STEPS {
            self.start.push(loss);
        }
        let level = self.start.iter().copied().fold(f64::INFINITY, f64::min);
        if level <= 0.0 || !level.is_finite() {
            return;
        }
        let factor = context
            .registration
            .detectors
            .as_ref()
            .and_then(|d| d.divergence_factor)
            .map_or(FACTOR, f64::from);
        let above = loss > factor * level;
        let kind = AlertKind::LossDivergence;
        if !alerts.observe(kind, SUBJECT, &mut self.above, above, |s| {
            s.reports(PERSIST)
        }) {
            return;
        }
        let first = self.above.first_step(record.step);
        let ratio = loss / level;
        let step = record.step;
        alerts.open(Opened {
            kind: AlertKind::LossDivergence,
            subject: SUBJECT.into(),
            severity: Severity::Warning,
            first_step: Some(first),
            step: Some(step),
            title: format!("Loss diverging: {ratio:.1}× its starting level at step {step}"),
            detail: format!(
                "The loss has stayed above {factor}× its starting level {} (the lowest of the \
                 first {} losses) on {} steps running, from step {first}; at step {step} it is \
                 {}. Training is moving away from a solution, and a run left like this often \
                 ends with a non-finite loss.",
                sci(level),
                self.start.len(),
                self.above.count,
                sci(loss),
            ),
            fix: "Lower the learning rate (by 10× to start with) or add a warm-up, clip \
                  gradients (torch.nn.utils.clip_grad_norm_, max_norm around 1.0), and check \
                  the loss itself (its reduction, its scale, the labels). If the loss rose right \
                  after a change of schedule or of data, look there first."
                .into(),
            evidence: json!({
                "cause": "divergence",
                "loss": loss,
                "start_level": level,
                "ratio": ratio,
                "factor": factor,
                "steps": self.above.count,
            }),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::context::RunContext;
    use crate::detect::testing::{record, transitions};
    use crate::detect::thresholds::Thresholds;
    use crate::model::alert::Transition;
    use gradflow_protocol::RunRegistration;

    fn run(losses: &[f64]) -> Vec<(u64, Transition)> {
        let registration: RunRegistration = serde_json::from_value(json!({"params": []})).unwrap();
        let context = RunContext::new(&registration, Thresholds::default());
        let mut detector = LossDivergence::default();
        let records = losses
            .iter()
            .enumerate()
            .map(|(step, loss)| record(json!({"step": step, "loss": loss})));
        transitions(records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        })
    }

    fn opened_steps(t: &[(u64, Transition)]) -> Vec<u64> {
        t.iter()
            .filter(|(_, t)| matches!(t, Transition::Open(_)))
            .map(|(s, _)| *s)
            .collect()
    }

    #[test]
    fn a_too_high_learning_rate_is_caught_within_a_few_steps() {
        // AdamW lr 1.0 on a tiny Qwen2 + agent in PyTorch.
        let mut losses = vec![2.3, 14.0, 40.0, 63.0];
        losses.extend([30.0; 14]);
        losses.extend([5.0, 4.0]);
        let t = run(&losses);
        assert_eq!(opened_steps(&t), [2], "{t:?}");
        assert!(
            matches!(t.last(), Some((18, Transition::Resolve { .. }))),
            "{t:?}"
        );
        // gradflow-trainer --scenario lr-too-high.
        let t = run(&[2.33, 25.07, 25.18, 11.02, 9.08, 11.03, 8.08, 5.33, 5.84]);
        assert_eq!(opened_steps(&t), [2], "{t:?}");
    }

    #[test]
    fn healthy_losses_stay_silent() {
        // Falling with noise.
        let falling: Vec<f64> = (0..300)
            .map(|i| 2.3 * 0.99f64.powi(i) + 0.2 * ((i * 7919 % 13) as f64 / 13.0))
            .collect();
        assert!(run(&falling).is_empty());
        // An early rise of a few percent, and a warm-up bump of 50%.
        let bump: Vec<f64> = [2.3, 2.35, 2.4, 3.4, 3.0, 2.2]
            .into_iter()
            .chain((0..100).map(|i| 2.0 - i as f64 * 0.01))
            .collect();
        assert!(run(&bump).is_empty());
        // Near convergence, noise of several times a tiny loss.
        let tiny: Vec<f64> = (0..200).map(|i| 1e-3 * (1.0 + (i % 4) as f64)).collect();
        let mut converged = vec![2.3, 2.0, 1.5, 1.0, 0.5];
        converged.extend(tiny);
        assert!(run(&converged).is_empty());
        // One odd batch is not a divergence.
        let mut odd: Vec<f64> = vec![2.3; 20];
        odd[10] = 9.0;
        assert!(run(&odd).is_empty());
        // A loss that is a negated reward has no scale to judge.
        assert!(run(&[-1.0, -0.5, 3.0, 5.0, 9.0]).is_empty());
    }
}
