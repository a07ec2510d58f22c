//! Registration checks of the model's wiring, from the findings a client sends with
//! the registration (`wiring`, v1.5): what only the live Python objects show, said
//! with the fix. One alert per finding.
//!
//! - `freeze_flag_ignored` (warning): `module.requires_grad = False` set as a plain
//!   attribute; the module's parameters still require grad and train.
//! - `modules_not_registered` (critical): modules kept in a plain list, tuple or
//!   dict; their parameters are not the model's, so `model.parameters()` (the
//!   optimizer, `.to()`, `state_dict`, DDP) never sees them.
//! - `tied_weights_untied` (warning): the config ties input and output embeddings,
//!   and they are two tensors.
//! - `params_created_in_forward` (critical, from an amendment during the first
//!   steps): a module's `forward` builds layers with parameters that end up
//!   registered nowhere; they are new random weights at every call and never train.
//! - `tensors_not_registered` (critical, v1.9, from an amendment once a gradient
//!   reached them): tensors with `requires_grad=True` kept as a module attribute
//!   instead of `nn.Parameter`; no optimizer built from `parameters()` holds them.

use gradflow_protocol::{RunRegistration, WiringFinding, WiringKind};
use serde_json::json;

use super::context::RunContext;
use super::loop_wiring;
use crate::model::alert::{AlertKind, Opened, Severity};

pub fn check(context: &RunContext, out: &mut Vec<Opened>) {
    for finding in &context.registration.wiring {
        out.push(opened(finding, &context.registration));
    }
}

fn opened(finding: &WiringFinding, registration: &RunRegistration) -> Opened {
    let module = if finding.module.is_empty() {
        "the model".to_owned()
    } else {
        finding.module.clone()
    };
    let attribute = finding.attribute.as_deref().unwrap_or("?");
    let params = finding
        .params
        .map(|n| format!("{n} parameter tensors"))
        .unwrap_or_else(|| "its parameters".to_owned());
    let (kind, severity, title, detail, fix) = match finding.kind {
        WiringKind::FreezeFlagIgnored => (
            AlertKind::FreezeFlagIgnored,
            Severity::Warning,
            format!("{module}.requires_grad = False freezes nothing"),
            format!(
                "{module} has a plain attribute requires_grad = False. nn.Module does not read \
                 it: {params} of {module} still have requires_grad=True, get gradients and \
                 are updated, so the module meant to stay frozen trains."
            ),
            format!(
                "Freeze the parameters, not the module object: {module}.requires_grad_(False) \
                 (or `for p in {module}.parameters(): p.requires_grad = False`), before \
                 building the optimizer."
            ),
        ),
        WiringKind::ModulesNotRegistered => (
            AlertKind::ModulesNotRegistered,
            Severity::Critical,
            format!("Layers in {module}.{attribute} are not part of the model"),
            format!(
                "{module}.{attribute} is a plain Python list, tuple or dict holding modules \
                 ({params}). nn.Module registers only modules assigned directly or held in an \
                 nn.ModuleList/nn.ModuleDict, so these are missing from model.parameters(): an \
                 optimizer built from it never updates them, .to(device) does not move them, \
                 and state_dict does not save them."
            ),
            format!(
                "Hold them in nn.ModuleList (nn.ModuleDict for a dict): {module}.{attribute} = \
                 nn.ModuleList([...]), then rebuild the optimizer from model.parameters()."
            ),
        ),
        WiringKind::TiedWeightsUntied => (
            AlertKind::TiedWeightsUntied,
            Severity::Warning,
            format!("{module}: input and output embeddings are meant to be tied but are not"),
            format!(
                "The model's config sets tie_word_embeddings, yet the input embedding and the \
                 output projection of {module} are two tensors: the model has twice the \
                 embedding parameters it was designed with, and the two drift apart as they \
                 train."
            ),
            "Call model.tie_weights() after building or resizing the model (and after \
             loading weights), before building the optimizer; or set \
             tie_word_embeddings=False in the config if separate embeddings are intended."
                .to_owned(),
        ),
        WiringKind::ParamsCreatedInForward => created_in_forward(&module, attribute, &params),
        WiringKind::TensorsNotRegistered => tensors_not_registered(&module, attribute, finding),
        WiringKind::FrozenWeightsStepped => frozen_weights_stepped(&module, attribute, finding),
        WiringKind::LossBroadcasts => loop_wiring::loss_broadcasts(finding),
        // The loop's order, seen in the first steps (v1.6), and empty optimizer groups.
        WiringKind::ClipBeforeUnscale => {
            let clip = loop_wiring::clip_function(finding);
            loop_wiring::clip_before_unscale(&params, finding.measured, clip)
        }
        WiringKind::ClipAfterStep => loop_wiring::clip_after_step(&params, finding),
        WiringKind::SchedulerPerMicroBatch => loop_wiring::scheduler(finding),
        WiringKind::PlateauModeMismatch => loop_wiring::plateau_mode(finding),
        WiringKind::ParamGroupEmpty => loop_wiring::empty_group(finding, registration),
    };
    Opened {
        kind,
        subject: loop_wiring::subject(finding).unwrap_or_else(|| {
            if finding.module.is_empty() {
                "run".to_owned()
            } else {
                finding.module.clone()
            }
        }),
        severity,
        first_step: None,
        step: None,
        title,
        detail,
        fix,
        evidence: evidence(finding),
    }
}

/// The finding's fields, and *(v1.11)* a clip's `bound` and `used_norms` where it
/// carries them (absent otherwise, as before).
fn evidence(finding: &WiringFinding) -> serde_json::Value {
    let mut evidence = json!({
        "cause": finding.kind.as_str(),
        "module": finding.module,
        "attribute": finding.attribute,
        "params": finding.params,
        "measured": finding.measured,
    });
    if let Some(bound) = finding.bound {
        evidence["bound"] = json!(bound);
        evidence["used_norms"] = json!(finding.used_norms);
    }
    evidence
}

/// `attribute` names every such attribute of the module, comma-separated.
fn tensors_not_registered(
    module: &str,
    attributes: &str,
    finding: &WiringFinding,
) -> (AlertKind, Severity, String, String, String) {
    let tensors = match finding.params {
        Some(1) => "a tensor".to_owned(),
        Some(n) => format!("{n} tensors"),
        None => "tensors".to_owned(),
    };
    let first = attributes.split(", ").next().unwrap_or(attributes);
    (
        AlertKind::TensorsNotRegistered,
        Severity::Critical,
        format!("{module}: {attributes} require grad but are not parameters: they never train"),
        format!(
            "{module} keeps {tensors} created with requires_grad=True as plain attributes \
             ({attributes}), not as nn.Parameter. Backward reached them (their .grad is \
             filled), but they are not in model.parameters() and not in the optimizer: \
             their gradients pile up step after step and their values never change. \
             .to(device) does not move them and state_dict does not save them either."
        ),
        format!(
            "Wrap each in nn.Parameter in __init__: self.{first} = \
             nn.Parameter(torch.zeros(...)) (an nn.ParameterList for a list), then build \
             the optimizer from model.parameters(). If they are meant to stay fixed, create \
             them without requires_grad and register them with \
             self.register_buffer(\"{first}\", ...)."
        ),
    )
}

fn frozen_weights_stepped(
    module: &str,
    attributes: &str,
    finding: &WiringFinding,
) -> (AlertKind, Severity, String, String, String) {
    let tensors = match finding.params {
        Some(1) => "a parameter".to_owned(),
        Some(n) => format!("{n} parameters"),
        None => "parameters".to_owned(),
    };
    (
        AlertKind::FrozenWeightsStepped,
        Severity::Warning,
        format!("{module}: frozen weights ({attributes}) are changed by optimizer.step()"),
        format!(
            "optimizer.step() changed {tensors} of {module} ({attributes}) that have \
             requires_grad=False: they are frozen, yet the optimizer holds them and moves \
             them every step. Weight decay shrinks them, or momentum keeps moving them, on \
             a gradient that was zeroed rather than set to None (zero_grad(set_to_none=\
             False), or torch before 2.0); some optimizers decay parameters that have no \
             gradient at all. Weights meant to stay fixed drift away from what was loaded \
             or learned."
        ),
        "Build the optimizer from the trainable parameters only: \
         torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], ...) \
         (rebuild it, or drop the frozen ones from its groups, when you freeze \
         mid-run); and clear gradients with optimizer.zero_grad(set_to_none=True)."
            .to_owned(),
    )
}

fn created_in_forward(
    module: &str,
    layer: &str,
    params: &str,
) -> (AlertKind, Severity, String, String, String) {
    (
        AlertKind::ParamsCreatedInForward,
        Severity::Critical,
        format!(
            "{module}.forward builds nn.{layer} layers the model does not hold: they never train"
        ),
        format!(
            "While the model ran its first steps, {module}.forward created nn.{layer} layers \
             ({params}) that were registered nowhere: they are not in model.parameters(), so \
             the optimizer never updates them, and a layer built at each call \
             (nn.{layer}(...)(x)) draws new random weights every time, so the same input \
             gives a different output at every call."
        ),
        format!(
            "Create the layer once in {module}'s __init__ (self.proj = nn.{layer}(...)) and \
             call self.proj(x) in forward; for a layer without weights use the functional \
             form (torch.nn.functional). Then rebuild the optimizer from model.parameters()."
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::{Thresholds, registration};
    use gradflow_protocol::RunRegistration;

    #[test]
    fn each_finding_is_one_registration_alert_with_its_fix() {
        let registration: RunRegistration = serde_json::from_value(json!({
            "params": [{"name": "encoder.w"}, {"name": "head.w"}],
            "wiring": [
                {"kind": "freeze_flag_ignored", "module": "encoder", "params": 2},
                {"kind": "modules_not_registered", "module": "", "attribute": "hidden", "params": 6},
                {"kind": "tied_weights_untied", "module": "", "params": 2}
            ]
        }))
        .unwrap();
        let found = registration::check(&RunContext::new(&registration, Thresholds::default()));
        let kinds: Vec<(AlertKind, &str, Severity)> = found
            .iter()
            .map(|a| (a.kind, a.subject.as_str(), a.severity))
            .collect();
        assert_eq!(
            kinds,
            [
                (AlertKind::FreezeFlagIgnored, "encoder", Severity::Warning),
                (AlertKind::ModulesNotRegistered, "run", Severity::Critical),
                (AlertKind::TiedWeightsUntied, "run", Severity::Warning),
            ]
        );
        assert!(found[0].fix.contains("encoder.requires_grad_(False)"));
        assert!(
            found[1].title.contains("the model.hidden"),
            "{}",
            found[1].title
        );
        assert!(found[1].fix.contains("nn.ModuleList"));
        assert_eq!(found[2].evidence["cause"], "tied_weights_untied");
    }

    /// iamwangyabin/S-Prompts#2: a frozen prompt pool left in the optimizer decays.
    #[test]
    fn frozen_weights_the_step_moves_are_named_by_module() {
        let found = crate::detect::testing::registration_alerts(json!({
            "params": [{"name": "prompt.pool", "requires_grad": false}, {"name": "head.w"}],
            "wiring": [{"kind": "frozen_weights_stepped", "module": "prompt",
                        "attribute": "pool", "params": 1}]
        }));
        let [alert] = &found[..] else {
            panic!("{found:?}")
        };
        assert_eq!(
            (alert.kind, alert.subject.as_str(), alert.severity),
            (AlertKind::FrozenWeightsStepped, "prompt", Severity::Warning)
        );
        assert!(
            alert.detail.contains("a parameter of prompt (pool)"),
            "{}",
            alert.detail
        );
        assert!(alert.fix.contains("if p.requires_grad"), "{}", alert.fix);
        assert_eq!(alert.evidence["cause"], "frozen_weights_stepped");
    }

    /// automan000/Convolutional_LSTM_PyTorch#17: the peephole weights Wci, Wcf, Wco
    /// kept as tensors with requires_grad=True.
    #[test]
    fn tensors_that_are_not_parameters_name_the_attribute_and_nn_parameter() {
        let registration: RunRegistration = serde_json::from_value(json!({
            "params": [{"name": "cell0.Wxi.weight"}],
            "wiring": [{"kind": "tensors_not_registered", "module": "cell0",
                        "attribute": "Wci, Wcf, Wco", "params": 3}]
        }))
        .unwrap();
        let found = registration::check(&RunContext::new(&registration, Thresholds::default()));
        let [alert] = &found[..] else {
            panic!("{found:?}")
        };
        assert_eq!(alert.kind, AlertKind::TensorsNotRegistered);
        assert_eq!(alert.subject, "cell0");
        assert_eq!(alert.severity, Severity::Critical);
        assert!(
            alert.title.starts_with("cell0: Wci, Wcf, Wco require grad"),
            "{}",
            alert.title
        );
        assert!(
            alert.detail.contains("3 tensors created"),
            "{}",
            alert.detail
        );
        assert!(
            alert.fix.contains("self.Wci = nn.Parameter("),
            "{}",
            alert.fix
        );
    }

    #[test]
    fn a_layer_built_in_forward_names_the_module_and_the_layer() {
        let registration: RunRegistration = serde_json::from_value(json!({
            "params": [{"name": "attention.W_Q.weight"}],
            "wiring": [{"kind": "params_created_in_forward", "module": "attention",
                        "attribute": "Linear", "params": 4}]
        }))
        .unwrap();
        let found = registration::check(&RunContext::new(&registration, Thresholds::default()));
        let [alert] = &found[..] else {
            panic!("{found:?}")
        };
        assert_eq!(alert.kind, AlertKind::ParamsCreatedInForward);
        assert_eq!(
            (alert.subject.as_str(), alert.severity),
            ("attention", Severity::Critical)
        );
        assert!(
            alert.detail.contains("4 parameter tensors"),
            "{}",
            alert.detail
        );
        assert!(alert.fix.contains("__init__"), "{}", alert.fix);
        assert_eq!(alert.evidence["cause"], "params_created_in_forward");
    }
}
