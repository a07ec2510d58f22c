//! `loss_divergence` (gradflow's own kind): the loss runs away from the level it
//! held, and the gradients with it — the steps are throwing the weights out of the
//! region they were in (a learning rate far too high, most often).
//!
//! # The rule
//!
//! Robust levels over a window, a fast rise, persistence and corroboration:
//!
//! - the loss's level is the median of its last [`WINDOW`] finite values (one odd
//!   batch, or the noise of small batches, does not move it), and likewise the
//!   gradient's (the run-wide norm of each step whose gradients were all finite);
//! - the condition holds when every one of the (up to [`WINDOW`]) readings since the
//!   window that ended [`SPAN`] steps before (within the first steps: every reading
//!   since the first, which alone is no level) has a loss above [`FACTOR`] times
//!   that window's highest, and the rise is an order of magnitude somewhere: every
//!   one of them has a gradient norm at least [`GRAD_FACTOR`] times the window's
//!   highest, or every one a loss at least [`LOSS_JUMP`] times the window's highest
//!   loss. The whole window rose, not a few odd batches in it, and it cleared the
//!   noise of the window it left;
//! - when every one of those losses is also above [`FACTOR`] times the highest loss
//!   the run had before that window, its first steps included (the rise left the
//!   whole range the loss has had, where weights thrown out of their region land),
//!   the alert opens once it holds on [`PERSIST`] reported steps running;
//! - a rise back within the range the loss already had may be the objective moving
//!   under weights that stayed where they were (a DQN's target network copied in,
//!   a new stage of a curriculum): the network then fits the new objective and the
//!   loss falls back. So it opens only after [`HOLD`] reports running on which the
//!   loss's level never fell below [`KEPT`] of the highest level it reached since
//!   the rise: a loss that stays up is not being fitted (a language model thrown
//!   back to its unigram loss, below its untrained loss but not recovering);
//! - from the first step it holds, the level left is kept: the episode lasts while
//!   the loss's level stays above [`FACTOR`] times it, however the gradients settle;
//! - only a positive loss is judged. A loss that has been 0 or below once is not
//!   one training drives down to 0 (a policy-gradient surrogate with a baseline, a
//!   negated reward, an adversarial or contrastive term), and is never judged again.
//!
//! # Why these numbers
//!
//! A too-high learning rate does not creep: AdamW at lr 1.0 on a tiny Qwen2 took
//! the loss from 4.1 to 20 and the gradient norm from 1.7 to 548 on its first step;
//! gradflow's own trainer (`--scenario lr-too-high`) goes from 2.33 to 25 on step 1,
//! its gradient norm only 2.4× (a saturated softmax bounds it): there the loss alone
//! rose tenfold.
//! The healthy runs whose loss rises do not jump: a GAN's generator loss climbs a
//! few percent a step while its discriminator learns (0.65 to 4.4 over 150 steps,
//! its gradient norm 80× over the same steps, no tenfold rise within [`SPAN`]); a
//! REINFORCE loss grows with the return, noisy from one episode to the next, its
//! gradient norm rising with it by a few times, not ten; the first Adam steps of a
//! regression overshoot the loss by tens of percent with gradients a few times
//! larger. A DQN that copies its online network into the target network every 100
//! steps has fitted the frozen targets to a TD loss near 1e-6 when the copy moves
//! them: the loss jumps 10⁴× at once and the gradient norm 100×, and both hold for
//! tens of steps while the network fits the new targets; yet the loss after each
//! copy (0.01–0.04) stays below the TD loss of the run's first steps (0.08–0.17,
//! random Q-values against a reward of 1), and is fitted back down. A loss only 3× higher could be the data (a harder batch, a new
//! curriculum stage); a loss or gradients an order of magnitude larger in the same
//! few steps say the weights were moved far, which is the step size's doing. Two steps
//! running keep one odd pair of batches from opening it and still answer by step
//! 2–3, long before the loss (if ever) goes non-finite. A run may override
//! [`FACTOR`] (`detectors.divergence_factor`).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::explosion::median;
use super::view::StepView;
use super::wording::sci;
use crate::model::alert::{AlertKind, Opened, Severity};

/// How many times the level it left the loss's level must be.
pub const FACTOR: f64 = 3.0;
/// How many times the level it left the gradient's level must be (an order of
/// magnitude: more than a 3× loss alone can explain).
pub const GRAD_FACTOR: f64 = 10.0;
/// How many times the level it left a loss rising without gradients to match must
/// be on every reading (an order of magnitude).
pub const LOSS_JUMP: f64 = 10.0;
/// Steps running the condition must hold (a rise beyond the loss's whole range).
pub const PERSIST: u32 = 2;
/// Reports running a rise back within the loss's range must hold, not recovering.
pub const HOLD: u32 = 20;
/// The fraction of the highest level since a rise within the range that the loss's
/// level must keep: below it, the loss is being fitted again.
pub const KEPT: f64 = 0.5;
/// Readings a level is the median of.
pub const WINDOW: usize = 5;
/// How many steps back the level the loss left is read: a rise slower than this
/// is a trend, not a divergence.
pub const SPAN: usize = 10;

const SUBJECT: &str = "loss";

/// One step's loss and run-wide gradient norm.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct Reading {
    loss: f64,
    grad: f64,
}

/// The loss's and the gradient's levels over a window of readings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct Level {
    /// Medians: what the loss and the gradient norm held.
    loss: f64,
    grad: f64,
    /// Highest: how far the window's noise reached.
    #[serde(default)]
    loss_max: f64,
    #[serde(default)]
    grad_max: f64,
}

impl Level {
    fn of<'a>(readings: impl Iterator<Item = &'a Reading> + Clone) -> Option<Level> {
        Some(Level {
            loss: median(readings.clone().map(|r| r.loss))?,
            grad: median(readings.clone().map(|r| r.grad))?,
            loss_max: readings.clone().map(|r| r.loss).fold(f64::MIN, f64::max),
            grad_max: readings.map(|r| r.grad).fold(f64::MIN, f64::max),
        })
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LossDivergence {
    /// The last [`WINDOW`] + [`SPAN`] readings, oldest first.
    recent: VecDeque<Reading>,
    /// The highest loss of the readings older than [`Self::recent`]: with the
    /// window the level left, the range the run's loss has had.
    peak: f64,
    /// The level the loss left, kept from the first step the condition held while
    /// it goes on holding.
    left: Option<Level>,
    /// The rise that began the episode stayed within the range the loss had had.
    within_range: bool,
    /// The highest level the loss reached since the episode began.
    high: f64,
    /// A finite loss of 0 or below was seen: not a loss training drives to 0.
    signed: bool,
    /// Steps running the condition held. Flattened, as stored before this detector
    /// used [`Streak`].
    #[serde(flatten)]
    above: Streak,
}

impl LossDivergence {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let (context, record) = (view.context, view.record);
        let Some(loss) = record.loss.map(|l| l.get()).filter(|l| l.is_finite()) else {
            return;
        };
        self.signed |= loss <= 0.0;
        if self.signed {
            return;
        }
        // A step whose gradients were not all finite (one the loss scaler skipped)
        // or not reported moved nothing this rule could blame: not a reading.
        let Some(grad) = run_grad_norm(view) else {
            return;
        };
        self.remember(Reading { loss, grad });
        let factor = context
            .registration
            .detectors
            .as_ref()
            .and_then(|d| d.divergence_factor)
            .map_or(FACTOR, f64::from);
        let Some(then) = self.left.or_else(|| self.then()) else {
            return;
        };
        let Some(now) = Level::of(self.since()) else {
            return;
        };
        // Set when an episode begins: whether its rise stayed within the range.
        let mut began = None;
        let holds = match self.left {
            // Kept while the loss's level stays away, however the gradients settle;
            // a rise within the range also while it is not being fitted back down.
            Some(_) => {
                self.high = self.high.max(now.loss);
                now.loss > factor * then.loss && (!self.within_range || now.loss >= KEPT * self.high)
            }
            // Every reading since, not only their median, above both bars: a rise
            // of the whole window, not a few odd batches in it.
            // A gradient level of 0 has no scale to rise from.
            // Every reading since clears the whole window it left, its noise
            // included (the window's highest values, not only its median).
            None => {
                let since = self.since();
                let rose = since.clone().all(|r| r.loss > factor * then.loss_max);
                // Corroborated: the gradients rose an order of magnitude with it, or
                // the loss itself did (a saturated softmax bounds the gradients).
                let gradients = then.grad_max > 0.0
                    && since.clone().all(|r| r.grad >= GRAD_FACTOR * then.grad_max);
                let holds = rose
                    && (gradients || since.clone().all(|r| r.loss >= LOSS_JUMP * then.loss_max));
                // Beyond the whole range the run's loss has had, or back within it.
                let highest = then.loss_max.max(self.peak);
                began = holds.then(|| !since.clone().all(|r| r.loss > factor * highest));
                holds
            }
        };
        if let Some(within_range) = began {
            self.within_range = within_range;
            self.high = now.loss;
        }
        self.left = holds.then_some(then);
        let kind = AlertKind::LossDivergence;
        let needed = if self.within_range { HOLD } else { PERSIST };
        if !alerts.observe(kind, SUBJECT, &mut self.above, holds, |s| {
            s.reports(needed)
        }) {
            return;
        }
        let lr = context.optimizer.lr_of(None, record);
        alerts.open(self.opened(record.step, now, then, factor, lr));
    }

    fn remember(&mut self, reading: Reading) {
        if self.recent.len() == WINDOW + SPAN {
            if let Some(old) = self.recent.pop_front() {
                self.peak = self.peak.max(old.loss);
            }
        }
        self.recent.push_back(reading);
    }

    /// The readings since the level the loss left: the last [`WINDOW`], none of
    /// them in [`Self::then`]'s window. While that window is the first reading
    /// alone, every reading since it: one sample is no level, so a rise from it
    /// counts only when it came at once and held (a small batch's first loss may be
    /// far below the losses that follow).
    fn since(&self) -> impl Iterator<Item = &Reading> + Clone {
        let after = self.then_end() + 1;
        let skip = if self.early() {
            after
        } else {
            self.recent.len().saturating_sub(WINDOW).max(after)
        };
        self.recent.iter().skip(skip)
    }

    /// Where the window of the level left ends: [`SPAN`] readings before the last
    /// (the first reading, while a full window is not that far back). Readings are the steps with
    /// finite gradients, so a step the loss scaler skipped does not count.
    fn then_end(&self) -> usize {
        if self.early() {
            0
        } else {
            self.recent.len() - 1 - SPAN
        }
    }

    /// Whether there are too few readings for a full window [`SPAN`] readings
    /// back: the level left is then the first reading's.
    fn early(&self) -> bool {
        self.recent.len() < SPAN + WINDOW
    }

    /// The levels over the [`WINDOW`] readings that ended at [`Self::then_end`].
    fn then(&self) -> Option<Level> {
        let end = self.then_end();
        let start = (end + 1).saturating_sub(WINDOW);
        Level::of(self.recent.iter().skip(start).take(end + 1 - start))
    }

    fn opened(&self, step: u64, now: Level, then: Level, factor: f64, lr: Option<f64>) -> Opened {
        let first = self.above.first_step(step);
        let ratio = now.loss / then.loss;
        let grad = now.grad / then.grad;
        let gradients = format!(
            "the gradient norm rose with it, {grad:.0}× (from {} to {})",
            sci(then.grad),
            sci(now.grad)
        );
        let lr_now = lr.map_or_else(String::new, |lr| format!(" (now {})", sci(lr)));
        Opened {
            kind: AlertKind::LossDivergence,
            subject: SUBJECT.into(),
            severity: Severity::Warning,
            first_step: Some(first),
            step: Some(step),
            title: format!("Loss diverging: {ratio:.1}× the level it left, at step {step}"),
            detail: format!(
                "From step {first} every loss has stayed above {factor}× the level it held \
                 before (at step {step}: {} against {}), \
                 and {gradients} within {SPAN} steps. A loss that rises that fast, by an \
                 order of magnitude in itself or in its gradients, is not noise nor a slow \
                 trend: the \
                 optimizer's steps moved the weights far out of the region they were in, and \
                 a run left like this often ends with a non-finite loss.",
                sci(now.loss),
                sci(then.loss),
            ),
            fix: format!(
                "The step size is the usual cause: lower the learning rate{lr_now} by 10× to \
                 start with, or add a warm-up, and clip gradients \
                 (torch.nn.utils.clip_grad_norm_, max_norm around 1.0). If the jump came \
                 right after a change of schedule or of data, look there first."
            ),
            evidence: json!({
                "cause": "divergence",
                "loss": now.loss,
                "start_level": then.loss,
                "ratio": ratio,
                "factor": factor,
                "grad_norm": now.grad,
                "grad_level": then.grad,
                "grad_ratio": grad,
                "lr": lr,
                "steps": self.above.count,
            }),
        }
    }
}

/// The step's run-wide gradient norm (the groups' norms combined), when every
/// reported norm was finite and the loss scaler did not skip the step.
fn run_grad_norm(view: &StepView<'_>) -> Option<f64> {
    if view.found_inf() {
        return None;
    }
    let mut sum = 0.0;
    let mut any = false;
    for (_, norm) in view.group_norms.iter() {
        any = true;
        sum += norm * norm;
    }
    let norm = sum.sqrt();
    (any && norm.is_finite()).then_some(norm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::context::RunContext;
    use crate::detect::testing::{record, transitions};
    use crate::detect::thresholds::Thresholds;
    use crate::model::alert::Transition;
    use gradflow_protocol::RunRegistration;

    /// Runs (loss, gradient norm) pairs through the detector.
    fn run(steps: &[(f64, f64)]) -> Vec<(u64, Transition)> {
        let registration: RunRegistration = serde_json::from_value(json!({"params": []})).unwrap();
        let context = RunContext::new(&registration, Thresholds::default());
        let mut detector = LossDivergence::default();
        let records = steps.iter().enumerate().map(|(step, (loss, grad))| {
            record(json!({
                "step": step,
                "loss": loss,
                "modules": [{"module": "net.fc", "grad_norm": grad}]
            }))
        });
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

    fn with_grads(losses: &[f64], grads: &[f64]) -> Vec<(f64, f64)> {
        losses.iter().copied().zip(grads.iter().copied()).collect()
    }

    #[test]
    fn a_too_high_learning_rate_is_caught_within_a_few_steps() {
        // AdamW lr 1.0 on a tiny Qwen2, as measured in PyTorch: the loss and the
        // gradient norm jump on the first step.
        let losses = [
            4.15, 20.3, 21.8, 24.1, 10.7, 19.3, 27.4, 24.8, 20.8, 10.1, 15.6, 17.2,
        ];
        let grads = [
            1.7, 548.0, 559.0, 854.0, 15.9, 26.2, 14.0, 53.4, 80.0, 9.5, 14.6, 11.6,
        ];
        let mut steps = with_grads(&losses, &grads);
        // It settles back near its start later on: the episode ends.
        steps.extend([(4.0, 2.0); 10]);
        let t = run(&steps);
        assert_eq!(opened_steps(&t), [2], "{t:?}");
        let Some((_, Transition::Open(o))) = t.first() else {
            panic!("{t:?}")
        };
        assert_eq!(o.evidence["cause"], "divergence");
        assert!(o.evidence["grad_ratio"].as_f64().unwrap() > 100.0, "{o:?}");
        assert!(o.fix.starts_with("The step size"), "{}", o.fix);
        assert!(
            matches!(t.last(), Some((s, Transition::Resolve { .. })) if *s > 12),
            "{t:?}"
        );
    }

    #[test]
    fn a_tenfold_loss_is_caught_with_gradients_a_softmax_bounds() {
        // gradflow-trainer --scenario lr-too-high, as the server stored it: the loss
        // 10.8× on step 1, the run-wide gradient norm 2.4×.
        let losses = [2.33, 25.07, 25.18, 11.02, 9.08, 11.03, 8.08, 5.33, 5.84];
        let grads = [5.1, 12.2, 7.7, 6.9, 8.0, 8.5, 4.7, 2.3, 6.0];
        assert_eq!(opened_steps(&run(&with_grads(&losses, &grads))), [2]);
        // 5× on every step with gradients 2×: neither rose tenfold.
        let losses = [2.33, 12.0, 12.5, 11.0, 9.0, 11.0, 8.0, 5.3, 5.8];
        assert!(run(&with_grads(&losses, &grads)).is_empty());
    }

    #[test]
    fn a_divergence_later_in_the_run_is_caught_against_the_level_it_left() {
        // Falling for 100 steps, then a bad step: loss ×8, gradients ×50, held.
        let mut steps: Vec<(f64, f64)> = (0..100)
            .map(|i| (2.3 * 0.995f64.powi(i), 1.0 + 0.1 * (i % 3) as f64))
            .collect();
        steps.extend([(11.0, 60.0); 20]);
        assert_eq!(opened_steps(&run(&steps)), [105]);
    }

    #[test]
    fn losses_that_rise_as_their_objective_wants_stay_silent() {
        // A GAN's generator loss, its discriminator learning faster: a steady climb
        // of ~1% a step for 150 steps, the gradient norm 80× over the run.
        let gan: Vec<(f64, f64)> = (0..300)
            .map(|i| {
                let t = f64::from(i.min(150));
                (0.65 * 1.013f64.powf(t), 0.11 * 1.03f64.powf(t))
            })
            .collect();
        assert!(run(&gan).is_empty());
        // A REINFORCE loss that grows with the return, noisy episode to episode, the
        // gradient norm proportional to it.
        let reinforce: Vec<(f64, f64)> = (0..300)
            .map(|i| {
                let noise = [0.2, 1.0, 0.5, 4.0, 0.7, 2.5, 0.3, 6.0][i % 8];
                let loss = noise * (1.0 + i as f64 / 30.0);
                (loss, 2.0 * loss)
            })
            .collect();
        assert!(run(&reinforce).is_empty());
        // An actor-critic loss with a baseline changes sign: never judged.
        let signed: Vec<(f64, f64)> = [-1.0, -0.5, 3.0, 5.0, 9.0, 30.0, 40.0, 50.0]
            .iter()
            .map(|&l| (l, if l > 20.0 { 100.0 } else { 1.0 }))
            .collect();
        assert!(run(&signed).is_empty());
    }

    #[test]
    fn a_loss_back_within_the_range_it_had_is_not_a_divergence() {
        // A DQN on a six-cell corridor, its target network copied in every 100
        // steps, as measured in PyTorch: its first TD losses up to 0.17, fitted down
        // to ~1e-6 before each copy; at each copy the loss jumps to 0.01–0.04 and the
        // gradient norm from ~0.002 to 0.1–0.3, both holding for tens of steps.
        let mut dqn: Vec<(f64, f64)> = (0..100)
            .map(|i| {
                let loss = 0.17 * 0.95f64.powi(i) + 0.005 * ((i * 7919 % 7) as f64 / 7.0);
                (loss, 2.0 * loss.sqrt())
            })
            .collect();
        for _copy in 0..5 {
            dqn.extend((0..100).map(|i| {
                let loss = (0.03 * 0.93f64.powi(i)).max(1e-6 * (1.0 + (i % 3) as f64));
                (loss, 2.0 * loss.sqrt())
            }));
        }
        assert!(run(&dqn).is_empty());
        // The same jumps above 3× everything the run had are a divergence.
        let mut thrown = dqn[..300].to_vec();
        thrown.extend([(0.9, 2.0); 10]);
        assert_eq!(opened_steps(&run(&thrown)), [305]);
    }

    #[test]
    fn a_loss_thrown_back_within_its_range_that_stays_up_is_a_divergence() {
        // A language model that trained from 10.8 (an untrained model over 50k
        // tokens) down to 2, then thrown to its unigram loss of 7 with gradients
        // 20×: below where it started, but not coming back down.
        let mut run_of: Vec<(f64, f64)> = (0..200)
            .map(|i| {
                let loss = 2.0 + 8.8 * 0.97f64.powi(i) + 0.05 * ((i * 7919 % 7) as f64 / 7.0);
                (loss, 1.0)
            })
            .collect();
        run_of.extend((0..40).map(|i| (7.0 + 0.1 * ((i % 3) as f64), 20.0)));
        let opened = opened_steps(&run(&run_of));
        // The rise holds from step 204 (the five readings since all clear the bar),
        // then for HOLD reports running.
        assert_eq!(opened, [204 + u64::from(HOLD) - 1]);
        // The same rise, fitted back down within a few steps, is the objective moving.
        let mut fitted = run_of[..200].to_vec();
        fitted.extend((0..40).map(|i| (2.0 + 5.0 * 0.8f64.powi(i), 20.0 * 0.8f64.powi(i))));
        assert!(run(&fitted).is_empty());
    }

    #[test]
    fn healthy_losses_stay_silent() {
        // Falling with noise.
        let falling: Vec<(f64, f64)> = (0..300)
            .map(|i| {
                let loss = 2.3 * 0.99f64.powi(i) + 0.2 * ((i * 7919 % 13) as f64 / 13.0);
                (loss, loss)
            })
            .collect();
        assert!(run(&falling).is_empty());
        // Adam's first steps overshoot a regression under a loss scaler: the loss 4×
        // for a few steps, the gradients 2–3×, then back.
        let overshoot = with_grads(
            &[1.0, 2.5, 4.0, 4.5, 4.2, 3.5, 2.0, 1.2, 0.9, 0.8, 0.7, 0.6],
            &[1.0, 1.6, 2.0, 2.6, 2.4, 2.1, 1.5, 1.1, 0.9, 0.9, 0.8, 0.7],
        );
        assert!(run(&overshoot).is_empty());
        // Near convergence, noise of several times a tiny loss.
        let mut converged = with_grads(&[2.3, 2.0, 1.5, 1.0, 0.5], &[1.0; 5]);
        converged.extend((0..200).map(|i| (1e-3 * (1.0 + (i % 4) as f64), 0.01)));
        assert!(run(&converged).is_empty());
        // A batch of one whose first loss is far below those that follow: one
        // sample is no level, a rise from it counts only if it came at once.
        let mut first_low = vec![(0.04, 0.3), (0.14, 0.6)];
        first_low.extend((0..60).map(|i| (1.0 + 3.0 * ((i * 7919 % 11) as f64 / 11.0), 2.0)));
        assert!(run(&first_low).is_empty());
        // Odd batches, gradients and all, are not a divergence.
        let mut odd = vec![(2.3, 1.0); 40];
        odd[10] = (9.0, 50.0);
        odd[20] = (9.0, 50.0);
        odd[21] = (9.0, 50.0);
        assert!(run(&odd).is_empty());
        // Without gradients nothing corroborates a rise.
        let registration: RunRegistration = serde_json::from_value(json!({"params": []})).unwrap();
        let context = RunContext::new(&registration, Thresholds::default());
        let mut detector = LossDivergence::default();
        let records = [2.3, 30.0, 30.0, 30.0, 30.0]
            .iter()
            .enumerate()
            .map(|(step, loss)| record(json!({"step": step, "loss": loss})));
        assert!(
            transitions(records, |r, out| detector
                .on_step(&StepView::new(&context, r), out))
            .is_empty()
        );
    }
}
