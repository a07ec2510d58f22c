//! `first_step_hint` (info): what the first reported step already shows — trainable
//! modules that got no gradient, norm weights the optimizer step did not change.
//!
//! # Why a hint, and when it ends
//!
//! It opens on the second reported step, naming what the first showed and the second
//! did not contradict: a gradient missing on step 0 only is a known healthy pattern
//! (the first backward of some hybrid models), and a hint that came and went on it
//! would be noise.
//!
//! One step cannot tell a graph cut from a module that by design gets a gradient
//! every 10th step (prompt caching), nor a frozen weight from a warm-up that starts
//! at lr 0. So this is `info`, never louder, and it never judges an update on a step
//! whose lr is 0 or unknown, or whose optimizer step the scaler skipped. It ends in
//! one of two ways: each entity it names either trains on a later step (gradient or
//! update above 0) or is confirmed by a streak verdict on it (`grad_stuck_zero`,
//! `norm_weight_frozen`), which then carries the diagnosis. When none is left, the
//! hint resolves.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::Alerts;
use super::view::StepView;
use super::wording::{is_within, name_list};
use crate::model::alert::{AlertKind, Opened, Severity, Transition};

const KIND: AlertKind = AlertKind::FirstStepHint;
const SUBJECT: &str = "first_step";
/// Entities named at most (a model with thousands of dead modules is one story).
const MAX_NAMED: usize = 1000;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct FirstStepHint {
    judged: bool,
    /// Whether the second reported step has been seen (the hint opens, or not, there).
    confirmed: bool,
    first_step: u64,
    /// Modules named as without a gradient, still not seen training.
    no_gradient: BTreeSet<String>,
    /// Norm weights named as unchanged, still not seen moving.
    unchanged: BTreeSet<String>,
}

impl FirstStepHint {
    /// After the streak detectors: this step's transitions so far, whose openings
    /// confirm what the hint named.
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        if !self.judged {
            if view.record.modules.is_empty() && view.record.params.is_empty() {
                return; // nothing measured yet
            }
            self.judged = true;
            self.first_step = view.record.step;
            self.judge(view);
            return;
        }
        if !self.confirmed && (!view.record.modules.is_empty() || !view.record.params.is_empty()) {
            self.confirmed = true;
            self.drop_what_trains(view);
            if !self.no_gradient.is_empty() || !self.unchanged.is_empty() {
                alerts.open(self.opened(view.record.step));
            }
            return;
        }
        if !alerts.is_open(KIND, SUBJECT) {
            return;
        }
        self.drop_what_trains(view);
        for t in alerts.transitions() {
            if let Transition::Open(o) = t
                && matches!(
                    o.kind,
                    AlertKind::GradStuckZero | AlertKind::NormWeightFrozen
                )
            {
                self.no_gradient.retain(|m| !is_within(m, &o.subject));
                self.unchanged.retain(|p| !is_within(p, &o.subject));
            }
        }
        if self.no_gradient.is_empty() && self.unchanged.is_empty() {
            alerts.clear(KIND, SUBJECT, view.record.step);
        }
    }

    /// Forgets what trains on this step: a gradient, or an update, above 0.
    fn drop_what_trains(&mut self, view: &StepView<'_>) {
        for (module, _) in view.trainable_modules() {
            if module.grad_norm.is_some_and(|n| n.get() > 0.0) {
                self.no_gradient.remove(&module.module);
            }
        }
        for param in &view.record.params {
            if param.update_norm.is_some_and(|n| n.get() > 0.0) {
                self.unchanged.remove(&param.name);
            }
        }
    }

    fn judge(&mut self, view: &StepView<'_>) {
        let record = view.record;
        for (module, _) in view.trainable_modules() {
            let no_gradient = module.grad_norm.is_none_or(|n| n.get() == 0.0);
            if no_gradient && self.no_gradient.len() < MAX_NAMED {
                self.no_gradient.insert(module.module.clone());
            }
        }
        let skipped = record
            .scaler
            .as_ref()
            .is_some_and(|s| s.found_inf == Some(true) || s.step_skipped == Some(true));
        if skipped {
            return;
        }
        let context = view.context;
        for param in &record.params {
            let Some(info) = context.norm_params.get(&param.name) else {
                continue;
            };
            let lr = context.optimizer.lr_of(info.param_group.as_deref(), record);
            let moved_nothing = param.update_norm.is_some_and(|u| u.get() == 0.0);
            let had_gradient = param.grad_norm.is_some_and(|g| g.get() > 0.0);
            if info.requires_grad
                && moved_nothing
                && had_gradient
                && lr.is_some_and(|lr| lr > 0.0)
                && self.unchanged.len() < MAX_NAMED
            {
                self.unchanged.insert(param.name.clone());
            }
        }
    }

    fn opened(&self, step: u64) -> Opened {
        let first = self.first_step;
        let modules: Vec<&str> = self.no_gradient.iter().map(String::as_str).collect();
        let weights: Vec<&str> = self.unchanged.iter().map(String::as_str).collect();
        let mut found = Vec::new();
        if !modules.is_empty() {
            found.push(format!(
                "{} trainable module(s) got no gradient ({})",
                modules.len(),
                name_list(&modules, 8)
            ));
        }
        if !weights.is_empty() {
            found.push(format!(
                "{} norm weight(s) had a gradient and an lr above 0 but did not change ({})",
                weights.len(),
                name_list(&weights, 8)
            ));
        }
        Opened {
            kind: AlertKind::FirstStepHint,
            subject: SUBJECT.into(),
            severity: Severity::Info,
            first_step: Some(first),
            step: Some(step),
            title: format!("Already at step {first}: {}", found.join("; ")),
            detail: format!(
                "On the first reported step (step {first}), and again on step {step}, {}. Two \
                 steps cannot tell a cut graph, a \
                 weight left out of the optimizer or an update lost to rounding from a module \
                 that trains only on some steps by design; the streak verdicts confirm it \
                 (grad_stuck_zero, norm_weight_frozen) or this hint resolves when they train.",
                found.join("; and ")
            ),
            fix: "If these should train from the first step, check them now rather than after the \
                  streak: for modules without a gradient, the path from their output to the loss \
                  (torch.no_grad, .detach(), a cached tensor); for unchanged weights, that they \
                  are in the optimizer with an lr above 0, and their dtype (bf16 rounds small \
                  updates away)."
                .into(),
            evidence: json!({
                "cause": "first_step",
                "no_gradient": modules,
                "unchanged": weights,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::context::RunContext;
    use crate::detect::testing::Run;
    use crate::detect::thresholds::Thresholds;
    use gradflow_protocol::{RunRegistration, StepRecord};

    fn context() -> RunContext {
        let registration: RunRegistration = serde_json::from_value(json!({
            "optimizer": {"name": "adamw", "lr": 1e-3},
            "params": [
                {"name": "qwen.a.weight"}, {"name": "qwen.norm.weight", "role": "norm"},
                {"name": "agent.x.weight"}, {"name": "agent.norm.weight", "role": "norm"}
            ]
        }))
        .unwrap();
        RunContext::new(&registration, Thresholds::default())
    }

    fn record(step: u64, qwen: f64, qwen_norm_update: f64, lr: f64) -> StepRecord {
        serde_json::from_value(json!({"step": step, "lr": lr,
            "modules": [{"module": "qwen.a", "grad_norm": qwen}, {"module": "qwen.norm", "grad_norm": qwen},
                        {"module": "agent.x", "grad_norm": 0.5}, {"module": "agent.norm", "grad_norm": 0.5}],
            "params": [
                {"name": "qwen.norm.weight", "grad_norm": qwen, "update_norm": qwen_norm_update},
                {"name": "agent.norm.weight", "grad_norm": 0.5, "update_norm": 1e-3}]}))
        .unwrap()
    }

    fn run(records: &[StepRecord], confirm_at: Option<u64>) -> Vec<(u64, Transition)> {
        let context = context();
        let mut hint = FirstStepHint::default();
        let mut run = Run::default();
        let mut all = Vec::new();
        for r in records {
            let out = run.step(r.step, |alerts| {
                if confirm_at == Some(r.step) {
                    alerts.open(Opened {
                        kind: AlertKind::GradStuckZero,
                        subject: "qwen".into(),
                        severity: Severity::Critical,
                        first_step: Some(0),
                        step: Some(r.step),
                        title: String::new(),
                        detail: String::new(),
                        fix: String::new(),
                        evidence: json!({}),
                    });
                }
                hint.on_step(&StepView::new(&context, r), alerts);
            });
            let hints = out.into_iter().filter(|t| match t {
                Transition::Open(o) => o.kind == KIND,
                Transition::Resolve { kind, .. } => *kind == KIND,
            });
            all.extend(hints.map(|t| (r.step, t)));
        }
        all
    }

    #[test]
    fn names_what_the_first_step_shows_and_resolves_when_it_trains() {
        let mut records = vec![record(0, 0.0, 0.0, 1e-3)];
        records.extend((1..10).map(|s| record(s, 0.0, 0.0, 1e-3)));
        records.push(record(10, 0.3, 1e-4, 1e-3)); // prompt caching: it trains now
        let t = run(&records, None);
        assert_eq!(t.len(), 2, "{t:?}");
        let Transition::Open(o) = &t[0].1 else {
            panic!("{t:?}")
        };
        assert_eq!(o.severity, Severity::Info);
        assert_eq!(o.evidence["no_gradient"], json!(["qwen.a", "qwen.norm"]));
        assert_eq!(
            o.evidence["unchanged"],
            json!([]),
            "no gradient: not judged as unchanged"
        );
        assert!(matches!(t[1], (10, Transition::Resolve { .. })));
    }

    #[test]
    fn a_streak_verdict_confirms_and_ends_the_hint() {
        let records: Vec<StepRecord> = (0..6).map(|s| record(s, 0.0, 0.0, 1e-3)).collect();
        let t = run(&records, Some(4));
        assert_eq!(t.len(), 2, "{t:?}");
        assert!(matches!(t[1], (4, Transition::Resolve { .. })));
    }

    #[test]
    fn warm_up_from_lr_0_and_healthy_steps_say_nothing() {
        // A norm weight with a gradient that did not move at lr 0: warm-up, not a fault.
        let twice = |r: fn(u64) -> StepRecord| run(&[r(0), r(1)], None);
        assert!(twice(|s| record(s, 0.3, 0.0, 0.0)).is_empty());
        assert!(twice(|s| record(s, 0.3, 1e-4, 1e-3)).is_empty());
        // A gradient missing on step 0 only (the first backward of some models).
        assert!(
            run(
                &[record(0, 0.0, 0.0, 1e-3), record(1, 0.3, 1e-4, 1e-3)],
                None
            )
            .is_empty()
        );
        // The same weight at lr 1e-3 is named.
        let t = twice(|s| record(s, 0.3, 0.0, 1e-3));
        let Transition::Open(o) = &t[0].1 else {
            panic!("{t:?}")
        };
        assert_eq!(o.evidence["unchanged"], json!(["qwen.norm.weight"]));
    }
}
