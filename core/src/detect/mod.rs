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
//! This file only lists the detectors and runs them ([`DetectorSet`]). The toolbox
//! they share sits below them, and no detector imports this file:
//!
//! - [`episode`]: [`episode::Episodes`], the one owner of which alerts are open (it
//!   builds every open and resolve, and holds a resolve while its condition might
//!   return), [`episode::Alerts`] (a step's handle on them) and
//!   [`episode::Streak`] (a condition's run of reports).
//! - [`view`]: [`view::StepView`], a record resolved against its run once.
//! - [`wording`]: how alert texts say numbers, step ranges and names.
//! - [`context`]: what the detectors know of a run from its registration;
//!   [`thresholds`]: the thresholds they count against.
//! - [`layers`]: stacks of numbered layers, named once at registration.
//! - [`precision`]: floating-point spacing arithmetic (the bf16 ulp story).
//! - [`spaced`]: a series' readings kept a few steps apart with the loss's running
//!   mean, what the trend rules compare with a window earlier.
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
//! - *(v1.10)* [`lr_vanished`]: `lr_vanished`, a group's lr fallen to 10⁻⁸ of its
//!   peak (or 0) for a twentieth of the run: the schedule ended or decays too fast.
//! - [`accumulation_reset`]: `accumulation_reset`, gradients reset between the
//!   backward passes of one optimizer step (only the last micro-batch counts).
//! - [`eval_mode`]: `model_in_eval_mode`, a model left in eval mode mid-run.
//! - [`first_step`]: `first_step_hint` (info), what the first step already shows.
//! - [`update_rounded_away`]: `update_rounded_away`, a group's low-precision weights
//!   whose every intended update rounds away.
//! - [`explosion`]: `grad_explosion`, a group's norm orders of magnitude above its level.
//! - [`vanishing`]: `grad_vanishing`, gradients that shrink across depth.
//! - *(v1.8)* [`loss_spike`]: `loss_spike`, the loss (or the gradient norm with it)
//!   far above its last 128 readings, with its cause and the step's batch ids;
//!   [`loss_scale_collapse`]: `loss_scale_collapse`, an fp16 loss scale that keeps
//!   halving; [`attention_logit_growth`]: `attention_logit_growth`, attention logits
//!   past QK-Clip's τ; [`adam_eps_dominated`]: `adam_eps_dominated`, Adam's ε above
//!   most of a group's √v̂; [`adam_update_spike`]: `adam_update_spike`, a module's
//!   Adam update twice its level; [`adam_second_moment_stale`]:
//!   `adam_second_moment_stale`, Adam's largest update far past its normalised step
//!   while β₂ is slow; [`moe_routing`]: `moe_router_collapse` and
//!   `moe_load_imbalance`, an MoE layer's tokens on one expert or unevenly spread.
//!   [`activation_norm_growth`]: `activation_norm_growth` (info), blocks' outputs
//!   that keep growing while the loss is flat. *(v1.13)* [`output_logit_drift`]:
//!   `output_logit_drift`, the output logits' log Z far from its early level while
//!   the loss worsens.
//!   [`rolling`] is their window of recent readings,
//!   [`update_levels`] each module's level of Adam's update.
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
//!
//! # Adding a detector
//!
//! Add its kind's row to [`crate::model::alert::AlertKind`]'s table, write its file
//! here (a struct with its own state and `on_step(&mut self, &StepView, &mut
//! Alerts)`, the rule and the traces it was checked against in its doc comment, its
//! unit tests through `testing`), and add its line to `streaming_detectors!` below: that
//! one line declares its module, stores its state and runs it.

pub mod context;
pub mod episode;
pub mod layers;
mod loop_wiring;
mod moved_by_hand;
pub mod precision;
pub mod ranks;
pub mod registration;
pub mod rolling;
pub mod spaced;
pub(crate) mod testing;
pub mod thresholds;
pub mod update_levels;
pub mod view;
pub mod wiring;
pub mod wording;

use gradflow_protocol::StepRecord;
use serde::{Deserialize, Serialize};

use crate::columnar::flatten::measures_a_step;
pub use crate::model::alert::{AlertKind, Opened, Severity, Transition};
pub use context::RunContext;
pub use episode::{Alerts, Episodes};
pub use thresholds::{Detection, Thresholds};
pub use view::StepView;
pub use wording::{sci, step_range};

/// The streaming detectors, one line each, in the order they run on a step: each
/// line declares the detector's module (`detect/<module>.rs`) and its state type,
/// which becomes [`DetectorSet`]'s field of the module's name (the name its state is
/// stored under: renaming one loses that state on a restart) and one call of its
/// `on_step(&mut self, &StepView, &mut Alerts)` in [`DetectorSet::on_step`] (which
/// the list writes, so that the detectors borrow the open episodes side by side).
macro_rules! streaming_detectors {
    ($($module:ident :: $state:ident,)*) => {
        $(pub mod $module;)*

        /// Every streaming detector's state for one run, and the run's open episodes.
        /// Serialized with the run (as JSON) in the transaction of each batch, so a
        /// restarted server continues every streak and every episode.
        #[derive(Debug, Clone, Default, Serialize, Deserialize)]
        #[serde(default)]
        pub struct DetectorSet {
            $(pub $module: $module::$state,)*
            /// What only multi-rank runs break, judged on each combined step.
            pub ranks: ranks::RankDetectors,
            /// Which alerts are open: every detector opens and ends alerts through it.
            pub episodes: Episodes,
            /// The step of an amendment that left nothing to train, sent in a record
            /// that carried no measurement (the last `requires_grad_(False)` a client
            /// sends at `close`): judged on the next step that runs under it.
            pub nothing_trains_amended_at: Option<u64>,
        }

        impl DetectorSet {
            /// Runs every streaming detector on one step record, in the list's order
            /// (and, for a multi-rank run's combined step, the rank detectors on its
            /// view of the ranks), after what an amendment taking effect on it opens
            /// (`amended`: the registration in force before it).
            pub fn on_step(
                &mut self,
                context: &RunContext,
                record: &StepRecord,
                amended: Option<&RunContext>,
                ranks: Option<&ranks::RankView>,
            ) -> Vec<Transition> {
                let step = StepView::new(context, record).with_ranks(ranks);
                let mut alerts = self.episodes.at(record.step);
                let measured = measures_a_step(record);
                if let Some(before) = amended {
                    let held = on_amendment(before, context, record.step, measured, &mut alerts);
                    if held.is_some() {
                        self.nothing_trains_amended_at = held;
                    }
                }
                if measured && let Some(at) = self.nothing_trains_amended_at.take() {
                    open_held_nothing_trains(context, at, &mut alerts);
                }
                $(self.$module.on_step(&step, &mut alerts);)*
                if let Some(view) = ranks {
                    self.ranks.on_step(view, &mut alerts);
                }
                alerts.finish()
            }
        }
    };
}

streaming_detectors! {
    loss_nonfinite::LossNonfinite,
    loss_divergence::LossDivergence,
    grad_nonfinite::GradNonfinite,
    grads_not_zeroed::GradsNotZeroed,
    optimizer_steps::OptimizerStepsPerReport,
    optimizer_not_stepped::OptimizerNotStepped,
    lr_vanished::LrVanished,
    accumulation_reset::AccumulationReset,
    eval_mode::EvalMode,
    stuck_zero::StuckZeroGrad,
    frozen_norm::FrozenNormWeight,
    update_rounded_away::UpdateRoundedAway,
    scaler_overflow::ScalerOverflowStreak,
    explosion::GradExplosion,
    vanishing::GradVanishing,
    unused::UnusedParameters,
    loss_spike::LossSpike,
    loss_scale_collapse::LossScaleCollapse,
    attention_logit_growth::AttentionLogitGrowth,
    adam_eps_dominated::AdamEpsDominated,
    adam_update_spike::AdamUpdateSpike,
    adam_second_moment_stale::AdamSecondMomentStale,
    moe_routing::MoeRouting,
    activation_norm_growth::ActivationNormGrowth,
    output_logit_drift::OutputLogitDrift,
    // Last: after the streak verdicts of the same step, which confirm what it named.
    first_step::FirstStepHint,
}

impl DetectorSet {
    /// Opens the alerts a registration alone proves wrong (before any step);
    /// returns them as they opened.
    pub fn on_registration(&mut self, context: &RunContext) -> Vec<Opened> {
        self.episodes.open_all(registration::check(context))
    }
}

/// What an amended registration proves wrong and the one before it (`before`) did
/// not (a parameter unfrozen outside the optimizer, adapters cast to bf16 under a
/// loss scaler) opens on the amendment's step.
///
/// `nothing_trains` says a run trains nothing: on an amendment sent in a record that
/// measured nothing, no step has run under it yet (a GAN's discriminator frozen
/// around the generator's update, its last freeze sent at `close`), so it is held
/// and the amendment's step returned, to be judged on the next measured step.
fn on_amendment(
    before: &RunContext,
    after: &RunContext,
    step: u64,
    measured: bool,
    alerts: &mut Alerts<'_>,
) -> Option<u64> {
    let known: Vec<(AlertKind, String)> = registration::check(before)
        .into_iter()
        .map(|a| (a.kind, a.subject))
        .collect();
    let mut held = None;
    for mut alert in registration::check(after) {
        if known.contains(&(alert.kind, alert.subject.clone())) {
            continue;
        }
        if alert.kind == AlertKind::NothingTrains && !measured {
            held = Some(step);
            continue;
        }
        if alert.kind == AlertKind::ParamNotInOptimizer {
            registration::explain_replaced(&mut alert, before, step);
        }
        alerts.open(amended(alert, step));
    }
    held
}

/// Opens `nothing_trains` on a measured step when the registration in force, amended
/// at step `at` in a record that measured nothing, still trains nothing.
fn open_held_nothing_trains(context: &RunContext, at: u64, alerts: &mut Alerts<'_>) {
    for alert in registration::check(context) {
        if alert.kind == AlertKind::NothingTrains {
            alerts.open(amended(alert, at));
        }
    }
}

/// `alert` dated at the amendment of step `step` that proved it.
fn amended(mut alert: Opened, step: u64) -> Opened {
    alert.first_step = Some(step);
    alert.step = Some(step);
    alert.detail = format!(
        "From step {step}, where the client amended the registration: {}",
        alert.detail
    );
    alert.evidence["amended_at"] = serde_json::json!(step);
    alert
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradflow_protocol::RunRegistration;

    fn context(value: serde_json::Value) -> RunContext {
        let registration: RunRegistration = serde_json::from_value(value).unwrap();
        RunContext::new(&registration, Thresholds::default())
    }

    /// What an amendment from `before` to `after` opens on `step` (a record that
    /// reports nothing else).
    fn on_amendment(
        detectors: &mut DetectorSet,
        before: &RunContext,
        after: &RunContext,
        step: u64,
    ) -> Vec<Transition> {
        let record = crate::detect::testing::record(serde_json::json!({"step": step}));
        detectors.on_step(after, &record, Some(before), None)
    }

    #[test]
    fn everything_frozen_by_an_amendment_sent_alone_is_judged_on_the_next_step_run_under_it() {
        let before = context(serde_json::json!({"params": [
            {"name": "disc.conv.weight"}, {"name": "disc.head.weight"}
        ]}));
        let frozen = context(serde_json::json!({"params": [
            {"name": "disc.conv.weight", "requires_grad": false},
            {"name": "disc.head.weight", "requires_grad": false}
        ]}));
        // Sent at close, measuring nothing: no step ran under it, nothing opens.
        let mut detectors = DetectorSet::default();
        let t = on_amendment(&mut detectors, &before, &frozen, 300);
        assert!(t.is_empty(), "{t:?}");
        // A step that runs under it (a loss, nothing trained): opened, dated at the
        // amendment.
        let step = crate::detect::testing::record(serde_json::json!({"step": 301, "loss": 0.5}));
        let t = detectors.on_step(&frozen, &step, None, None);
        let [Transition::Open(o)] = &t[..] else {
            panic!("{t:?}")
        };
        assert_eq!(
            (o.kind, o.subject.as_str()),
            (AlertKind::NothingTrains, "run")
        );
        assert_eq!(o.evidence["amended_at"], 300);
        // Unfrozen again before any step ran under it: nothing opens.
        let mut detectors = DetectorSet::default();
        assert!(on_amendment(&mut detectors, &before, &frozen, 40).is_empty());
        let t = detectors.on_step(&before, &step, Some(&frozen), None);
        assert!(t.is_empty(), "{t:?}");
        // In a record that measured its step, it opens at once, as before.
        let mut detectors = DetectorSet::default();
        let t = detectors.on_step(&frozen, &step, Some(&before), None);
        assert!(
            t.iter()
                .any(|t| matches!(t, Transition::Open(o) if o.kind == AlertKind::NothingTrains)),
            "{t:?}"
        );
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
        let t = on_amendment(&mut DetectorSet::default(), &before, &after, 12);
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
        let t = on_amendment(&mut detectors, &before, &after, 30);
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
        assert!(on_amendment(&mut detectors, &before, &fine, 30).is_empty());
        // Adapters cast to bf16 under a loss scaler: the GradScaler failure's
        // precondition, on the step it appears.
        let scaled = |dtype: &str| {
            context(serde_json::json!({
                "precision": {"param_dtype": "f32", "loss_scaler": "dynamic"},
                "params": [{"name": "agent.lora_a.weight", "dtype": dtype}]
            }))
        };
        let t = on_amendment(&mut detectors, &scaled("f32"), &scaled("bf16"), 10);
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
