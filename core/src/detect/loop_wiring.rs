//! The wording of the wiring findings a client makes about the training loop's order
//! during the first steps (protocol v1.6, sent in an amendment's `wiring`), and of an
//! optimizer group that holds nothing (at registration):
//!
//! - `clip_before_unscale` (critical): `clip_grad_norm_` clipped the scaled gradients
//!   (or `clip_grad_value_` clamped them: the finding's `attribute`, v1.10).
//! - `clip_after_step` (warning): a clip cut gradients the optimizer had already used
//!   (after `optimizer.step()`, before the next `backward`).
//! - `scheduler_per_micro_batch` (warning): an LR scheduler advances k ≥ 2 steps per
//!   optimizer step.
//! - `plateau_mode_mismatch` (warning, v1.10): `ReduceLROnPlateau` cuts the lr while
//!   its metric moves steadily the way its mode calls worse, never once better.
//! - `loss_broadcasts` (critical, v1.10): an element-wise loss whose prediction and
//!   target broadcast into more pairs than either holds.
//! - `param_group_empty` (warning): an optimizer group holds no parameter and its lr
//!   differs from every group that holds some.

use gradflow_protocol::{RunRegistration, WiringFinding, WiringKind};

use crate::model::alert::{AlertKind, Severity};

/// Kind, severity, title, detail and fix, as the other wiring findings.
pub(super) type Worded = (AlertKind, Severity, String, String, String);

/// The alert's subject where it is not the finding's module.
pub(super) fn subject(finding: &WiringFinding) -> Option<String> {
    match finding.kind {
        WiringKind::ClipBeforeUnscale | WiringKind::ClipAfterStep => Some("gradients".to_owned()),
        WiringKind::SchedulerPerMicroBatch => Some(
            finding
                .attribute
                .clone()
                .unwrap_or_else(|| "scheduler".to_owned()),
        ),
        WiringKind::PlateauModeMismatch => Some("ReduceLROnPlateau".to_owned()),
        WiringKind::LossBroadcasts => Some("loss".to_owned()),
        WiringKind::ParamGroupEmpty => Some(format!(
            "param group {}",
            finding.attribute.as_deref().unwrap_or("?")
        )),
        _ => None,
    }
}

/// The clip function a finding names: `clip_grad_value_` in its `attribute` (v1.10),
/// else `clip_grad_norm_` (the only one v1.6 clients report).
pub(super) fn clip_function(finding: &WiringFinding) -> Clip {
    match finding.attribute.as_deref() {
        Some("clip_grad_value_") => Clip::Value,
        _ => Clip::Norm,
    }
}

/// Which of torch's two gradient clips a loop-order finding is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Clip {
    Norm,
    Value,
}

impl Clip {
    fn name(self) -> &'static str {
        match self {
            Clip::Norm => "clip_grad_norm_",
            Clip::Value => "clip_grad_value_",
        }
    }

    /// The clip call as the fix writes it.
    fn call(self) -> &'static str {
        match self {
            Clip::Norm => "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)",
            Clip::Value => "torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)",
        }
    }

    /// What it did when it cut.
    fn cut(self) -> &'static str {
        match self {
            Clip::Norm => "their norm was above max_norm",
            Clip::Value => "some elements were above clip_value",
        }
    }
}

/// `clip_after_step`: a clip that cut gradients the last step had used, or *(v1.11)*
/// one that ran before the backward that wrote the gradients the next step used (the
/// finding's `bound` and `used_norms`).
pub(super) fn clip_after_step(params: &str, finding: &WiringFinding) -> Worded {
    let clip = clip_function(finding);
    let (name, call, cut) = (clip.name(), clip.call(), clip.cut());
    let (does_nothing, bound_name, size) = match clip {
        Clip::Norm => ("max_norm does nothing", "max_norm", "gradient norm"),
        Clip::Value => (
            "clip_value does nothing",
            "clip_value",
            "largest gradient element",
        ),
    };
    let detail = match finding.bound {
        Some(bound) if !finding.used_norms.is_empty() => {
            let used = finding
                .used_norms
                .iter()
                .map(|n| format!("{n}"))
                .collect::<Vec<_>>()
                .join(", ");
            format!(
                "{name} ran on {params} before loss.backward(): it found no gradient to \
                 cut (none yet, or only zeros), then backward wrote the gradients the \
                 optimizer stepped on, unclipped. Its {bound_name} is {bound}; the steps \
                 used a {size} above it: {used}, so {does_nothing}."
            )
        }
        _ => format!(
            "During the first steps, {name} cut {params} ({cut}) while no backward had \
             written them since the last optimizer.step(): it ran after the step, or \
             before the next backward, so it clipped gradients already used (or about to \
             be cleared). Every optimizer step used the unclipped gradients: \
             {does_nothing}."
        ),
    };
    (
        AlertKind::ClipAfterStep,
        Severity::Warning,
        "Gradient clipping runs where it cannot act: the optimizer steps on unclipped \
         gradients"
            .to_owned(),
        detail,
        format!(
            "Clip between backward and the step: loss.backward(); {call}; optimizer.step() \
             (under a GradScaler: scaler.unscale_(optimizer) right before the clip)."
        ),
    )
}

pub(super) fn clip_before_unscale(params: &str, scale: Option<u64>, clip: Clip) -> Worded {
    let scale = scale.map_or_else(|| "the loss scale".to_owned(), |s| s.to_string());
    let (name, call) = (clip.name(), clip.call());
    let (title, what) = match clip {
        Clip::Norm => (
            "clip_grad_norm_ clips the scaled gradients: every step is cut far below max_norm",
            format!(
                "the norm it measured and clipped is the scaled one ({scale} × the true \
                 norm), so once scaler.step unscales them the gradients are cut to \
                 max_norm / {scale}"
            ),
        ),
        Clip::Value => (
            "clip_grad_value_ clamps the scaled gradients: every step is cut far below \
             clip_value",
            format!(
                "it clamped the scaled elements ({scale} × the true ones) to ±clip_value, \
                 so once scaler.step unscales them no element is above clip_value / \
                 {scale}"
            ),
        ),
    };
    (
        AlertKind::ClipBeforeUnscale,
        Severity::Critical,
        title.to_owned(),
        format!(
            "Under the GradScaler, {name} ran on {params} after backward and before \
             scaler.unscale_(optimizer): {what}. The model trains with steps thousands of \
             times too small, and the loss stalls."
        ),
        format!(
            "Unscale before clipping: scaler.scale(loss).backward(); \
             scaler.unscale_(optimizer); {call}; scaler.step(optimizer); scaler.update()."
        ),
    )
}

pub(super) fn scheduler(finding: &WiringFinding) -> Worded {
    let class = finding.attribute.as_deref().unwrap_or("LR scheduler");
    let k = finding.measured.unwrap_or(2);
    (
        AlertKind::SchedulerPerMicroBatch,
        Severity::Warning,
        format!("{class} steps {k} times per optimizer step: the schedule runs {k}x too fast"),
        format!(
            "Over the first optimizer steps, {class}.last_epoch advanced by {k} at every \
             optimizer step: scheduler.step() runs once per micro-batch (or per backward), \
             not once per optimizer step. A warm-up and decay counted in optimizer steps \
             are over after 1/{k} of the run, and the lr then stays at its floor."
        ),
        format!(
            "Call scheduler.step() right after optimizer.step(), inside the accumulation \
             branch (once per optimizer step); or, if the schedule is meant to count \
             micro-batches, build it with {k}x the steps, knowingly."
        ),
    )
}

pub(super) fn plateau_mode(finding: &WiringFinding) -> Worded {
    let mode = finding.attribute.as_deref().unwrap_or("min");
    let cuts = finding.measured.unwrap_or(2);
    let (worse, better, other, meant) = if mode == "max" {
        ("fell", "above", "min", "a loss or an error")
    } else {
        ("rose", "below", "max", "an accuracy or a score")
    };
    (
        AlertKind::PlateauModeMismatch,
        Severity::Warning,
        format!(
            "ReduceLROnPlateau (mode='{mode}') cut the lr {cuts} times while its metric \
             steadily {worse}"
        ),
        format!(
            "The metric ReduceLROnPlateau is stepped with never went {better} its first \
             reading and {worse} steadily since, and the scheduler cut the lr {cuts} times. \
             In mode '{mode}' a metric that {worse} never improves, so every evaluation \
             counts towards patience and the lr keeps falling while the metric moves: if \
             it is {meant}, the scheduler reads it the wrong way round."
        ),
        format!(
            "If the metric is {meant}, build the scheduler with mode='{other}' \
             (ReduceLROnPlateau(optimizer, mode='{other}', ...)); if the mode is right, the \
             metric has got worse since the first evaluation (a model that overfits from \
             the start): look at that rather than at the lr."
        ),
    )
}

pub(super) fn loss_broadcasts(finding: &WiringFinding) -> Worded {
    let call = finding
        .attribute
        .as_deref()
        .unwrap_or("an element-wise loss: shapes that differ");
    let function = call.split(':').next().unwrap_or("the loss");
    let times = finding
        .measured
        .map_or_else(|| "many".to_owned(), |n| n.to_string());
    (
        AlertKind::LossBroadcasts,
        Severity::Critical,
        format!(
            "{function} broadcasts its prediction against its target: the model fits the wrong objective"
        ),
        format!(
            "{call}. The shapes differ and broadcast into {times} times as many pairs as \
             there are predictions: every prediction is compared with every target (for \
             (N, 1) against (N,), an (N, N) loss), whose minimum predicts the mean target \
             for every sample. The loss falls and the gradients flow, but the model \
             cannot learn the mapping. Torch warned about it once (\"Using a target size \
             ... different to the input size\")."
        ),
        format!(
            "Give the prediction and the target the same shape: {function}(pred.squeeze(-1), \
             target) or {function}(pred, target.unsqueeze(-1)); assert pred.shape == \
             target.shape before the loss."
        ),
    )
}

pub(super) fn empty_group(finding: &WiringFinding, registration: &RunRegistration) -> Worded {
    let name = finding.attribute.as_deref().unwrap_or("?");
    let groups = registration
        .optimizer
        .as_ref()
        .map(|o| o.param_groups.as_slice())
        .unwrap_or_default();
    let lr_of = |n: &str| {
        groups
            .iter()
            .find(|g| g.name == n)
            .and_then(|g| g.lr)
            .map_or_else(|| "its own lr".to_owned(), |lr| format!("lr {}", lr.0))
    };
    let others: Vec<String> = groups
        .iter()
        .filter(|g| g.name != name)
        .map(|g| format!("group {} at {}", g.name, lr_of(&g.name)))
        .collect();
    (
        AlertKind::ParamGroupEmpty,
        Severity::Warning,
        format!(
            "Optimizer param group {name} holds no parameter: its {} applies to nothing",
            lr_of(name)
        ),
        format!(
            "Param group {name} was given {} but no parameter: the filter that built it \
             (a name prefix, a module list) matched nothing, so the parameters meant for \
             it train in the other groups ({}).",
            lr_of(name),
            if others.is_empty() {
                "none listed".to_owned()
            } else {
                others.join(", ")
            }
        ),
        format!(
            "Check the filter that builds group {name} against model.named_parameters() \
             (print the names it should match) and fail loudly when a group comes out \
             empty: assert all(g[\"params\"] for g in optimizer.param_groups)."
        ),
    )
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn loop_findings_name_the_numbers_and_the_fix() {
        let found = crate::detect::testing::registration_alerts(json!({
            "params": [{"name": "base.0.weight", "param_group": "0"}],
            "optimizer": {"name": "adamw", "param_groups": [
                {"name": "0", "lr": 1e-3}, {"name": "1", "lr": 1e-5}]},
            "wiring": [
                {"kind": "clip_before_unscale", "module": "", "params": 6, "measured": 65536},
                {"kind": "clip_after_step", "module": "", "params": 6},
                {"kind": "scheduler_per_micro_batch", "module": "",
                 "attribute": "LambdaLR", "measured": 4},
                {"kind": "param_group_empty", "module": "", "attribute": "1", "params": 0}
            ]
        }));
        let got: Vec<_> = found
            .iter()
            .map(|a| (a.kind, a.subject.as_str(), a.severity))
            .collect();
        assert_eq!(
            got,
            [
                (
                    AlertKind::ClipBeforeUnscale,
                    "gradients",
                    Severity::Critical
                ),
                (AlertKind::ClipAfterStep, "gradients", Severity::Warning),
                (
                    AlertKind::SchedulerPerMicroBatch,
                    "LambdaLR",
                    Severity::Warning
                ),
                (
                    AlertKind::ParamGroupEmpty,
                    "param group 1",
                    Severity::Warning
                ),
            ]
        );
        assert!(
            found[0].detail.contains("max_norm / 65536"),
            "{}",
            found[0].detail
        );
        assert!(found[0].fix.contains("scaler.unscale_(optimizer)"));
        assert!(found[2].title.contains("4 times"), "{}", found[2].title);
        assert!(
            found[3].detail.contains("lr 0.00001"),
            "{}",
            found[3].detail
        );
        assert!(
            found[3].detail.contains("group 0 at lr 0.001"),
            "{}",
            found[3].detail
        );
        assert_eq!(found[1].evidence["cause"], "clip_after_step");
    }

    #[test]
    fn a_clip_before_backward_is_said_with_its_bound_and_the_norms_used() {
        let found = crate::detect::testing::registration_alerts(json!({
            "params": [{"name": "shared.0.weight"}],
            "wiring": [{"kind": "clip_after_step", "module": "", "params": 4,
                        "bound": 1.0, "used_norms": [1.73, 2.5]}]
        }));
        assert_eq!(found.len(), 1);
        let alert = &found[0];
        assert_eq!(alert.evidence["cause"], "clip_after_step");
        assert_eq!(alert.evidence["bound"], 1.0);
        assert_eq!(alert.evidence["used_norms"], json!([1.73, 2.5]));
        for said in [
            "clip_grad_norm_ ran on 4 parameter tensors before loss.backward()",
            "Its max_norm is 1",
            "above it: 1.73, 2.5",
        ] {
            assert!(alert.detail.contains(said), "{said}: {}", alert.detail);
        }
    }

    #[test]
    fn a_value_clip_is_named_and_its_fix_clamps_after_unscaling() {
        let found = crate::detect::testing::registration_alerts(json!({
            "params": [{"name": "base.0.weight"}],
            "wiring": [
                {"kind": "clip_before_unscale", "module": "", "params": 4, "measured": 65536,
                 "attribute": "clip_grad_value_"},
                {"kind": "clip_after_step", "module": "", "params": 4,
                 "attribute": "clip_grad_value_"}
            ]
        }));
        assert_eq!(found.len(), 2);
        let (scaled, after) = (&found[0], &found[1]);
        assert_eq!(scaled.subject, "gradients");
        assert!(
            scaled
                .title
                .starts_with("clip_grad_value_ clamps the scaled gradients"),
            "{}",
            scaled.title
        );
        assert!(
            scaled.detail.contains("clip_value / 65536"),
            "{}",
            scaled.detail
        );
        assert!(
            scaled
                .fix
                .contains("clip_grad_value_(model.parameters(), clip_value)")
        );
        assert!(
            !scaled.detail.contains("clip_grad_norm_"),
            "{}",
            scaled.detail
        );
        assert!(
            after.detail.contains("clip_grad_value_ cut 4"),
            "{}",
            after.detail
        );
        assert!(
            after.detail.contains("clip_value does nothing"),
            "{}",
            after.detail
        );
    }

    #[test]
    fn a_plateau_mode_mismatch_names_the_mode_and_the_other_one() {
        let found = crate::detect::testing::registration_alerts(json!({
            "params": [{"name": "base.0.weight"}],
            "wiring": [{"kind": "plateau_mode_mismatch", "module": "", "attribute": "min",
                        "measured": 3}]
        }));
        let [alert] = &found[..] else {
            panic!("{found:?}")
        };
        assert_eq!(
            (alert.kind, alert.subject.as_str(), alert.severity),
            (
                AlertKind::PlateauModeMismatch,
                "ReduceLROnPlateau",
                Severity::Warning
            )
        );
        assert!(
            alert.title.contains("cut the lr 3 times"),
            "{}",
            alert.title
        );
        assert!(
            alert.detail.contains("an accuracy or a score"),
            "{}",
            alert.detail
        );
        assert!(alert.fix.contains("mode='max'"), "{}", alert.fix);
        assert_eq!(alert.evidence["cause"], "plateau_mode_mismatch");
    }

    /// pytorch/pytorch#16045: MSELoss on predictions (100, 1) and targets (100,).
    #[test]
    fn a_broadcasting_loss_names_the_shapes_and_the_squeeze() {
        let found = crate::detect::testing::registration_alerts(json!({
            "params": [{"name": "weight"}],
            "wiring": [{"kind": "loss_broadcasts", "module": "",
                        "attribute": "mse_loss: input (100, 1), target (100,)", "measured": 100}]
        }));
        let [alert] = &found[..] else {
            panic!("{found:?}")
        };
        assert_eq!(
            (alert.kind, alert.subject.as_str(), alert.severity),
            (AlertKind::LossBroadcasts, "loss", Severity::Critical)
        );
        assert!(
            alert.title.starts_with("mse_loss broadcasts"),
            "{}",
            alert.title
        );
        assert!(
            alert.detail.contains("input (100, 1), target (100,)"),
            "{}",
            alert.detail
        );
        assert!(alert.detail.contains("100 times"), "{}", alert.detail);
        assert!(
            alert.fix.contains("mse_loss(pred.squeeze(-1), target)"),
            "{}",
            alert.fix
        );
    }
}
