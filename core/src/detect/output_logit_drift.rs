//! `output_logit_drift` (v1.13): the output logits' normaliser log Z has left its
//! early level by many nats while the loss got worse — the output-logit divergence
//! that z-loss exists to prevent (PaLM, arXiv 2204.02311; Wortsman et al. 2023, arXiv
//! 2309.14322; Stollenwerk et al. 2026, arXiv 2601.02031, trace it to the output
//! embeddings' mean).
//!
//! # The rule
//!
//! From `output_logits.logz_mean` (the mean over tokens of the head's logsumexp):
//! the early level is the median of its first [`EARLY_READINGS`] readings. A report
//! drifts when log Z is at least [`DRIFT`] nats from that level, either way, and the
//! loss's running mean is at least [`LOSS_WORSE`] above the lowest it has had (the
//! drift comes with a loss going the wrong way, not with a model growing
//! confident). [`REPORTS`] such reports running open one alert (subject `logits`);
//! a report that does not drift resolves it. A loss that has been 0 or below is no
//! cross-entropy and is not judged.
//!
//! # Why these numbers
//!
//! The softmax, and so the loss, does not see the logits' level: a healthy model's
//! log Z wanders as it learns. Measured on the 2-layer GPT of docs/instabilities.md
//! (vocabulary 4096, 256 ids used, AdamW): every healthy run stayed within 6 nats of
//! its start (5.7 → 11.2 at most, f32; 8.5 → 6.7–9.2 under bf16 autocast at lr 3e-3,
//! 3e-2, and 1e-1 with a final LayerNorm), while without a final norm at lr 1e-1 log Z
//! left 8.5 for 25–200 within 50 steps on every seed, and 1,900 at its worst, each
//! time with the loss from ~5 to 20–470. 16 nats (a normaliser e¹⁶ ≈ 9·10⁶ times its
//! early size) is nearly three times the healthy runs' largest move and under the
//! smallest divergence. A model that grows confident moves log Z with a loss that
//! falls; the loss condition keeps it silent.

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::explosion::median;
use super::precision::smallest_change;
use super::spaced::LossMean;
use super::view::StepView;
use super::wording::sci;
use crate::model::alert::{AlertKind, Opened, Severity};

/// Readings of log Z whose median is its early level.
pub const EARLY_READINGS: usize = 5;
/// Nats log Z must be from its early level to drift.
pub const DRIFT: f64 = 16.0;
/// How far above its lowest the loss's running mean must be (a fraction of it).
pub const LOSS_WORSE: f64 = 0.10;
/// Reports running before it opens.
pub const REPORTS: u32 = 3;

const SUBJECT: &str = "logits";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct OutputLogitDrift {
    /// The first readings of log Z, until there are [`EARLY_READINGS`] of them.
    early: Vec<f64>,
    loss_mean: LossMean,
    /// The lowest running mean of the loss so far.
    lowest_loss: Option<f64>,
    /// Whether the loss has been 0 or below: not a cross-entropy.
    crossed_zero: bool,
    streak: Streak,
}

/// A report that drifted: log Z against its early level, the loss against its lowest.
struct Drift {
    early: f64,
    logz: f64,
    loss: f64,
    lowest_loss: f64,
    logit_mean: Option<f64>,
    absmax: Option<f64>,
}

impl OutputLogitDrift {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let record = view.record;
        if let Some(loss) = record.loss.map(|l| l.get()).filter(|l| l.is_finite()) {
            self.crossed_zero |= loss <= 0.0;
            let mean = self.loss_mean.observe(loss);
            self.lowest_loss = Some(self.lowest_loss.map_or(mean, |low| low.min(mean)));
        }
        let Some(logits) = record.output_logits.as_ref() else {
            return;
        };
        let Some(logz) = logits.logz_mean.map(|z| z.get()).filter(|z| z.is_finite()) else {
            return;
        };
        if self.early.len() < EARLY_READINGS {
            self.early.push(logz);
            return;
        }
        let drift = self.drift(logz).map(|(early, loss, lowest_loss)| Drift {
            early,
            logz,
            loss,
            lowest_loss,
            logit_mean: logits.logit_mean.map(|m| m.get()),
            absmax: logits.absmax.map(|m| m.get()),
        });
        let kind = AlertKind::OutputLogitDrift;
        if !alerts.observe(kind, SUBJECT, &mut self.streak, drift.is_some(), |s| {
            s.reports(REPORTS)
        }) {
            return;
        }
        if let Some(drift) = drift {
            let dtype = view
                .context
                .registration
                .precision
                .as_ref()
                .and_then(|p| p.compute_dtype);
            alerts.open(alert(record.step, &self.streak, &drift, dtype));
        }
    }

    /// The early level, the loss's running mean and its lowest, when `logz` is
    /// [`DRIFT`] nats or more from the early level and the loss is [`LOSS_WORSE`]
    /// above its lowest.
    fn drift(&self, logz: f64) -> Option<(f64, f64, f64)> {
        if self.crossed_zero {
            return None;
        }
        let early = median(self.early.iter().copied())?;
        let (loss, lowest) = (self.loss_mean.get()?, self.lowest_loss?);
        let worse = lowest > 0.0 && loss >= lowest * (1.0 + LOSS_WORSE);
        ((logz - early).abs() >= DRIFT && worse).then_some((early, loss, lowest))
    }
}

fn alert(
    step: u64,
    streak: &Streak,
    drift: &Drift,
    dtype: Option<gradflow_protocol::Dtype>,
) -> Opened {
    let (early, logz) = (drift.early, drift.logz);
    let direction = if logz > early { "risen" } else { "fallen" };
    // Under autocast the head's logits are in the compute dtype: how coarsely the
    // logits that carry the probability are stored at this level.
    let rounding = dtype
        .filter(|d| d.mantissa_bits() < 23)
        .and_then(|d| smallest_change(logz, d).map(|half| (d, 2.0 * half)));
    let rounding_text = rounding.map_or(String::new(), |(d, spacing)| {
        format!(
            " Under {} autocast the head's logits at this level are {} apart: \
             each probability the loss and its gradient read is off by up to {:.0} %.",
            d.as_str(),
            sci(spacing),
            ((spacing / 2.0).exp() - 1.0) * 100.0
        )
    });
    Opened {
        kind: AlertKind::OutputLogitDrift,
        subject: SUBJECT.into(),
        severity: Severity::Warning,
        first_step: Some(streak.first_step(step)),
        step: Some(step),
        title: format!(
            "The output logits' log Z has {direction} from {early:.1} to {logz:.1} while the \
             loss got worse"
        ),
        detail: format!(
            "The mean log Z of the output logits (their logsumexp) was {early:.1} over the \
             first readings and is {logz:.1} at step {step}, {:.1} nats away, while the \
             loss's running mean is {:.4}, {:.0} % above its lowest ({:.4}). The softmax \
             does not see the logits' level, so nothing in the loss holds it: this is the \
             output-logit divergence of large runs, which precedes loss spikes.{}{}",
            (logz - early).abs(),
            drift.loss,
            (drift.loss / drift.lowest_loss - 1.0) * 100.0,
            drift.lowest_loss,
            drift.absmax.map_or(String::new(), |a| format!(
                " The largest logit is {} in magnitude.",
                sci(a)
            )),
            rounding_text,
        ),
        fix: "Keep log Z near 0 with a z-loss (1e-4·log²Z, as PaLM did); put a final norm \
              before the output head if the model has none; weight decay on the head, or \
              centre its output embeddings (μ-centering); a lower peak lr. Under bf16, \
              compute the head and the loss in f32."
            .into(),
        evidence: json!({
            "cause": "logz_drift",
            "early_logz": early,
            "logz": logz,
            "drift": (logz - early).abs(),
            "logit_mean": drift.logit_mean,
            "absmax": drift.absmax,
            "loss": drift.loss,
            "lowest_loss": drift.lowest_loss,
            "compute_dtype": rounding.map(|(d, _)| d.as_str()),
            "logit_spacing": rounding.map(|(_, s)| s),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::{record, viewed};
    use crate::model::alert::Transition;

    /// Reports every step with a loss; log Z every 10th.
    fn run(logz: impl Fn(u64) -> f64, loss: impl Fn(u64) -> f64, steps: u64) -> Vec<(u64, Transition)> {
        let mut detector = OutputLogitDrift::default();
        let records: Vec<_> = (0..steps)
            .map(|s| {
                if s % 10 == 0 {
                    record(json!({"step": s, "loss": loss(s),
                        "output_logits": {"logz_mean": logz(s), "absmax": 2.0 * logz(s)}}))
                } else {
                    record(json!({"step": s, "loss": loss(s)}))
                }
            })
            .collect();
        viewed(records, |view, alerts| detector.on_step(view, alerts))
    }

    #[test]
    fn log_z_that_runs_away_while_the_loss_worsens_opens_and_resolves() {
        // Log Z 8.5 for 100 steps, then 40 while the loss climbs from 3 to 9.
        let t = run(
            |s| if s < 100 { 8.5 } else { 40.0 },
            |s| if s < 100 { 3.0 } else { 9.0 },
            300,
        );
        let Some((at, Transition::Open(o))) = t.first() else {
            panic!("{t:?}")
        };
        assert_eq!((o.kind, o.severity), (AlertKind::OutputLogitDrift, Severity::Warning));
        assert_eq!(o.subject, "logits");
        assert_eq!(o.evidence["cause"], "logz_drift");
        assert_eq!(o.first_step, Some(100));
        assert_eq!(*at, 120);
        assert!(o.evidence["drift"].as_f64().unwrap() > 31.0);
        // Back to its level: resolved.
        let t = run(
            |s| if (100..150).contains(&s) { 40.0 } else { 8.5 },
            |s| if (100..150).contains(&s) { 9.0 } else { 3.0 },
            300,
        );
        assert!(matches!(t.last(), Some((_, Transition::Resolve { .. }))), "{t:?}");
    }

    #[test]
    fn a_model_growing_confident_and_a_level_that_wanders_stay_silent() {
        // Log Z rises 30 nats as the loss falls to nothing: confidence.
        assert!(run(|s| 8.0 + 0.1 * s as f64, |s| 5.0 / (1.0 + s as f64), 400).is_empty());
        // The loss worsens, log Z moves 10 nats: within a healthy model's wander.
        assert!(run(|s| if s < 100 { 8.5 } else { 18.5 }, |s| if s < 100 { 3.0 } else { 9.0 }, 300)
            .is_empty());
        // A loss that went below 0 is no cross-entropy.
        assert!(run(|s| if s < 100 { 8.5 } else { 40.0 }, |s| if s < 100 { -1.0 } else { 9.0 }, 300)
            .is_empty());
    }
}
