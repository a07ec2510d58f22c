//! `grad_explosion` (gradflow's own kind): a group's gradient norm far above its own
//! recent history — more than [`FACTOR`] times the median of its last [`WINDOW`]
//! normal readings, once it has [`WARM_UP`] of them.
//!
//! A median, not a mean, so that one spike does not raise the bar for the next; and
//! readings that exploded are kept out of the history for the same reason. Early
//! training, where norms fall by orders of magnitude, stays silent: falling is not
//! exploding. Steps where the loss scaler found inf are skipped (scaled gradients).
//! Non-finite norms are `grad_nonfinite`'s business, zeros `grad_stuck_zero`'s.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{AlertKind, Opened, Severity, StepView, Transition, sci};

/// How many times the running median a norm must exceed.
pub const FACTOR: f64 = 10.0;
/// Normal readings the median is taken over.
pub const WINDOW: usize = 100;
/// Readings needed before anything is judged.
pub const WARM_UP: usize = 20;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GradExplosion {
    groups: BTreeMap<String, History>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct History {
    recent: VecDeque<f64>,
    open: bool,
}

impl History {
    fn median(&self) -> f64 {
        let mut sorted: Vec<f64> = self.recent.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        sorted[sorted.len() / 2]
    }

    fn remember(&mut self, norm: f64) {
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(norm);
    }
}

impl GradExplosion {
    pub fn on_step(&mut self, view: &StepView<'_>, out: &mut Vec<Transition>) {
        let record = view.record;
        if view.found_inf() {
            return;
        }
        for (group, &norm) in view.group_norms.iter() {
            if !(norm.is_finite() && norm > 0.0) {
                continue;
            }
            let history = self.groups.entry(group.to_owned()).or_default();
            if history.recent.len() < WARM_UP {
                history.remember(norm);
                continue;
            }
            let median = history.median();
            if norm > FACTOR * median {
                if !history.open {
                    history.open = true;
                    out.push(opened(
                        group,
                        norm,
                        median,
                        history.recent.len(),
                        record.step,
                    ));
                }
            } else {
                if history.open {
                    history.open = false;
                    out.push(Transition::Resolve {
                        kind: AlertKind::GradExplosion,
                        subject: group.to_owned(),
                        step: record.step,
                    });
                }
                history.remember(norm);
            }
        }
    }
}

fn opened(group: &str, norm: f64, median: f64, window: usize, step: u64) -> Transition {
    let ratio = norm / median;
    Transition::Open(Opened {
        kind: AlertKind::GradExplosion,
        subject: group.to_owned(),
        severity: Severity::Warning,
        first_step: Some(step),
        step: Some(step),
        title: format!("Gradient explosion in {group}: norm {ratio:.0}× its recent median"),
        detail: format!(
            "At step {step} the gradient norm of {group} was {}, {ratio:.0} times the median {} of \
             its last {window} normal steps (the threshold is {FACTOR:.0}×). An update this large \
             can undo much of what the model learned.",
            sci(norm),
            sci(median),
        ),
        fix: "Clip gradients (torch.nn.utils.clip_grad_norm_, max_norm around 1.0), warm the \
              learning rate up or lower it, and look at the batch of this step (outliers, \
              corrupted or mislabelled samples, an unusually long sequence). A loss spike at \
              the same step confirms it."
            .into(),
        evidence: json!({
            "cause": "spike",
            "grad_norm": norm,
            "median": median,
            "ratio": ratio,
            "factor": FACTOR,
            "window": window,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::RunContext;
    use crate::detect::StepView;
    use crate::detect::Thresholds;
    use crate::detect::testing::{record, transitions};
    use gradflow_protocol::RunRegistration;

    fn run(norms: &[f64]) -> Vec<(u64, Transition)> {
        let registration: RunRegistration =
            serde_json::from_value(json!({"params": [{"name": "qwen.a.weight"}]})).unwrap();
        let context = RunContext::new(&registration, Thresholds::default());
        let mut detector = GradExplosion::default();
        let records = norms.iter().enumerate().map(|(step, norm)| {
            record(json!({"step": step, "modules": [{"module": "qwen.a", "grad_norm": norm}]}))
        });
        transitions(records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        })
    }

    fn noisy(n: usize) -> Vec<f64> {
        (0..n)
            .map(|i| 1.0 + 0.5 * ((i * 7919 % 13) as f64 / 13.0))
            .collect()
    }

    #[test]
    fn a_spike_far_above_the_median_opens_and_resolves() {
        let mut norms = noisy(50);
        norms.extend([40.0, 35.0, 1.2]);
        let t = run(&norms);
        assert_eq!(t.len(), 2, "{t:?}");
        let (50, Transition::Open(o)) = &t[0] else {
            panic!("{t:?}")
        };
        assert_eq!(o.subject, "qwen");
        assert!(o.evidence["ratio"].as_f64().unwrap() > 25.0);
        assert_eq!(
            t[1],
            (
                52,
                Transition::Resolve {
                    kind: AlertKind::GradExplosion,
                    subject: "qwen".into(),
                    step: 52
                }
            )
        );
    }

    #[test]
    fn healthy_variation_falling_norms_and_warm_up_stay_silent() {
        assert!(run(&noisy(300)).is_empty());
        // Norms falling by orders of magnitude, as early in training.
        let falling: Vec<f64> = (0..300).map(|i| 100.0 * 0.97f64.powi(i)).collect();
        assert!(run(&falling).is_empty());
        // A large value during warm-up is not judged.
        let mut early = vec![1.0; 5];
        early.push(1000.0);
        assert!(run(&early).is_empty());
        // 5× is variation, not explosion.
        let mut mild = noisy(50);
        mild.push(6.0);
        assert!(run(&mild).is_empty());
    }
}
