//! `grad_explosion` (gradflow's own kind): a group's gradient norm orders of
//! magnitude above its own history.
//!
//! # The rule
//!
//! Per group, the detector keeps the base-10 logarithms of the last [`WINDOW`]
//! finite, non-zero norms and judges a reading once it has [`WARM_UP`] of them,
//! against the median of that window (the group's level):
//!
//! - **spike**: one reading at least [`SPIKE_FACTOR`] (1,000×) above the level — a
//!   bad batch, a corrupted sample. Opens on that step.
//! - **sustained**: [`PERSIST`] reported readings running at least [`FACTOR`]
//!   (100×) above the level, while the loss of those steps is above its own median
//!   (or the client sends no loss) — a divergence. Opens on the last of them.
//!
//! It resolves on the first reading back under [`FACTOR`] × the level.
//!
//! A spike the loop's own clip cut is not one: where the client read the norms
//! before a norm clip of all the gradients (the step metric [`CLIP_METRIC`], the
//! clip's `max_norm`: Lightning's `gradient_clip_val`), a reading above that bound was
//! scaled down to it before the optimizer used it, and one bad batch moved the
//! weights no further than a clipped step does. The reading still counts towards a
//! sustained explosion: a clip that cuts every step hides a divergence, not a batch.
//!
//! # Why these numbers
//!
//! Healthy training moves gradient norms a lot: they fall by orders of magnitude
//! early on, and a component that starts learning late rises. The bundled trainer's
//! healthy Qwen + agent run shows Qwen's norm climbing from ~0.08 to ~1.7 (about 20×
//! within 15 steps) around step 160, and prompt caching makes a group's norm jump
//! whenever the cached component is reached again; the old rule (10× a 100-reading
//! median) opened nine alerts on that healthy run. A blow-up is larger: a bad batch
//! multiplies a norm by thousands, and a too-high learning rate keeps norms hundreds
//! of times up while the loss climbs. So the bar is two orders of magnitude, and
//! three for a single reading; a rise that the loss does not share is learning, not
//! divergence (a loss that falls while norms rise is healthy).
//!
//! Every reading is remembered, clipped to one order of magnitude above the level,
//! so a lasting change of regime moves the level with it (in about half a window)
//! while one spike cannot drag the bar up. Steps where the loss scaler found inf are
//! skipped (their gradients are scaled); non-finite norms are `grad_nonfinite`'s
//! business, zeros `grad_stuck_zero`'s. A run may override [`FACTOR`] and
//! [`SPIKE_FACTOR`] (`detectors.explosion_factor`, `detectors.explosion_spike_factor`).

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::view::StepView;
use super::wording::sci;
use crate::model::alert::{AlertKind, Opened, Severity};
use crate::model::metric::DetectorMetric;

/// How many times the level a norm must stay, [`PERSIST`] readings running.
pub const FACTOR: f64 = 100.0;
/// How many times the level one reading must be to open at once.
pub const SPIKE_FACTOR: f64 = 1000.0;
/// Readings above [`FACTOR`] in a row that make a sustained explosion.
pub const PERSIST: usize = 3;
/// Readings the level is the median of.
pub const WINDOW: usize = 100;
/// Readings needed before anything is judged.
pub const WARM_UP: usize = 20;
/// A remembered reading is clipped to this many orders of magnitude above the level.
const CLIP_ORDERS: f64 = 1.0;
/// The step metric that carries the `max_norm` of the loop's norm clip, when the
/// reported norms were read before it.
pub const CLIP_METRIC: &str = DetectorMetric::GradClipMaxNorm.as_str();

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct GradExplosion {
    groups: BTreeMap<String, History>,
    /// Recent losses (natural values), for the sustained rule.
    losses: VecDeque<f64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(from = "StoredHistory", into = "StoredHistory")]
struct History {
    /// log10 of recent norms, clipped.
    recent: VecDeque<f64>,
    /// Consecutive readings above the bar.
    high: Streak,
}

/// How a [`History`] is stored: the layout it had before it counted with
/// [`Streak`], so that stored detector states carry on where they were.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
struct StoredHistory {
    recent: VecDeque<f64>,
    high_since: Option<u64>,
    high_count: usize,
}

impl From<StoredHistory> for History {
    fn from(stored: StoredHistory) -> Self {
        History {
            recent: stored.recent,
            high: Streak {
                since: stored.high_since,
                count: u32::try_from(stored.high_count).unwrap_or(u32::MAX),
            },
        }
    }
}

impl From<History> for StoredHistory {
    fn from(history: History) -> Self {
        StoredHistory {
            recent: history.recent,
            high_since: history.high.since,
            high_count: history.high.count as usize,
        }
    }
}

/// The median of `values` (the upper one of an even count); `None` when empty.
pub(super) fn median(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut sorted: Vec<f64> = values.collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    Some(sorted[sorted.len() / 2])
}

impl History {
    fn level(&self) -> f64 {
        median(self.recent.iter().copied()).unwrap_or(0.0)
    }

    fn remember(&mut self, log_norm: f64, level: Option<f64>) {
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        let clipped = match level {
            Some(level) => log_norm.min(level + CLIP_ORDERS),
            None => log_norm,
        };
        self.recent.push_back(clipped);
    }
}

impl GradExplosion {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let record = view.record;
        let overrides = view.context.registration.detectors.as_ref();
        let factor = overrides
            .and_then(|d| d.explosion_factor)
            .map_or(FACTOR, f64::from);
        let spike_factor = overrides
            .and_then(|d| d.explosion_spike_factor)
            .map_or(SPIKE_FACTOR, f64::from);
        let loss = record.loss.map(|l| l.get()).filter(|l| l.is_finite());
        // Is the loss above its recent median (or unknown)?
        let loss_rising = match (loss, median(self.losses.iter().copied())) {
            (Some(loss), Some(median)) if self.losses.len() >= WARM_UP => loss > median,
            _ => true,
        };
        if let Some(loss) = loss {
            if self.losses.len() == WINDOW {
                self.losses.pop_front();
            }
            self.losses.push_back(loss);
        }
        if view.found_inf() {
            return;
        }
        let clipped_above = view
            .metric(CLIP_METRIC)
            .filter(|bound| bound.is_finite() && *bound > 0.0);
        for (group, &norm) in view.group_norms.iter() {
            if !(norm.is_finite() && norm > 0.0) {
                continue;
            }
            let log_norm = norm.log10();
            let history = self.groups.entry(group.to_owned()).or_default();
            if history.recent.len() < WARM_UP {
                history.remember(log_norm, None);
                continue;
            }
            let level = history.level();
            let above = log_norm - level;
            history.remember(log_norm, Some(level));
            // A spike opens on its own reading; a run above the bar, once it is
            // long enough and the loss rises with it.
            let cut_by_clip = clipped_above.is_some_and(|bound| norm > bound);
            let spike = above >= spike_factor.log10() && !cut_by_clip;
            let high = above >= factor.log10();
            let opens = alerts.observe(
                AlertKind::GradExplosion,
                group,
                &mut history.high,
                high,
                |s| spike || (s.count as usize >= PERSIST && loss_rising),
            );
            if !opens {
                continue;
            }
            let reading = Reading {
                group,
                norm,
                level: 10f64.powf(level),
                step: record.step,
                first_step: history.high.first_step(record.step),
                readings: history.high.count as usize,
                window: history.recent.len(),
            };
            alerts.open(if spike {
                opened(&reading, "spike", spike_factor)
            } else {
                opened(&reading, "sustained", factor)
            });
        }
    }
}

struct Reading<'a> {
    group: &'a str,
    norm: f64,
    level: f64,
    step: u64,
    first_step: u64,
    readings: usize,
    window: usize,
}

fn opened(r: &Reading<'_>, cause: &str, bar: f64) -> Opened {
    let ratio = r.norm / r.level;
    let (group, step) = (r.group, r.step);
    let what = if cause == "spike" {
        format!(
            "At step {step} the gradient norm of {group} was {}, {ratio:.0} times its level {} \
             (the median of its last {} readings; a single reading opens at {bar:.0}×).",
            sci(r.norm),
            sci(r.level),
            r.window,
        )
    } else {
        format!(
            "From step {} to step {step} the gradient norm of {group} stayed over {bar:.0} times \
             its level {} ({} readings running; {} at step {step}, {ratio:.0}×), while the loss \
             rose above its recent median.",
            r.first_step,
            sci(r.level),
            r.readings,
            sci(r.norm),
        )
    };
    Opened {
        kind: AlertKind::GradExplosion,
        subject: group.to_owned(),
        severity: Severity::Warning,
        first_step: Some(r.first_step),
        step: Some(step),
        title: format!("Gradient explosion in {group}: norm {ratio:.0}× its usual level"),
        detail: format!("{what} An update this large can undo much of what the model learned."),
        fix: "Clip gradients (torch.nn.utils.clip_grad_norm_, max_norm around 1.0), warm the \
              learning rate up or lower it, and look at the batch of this step (outliers, \
              corrupted or mislabelled samples, an unusually long sequence). A loss spike at \
              the same step confirms it."
            .into(),
        evidence: json!({
            "cause": cause,
            "grad_norm": r.norm,
            "level": r.level,
            "ratio": ratio,
            "factor": bar,
            "readings": r.readings,
            "window": r.window,
        }),
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

    /// Norms of group qwen with an optional loss per step.
    fn run_with(norms: &[f64], losses: Option<&[f64]>) -> Vec<(u64, Transition)> {
        run_clipped(norms, losses, None)
    }

    /// As [`run_with`], each step's record carrying the loop's clip bound if any.
    fn run_clipped(
        norms: &[f64],
        losses: Option<&[f64]>,
        clip: Option<f64>,
    ) -> Vec<(u64, Transition)> {
        let registration: RunRegistration =
            serde_json::from_value(json!({"params": [{"name": "qwen.a.weight"}]})).unwrap();
        let context = RunContext::new(&registration, Thresholds::default());
        let mut detector = GradExplosion::default();
        let records = norms.iter().enumerate().map(|(step, norm)| {
            let mut r = json!({"step": step, "modules": [{"module": "qwen.a", "grad_norm": norm}]});
            if let Some(losses) = losses {
                r["loss"] = json!(losses[step]);
            }
            if let Some(bound) = clip {
                r["metrics"] = json!({CLIP_METRIC: bound});
            }
            record(r)
        });
        transitions(records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        })
    }

    fn run(norms: &[f64]) -> Vec<(u64, Transition)> {
        run_with(norms, None)
    }

    fn noisy(n: usize) -> Vec<f64> {
        (0..n)
            .map(|i| 1.0 + 0.5 * ((i * 7919 % 13) as f64 / 13.0))
            .collect()
    }

    fn opened_at(t: &[(u64, Transition)]) -> Vec<(u64, String)> {
        t.iter()
            .filter_map(|(step, t)| match t {
                Transition::Open(o) => {
                    Some((*step, o.evidence["cause"].as_str().unwrap().to_owned()))
                }
                Transition::Resolve { .. } => None,
            })
            .collect()
    }

    #[test]
    fn a_bad_batch_thousands_of_times_the_level_opens_at_once_and_resolves() {
        let mut norms = noisy(50);
        norms.extend([4000.0, 1.2]);
        let t = run(&norms);
        assert_eq!(opened_at(&t), [(50, "spike".to_owned())], "{t:?}");
        assert!(matches!(t[1], (51, Transition::Resolve { .. })), "{t:?}");
    }

    #[test]
    fn a_spike_the_loops_clip_cut_is_no_explosion_and_one_it_did_not_is() {
        let mut norms = noisy(50);
        norms.extend([4000.0, 1.2]);
        let t = run_clipped(&norms, None, Some(1.0));
        assert!(opened_at(&t).is_empty(), "cut to max_norm 1: {t:?}");
        // A bound above the spike cut nothing: the update took it whole.
        let t = run_clipped(&norms, None, Some(1e4));
        assert_eq!(opened_at(&t), [(50, "spike".to_owned())], "{t:?}");
    }

    #[test]
    fn a_clip_on_every_step_does_not_hide_a_sustained_blow_up() {
        let mut norms = noisy(40);
        norms.extend([5000.0, 6000.0, 7000.0]);
        let mut losses = vec![2.0; 40];
        losses.extend([3.0, 4.0, 5.0]);
        let t = run_clipped(&norms, Some(&losses), Some(1.0));
        assert_eq!(opened_at(&t), [(42, "sustained".to_owned())], "{t:?}");
    }

    #[test]
    fn a_sustained_blow_up_with_a_rising_loss_opens_after_three_readings() {
        let mut norms = noisy(40);
        let mut losses: Vec<f64> = (0..40).map(|i| 2.5 - i as f64 * 0.01).collect();
        norms.extend([300.0, 500.0, 800.0, 900.0]);
        losses.extend([6.0, 9.0, 15.0, 20.0]);
        let t = run_with(&norms, Some(&losses));
        assert_eq!(opened_at(&t), [(42, "sustained".to_owned())], "{t:?}");
        let Transition::Open(o) = &t[0].1 else {
            panic!()
        };
        assert_eq!(o.first_step, Some(40));
    }

    #[test]
    fn a_rise_the_loss_does_not_share_is_learning() {
        // Norms 200× up for a while, the loss still falling: a component starting to
        // learn, not a divergence.
        let mut norms = noisy(40);
        norms.extend([200.0; 30]);
        let losses: Vec<f64> = (0..70).map(|i| 2.5 - i as f64 * 0.01).collect();
        let t = run_with(&norms, Some(&losses));
        assert!(t.is_empty(), "{t:?}");
    }

    #[test]
    fn healthy_rises_level_shifts_and_caching_stay_silent() {
        assert!(run(&noisy(300)).is_empty());
        // Falling by orders of magnitude, as early in training.
        let falling: Vec<f64> = (0..300).map(|i| 100.0 * 0.97f64.powi(i)).collect();
        assert!(run(&falling).is_empty());
        // The healthy Qwen rise: ~0.08 to ~1.7 over 15 steps, then noisy at that level.
        let mut rise: Vec<f64> = (0..160)
            .map(|i| 0.08 + 0.02 * ((i % 7) as f64 / 7.0))
            .collect();
        rise.extend((0..15).map(|i| 0.08 * 1.23f64.powi(i)));
        rise.extend((0..200).map(|i| 0.3 + 1.4 * ((i * 31 % 17) as f64 / 17.0)));
        assert!(run(&rise).is_empty());
        // A lasting level shift of 30× does not stay "exploding" for ever.
        let mut shift = noisy(60);
        shift.extend(noisy(200).iter().map(|v| v * 30.0));
        assert!(run(&shift).is_empty());
        // Prompt caching: a group reported at 0.05 most steps and at 5 every tenth.
        let caching: Vec<f64> = (0..300)
            .map(|i| if i % 10 == 0 { 5.0 } else { 0.05 })
            .collect();
        assert!(run(&caching).is_empty());
        // A warm-up ramp of the lr: norms grow 20× over 50 steps.
        let ramp: Vec<f64> = (0..300)
            .map(|i| 0.1 * (1.0 + (i.min(50) as f64) * 0.4))
            .collect();
        assert!(run(&ramp).is_empty());
        // A large value during warm-up is not judged.
        let mut early = vec![1.0; 5];
        early.push(1000.0);
        assert!(run(&early).is_empty());
    }

    #[test]
    fn a_state_stored_in_the_earlier_layout_carries_on_mid_run() {
        // Two readings above the bar so far, stored as the history was laid out
        // before it counted with episode::Streak (the keys it is still stored under).
        let stored = json!({"groups": {"qwen": {"recent": vec![0.0; 30], "high_since": 30,
            "high_count": 2, "open": false}}, "losses": []});
        let mut detector: GradExplosion = serde_json::from_value(stored).unwrap();
        let registration: RunRegistration =
            serde_json::from_value(json!({"params": [{"name": "qwen.a.weight"}]})).unwrap();
        let context = RunContext::new(&registration, Thresholds::default());
        let r = record(json!({"step": 32, "modules": [{"module": "qwen.a", "grad_norm": 300.0}]}));
        let out = transitions([r], |r, alerts| {
            detector.on_step(&StepView::new(&context, r), alerts)
        });
        let [(32, Transition::Open(o))] = &out[..] else {
            panic!("{out:?}")
        };
        assert_eq!(
            (o.evidence["cause"].as_str(), o.first_step),
            (Some("sustained"), Some(30))
        );
        assert_eq!(o.evidence["readings"], 3);
        let saved = serde_json::to_value(&detector).unwrap();
        assert_eq!(
            (
                &saved["groups"]["qwen"]["high_since"],
                &saved["groups"]["qwen"]["high_count"]
            ),
            (&json!(30), &json!(3))
        );
    }

    #[test]
    fn overrides_lower_the_bars() {
        let registration: RunRegistration = serde_json::from_value(json!({
            "params": [{"name": "qwen.a.weight"}],
            "detectors": {"explosion_factor": 10, "explosion_spike_factor": 20}
        }))
        .unwrap();
        let context = RunContext::new(&registration, Thresholds::default());
        let mut detector = GradExplosion::default();
        let mut norms = noisy(30);
        norms.push(40.0);
        let records = norms.iter().enumerate().map(|(step, norm)| {
            record(json!({"step": step, "modules": [{"module": "qwen.a", "grad_norm": norm}]}))
        });
        let t = transitions(records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        });
        assert_eq!(opened_at(&t), [(30, "spike".to_owned())]);
    }
}
