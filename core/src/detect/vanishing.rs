//! `grad_vanishing` (gradflow's own kind): gradients that shrink across depth. In a
//! group whose modules are numbered layers (`….layers.3.…`), the gradient norm of the
//! first layer is below [`RATIO`] times that of the last on [`STEPS`] consecutive
//! reported steps: the early layers barely learn.
//!
//! Residual networks with pre-norm keep layer norms within a small factor of each
//! other, so healthy transformers stay far from the threshold. Layers with a zero or
//! non-finite norm are other detectors' business and make a step not count.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::layers::Layer;
use super::view::{GroupMap, StepView};
use super::wording::{sci, step_range};
use crate::model::alert::{AlertKind, Opened, Severity};

/// First-layer norm / last-layer norm below which gradients count as vanishing.
pub const RATIO: f64 = 1e-3;
/// Consecutive reported steps it must hold for.
pub const STEPS: u32 = 20;
/// Fewer numbered layers than this say nothing about depth.
pub const MIN_LAYERS: usize = 4;
/// Layer numbers above this are not layers of a real network (and would make the
/// per-layer vector huge): ignored.
const MAX_LAYER: usize = 10_000;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GradVanishing {
    /// Per group, its run of steps with vanishing gradients, as stored before
    /// [`Streak`]; a run still counting starts again.
    groups: BTreeMap<String, Streak>,
}

impl GradVanishing {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let record = view.record;
        // Sum of squared module norms per (group, layer).
        // Per group, the sum of squared module norms of each layer, indexed by layer.
        let mut layers: GroupMap<Vec<Option<f64>>> = GroupMap::default();
        for (module, info) in view.trainable_modules() {
            let (Some(layer), Some(norm)) = (&info.layer, module.grad_norm.map(|n| n.get())) else {
                continue;
            };
            let Layer {
                index: layer,
                stack_subject,
            } = layer;
            let layer = *layer;
            if layer > MAX_LAYER {
                continue;
            }
            let sums = layers.entry(stack_subject);
            if sums.len() <= layer {
                sums.resize(layer + 1, None);
            }
            *sums[layer].get_or_insert(0.0) += norm * norm;
        }
        for (group, by_layer) in layers.iter() {
            let present: Vec<(usize, f64)> = by_layer
                .iter()
                .enumerate()
                .filter_map(|(layer, sum)| sum.map(|s| (layer, s)))
                .collect();
            if present.len() < MIN_LAYERS {
                continue;
            }
            let (first_layer, first) = present[0];
            let (last_layer, last) = present[present.len() - 1];
            let (first, last) = (first.sqrt(), last.sqrt());
            if !(first.is_finite() && last.is_finite() && first > 0.0 && last > 0.0) {
                continue;
            }
            let ratio = first / last;
            let streak = self.groups.entry(group.to_owned()).or_default();
            // Step numbers, not reports.
            let (kind, step) = (AlertKind::GradVanishing, record.step);
            let steps = u64::from(STEPS);
            if !alerts.observe(kind, group, streak, ratio < RATIO, |s| s.spans(steps, step)) {
                continue;
            }
            let since = streak.first_step(record.step);
            alerts.open(Opened {
                kind: AlertKind::GradVanishing,
                subject: group.to_owned(),
                severity: Severity::Warning,
                first_step: Some(since),
                step: Some(record.step),
                title: format!("Gradients vanish across the depth of {group}"),
                detail: format!(
                    "On each of the last {} steps ({}) the gradient norm of layer {first_layer} of \
                 {group} was below {RATIO:.0e} times that of layer {last_layer} (at step {}: \
                 {} against {}, a ratio of {}): the early layers barely learn.",
                    streak.count,
                    step_range(since, record.step),
                    record.step,
                    sci(first),
                    sci(last),
                    sci(ratio),
                ),
                fix: "Check the residual connections (a missing skip path), put normalization \
                  before each block (pre-norm), scale the initialization with depth, and \
                  avoid saturating activations (sigmoid, tanh) inside deep stacks."
                    .into(),
                evidence: json!({
                    "cause": "depth_decay",
                    "first_layer": first_layer,
                    "last_layer": last_layer,
                    "first_layer_norm": first,
                    "last_layer_norm": last,
                    "ratio": ratio,
                    "steps": streak.count,
                }),
            });
        }
        self.groups.retain(|_, s| s.count > 0);
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
    use serde_json::Value;

    #[test]
    fn a_vision_language_models_stacks_are_judged_apart() {
        // Vision layers decay 1000-fold over depth; language layers are flat. Summed
        // per layer number they would hide each other; apart, the vision stack is
        // named and the language stack stays silent.
        let mut params = Vec::new();
        for l in 0..6 {
            params.push(json!({"name": format!("model.vision_tower.layers.{l}.mlp.weight"), "group": "model"}));
            params.push(json!({"name": format!("model.language_model.layers.{l}.mlp.weight"), "group": "model"}));
        }
        let registration: RunRegistration =
            serde_json::from_value(json!({"params": params})).unwrap();
        let context = RunContext::new(&registration, Thresholds::default());
        let mut detector = GradVanishing::default();
        let records = (0..25u64).map(|step| {
            let mut modules = Vec::new();
            for l in 0..6 {
                modules.push(
                    json!({"module": format!("model.vision_tower.layers.{l}.mlp"),
                                    "grad_norm": 0.1f64.powi(5 - l)}),
                );
                modules.push(
                    json!({"module": format!("model.language_model.layers.{l}.mlp"),
                                    "grad_norm": 1.0}),
                );
            }
            record(json!({"step": step, "modules": modules}))
        });
        let t = transitions(records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        });
        assert_eq!(t.len(), 1, "{t:?}");
        let Transition::Open(o) = &t[0].1 else {
            panic!("{t:?}")
        };
        assert_eq!(o.subject, "model.vision_tower.layers");
    }

    fn run(decay: f64, steps: u64) -> Vec<(u64, Transition)> {
        let params: Vec<Value> = (0..6)
            .map(|l| json!({"name": format!("qwen.layers.{l}.mlp.weight")}))
            .collect();
        let registration: RunRegistration =
            serde_json::from_value(json!({"params": params})).unwrap();
        let context = RunContext::new(&registration, Thresholds::default());
        let mut detector = GradVanishing::default();
        let records = (0..steps).map(|step| {
            // Layer l has norm decay^(5 - l): layer 5 is 1.0, layer 0 is decay^5.
            let modules: Vec<Value> = (0..6)
                .map(|l| json!({"module": format!("qwen.layers.{l}.mlp"), "grad_norm": decay.powi(5 - l)}))
                .collect();
            record(json!({"step": step, "modules": modules}))
        });
        transitions(records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        })
    }

    #[test]
    fn a_thousandfold_decay_over_depth_opens_after_the_streak() {
        let t = run(0.1, 25); // ratio 1e-5
        assert_eq!(t.len(), 1, "{t:?}");
        let (19, Transition::Open(o)) = &t[0] else {
            panic!("{t:?}")
        };
        assert_eq!(o.evidence["first_layer"], 0);
        assert_eq!(o.evidence["last_layer"], 5);
    }

    #[test]
    fn residual_networks_keep_their_layers_close_and_stay_silent() {
        assert!(run(0.8, 100).is_empty()); // ratio 0.33
        assert!(run(0.3, 100).is_empty()); // ratio 2.4e-3
    }
}
