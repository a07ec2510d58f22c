//! The streaming detectors: what is wrong with a run, decided from its registration
//! and its step records as they arrive.
//!
//! **Detectors are pure**: a registration or a step record and the detector's own
//! state in, alert transitions out. No SQL, no clock, no HTTP: the store persists
//! their state and their alerts in the same transaction as the steps that moved
//! them, which is what makes them restart-safe.
//!
//! # Layout
//!
//! One detector a file, each unit-tested beside itself:
//!
//! - [`stuck_zero`]: `grad_stuck_zero`, gradients exactly 0 or absent for N steps.
//! - [`frozen_norm`]: `norm_weight_frozen`, norm weights whose updates round away.
//! - [`scaler_overflow`]: `scaler_overflow_streak`, `found_inf` K steps running.
//! - [`grad_nonfinite`]: `grad_nonfinite`, NaN/Inf gradients the scaler did not catch.
//! - [`loss_nonfinite`]: `loss_nonfinite`, a NaN or infinite loss.
//! - [`loss_divergence`]: `loss_divergence`, the loss running away from its start.
//! - [`grads_not_zeroed`]: `grads_not_zeroed`, gradients carried over optimizer steps.
//! - [`accumulation_reset`]: `accumulation_reset`, gradients reset between the
//!   backward passes of one optimizer step (only the last micro-batch counts).
//! - [`eval_mode`]: `model_in_eval_mode`, a model left in eval mode mid-run.
//! - [`first_step`]: `first_step_hint` (info), what the first step already shows.
//! - [`update_rounded_away`]: `update_rounded_away`, a group's low-precision weights
//!   whose every intended update rounds away.
//! - [`explosion`]: `grad_explosion`, a group's norm orders of magnitude above its level.
//! - [`vanishing`]: `grad_vanishing`, gradients that shrink across depth.
//! - [`ranks`]: what only multi-rank runs break, judged on each combined step:
//!   `rank_missing`, `rank_straggler`, `rank_nonfinite`, `replica_divergence`,
//!   `shard_reported_as_global`.
//! - [`unused`]: `unused_parameters`, trainable modules no step ever reports.
//! - [`registration`]: the checks made once, at registration (and again at each
//!   amendment): `scaler_bf16_incompatible`, `dtype_mismatch`, `param_not_in_optimizer`,
//!   `group_not_training`.
//! - [`wiring`]: `freeze_flag_ignored`, `modules_not_registered`,
//!   `tied_weights_untied`, `params_created_in_forward` (from an amendment): the
//!   client's findings about the model's wiring.
//!   With [`loop_wiring`]'s wording (v1.6): `clip_before_unscale`, `clip_after_step`,
//!   `scheduler_per_micro_batch` (the loop's order in the first steps, from an
//!   amendment) and `param_group_empty`.
//! - [`context`]: what the detectors know of a run from its registration.
//! - [`layers`]: stacks of numbered layers, named once at registration.
//! - [`precision`]: floating-point spacing arithmetic (the bf16 ulp story).
//! - [`episode`]: the streak that opens and resolves an episode.

pub mod accumulation_reset;
pub mod context;
pub mod episode;
pub mod eval_mode;
pub mod explosion;
pub mod first_step;
pub mod frozen_norm;
pub mod grad_nonfinite;
pub mod grads_not_zeroed;
pub mod layers;
mod loop_wiring;
pub mod loss_divergence;
pub mod loss_nonfinite;
pub mod precision;
pub mod ranks;
pub mod registration;
pub mod scaler_overflow;
pub mod stuck_zero;
pub mod unused;
pub mod update_rounded_away;
pub mod vanishing;
pub mod wiring;

use gradflow_protocol::StepRecord;
use serde::{Deserialize, Serialize};

pub use crate::model::alert::{AlertKind, Opened, Severity, Transition};
pub use context::RunContext;

#[cfg(test)]
mod amendment_tests {
    use super::*;
    use gradflow_protocol::RunRegistration;

    fn context(value: serde_json::Value) -> RunContext {
        let registration: RunRegistration = serde_json::from_value(value).unwrap();
        RunContext::new(&registration, Thresholds::default())
    }

    #[test]
    fn a_parameter_the_optimizer_held_that_leaves_it_was_replaced() {
        let before = context(serde_json::json!({"params": [
            {"name": "model.embed_tokens.weight"}, {"name": "lm_head.weight"}
        ]}));
        let after = context(serde_json::json!({"params": [
            {"name": "model.embed_tokens.weight"},
            {"name": "lm_head.weight", "in_optimizer": false}
        ]}));
        let t = DetectorSet::default().on_amendment(&before, &after, 12);
        let [Transition::Open(o)] = &t[..] else {
            panic!("{t:?}")
        };
        assert_eq!(
            (o.kind, o.subject.as_str()),
            (AlertKind::ParamNotInOptimizer, "lm_head")
        );
        assert_eq!(o.evidence["cause"], "replaced_after_optimizer");
        assert!(o.title.contains("replaced"), "{}", o.title);
        assert!(o.fix.contains("add_param_group"), "{}", o.fix);
    }

    #[test]
    fn a_late_unfreeze_outside_the_optimizer_opens_on_the_amendment_step() {
        let before = context(serde_json::json!({"params": [
            {"name": "agent.head.weight"},
            {"name": "qwen.layers.0.mlp.up_proj.weight", "requires_grad": false, "in_optimizer": false}
        ]}));
        let after = context(serde_json::json!({"params": [
            {"name": "agent.head.weight"},
            {"name": "qwen.layers.0.mlp.up_proj.weight", "requires_grad": true, "in_optimizer": false}
        ]}));
        let mut detectors = DetectorSet::default();
        let t = detectors.on_amendment(&before, &after, 30);
        let [Transition::Open(o)] = &t[..] else {
            panic!("{t:?}")
        };
        assert_eq!(
            (o.kind, o.subject.as_str()),
            (AlertKind::ParamNotInOptimizer, "qwen")
        );
        assert_eq!((o.first_step, o.step), (Some(30), Some(30)));
        assert!(o.detail.starts_with("From step 30"), "{}", o.detail);
        // Unfrozen into the optimizer: nothing to say.
        let fine = context(serde_json::json!({"params": [
            {"name": "agent.head.weight"},
            {"name": "qwen.layers.0.mlp.up_proj.weight"}
        ]}));
        assert!(detectors.on_amendment(&before, &fine, 30).is_empty());
        // Adapters cast to bf16 under a loss scaler: the GradScaler failure's
        // precondition, on the step it appears.
        let scaled = |dtype: &str| {
            context(serde_json::json!({
                "precision": {"param_dtype": "f32", "loss_scaler": "dynamic"},
                "params": [{"name": "agent.lora_a.weight", "dtype": dtype}]
            }))
        };
        let t = detectors.on_amendment(&scaled("f32"), &scaled("bf16"), 10);
        let kinds: Vec<AlertKind> = t
            .iter()
            .filter_map(|t| match t {
                Transition::Open(o) => Some(o.kind),
                Transition::Resolve { .. } => None,
            })
            .collect();
        assert!(
            kinds.contains(&AlertKind::ScalerBf16Incompatible),
            "{kinds:?}"
        );
    }
}

use context::ModuleInfo;
use gradflow_protocol::ModuleStep;

/// The server-wide thresholds, in consecutive reported steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Thresholds {
    pub stuck_zero_steps: u32,
    pub frozen_norm_steps: u32,
    pub overflow_streak_steps: u32,
}

impl Default for Thresholds {
    /// docs/PROTOCOL.md's defaults.
    fn default() -> Self {
        Thresholds {
            stuck_zero_steps: 50,
            frozen_norm_steps: 20,
            overflow_streak_steps: 10,
        }
    }
}

impl Thresholds {
    /// These thresholds with a run's own overrides applied.
    pub fn with_overrides(self, overrides: Option<&gradflow_protocol::DetectorOverrides>) -> Self {
        let Some(o) = overrides else { return self };
        Thresholds {
            stuck_zero_steps: o.stuck_zero_steps.unwrap_or(self.stuck_zero_steps),
            frozen_norm_steps: o.frozen_norm_steps.unwrap_or(self.frozen_norm_steps),
            overflow_streak_steps: o
                .overflow_streak_steps
                .unwrap_or(self.overflow_streak_steps),
        }
    }
}

/// Whether the detectors run, and with which server-wide thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Detection {
    pub enabled: bool,
    pub thresholds: Thresholds,
}

impl Default for Detection {
    fn default() -> Self {
        Detection {
            enabled: true,
            thresholds: Thresholds::default(),
        }
    }
}

/// Every streaming detector's state for one run. Serialized with the run (as JSON)
/// in the transaction of each batch, so a restarted server continues every streak.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DetectorSet {
    pub stuck_zero: stuck_zero::StuckZeroGrad,
    pub frozen_norm: frozen_norm::FrozenNormWeight,
    pub scaler_overflow: scaler_overflow::ScalerOverflowStreak,
    pub grad_nonfinite: grad_nonfinite::GradNonfinite,
    pub loss_nonfinite: loss_nonfinite::LossNonfinite,
    pub explosion: explosion::GradExplosion,
    pub vanishing: vanishing::GradVanishing,
    pub unused: unused::UnusedParameters,
    pub loss_divergence: loss_divergence::LossDivergence,
    pub grads_not_zeroed: grads_not_zeroed::GradsNotZeroed,
    pub accumulation_reset: accumulation_reset::AccumulationReset,
    pub eval_mode: eval_mode::EvalMode,
    pub first_step: first_step::FirstStepHint,
    pub update_rounded_away: update_rounded_away::UpdateRoundedAway,
    pub ranks: ranks::RankDetectors,
}

impl DetectorSet {
    /// Runs every streaming detector on one step record, in order.
    pub fn on_step(&mut self, context: &RunContext, record: &StepRecord) -> Vec<Transition> {
        let step = StepView::new(context, record);
        let mut transitions = Vec::new();
        self.loss_nonfinite.on_step(&step, &mut transitions);
        self.loss_divergence.on_step(&step, &mut transitions);
        self.grad_nonfinite.on_step(&step, &mut transitions);
        self.grads_not_zeroed.on_step(&step, &mut transitions);
        self.accumulation_reset.on_step(&step, &mut transitions);
        self.eval_mode.on_step(&step, &mut transitions);
        self.stuck_zero.on_step(&step, &mut transitions);
        self.frozen_norm.on_step(&step, &mut transitions);
        self.update_rounded_away.on_step(&step, &mut transitions);
        self.scaler_overflow.on_step(&step, &mut transitions);
        self.explosion.on_step(&step, &mut transitions);
        self.vanishing.on_step(&step, &mut transitions);
        self.unused.on_step(&step, &mut transitions);
        let mut hint = Vec::new();
        self.first_step.on_step(&step, &transitions, &mut hint);
        transitions.extend(hint);
        transitions
    }

    /// Called when a v1.1 amendment changes the registration at `step`, before that
    /// step's record is seen with `after`. What the amended registration proves
    /// wrong and the one before it did not (a parameter unfrozen outside the
    /// optimizer, adapters cast to bf16 under a loss scaler) opens on that step.
    pub fn on_amendment(
        &mut self,
        before: &RunContext,
        after: &RunContext,
        step: u64,
    ) -> Vec<Transition> {
        let known: Vec<(AlertKind, String)> = registration::check(before)
            .into_iter()
            .map(|a| (a.kind, a.subject))
            .collect();
        registration::check(after)
            .into_iter()
            .filter(|a| !known.contains(&(a.kind, a.subject.clone())))
            .map(|mut alert| {
                if alert.kind == AlertKind::ParamNotInOptimizer {
                    registration::explain_replaced(&mut alert, before, step);
                }
                alert.first_step = Some(step);
                alert.step = Some(step);
                alert.detail = format!(
                    "From step {step}, where the client amended the registration: {}",
                    alert.detail
                );
                alert.evidence["amended_at"] = serde_json::json!(step);
                Transition::Open(alert)
            })
            .collect()
    }
}

/// One step record resolved against its run once, for every detector: each
/// reported module's registration entry (a lookup by name, done once rather than
/// once per detector) and the groups' norms.
pub struct StepView<'a> {
    pub context: &'a RunContext,
    pub record: &'a StepRecord,
    /// Per entry of `record.modules`, in order: the module's entry when it has
    /// trainable parameters.
    trainable: Vec<Option<&'a ModuleInfo>>,
    /// Each group's norm, as the server derives it: the L2 norm of the norms its
    /// modules reported (modules without a gradient add nothing; a non-finite module
    /// norm makes the group's non-finite). Groups come from the registration, or
    /// from the module name's first part.
    pub group_norms: GroupMap<'a, f64>,
}

/// Values per group for one step. A run has a handful of groups, so a vector
/// searched linearly beats a tree or a hash on the per-module hot path. Iterates in
/// order of first appearance.
#[derive(Debug, Clone)]
pub struct GroupMap<'a, T>(Vec<(&'a str, T)>);

impl<T> Default for GroupMap<'_, T> {
    fn default() -> Self {
        GroupMap(Vec::new())
    }
}

impl<'a, T: Default> GroupMap<'a, T> {
    /// The value of `group`, inserted as `T::default()` if absent.
    pub fn entry(&mut self, group: &'a str) -> &mut T {
        let index = match self.0.iter().position(|(g, _)| *g == group) {
            Some(index) => index,
            None => {
                self.0.push((group, T::default()));
                self.0.len() - 1
            }
        };
        &mut self.0[index].1
    }
}

impl<'a, T> GroupMap<'a, T> {
    pub fn get(&self, group: &str) -> Option<&T> {
        self.0.iter().find(|(g, _)| *g == group).map(|(_, v)| v)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&'a str, &T)> + '_ {
        self.0.iter().map(|(g, v)| (*g, v))
    }
}

impl<'a> StepView<'a> {
    pub fn new(context: &'a RunContext, record: &'a StepRecord) -> StepView<'a> {
        let trainable: Vec<Option<&ModuleInfo>> = record
            .modules
            .iter()
            .map(|m| context.trainable_modules.get(&m.module))
            .collect();
        let mut view = StepView {
            context,
            record,
            trainable,
            group_norms: GroupMap::default(),
        };
        let mut sums: GroupMap<f64> = GroupMap::default();
        for (module, group) in view.modules_with_groups() {
            if let Some(norm) = module.grad_norm.map(|n| n.get()) {
                *sums.entry(group) += norm * norm;
            }
        }
        for (_, sum) in &mut sums.0 {
            *sum = sum.sqrt();
        }
        view.group_norms = sums;
        view
    }

    /// The reported modules that have trainable parameters, with their entries.
    pub fn trainable_modules(&self) -> impl Iterator<Item = (&'a ModuleStep, &'a ModuleInfo)> + '_ {
        self.record
            .modules
            .iter()
            .zip(&self.trainable)
            .filter_map(|(m, info)| info.map(|i| (m, i)))
    }

    /// Every reported module with its group (registered, or its name's first part).
    pub fn modules_with_groups(&self) -> impl Iterator<Item = (&'a ModuleStep, &'a str)> + '_ {
        self.record
            .modules
            .iter()
            .zip(&self.trainable)
            .map(|(m, info)| {
                let group = info.map_or_else(
                    || gradflow_protocol::default_group(&m.module),
                    |i| i.group.as_str(),
                );
                (m, group)
            })
    }

    /// Whether the loss scaler reported an overflow on this step.
    pub fn found_inf(&self) -> bool {
        self.record.scaler.as_ref().and_then(|s| s.found_inf) == Some(true)
    }
}

/// `1.2e-5`-style formatting for the numbers in alert texts.
pub fn sci(value: f64) -> String {
    match gradflow_protocol::non_finite_spelling(value) {
        Some(s) => s.to_owned(),
        None => format!("{value:.2e}"),
    }
}

/// "steps 0–49", or "step 7" for one.
pub fn step_range(first: u64, last: u64) -> String {
    if first == last {
        format!("step {first}")
    } else {
        format!("steps {first}–{last}")
    }
}

/// A list of names for a person: at most `max`, then "and N more".
/// Whether the dotted name `name` is `prefix` itself or lies under it
/// (`qwen.layers.0` is within `qwen`; `qwen2` is not).
pub(crate) fn is_within(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

pub(crate) fn name_list(names: &[&str], max: usize) -> String {
    let shown: Vec<&str> = names.iter().take(max).copied().collect();
    let mut text = shown.join(", ");
    if names.len() > max {
        text.push_str(&format!(" and {} more", names.len() - max));
    }
    text
}

/// What the detectors' unit tests share.
#[cfg(test)]
pub(crate) mod testing {
    use std::borrow::Borrow;

    use gradflow_protocol::StepRecord;

    use super::{RunContext, StepView, Thresholds, Transition};

    /// Feeds `records` in order to `on_step` and collects every transition, with the
    /// step of the record that caused it.
    pub fn transitions<R: Borrow<StepRecord>>(
        records: impl IntoIterator<Item = R>,
        mut on_step: impl FnMut(&StepRecord, &mut Vec<Transition>),
    ) -> Vec<(u64, Transition)> {
        let mut all = Vec::new();
        for record in records {
            let record = record.borrow();
            let mut out = Vec::new();
            on_step(record, &mut out);
            all.extend(out.into_iter().map(|t| (record.step, t)));
        }
        all
    }

    /// [`transitions`] for a detector that needs nothing of the registration: each
    /// record seen through a [`StepView`] of an empty one.
    pub fn viewed<R: Borrow<StepRecord>>(
        records: impl IntoIterator<Item = R>,
        mut on_step: impl FnMut(&StepView<'_>, &mut Vec<Transition>),
    ) -> Vec<(u64, Transition)> {
        let registration = serde_json::from_value(serde_json::json!({"params": []}))
            .expect("an empty registration");
        let context = RunContext::new(&registration, Thresholds::default());
        transitions(records, |record, out| {
            on_step(&StepView::new(&context, record), out)
        })
    }

    /// A step record from its JSON.
    pub fn record(value: serde_json::Value) -> StepRecord {
        serde_json::from_value(value).expect("a valid step record")
    }
}
