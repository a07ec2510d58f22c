//! v1.5: what a client found wrong in how the model is wired when it registered the
//! run — facts only the live Python objects show (a module attribute that freezes
//! nothing, layers kept in a plain list, embeddings meant to be tied that are two
//! tensors). The server words the alerts; the client only says what it saw.

use serde::{Deserialize, Serialize};

use crate::error::{InvalidBody, Path};
use crate::validate::check_name;

/// Most wiring findings one registration may carry.
pub const MAX_WIRING_FINDINGS: usize = 256;

/// One finding about the model's wiring.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct WiringFinding {
    pub kind: WiringKind,
    /// The module it concerns, by its name in the model (`""` for the model itself).
    pub module: String,
    /// The attribute involved, where there is one (`layers` for `self.layers = [...]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attribute: Option<String>,
    /// Parameter tensors concerned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<u64>,
    /// *(v1.6)* A whole number the finding measured, where its kind has one: the loss
    /// scale in force (`clip_before_unscale`), the scheduler steps per optimizer step
    /// (`scheduler_per_micro_batch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured: Option<u64>,
    /// *(v1.11)* `clip_after_step` only: the bound of a clip that ran before the
    /// backward that wrote the gradients the next step used (its `max_norm`, or
    /// `clip_value`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound: Option<f64>,
    /// *(v1.11)* With `bound`: the sizes of the gradients those steps used, above the
    /// bound (their norm; for `clip_grad_value_` their largest element), at most
    /// [`MAX_USED_NORMS`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub used_norms: Vec<f64>,
}

/// Most `used_norms` one finding may carry.
pub const MAX_USED_NORMS: usize = 16;

crate::vocabulary! {
    /// What kind of wiring mistake a finding is. Each is also the alert kind the server
    /// raises for it (`gradflow_core`'s `AlertKind` borrows these names).
    pub enum WiringKind {
        /// `module.requires_grad = False` set as a plain attribute, which `nn.Module`
        /// ignores: the module's parameters still require grad (`requires_grad_(False)`
        /// was meant).
        FreezeFlagIgnored = "freeze_flag_ignored",
        /// Modules held in a plain Python list, tuple or dict attribute instead of an
        /// `nn.ModuleList`/`nn.ModuleDict`: their parameters are not the model's, so an
        /// optimizer built from `model.parameters()` never updates them.
        ModulesNotRegistered = "modules_not_registered",
        /// The model's config asks for tied input and output embeddings, and they are two
        /// tensors.
        TiedWeightsUntied = "tied_weights_untied",
        /// A module's `forward` builds layers with parameters (`nn.Linear(d, d)(x)`) that
        /// end up registered nowhere: new random weights at every call, never trained.
        /// Seen during the first steps and sent in an amendment (`attribute`: the class of
        /// the layer built, `params`: the parameter tensors built).
        ParamsCreatedInForward = "params_created_in_forward",
        /// *(v1.6)* `clip_grad_norm_` ran on the scaled gradients under a GradScaler
        /// (after `backward`, with no `scaler.unscale_(optimizer)` before it): the norm
        /// clipped is the scaled one (`measured`: the scale), so every step is cut to
        /// `max_norm / scale` once unscaled. Sent in an amendment. *(v1.10)* `attribute`
        /// `clip_grad_value_`: the clip was `clip_grad_value_`, which clamped the scaled
        /// elements.
        ClipBeforeUnscale = "clip_before_unscale",
        /// *(v1.6)* `clip_grad_norm_` cut gradients that no `backward` had written since the
        /// last `optimizer.step()` (called after the step, or before the next `backward`):
        /// the optimizer steps on unclipped gradients. Sent in an amendment. *(v1.10)*
        /// `attribute` `clip_grad_value_`: the clip was `clip_grad_value_`.
        ClipAfterStep = "clip_after_step",
        /// *(v1.6)* An LR scheduler of the optimizer advances `measured` (≥ 2) steps per
        /// optimizer step, every step (stepped per micro-batch under gradient
        /// accumulation): the schedule runs that many times too fast (`attribute`: the
        /// scheduler's class). Sent in an amendment.
        SchedulerPerMicroBatch = "scheduler_per_micro_batch",
        /// *(v1.6)* An optimizer param group holds no parameter while its lr differs from
        /// every group that holds some (a name filter that matched nothing): the
        /// parameters meant for it train at another lr (`attribute`: the group's name).
        ParamGroupEmpty = "param_group_empty",
        /// *(v1.9)* A module's attributes (`attribute`, comma-separated) hold `params`
        /// tensors that require grad and are not parameters (`self.w = torch.zeros(...,
        /// requires_grad=True)`): not in `parameters()` nor the optimizer, backward fills
        /// their `.grad` and they never change. Sent in an amendment once a gradient
        /// reached them.
        TensorsNotRegistered = "tensors_not_registered",
        /// *(v1.10)* `ReduceLROnPlateau` cut the lr `measured` (≥ 2) times while the
        /// metric it is stepped with never improved on its first reading under its mode
        /// (`attribute`: `min` or `max`) and moved steadily the other way: an accuracy
        /// read in mode `min` (or a loss in mode `max`), every evaluation counted as no
        /// improvement. Sent in an amendment.
        PlateauModeMismatch = "plateau_mode_mismatch",
        /// *(v1.10)* `optimizer.step()` changed `params` parameters of `module` that have
        /// `requires_grad=False` (`attribute`: their names, comma-separated): frozen
        /// weights left in the optimizer, moved by weight decay or momentum on a zeroed
        /// gradient, or by an optimizer that decays parameters without one. Weights moved
        /// outside the step (an EMA teacher) are not judged. Sent in an amendment.
        FrozenWeightsStepped = "frozen_weights_stepped",
        /// *(v1.10)* An element-wise loss (`mse_loss`, `l1_loss`, `smooth_l1_loss`,
        /// `huber_loss`) got a prediction and a target whose shapes broadcast into more
        /// pairs than either holds (`attribute`: the function and the two shapes;
        /// `measured`: the pairs per prediction): `(N, 1)` against `(N)` compares every
        /// prediction with every target. Sent in an amendment.
        LossBroadcasts = "loss_broadcasts",
    }
}

#[cfg(feature = "openapi")]
crate::vocabulary_schema!(WiringKind);

pub(crate) fn validate_wiring(
    path: &Path<'_>,
    findings: &[WiringFinding],
) -> Result<(), InvalidBody> {
    if findings.len() > MAX_WIRING_FINDINGS {
        return Err(path.error(format!(
            "{} wiring findings are more than the limit of {MAX_WIRING_FINDINGS}",
            findings.len()
        )));
    }
    for (i, finding) in findings.iter().enumerate() {
        let path = path.index(i);
        if !finding.module.is_empty() {
            check_name(&path.field("module"), &finding.module)?;
        }
        if let Some(attribute) = &finding.attribute {
            check_name(&path.field("attribute"), attribute)?;
        }
        check_clip_sizes(&path, finding)?;
    }
    Ok(())
}

/// A clip's `bound` and `used_norms`: finite and not negative, at most
/// [`MAX_USED_NORMS`] norms.
fn check_clip_sizes(path: &Path<'_>, finding: &WiringFinding) -> Result<(), InvalidBody> {
    if let Some(bound) = finding.bound
        && !(bound.is_finite() && bound >= 0.0)
    {
        return Err(path
            .field("bound")
            .error(format!("bound {bound} is not a finite number >= 0")));
    }
    if finding.used_norms.len() > MAX_USED_NORMS {
        return Err(path.field("used_norms").error(format!(
            "{} used norms are more than the limit of {MAX_USED_NORMS}",
            finding.used_norms.len()
        )));
    }
    let norms = path.field("used_norms");
    for (i, norm) in finding.used_norms.iter().enumerate() {
        if !(norm.is_finite() && *norm >= 0.0) {
            return Err(norms
                .index(i)
                .error(format!("{norm} is not a finite number >= 0")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RunRegistration;

    #[test]
    fn findings_parse_and_unknown_kinds_are_refused() {
        let registration: RunRegistration = serde_json::from_value(serde_json::json!({
            "params": [{"name": "encoder.w"}],
            "wiring": [{"kind": "freeze_flag_ignored", "module": "encoder", "params": 1}]
        }))
        .unwrap();
        registration.validate().unwrap();
        assert_eq!(registration.wiring[0].kind, WiringKind::FreezeFlagIgnored);
        let unknown = serde_json::from_value::<RunRegistration>(serde_json::json!({
            "params": [], "wiring": [{"kind": "something_else", "module": "m"}]
        }));
        assert!(unknown.is_err());
        let bad_name: RunRegistration = serde_json::from_value(serde_json::json!({
            "params": [], "wiring": [{"kind": "tied_weights_untied", "module": "a\u{7}b"}]
        }))
        .unwrap();
        let error = bad_name.validate().unwrap_err();
        assert!(error.to_string().contains("wiring[0].module"), "{error}");
    }

    #[test]
    fn a_clip_before_backward_carries_its_bound_and_the_norms_used() {
        let registration: RunRegistration = serde_json::from_value(serde_json::json!({
            "params": [], "wiring": [{"kind": "clip_after_step", "module": "", "params": 4,
                                      "bound": 1.0, "used_norms": [1.7, 2.25]}]
        }))
        .unwrap();
        registration.validate().unwrap();
        assert_eq!(registration.wiring[0].used_norms, vec![1.7, 2.25]);
        let negative: RunRegistration = serde_json::from_value(serde_json::json!({
            "params": [], "wiring": [{"kind": "clip_after_step", "module": "",
                                      "bound": 1.0, "used_norms": [1.7, -2.0]}]
        }))
        .unwrap();
        let error = negative.validate().unwrap_err();
        assert!(
            error.to_string().contains("wiring[0].used_norms[1]"),
            "{error}"
        );
    }
}
