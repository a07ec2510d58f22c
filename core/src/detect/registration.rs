//! The checks made once, when a run registers, before its first step: what the
//! registration alone proves wrong.
//!
//! - `scaler_bf16_incompatible`: a loss scaler over bf16 trainable parameters.
//! - `dtype_mismatch`: trainable parameters whose dtype is not the run's
//!   `precision.param_dtype` (e.g. LoRA adapters left in bf16 under fp32 masters).
//! - `param_not_in_optimizer`: `requires_grad` parameters the optimizer does not hold.
//! - `group_not_training`: a group the registration declares meant to train
//!   (`train`, v1.1) has no trainable parameter (a wrong name filter froze it).
//! - `freeze_flag_ignored`, `modules_not_registered`, `tied_weights_untied`,
//!   `params_created_in_forward`: what the client found wrong in the model's wiring
//!   ([`super::wiring`]).
//! - `nothing_trains`: no parameter at all is both `requires_grad` and in the
//!   optimizer: whatever the run computes, no weight can change.
//!
//! One alert per kind and group, listing the parameters.

use std::collections::BTreeMap;

use gradflow_protocol::{Dtype, LossScaler, ParamSpec};
use serde_json::json;

use super::context::RunContext;
use super::wording::{is_within, name_list};
use crate::model::alert::{AlertKind, Opened, Severity};

/// Every registration-time alert of a run.
pub fn check(context: &RunContext) -> Vec<Opened> {
    let mut alerts = Vec::new();
    scaler_bf16_incompatible(context, &mut alerts);
    dtype_mismatch(context, &mut alerts);
    param_not_in_optimizer(context, &mut alerts);
    group_not_training(context, &mut alerts);
    nothing_trains(context, &mut alerts);
    one_cause_once(&mut alerts);
    super::wiring::check(context, &mut alerts);
    alerts
}

/// A run whose optimizer holds none of its trainable parameters is one cause:
/// `nothing_trains` says it for the run, with the modules, and the modules'
/// `param_not_in_optimizer` alerts, which would each say a part of it, are dropped.
fn one_cause_once(alerts: &mut Vec<Opened>) {
    let Some(at) = alerts.iter().position(|a| {
        a.kind == AlertKind::NothingTrains && a.evidence["cause"] == "none_in_optimizer"
    }) else {
        return;
    };
    let modules: Vec<String> = alerts
        .iter()
        .filter(|a| a.kind == AlertKind::ParamNotInOptimizer)
        .map(|a| a.subject.clone())
        .collect();
    if modules.is_empty() {
        return;
    }
    let names: Vec<&str> = modules.iter().map(String::as_str).collect();
    let run = &mut alerts[at];
    run.detail = format!(
        "{} Outside the optimizer: {}.",
        run.detail,
        super::wording::name_list(&names, 8)
    );
    run.evidence["modules"] = json!(modules);
    alerts.retain(|a| a.kind != AlertKind::ParamNotInOptimizer);
}

/// A run none of whose parameters can change: every one frozen, or the optimizer
/// holding none of the trainable ones (an adapter loaded frozen, `"trainable params:
/// 0"`, an optimizer built before unfreezing). Needs no `train` declaration: a run
/// that registers parameters registers them to train some of them.
fn nothing_trains(context: &RunContext, out: &mut Vec<Opened>) {
    let params = &context.registration.params;
    if params.is_empty() || params.iter().any(|p| p.requires_grad() && p.in_optimizer()) {
        return;
    }
    let frozen = params.iter().filter(|p| !p.requires_grad()).count();
    let outside = params.len() - frozen;
    let (cause, detail, fix) = if outside == 0 {
        (
            "all_frozen",
            format!(
                "All {} registered parameters have requires_grad=False: backward computes no \
                 gradient for any of them and the optimizer has nothing to update, so the \
                 loss can only move through randomness (dropout, data order).",
                params.len()
            ),
            "Unfreeze what should train before building the optimizer: for an adapter \
             loaded from disk, PeftModel.from_pretrained(..., is_trainable=True); otherwise \
             call requires_grad_(True) on the modules meant to train (print the count of \
             parameters with requires_grad to check).",
        )
    } else {
        (
            "none_in_optimizer",
            format!(
                "{outside} parameters require a gradient and {frozen} are frozen, but the \
                 optimizer holds none of the trainable ones: its parameter groups are empty \
                 or hold other tensors (frozen ones, or ones replaced since), so no step \
                 changes a weight."
            ),
            "Build the optimizer after freezing and unfreezing, from the parameters that \
             require grad: torch.optim.AdamW(p for p in model.parameters() if \
             p.requires_grad).",
        )
    };
    out.push(Opened {
        kind: AlertKind::NothingTrains,
        subject: "run".into(),
        severity: Severity::Critical,
        first_step: None,
        step: None,
        title: "Nothing in this run can train".into(),
        detail,
        fix: fix.into(),
        evidence: json!({
            "cause": cause,
            "registered_params": params.len(),
            "frozen_params": frozen,
            "trainable_outside_optimizer": outside,
        }),
    });
}

fn group_not_training(context: &RunContext, out: &mut Vec<Opened>) {
    let Some(train) = &context.registration.train else {
        return;
    };
    // A group's name, or a module prefix inside one (`agent.head`).
    let params_of = |group: &str| -> Vec<&ParamSpec> {
        context
            .registration
            .params
            .iter()
            .filter(|p| p.group_name() == group || is_within(&p.name, group))
            .collect()
    };
    let trains = |p: &ParamSpec| p.requires_grad() && p.in_optimizer();
    // Entries with nothing trainable get their own critical alert; a wider entry
    // does not name their modules again.
    let dead: Vec<&str> = train
        .iter()
        .filter(|group| !params_of(group).iter().any(|p| trains(p)))
        .map(String::as_str)
        .collect();
    for group in train {
        let params = params_of(group);
        let trainable = params.iter().filter(|p| trains(p)).count();
        if trainable > 0 {
            if let Some(alert) = frozen_modules_inside(group, &params, trainable, &dead) {
                out.push(alert);
            }
            continue;
        }
        let (detail, cause) = if params.is_empty() {
            (
                format!(
                    "The registration says {group} is meant to train, but no registered \
                     parameter belongs to it: the group name does not match the parameters' \
                     groups, or the module was never built."
                ),
                "no_params",
            )
        } else {
            (
                format!(
                    "The registration says {group} is meant to train, but none of its {} \
                     parameters is both trainable and in the optimizer ({} have \
                     requires_grad=False, {} are outside the optimizer): it will not learn.",
                    params.len(),
                    params.iter().filter(|p| !p.requires_grad()).count(),
                    params
                        .iter()
                        .filter(|p| p.requires_grad() && !p.in_optimizer())
                        .count(),
                ),
                "no_trainable_params",
            )
        };
        out.push(Opened {
            kind: AlertKind::GroupNotTraining,
            subject: group.clone(),
            severity: Severity::Critical,
            first_step: None,
            step: None,
            title: format!("{group} is meant to train but has no trainable parameters"),
            detail,
            fix: "Check the filter that freezes parameters (a name pattern that matches more \
                  than intended, e.g. 'head' in 'agent.head'), and build the optimizer from the \
                  parameters that should train after freezing."
                .into(),
            evidence: json!({
                "cause": cause,
                "params": params.iter().take(20).map(|p| p.name.as_str()).collect::<Vec<_>>(),
                "registered_params": params.len(),
            }),
        });
    }
}

/// Modules wholly frozen inside a group declared to train while most of the group
/// trains (`train=["agent"]` with `agent.head` frozen by a name filter): a warning
/// naming them. A group that is mostly frozen (a LoRA model's base, with adapters
/// training) is a design, and says nothing here.
fn frozen_modules_inside(
    group: &str,
    params: &[&ParamSpec],
    trainable: usize,
    named_elsewhere: &[&str],
) -> Option<Opened> {
    if trainable * 2 < params.len() {
        return None;
    }
    let mut modules: BTreeMap<&str, bool> = BTreeMap::new();
    for param in params {
        let trains = param.requires_grad() && param.in_optimizer();
        *modules.entry(param.module_name()).or_insert(false) |= trains;
    }
    let frozen: Vec<&str> = modules
        .iter()
        .filter(|(_, trains)| !**trains)
        .map(|(module, _)| *module)
        .filter(|module| !named_elsewhere.iter().any(|entry| is_within(module, entry)))
        .collect();
    if frozen.is_empty() {
        return None;
    }
    Some(Opened {
        kind: AlertKind::GroupNotTraining,
        subject: group.to_owned(),
        severity: Severity::Warning,
        first_step: None,
        step: None,
        title: format!("{} modules of {group} will not train", frozen.len()),
        detail: format!(
            "The registration says {group} is meant to train, and {trainable} of its {} \
             parameters do, but every parameter of {} is frozen or outside the optimizer: \
             those modules keep their initial weights.",
            params.len(),
            name_list(&frozen, 5),
        ),
        fix: "Check the filter that freezes parameters (a name pattern that matches more than \
              intended, e.g. 'head' in 'agent.head'), and build the optimizer from the \
              parameters that should train after freezing; or leave these modules out of \
              train= if they are frozen on purpose."
            .into(),
        evidence: json!({
            "cause": "frozen_modules",
            "modules": frozen.iter().take(20).collect::<Vec<_>>(),
            "frozen_modules": frozen.len(),
            "trainable_params": trainable,
            "registered_params": params.len(),
        }),
    })
}

fn trainable(context: &RunContext) -> impl Iterator<Item = &ParamSpec> {
    context
        .registration
        .params
        .iter()
        .filter(|p| p.requires_grad())
}

fn by_group<'a>(params: impl Iterator<Item = &'a ParamSpec>) -> BTreeMap<&'a str, Vec<&'a str>> {
    let mut groups: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for param in params {
        groups
            .entry(param.group_name())
            .or_default()
            .push(&param.name);
    }
    groups
}

fn scaler_bf16_incompatible(context: &RunContext, out: &mut Vec<Opened>) {
    let precision = context.registration.precision.clone().unwrap_or_default();
    let scaler = match precision.loss_scaler {
        Some(LossScaler::Static) => "static",
        Some(LossScaler::Dynamic) => "dynamic",
        _ => return,
    };
    let run_dtype = precision.param_dtype;
    let bf16: Vec<&str> = trainable(context)
        .filter(|p| p.dtype.or(run_dtype) == Some(Dtype::Bf16))
        .map(|p| p.name.as_str())
        .collect();
    if bf16.is_empty() {
        return;
    }
    out.push(Opened {
        kind: AlertKind::ScalerBf16Incompatible,
        subject: "run".into(),
        severity: Severity::Critical,
        first_step: None,
        step: None,
        title: "Loss scaler over bf16 parameters: GradScaler will fail".into(),
        detail: format!(
            "The run uses a {scaler} loss scaler and {} trainable parameters are bf16 ({}). \
             PyTorch's CUDA kernel behind GradScaler.unscale_ handles float, double and half only, \
             so the first step fails with \"_amp_foreach_non_finite_check_and_unscale_cuda\" not \
             implemented for 'BFloat16'. Loss scaling exists for fp16's narrow exponent range; \
             bf16 has fp32's.",
            bf16.len(),
            name_list(&bf16, 3)
        ),
        fix: "bf16 needs no loss scaling: drop the GradScaler (or construct it with \
              enabled=False) when training in bf16. If fp16 compute was meant, keep fp32 master \
              weights and run the forward under torch.autocast(dtype=torch.float16) with the \
              scaler. Check the dtype mapping of your config: a string such as \"float32\" \
              silently mapped to bf16 is a known way to get here."
            .into(),
        evidence: json!({
            "cause": "bf16_params_with_loss_scaler",
            "loss_scaler": scaler,
            "bf16_params": bf16.len(),
            "params": bf16.iter().take(20).collect::<Vec<_>>(),
        }),
    });
}

fn dtype_mismatch(context: &RunContext, out: &mut Vec<Opened>) {
    let Some(expected) = context
        .registration
        .precision
        .as_ref()
        .and_then(|p| p.param_dtype)
    else {
        return;
    };
    let mismatched = trainable(context).filter(|p| p.dtype.is_some_and(|d| d != expected));
    for (group, names) in by_group(mismatched) {
        let dtypes: Vec<&str> = {
            let mut d: Vec<&str> = context
                .registration
                .params
                .iter()
                .filter(|p| names.contains(&p.name.as_str()))
                .filter_map(|p| p.dtype.map(Dtype::as_str))
                .collect();
            d.sort();
            d.dedup();
            d
        };
        out.push(Opened {
            kind: AlertKind::DtypeMismatch,
            subject: group.to_owned(),
            severity: Severity::Warning,
            first_step: None,
            step: None,
            title: format!(
                "{} parameters of {group} are not {}",
                names.len(),
                expected.as_str()
            ),
            detail: format!(
                "The run's master weights are {} (precision.param_dtype), but {} trainable \
                 parameters of {group} are {} ({}). The optimizer updates them in that dtype: \
                 small updates round away in low precision, and mixing dtypes breaks fused \
                 optimizers and loss scaling.",
                expected.as_str(),
                names.len(),
                dtypes.join(" and "),
                name_list(&names, 3),
            ),
            fix: format!(
                "Cast these parameters to {} after creating them (adapters and heads added \
                 after the model was cast are the usual culprits: model.to(dtype) before adding \
                 them, or cast them explicitly), and let autocast handle compute precision.",
                expected.as_str()
            ),
            evidence: json!({
                "cause": "mixed_param_dtypes",
                "expected": expected.as_str(),
                "found": dtypes,
                "params": names.iter().take(20).collect::<Vec<_>>(),
                "mismatched_params": names.len(),
            }),
        });
    }
}

/// A `param_not_in_optimizer` opened by an amendment whose parameters the optimizer
/// held before it: the names now resolve to other tensors (`resize_token_embeddings`
/// after building the optimizer, a module swapped or re-created), and the optimizer
/// still steps the old ones, which the model no longer uses. Says that instead of the
/// generic text.
pub fn explain_replaced(alert: &mut Opened, before: &RunContext, step: u64) {
    let held: Vec<&str> = before
        .registration
        .params
        .iter()
        .filter(|p| p.requires_grad() && p.in_optimizer())
        .map(|p| p.name.as_str())
        .collect();
    let names: Vec<&str> = alert.evidence["params"]
        .as_array()
        .map(|names| names.iter().filter_map(|n| n.as_str()).collect())
        .unwrap_or_default();
    if names.is_empty() || !names.iter().all(|name| held.contains(name)) {
        return;
    }
    let subject = alert.subject.clone();
    alert.title = format!("{subject} was replaced after the optimizer was built");
    alert.detail = format!(
        "At step {step} the names {} resolve to new tensors (a resize_token_embeddings, a \
         module swapped or re-created after the optimizer was built). The model now uses \
         the new tensors and they get gradients, but the optimizer still holds the old \
         ones, which nothing uses any more: {subject} stops learning.",
        name_list(&names, 3)
    );
    alert.fix = "Build the optimizer (and its learning-rate scheduler) after resizing or \
                 replacing modules; if it must exist before, rebuild it afterwards or give \
                 it the new parameters with optimizer.add_param_group."
        .into();
    alert.evidence["cause"] = json!("replaced_after_optimizer");
}

fn param_not_in_optimizer(context: &RunContext, out: &mut Vec<Opened>) {
    let missing = trainable(context).filter(|p| !p.in_optimizer());
    for (group, names) in by_group(missing) {
        out.push(Opened {
            kind: AlertKind::ParamNotInOptimizer,
            subject: group.to_owned(),
            severity: Severity::Critical,
            first_step: None,
            step: None,
            title: format!(
                "{} trainable parameters of {group} are not in the optimizer",
                names.len()
            ),
            detail: format!(
                "{} parameters of {group} have requires_grad=True but the optimizer does not hold \
                 them ({}): they get gradients every step and never change.",
                names.len(),
                name_list(&names, 3)
            ),
            fix: "Build the optimizer after every module exists and after wrapping (LoRA, DDP, \
                  torch.compile), from model.parameters() or explicit parameter groups that \
                  include these; or set requires_grad=False on them if they are meant to stay \
                  frozen."
                .into(),
            evidence: json!({
                "cause": "not_in_optimizer",
                "params": names.iter().take(20).collect::<Vec<_>>(),
                "missing_params": names.len(),
            }),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::thresholds::Thresholds;
    use gradflow_protocol::RunRegistration;
    use serde_json::Value;

    fn alerts(registration: Value) -> Vec<Opened> {
        let registration: RunRegistration = serde_json::from_value(registration).unwrap();
        check(&RunContext::new(&registration, Thresholds::default()))
    }

    #[test]
    fn a_run_with_nothing_trainable_is_critical_without_any_declaration() {
        // "trainable params: 0" (tloen/alpaca-lora#352): all frozen, the optimizer over all.
        let found = alerts(json!({"params": [
            {"name": "model.layers.0.mlp.weight", "requires_grad": false},
            {"name": "lm_head.weight", "requires_grad": false}
        ]}));
        let [alert] = &found[..] else {
            panic!("{found:?}")
        };
        assert_eq!(
            (alert.kind, alert.subject.as_str()),
            (AlertKind::NothingTrains, "run")
        );
        assert_eq!(alert.severity, Severity::Critical);
        assert_eq!(alert.evidence["cause"], "all_frozen");
        assert!(alert.fix.contains("is_trainable=True"), "{}", alert.fix);
        // An adapter loaded frozen beside an optimizer of empty groups (huggingface/trl#6700):
        // trainable tensors exist, the optimizer holds none of them.
        let found = alerts(json!({"params": [
            {"name": "base.w", "requires_grad": false, "in_optimizer": false},
            {"name": "lora.a", "in_optimizer": false}
        ]}));
        let nothing: Vec<&Opened> = found
            .iter()
            .filter(|a| a.kind == AlertKind::NothingTrains)
            .collect();
        assert_eq!(nothing.len(), 1, "{found:?}");
        assert_eq!(nothing[0].evidence["cause"], "none_in_optimizer");
        assert_eq!(nothing[0].evidence["frozen_params"], 1);
        // An optimizer built over another copy of the model (spro/practical-pytorch#9):
        // one alert for the run, naming the modules, not one more per module.
        let found = alerts(json!({"params": [
            {"name": "i2h.weight", "in_optimizer": false},
            {"name": "i2o.weight", "in_optimizer": false}
        ]}));
        let [alert] = &found[..] else {
            panic!("{found:?}")
        };
        assert_eq!(alert.kind, AlertKind::NothingTrains);
        assert_eq!(alert.evidence["modules"], json!(["i2h", "i2o"]));
        assert!(
            alert.detail.ends_with("Outside the optimizer: i2h, i2o."),
            "{}",
            alert.detail
        );
        // One trainable parameter in the optimizer is enough; no parameters says nothing.
        let one = alerts(json!({"params": [
            {"name": "base.w", "requires_grad": false},
            {"name": "lora.a"}
        ]}));
        assert!(one.is_empty(), "{one:?}");
        assert!(alerts(json!({"params": []})).is_empty());
    }

    #[test]
    fn a_group_meant_to_train_with_nothing_trainable_is_flagged() {
        let found = alerts(json!({
            "train": ["qwen", "agent"],
            "params": [
                {"name": "qwen.layers.0.mlp.weight"},
                {"name": "agent.head.weight", "requires_grad": false, "in_optimizer": false},
                {"name": "agent.head.bias", "requires_grad": false, "in_optimizer": false},
                {"name": "vision.patch.weight", "requires_grad": false}
            ]
        }));
        let groups: Vec<&str> = found
            .iter()
            .filter(|a| a.kind == AlertKind::GroupNotTraining)
            .map(|a| a.subject.as_str())
            .collect();
        // vision is frozen too, but nobody said it should train.
        assert_eq!(groups, ["agent"]);
        // A declared group that mostly trains names the modules that do not.
        let partly = alerts(json!({
            "train": ["agent"],
            "params": [
                {"name": "agent.body.weight"}, {"name": "agent.body.bias"},
                {"name": "agent.norm.weight"},
                {"name": "agent.head.weight", "requires_grad": false}
            ]
        }));
        let [alert] = &partly[..] else {
            panic!("{partly:?}")
        };
        assert_eq!(
            (alert.kind, alert.severity),
            (AlertKind::GroupNotTraining, Severity::Warning)
        );
        assert_eq!(alert.evidence["cause"], "frozen_modules");
        assert_eq!(alert.evidence["modules"], json!(["agent.head"]));
        // A frozen module that is an entry of its own is named once, by that entry.
        let once = alerts(json!({
            "train": ["agent", "agent.head"],
            "params": [
                {"name": "agent.body.weight"}, {"name": "agent.norm.weight"},
                {"name": "agent.head.weight", "requires_grad": false}
            ]
        }));
        let subjects: Vec<&str> = once.iter().map(|a| a.subject.as_str()).collect();
        assert_eq!(subjects, ["agent.head"], "{once:?}");
        // A LoRA model's base, mostly frozen by design, says nothing.
        let lora = alerts(json!({
            "train": ["model"],
            "params": [
                {"name": "model.layers.0.q_proj.weight", "requires_grad": false},
                {"name": "model.layers.0.v_proj.weight", "requires_grad": false},
                {"name": "model.layers.0.mlp.weight", "requires_grad": false},
                {"name": "model.layers.0.q_proj.lora_A.weight"}
            ]
        }));
        assert!(lora.is_empty(), "{lora:?}");
        let frozen = alerts(json!({"params": [
            {"name": "a.w", "requires_grad": false},
            {"name": "b.w"}
        ]}));
        assert!(frozen.is_empty(), "{frozen:?}");
    }

    #[test]
    fn a_module_prefix_meant_to_train_is_judged_on_its_own() {
        // agent trains as a group, but its head was frozen by a wrong name filter.
        let found = alerts(json!({
            "train": ["agent", "agent.head"],
            "params": [
                {"name": "agent.hidden.weight"},
                {"name": "agent.head.weight", "requires_grad": false},
                {"name": "agent.head.bias", "requires_grad": false}
            ]
        }));
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].subject, "agent.head");
        assert!(found[0].detail.contains("none of its 2 parameters"));
    }

    #[test]
    fn a_scaler_over_bf16_is_flagged_at_registration_with_the_pytorch_error() {
        let found = alerts(json!({
            "precision": {"param_dtype": "bf16", "loss_scaler": "dynamic"},
            "params": [{"name": "qwen.w"}, {"name": "agent.w"}]
        }));
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].kind, AlertKind::ScalerBf16Incompatible);
        assert_eq!(found[0].step, None);
        assert!(
            found[0]
                .detail
                .contains("_amp_foreach_non_finite_check_and_unscale_cuda")
        );
        assert!(found[0].fix.contains("no loss scaling"));
        // Healthy combinations stay silent.
        for precision in [
            json!({"param_dtype": "bf16", "loss_scaler": "none"}),
            json!({"param_dtype": "f32", "compute_dtype": "f16", "loss_scaler": "dynamic"}),
            json!({"param_dtype": "bf16"}),
        ] {
            assert!(
                alerts(json!({"precision": precision, "params": [{"name": "a.w"}]})).is_empty()
            );
        }
        // Frozen bf16 parameters do not count.
        assert!(
            alerts(
                json!({"precision": {"param_dtype": "f32", "loss_scaler": "dynamic"},
            "params": [{"name": "a.w", "dtype": "bf16", "requires_grad": false}, {"name": "b.w"}]})
            )
            .is_empty()
        );
    }

    #[test]
    fn bf16_adapters_under_fp32_masters_are_a_dtype_mismatch_per_group() {
        let found = alerts(json!({
            "precision": {"param_dtype": "f32"},
            "params": [{"name": "qwen.lora_a", "dtype": "bf16"}, {"name": "qwen.lora_b", "dtype": "bf16"},
                       {"name": "qwen.w", "dtype": "f32"}, {"name": "agent.w", "dtype": "f32"}]
        }));
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].subject, "qwen");
        assert_eq!(found[0].evidence["mismatched_params"], 2);
        assert_eq!(found[0].evidence["found"], json!(["bf16"]));
    }

    #[test]
    fn trainable_parameters_outside_the_optimizer_are_named() {
        let found = alerts(json!({"params": [
            {"name": "qwen.w", "in_optimizer": false},
            {"name": "qwen.frozen", "in_optimizer": false, "requires_grad": false},
            {"name": "agent.w"}]}));
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].kind, AlertKind::ParamNotInOptimizer);
        assert_eq!(found[0].evidence["params"], json!(["qwen.w"]));
    }
}
