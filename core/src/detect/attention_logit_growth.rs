//! `attention_logit_growth` (v1.8): an attention module whose largest pre-softmax
//! logit q·k/√d has grown past where attention stays soft — the precursor of the
//! attention-entropy collapse that diverged ViT-22B and that QK-norm and QK-Clip
//! exist to prevent.
//!
//! # The rule
//!
//! Per attention module (`modules[].attn_max_logit`): the alert opens when the max
//! logit is above [`WARN_LOGIT`] on [`REPORTS`] reports running — τ = 100 is Kimi K2's
//! QK-Clip threshold and Megatron's `qk_clip_threshold` default. It opens critical
//! when the last of them is above [`CRITICAL_LOGIT`] or not finite, or when the
//! module's smallest head entropy (`attn_min_entropy`) is below [`MIN_ENTROPY`] nats
//! (near one-hot attention), or when the logit is [`TENFOLD`]× its reading
//! [`TENFOLD_STEPS`] or more steps earlier while the loss's running mean improved by
//! less than [`LOSS_GAIN`] since (the growth bought nothing). Resolves on a report at
//! or under [`WARN_LOGIT`].
//!
//! # Why these numbers
//!
//! On a 2-layer pre-LN GPT (d = 64, 4 heads) at lr 1e-1 without QK-norm the max logit
//! went 1.6 → 1.1e4 by step 100; at lr 3e-3 it stayed ≤ 5.8, at lr 1e-1 with QK
//! LayerNorm ≤ 52, and a copy task's legitimately sharp heads reached 51. Three
//! reports keep one odd batch from opening it. Healthy large models can have sharp
//! heads above 100, which is why 100 is a warning and only 1000 critical
//! (docs/instabilities.md).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::spaced::{LossMean, Reading, Spaced};
use super::view::StepView;
use super::wording::sci;
use crate::model::alert::{AlertKind, Opened, Severity};

/// The max logit above which attention is judged to grow (QK-Clip's τ).
pub const WARN_LOGIT: f64 = 100.0;
/// The max logit above which the alert is critical.
pub const CRITICAL_LOGIT: f64 = 1000.0;
/// Reports running above [`WARN_LOGIT`].
pub const REPORTS: u32 = 3;
/// A head entropy below this (nats) is near one-hot attention.
pub const MIN_ENTROPY: f64 = 0.05;
/// The growth of the max logit that, with a loss that did not improve, is critical.
pub const TENFOLD: f64 = 10.0;
/// Steps that growth is measured over, at least.
pub const TENFOLD_STEPS: u64 = 100;
/// How much of its running mean the loss may have improved and still count as not
/// improving.
pub const LOSS_GAIN: f64 = 0.10;
/// Steps between two kept readings, and how many are kept (more than
/// [`TENFOLD_STEPS`] / the spacing).
const SPACING: u64 = 10;
const KEPT: usize = 16;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AttentionLogitGrowth {
    modules: BTreeMap<String, ModuleLogits>,
    loss_mean: LossMean,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
struct ModuleLogits {
    /// The first max logit the module reported, and its step.
    first: Option<(u64, f64)>,
    above: Streak,
    /// Its max logits, kept [`SPACING`] steps apart.
    kept: Spaced,
}

impl ModuleLogits {
    /// The reading `logit` grew [`TENFOLD`]× from over [`TENFOLD_STEPS`] or more
    /// while the loss did not improve by [`LOSS_GAIN`], if any.
    fn tenfold_without_progress(
        &self,
        step: u64,
        logit: f64,
        loss: Option<f64>,
    ) -> Option<(u64, f64)> {
        let then = *self.kept.since(step, TENFOLD_STEPS)?.first()?;
        let flat = loss
            .zip(then.loss)
            .is_some_and(|(now, before)| now >= before * (1.0 - LOSS_GAIN));
        (then.value > 0.0 && logit >= TENFOLD * then.value && flat).then_some((then.step, then.value))
    }
}

impl AttentionLogitGrowth {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let step = view.record.step;
        if let Some(loss) = view.record.loss.map(|l| l.get()).filter(|l| l.is_finite()) {
            self.loss_mean.observe(loss);
        }
        let loss = self.loss_mean.get();
        for module in &view.record.modules {
            let Some(logit) = module.attn_max_logit.map(|l| l.get()) else {
                continue;
            };
            if logit.is_nan() {
                continue;
            }
            let state = self.modules.entry(module.module.clone()).or_default();
            state.first.get_or_insert((step, logit));
            let tenfold = state.tenfold_without_progress(step, logit, loss);
            let reading = Reading {
                step,
                value: logit,
                loss,
            };
            state.kept.keep(reading, SPACING, KEPT);
            let above = logit > WARN_LOGIT;
            let kind = AlertKind::AttentionLogitGrowth;
            if !alerts.observe(kind, &module.module, &mut state.above, above, |s| {
                s.reports(REPORTS)
            }) {
                continue;
            }
            let entropy = module
                .attn_min_entropy
                .map(|e| e.get())
                .filter(|e| e.is_finite());
            alerts.open(alert(&module.module, step, logit, entropy, tenfold, state));
        }
    }
}

fn alert(
    module: &str,
    step: u64,
    logit: f64,
    entropy: Option<f64>,
    tenfold: Option<(u64, f64)>,
    state: &ModuleLogits,
) -> Opened {
    let (first_step, first) = state.first.unwrap_or((step, logit));
    let collapsed = entropy.is_some_and(|e| e < MIN_ENTROPY);
    let tenfold_text = tenfold.map_or(String::new(), |(then, earlier)| {
        format!(
            " It is {:.0}× its {} of step {then} while the loss has not improved since:              the growth buys nothing.",
            logit / earlier,
            sci(earlier)
        )
    });
    let severity = if !logit.is_finite() || logit > CRITICAL_LOGIT || collapsed || tenfold.is_some()
    {
        Severity::Critical
    } else {
        Severity::Warning
    };
    let entropy_text = entropy.map_or(String::new(), |e| {
        format!(
            " Its most focused head's entropy is {e:.3} nats{}.",
            if collapsed {
                ": attention there is close to one-hot"
            } else {
                ""
            }
        )
    });
    let since = state.above.first_step(step);
    Opened {
        kind: AlertKind::AttentionLogitGrowth,
        subject: module.into(),
        severity,
        first_step: Some(since),
        step: Some(step),
        title: format!(
            "Attention logits in {module} reached {} at step {step}",
            sci(logit)
        ),
        detail: format!(
            "The largest pre-softmax attention logit (q·k/√d) of {module} grew from {} at step \
             {first_step} to {} at step {step}, above {WARN_LOGIT} on {} reports running since \
             step {since}.{entropy_text}{tenfold_text} Logits this large make the softmax saturate: attention \
             collapses onto single keys and its gradient vanishes, and the loss usually spikes \
             or diverges next (ViT-22B, Dehghani et al. 2023; Wortsman et al. 2023).",
            sci(first),
            sci(logit),
            state.above.count,
        ),
        fix: "Normalise queries and keys (QK-norm: a LayerNorm or RMSNorm on q and k per head, \
              as ViT-22B, OLMo 2 and Qwen3 do), or clip them (QK-Clip, τ = 100, Kimi K2), or \
              soft-cap the logits (tanh cap ~50, Gemma 2); a lower peak learning rate or a \
              longer warm-up slows the growth."
            .into(),
        evidence: json!({
            "cause": if collapsed { "entropy_collapse" } else { "logit_growth" },
            "max_logit": logit,
            "first_logit": first,
            "first_step": first_step,
            "min_entropy": entropy,
            "reports": state.above.count,
            "threshold": WARN_LOGIT,
            "tenfold_since": tenfold.map(|(then, _)| then),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::{record, viewed};
    use crate::model::alert::Transition;

    fn run(logits: &[f64], entropy: f64) -> Vec<(u64, Transition)> {
        let mut detector = AttentionLogitGrowth::default();
        let records: Vec<_> = logits
            .iter()
            .enumerate()
            .map(|(step, &logit)| {
                let logit = if logit.is_finite() { json!(logit) } else { json!("Infinity") };
                record(json!({"step": step, "loss": 3.0, "modules": [
                    {"module": "layers.0.attn", "attn_max_logit": logit, "attn_min_entropy": entropy},
                    {"module": "layers.1.attn", "attn_max_logit": 2.0}]}))
            })
            .collect();
        viewed(records, |view, alerts| detector.on_step(view, alerts))
    }

    #[test]
    fn logits_growing_past_100_open_on_the_third_report() {
        // The probe at lr 1e-1 without QK-norm: 1.6 → 1.1e4 by step 100.
        let logits: Vec<f64> = (0..101).map(|s| 1.6 * 1.092f64.powi(s)).collect();
        let t = run(&logits, 1.2);
        let [(at, Transition::Open(o))] = &t[..] else {
            panic!("{t:?}")
        };
        assert_eq!(o.subject, "layers.0.attn");
        let first_above = logits.iter().position(|&l| l > 100.0).unwrap() as u64;
        assert_eq!((*at, o.first_step), (first_above + 2, Some(first_above)));
        assert_eq!(o.severity, Severity::Warning);
        assert!(o.detail.contains("1.60e0"), "{}", o.detail);
        // Past 1000, or with a collapsed entropy: critical.
        let t = run(&[5.0, 900.0, 1200.0, 5000.0], 1.0);
        assert!(matches!(&t[..], [(3, Transition::Open(o))] if o.severity == Severity::Critical));
        let t = run(&[150.0, 150.0, 150.0], 0.01);
        assert!(matches!(&t[..], [(2, Transition::Open(o))] if o.severity == Severity::Critical));
        let t = run(&[150.0, 150.0, f64::INFINITY], 1.0);
        assert!(matches!(&t[..], [(2, Transition::Open(o))] if o.severity == Severity::Critical));
    }

    #[test]
    fn a_tenfold_growth_while_the_loss_is_flat_is_critical_and_one_the_loss_pays_for_is_not() {
        // 2 × 1.03^step: above 100 from step 133 on, 22× its reading of step 30.
        let logits: Vec<f64> = (0..140).map(|s| 2.0 * 1.03f64.powi(s)).collect();
        let t = run(&logits, 1.0);
        let [(_, Transition::Open(o))] = &t[..] else {
            panic!("{t:?}")
        };
        assert_eq!(o.severity, Severity::Critical, "{}", o.detail);
        assert!(o.evidence["tenfold_since"].is_u64(), "{}", o.evidence);
        // The same logits while the loss falls by half: a warning.
        let mut detector = AttentionLogitGrowth::default();
        let records: Vec<_> = logits
            .iter()
            .enumerate()
            .map(|(step, &logit)| {
                record(json!({"step": step, "loss": 3.0 - 0.012 * step as f64, "modules": [
                    {"module": "layers.0.attn", "attn_max_logit": logit, "attn_min_entropy": 1.0}]}))
            })
            .collect();
        let t = viewed(records, |view, alerts| detector.on_step(view, alerts));
        assert!(matches!(&t[..], [(_, Transition::Open(o))] if o.severity == Severity::Warning));
    }

    #[test]
    fn sharp_but_bounded_heads_stay_silent() {
        // QK-LayerNorm at lr 1e-1 (max 52), the copy task's heads (51), and one odd
        // batch above 100 between two under it.
        let mut logits: Vec<f64> = (0..300)
            .map(|s| 52.0 * (1.0 - (-(s as f64) / 50.0).exp()))
            .collect();
        logits[200] = 140.0;
        logits[201] = 130.0;
        assert!(run(&logits, 0.3).is_empty());
    }
}
