//! `activation_norm_growth` (v1.8, info): a block's output RMS keeps growing while
//! the loss has stopped improving — the residual stream's norm growth that precedes
//! logit divergence in long runs (Rybakov et al. 2024, arXiv 2410.16682; Wortsman et
//! al. 2023 on output-logit and attention-logit growth). Info until calibrated on
//! more runs: some growth of the parameter norms is ordinary in healthy training.
//!
//! # The rule
//!
//! Per module with `act_rms` (the client's blocks, sampled): its readings are kept
//! [`SPACING`] steps apart or more. A report where the RMS is at least [`GROWTH`]×
//! its reading [`WINDOW`] steps or more earlier, is within [`NEAR_HIGHEST`] of the
//! largest since then and
//! [`RECENT_GROWTH`]× its reading half a window earlier (still rising), and the
//! loss's running mean is no more than [`LOSS_GAIN`] below its mean at that earlier
//! step (nothing learnt for it), on [`REPORTS`] reports running, opens one alert for
//! the run (subject `activations`), naming the module that grew most and the others
//! that grew. Resolves on a report where no module does.
//!
//! # Why these numbers
//!
//! On the 2-layer GPT of docs/instabilities.md, without weight decay: at lr 3e-2 both
//! blocks' output RMS grew 2.5–2.9× every 200 steps from step 200 to 500 (1.5 → 40
//! in all) while the loss's running mean improved 6–9 % a window (0.93 → 0.82), with
//! dips of up to 8 % in the RMS on the way; at lr 3e-3 it grew 1.6× (1.29 → 2.05)
//! from step 100 to 300 while the loss fell from 0.99 to 0.78. A tenth of the loss is
//! the line between "nothing learnt for it" and learning that pays.

use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::BTreeMap;

use super::episode::{Alerts, Streak};
use super::spaced::{LossMean, Reading, Spaced};
use super::view::StepView;
use super::wording::{name_list, sci};
use crate::model::alert::{AlertKind, Opened, Severity};

/// Steps the growth is measured over, at least.
pub const WINDOW: u64 = 200;
/// The growth of the RMS over [`WINDOW`] that counts.
pub const GROWTH: f64 = 2.0;
/// How much lower the loss may be than at the window's start and still count as not
/// improving (a fraction of it).
pub const LOSS_GAIN: f64 = 0.10;
/// How close to the window's highest reading the RMS must be (a growth with dips).
pub const NEAR_HIGHEST: f64 = 0.9;
/// The growth over the window's second half that says it still goes on.
pub const RECENT_GROWTH: f64 = 1.2;
/// Steps between two kept readings.
pub const SPACING: u64 = 20;
/// Readings kept per module: more than [`WINDOW`] / [`SPACING`].
const KEPT: usize = 16;
/// Reports running before it opens.
pub const REPORTS: u32 = 3;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ActivationNormGrowth {
    /// Per module, its kept readings of the RMS.
    history: BTreeMap<String, Spaced>,
    loss_mean: LossMean,
    streak: Streak,
}

/// A module whose RMS grew over the window.
struct Growth<'a> {
    module: &'a str,
    /// The reading it grew from, and the loss's running mean then.
    from: Reading,
    from_loss: f64,
    rms: f64,
}

impl Growth<'_> {
    fn ratio(&self) -> f64 {
        self.rms / self.from.value
    }
}

impl ActivationNormGrowth {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let step = view.record.step;
        let Some(loss) = view.record.loss.map(|l| l.get()).filter(|l| l.is_finite()) else {
            return;
        };
        let loss = self.loss_mean.observe(loss);
        let mut grown: Vec<Growth<'_>> = Vec::new();
        let mut measured = false;
        for module in &view.record.modules {
            let Some(rms) = module.act_rms.map(|r| r.get()).filter(|r| r.is_finite()) else {
                continue;
            };
            measured = true;
            let history = self.history.entry(module.module.clone()).or_default();
            if let Some((from, from_loss)) = growth(history, step, rms, loss) {
                grown.push(Growth {
                    module: &module.module,
                    from,
                    from_loss,
                    rms,
                });
            }
            let reading = Reading {
                step,
                value: rms,
                loss: Some(loss),
            };
            history.keep(reading, SPACING, KEPT);
        }
        if !measured {
            return;
        }
        let kind = AlertKind::ActivationNormGrowth;
        if !alerts.observe(kind, SUBJECT, &mut self.streak, !grown.is_empty(), |s| {
            s.reports(REPORTS)
        }) {
            return;
        }
        grown.sort_by(|a, b| b.ratio().total_cmp(&a.ratio()));
        alerts.open(alert(step, loss, &self.streak, &grown));
    }
}

const SUBJECT: &str = "activations";

/// The reading `rms` grew from and the loss's mean then, when it grew by
/// [`GROWTH`] over [`WINDOW`] steps or more, is still rising, and the loss (its
/// running mean, `loss`) did not improve for it.
fn growth(history: &Spaced, step: u64, rms: f64, loss: f64) -> Option<(Reading, f64)> {
    let since = history.since(step, WINDOW)?;
    let from = since[0];
    let from_loss = from.loss?;
    // Still rising: near the largest since the window's start, and grown over its
    // second half too (a step up that then stays flat is not a growth that goes on).
    let half = history.since(step, WINDOW / 2).map_or(from, |r| r[0]);
    let highest = since.iter().map(|r| r.value).fold(0.0, f64::max);
    let rising = rms >= NEAR_HIGHEST * highest && rms >= RECENT_GROWTH * half.value;
    let flat = loss >= from_loss * (1.0 - LOSS_GAIN);
    (from.value > 0.0 && rms >= GROWTH * from.value && rising && flat)
        .then_some((from, from_loss))
}

fn alert(step: u64, loss: f64, streak: &Streak, grown: &[Growth<'_>]) -> Opened {
    let worst = &grown[0];
    let (from_step, from_rms, from_loss) = (worst.from.step, worst.from.value, worst.from_loss);
    let modules: Vec<&str> = grown.iter().map(|g| g.module).collect();
    Opened {
        kind: AlertKind::ActivationNormGrowth,
        subject: SUBJECT.into(),
        severity: Severity::Info,
        first_step: Some(streak.first_step(step)),
        step: Some(step),
        title: format!(
            "{}'s output RMS grew {:.1}× since step {from_step} while the loss stayed flat",
            worst.module,
            worst.ratio()
        ),
        detail: format!(
            "The RMS of {}'s output went from {} at step {from_step} to {} at \
             step {step} and is still rising, while the loss went from {from_loss:.4} to \
             {loss:.4}. Growing activations with nothing learnt for them are the norm growth \
             that precedes logit divergence and loss spikes in long runs. Growing too: {}.",
            worst.module,
            sci(from_rms),
            sci(worst.rms),
            name_list(&modules, 6),
        ),
        fix: "Weight decay on the weights that feed the residual stream, a lower peak lr, and \
              normalisation that bounds what each block adds (QK-norm, pre-LN with a final \
              norm, or scaling the residual branches); watch the output logits and the \
              attention logits next."
            .into(),
        evidence: json!({
            "cause": "norm_growth",
            "module": worst.module,
            "ratio": worst.ratio(),
            "from_step": from_step,
            "from_rms": from_rms,
            "rms": worst.rms,
            "from_loss": from_loss,
            "loss": loss,
            "modules": modules,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::{record, viewed};
    use crate::model::alert::Transition;

    /// Reports every 10 steps of two blocks: `rms(step)` for `layers.1`, 1.4 for
    /// `layers.0`, and the loss `loss(step)`.
    fn run(
        rms: impl Fn(u64) -> f64,
        loss: impl Fn(u64) -> f64,
        reports: u64,
    ) -> Vec<(u64, Transition)> {
        let mut detector = ActivationNormGrowth::default();
        let records: Vec<_> = (0..reports)
            .map(|r| {
                let s = r * 10;
                record(json!({"step": s, "loss": loss(s), "modules": [
                    {"module": "layers.0", "act_rms": 1.4},
                    {"module": "layers.1", "act_rms": rms(s)}]}))
            })
            .collect();
        viewed(records, |view, alerts| detector.on_step(view, alerts))
    }

    #[test]
    fn activations_that_keep_growing_while_the_loss_is_flat_are_said_as_info() {
        // +0.05 a step from 2.0: 6× over the first 200-step window, so the condition
        // holds from step 200 and opens on its third report; the loss flat at 0.9.
        let t = run(|s| 2.0 + 0.05 * s as f64, |_| 0.9, 40);
        let Some((at, Transition::Open(o))) = t.first() else {
            panic!("{t:?}")
        };
        assert_eq!((o.kind, o.severity), (AlertKind::ActivationNormGrowth, Severity::Info));
        assert_eq!(o.evidence["module"], "layers.1");
        assert!(o.evidence["ratio"].as_f64().unwrap() >= GROWTH);
        assert_eq!(o.first_step, Some(at - 20));
    }

    #[test]
    fn growth_the_loss_pays_for_a_plateau_and_noise_stay_silent() {
        // The same growth while the loss falls by a third.
        assert!(run(|s| 2.0 + 0.05 * s as f64, |s| 2.0 - 0.003 * s as f64, 40).is_empty());
        // Flat activations, flat loss.
        assert!(run(|s| 1.5 + 0.2 * ((s / 10) % 2) as f64, |_| 0.9, 60).is_empty());
        // Grew once, then stopped: not still rising against the window's readings.
        assert!(run(|s| if s < 100 { 1.5 } else { 4.0 }, |_| 0.9, 60).is_empty());
    }
}
