//! v1.8: the signals of training instabilities — attention and activation statistics
//! per module, Adam's state, the output logits, the experts' loads of each MoE layer,
//! the step's batch ids — and which of them a client measures, how often.
//!
//! Every field is optional and absent means "not measured", as everywhere else. The
//! server stores each value as a series and its detectors read them
//! (`attention_logit_growth`, `adam_eps_dominated`, `loss_spike`, ...).

use serde::{Deserialize, Serialize};

use crate::error::{InvalidBody, Path};
use crate::float::Float;
use crate::limits::{
    MAX_BATCH_ID_BYTES, MAX_BATCH_IDS, MAX_EXPERTS, MAX_MICRO_LOSSES, MAX_MOE_LAYERS_PER_STEP,
};
use crate::step::ModuleStep;
use crate::validate::{check_name, check_norm, check_text};

/// Adam(W)'s state over one module's own parameters, read after the optimizer step
/// on the steps the client samples. Elements never updated (`v = 0`: embedding rows of
/// tokens not seen yet) are left out of every figure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AdamState {
    /// How many elements have `v > 0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated: Option<u64>,
    /// The fraction of those elements with `√v̂ < ε`, in [0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub below_eps: Option<Float>,
    /// RMS of `u = m̂/(√v̂ + ε)`: the update divided by the lr, weight decay left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_rms: Option<Float>,
    /// The largest `|u|`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_absmax: Option<Float>,
}

/// The model's output logits this step (possibly on a subsample of tokens).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct OutputLogits {
    /// The mean over tokens of the logsumexp of the output logits (log Z).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logz_mean: Option<Float>,
    /// The largest absolute output logit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub absmax: Option<Float>,
    /// v1.9: the mean over tokens of the mean output logit over the vocabulary: the
    /// logits' level, which the softmax (and so the loss) does not see.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_mean: Option<Float>,
}

/// One MoE layer's routing this step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct MoeLayer {
    /// The layer's name (its router's or its block's module).
    pub module: String,
    /// Tokens routed to each expert, indexed by expert.
    pub tokens_per_expert: Vec<u64>,
    /// The mean over tokens of (logsumexp of the router logits)²: what a router z-loss
    /// penalises.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_z: Option<Float>,
}

/// What the step trained on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct BatchInfo {
    /// The user's ids of this step's samples or batches (`gf.step(batch_ids=...)`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ids: Vec<String>,
    /// The loss of each micro-batch of the step, in order, when the client sees them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub micro_losses: Vec<Float>,
    /// v1.9: how repetitive the step's token ids were: the largest share of one token
    /// id within one sequence (its count over the sequence's length), the largest over
    /// the step's sequences, in [0, 1]. A batch of one repeated token reads 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeated_token_share: Option<Float>,
}

/// The registration's `signals`: for each family the client measures, its interval in
/// reported steps (1: every reported step). A family left out is not measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SignalIntervals {
    /// `modules[].attn_max_logit`, `attn_min_entropy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<u32>,
    /// `modules[].act_rms`, `act_absmax`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activations: Option<u32>,
    /// `modules[].adam`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adam: Option<u32>,
    /// `output_logits`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_logits: Option<u32>,
    /// `moe`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<u32>,
    /// v1.9: `batch.repeated_token_share`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u32>,
}

impl SignalIntervals {
    /// Each family with its interval, as the registration names them.
    pub fn families(&self) -> [(&'static str, Option<u32>); 6] {
        [
            ("attention", self.attention),
            ("activations", self.activations),
            ("adam", self.adam),
            ("output_logits", self.output_logits),
            ("moe", self.moe),
            ("tokens", self.tokens),
        ]
    }

    pub(crate) fn validate(&self, path: &Path<'_>) -> Result<(), InvalidBody> {
        for (family, interval) in self.families() {
            if interval == Some(0) {
                return Err(path
                    .field(family)
                    .error("an interval is a number of reported steps, at least 1"));
            }
        }
        Ok(())
    }
}

/// Checks a module's v1.8 fields.
pub(crate) fn check_module(path: &Path<'_>, module: &ModuleStep) -> Result<(), InvalidBody> {
    check_norm(&path.field("attn_min_entropy"), module.attn_min_entropy)?;
    check_norm(&path.field("act_rms"), module.act_rms)?;
    check_norm(&path.field("act_absmax"), module.act_absmax)?;
    if let Some(adam) = &module.adam {
        let path = path.field("adam");
        check_fraction(&path.field("below_eps"), adam.below_eps)?;
        check_norm(&path.field("update_rms"), adam.update_rms)?;
        check_norm(&path.field("update_absmax"), adam.update_absmax)?;
    }
    Ok(())
}

/// Checks a step record's v1.8 top-level fields: `output_logits`, `moe`, `batch`.
pub(crate) fn check_step(
    path: &Path<'_>,
    output_logits: Option<&OutputLogits>,
    moe: &[MoeLayer],
    batch: Option<&BatchInfo>,
) -> Result<(), InvalidBody> {
    if let Some(logits) = output_logits {
        check_norm(&path.field("output_logits").field("absmax"), logits.absmax)?;
    }
    check_moe(&path.field("moe"), moe)?;
    if let Some(batch) = batch {
        check_batch(&path.field("batch"), batch)?;
    }
    Ok(())
}

fn check_moe(path: &Path<'_>, layers: &[MoeLayer]) -> Result<(), InvalidBody> {
    if layers.len() > MAX_MOE_LAYERS_PER_STEP {
        return Err(path.error(format!(
            "{} MoE layers is more than the limit of {MAX_MOE_LAYERS_PER_STEP} per step",
            layers.len()
        )));
    }
    for (i, layer) in layers.iter().enumerate() {
        let path = path.index(i);
        check_name(&path.field("module"), &layer.module)?;
        if layers[..i].iter().any(|l| l.module == layer.module) {
            return Err(path.field("module").error(format!(
                "MoE layer {:?} appears twice in this step",
                layer.module
            )));
        }
        let experts = layer.tokens_per_expert.len();
        if experts == 0 || experts > MAX_EXPERTS {
            return Err(path.field("tokens_per_expert").error(format!(
                "a layer has 1 to {MAX_EXPERTS} experts, got {experts}"
            )));
        }
        check_norm(&path.field("router_z"), layer.router_z)?;
    }
    Ok(())
}

fn check_batch(path: &Path<'_>, batch: &BatchInfo) -> Result<(), InvalidBody> {
    let ids = path.field("ids");
    if batch.ids.len() > MAX_BATCH_IDS {
        return Err(ids.error(format!(
            "{} batch ids is more than the limit of {MAX_BATCH_IDS} per step",
            batch.ids.len()
        )));
    }
    for (i, id) in batch.ids.iter().enumerate() {
        if id.is_empty() {
            return Err(ids.index(i).error("a batch id must not be empty"));
        }
        check_text(&ids.index(i), id, MAX_BATCH_ID_BYTES)?;
    }
    check_fraction(
        &path.field("repeated_token_share"),
        batch.repeated_token_share,
    )?;
    if batch.micro_losses.len() > MAX_MICRO_LOSSES {
        return Err(path.field("micro_losses").error(format!(
            "{} micro-batch losses is more than the limit of {MAX_MICRO_LOSSES} per step",
            batch.micro_losses.len()
        )));
    }
    Ok(())
}

/// A fraction lies in [0, 1]; NaN is not one.
fn check_fraction(path: &Path<'_>, value: Option<Float>) -> Result<(), InvalidBody> {
    match value {
        Some(v) if !(0.0..=1.0).contains(&v.get()) => Err(path.error(format!(
            "a fraction must lie between 0 and 1, got {}",
            crate::format_float(v.get())
        ))),
        _ => Ok(()),
    }
}
