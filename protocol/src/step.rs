//! Streaming steps: `POST /api/v1/runs/{run_id}/steps` and its records.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use crate::amend::Amendment;
use crate::error::{InvalidBody, Path};
use crate::float::Float;
use crate::limits::{
    MAX_GPUS_PER_STEP, MAX_GRAPH_CUTS_PER_STEP, MAX_METRICS_PER_STEP, MAX_MODULES_PER_STEP,
    MAX_PARAMS_PER_STEP, MAX_STACK_FRAMES, MAX_STEP, MAX_STEPS_PER_BATCH, MAX_TEXT_BYTES,
};
use crate::signals::{AdamState, BatchInfo, MoeLayer, OutputLogits};
use crate::timestamp::Timestamp;
use crate::validate::{check_name, check_norm, check_text};

/// One training step's telemetry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct StepRecord {
    #[serde(deserialize_with = "step_number")]
    pub step: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<Float>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<Float>,
    #[serde(
        default,
        deserialize_with = "null_as_empty",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub modules: Vec<ModuleStep>,
    #[serde(
        default,
        deserialize_with = "null_as_empty",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub params: Vec<ParamStep>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaler: Option<ScalerState>,
    #[serde(
        default,
        deserialize_with = "null_as_empty",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub gpu: Vec<GpuStat>,
    /// Any other named scalars; a `null` value is "not measured this step".
    #[serde(
        default,
        deserialize_with = "null_as_empty",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    /// Free-form named values (numbers, non-finite spellings or null).
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub metrics: BTreeMap<String, Option<Float>>,
    /// Extension: how many of this run's step records the client has dropped so far
    /// (cumulative), because its local spool was full while the server was out of
    /// reach. Absent: none dropped, or a client that does not count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropped_steps: Option<u64>,
    /// v1.1: the lr of each optimizer parameter group at this step, by group name
    /// (`optimizer.param_groups[].name`). `lr` stays the run-wide value for v1 readers.
    #[serde(
        default,
        deserialize_with = "null_as_empty",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub lrs: BTreeMap<String, Float>,
    /// v1.1: changes to the registration, in force from this step on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amend: Option<Amendment>,
    /// v1.2: where the client saw the autograd graph cut since its last record, each
    /// sent once per module per episode. The server keeps them and names the place in
    /// the `grad_stuck_zero` alert (cause `backward_not_reached`) they explain.
    #[serde(
        default,
        deserialize_with = "null_as_empty",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub graph_cuts: Vec<GraphCut>,
    /// v1.2: whether the gradients this step's first backward pass added to were
    /// still those of the previous optimizer step (nothing zeroed them in between).
    /// Absent: not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grads_carried_over: Option<bool>,
    /// v1.2: the largest absolute value among the floating-point tensors passed to the
    /// watched model's forward this step (`NaN` when one held a NaN). Lets the overflow
    /// verdicts say when the batch, not the model, is the cause.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_absmax: Option<Float>,
    /// v1.4: which rank of a multi-rank run sent this record (required there, and
    /// below the run's `world_size`). Every rank reports its own record of a step;
    /// the server combines them once all have arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    /// v1.4: seconds this step took on the sending rank (wall clock, from the end of
    /// its previous optimizer step to the end of this one): what shows a straggler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_time: Option<Float>,
    /// v1.7: in a multi-rank run, whether this rank's own gradients, read as its
    /// backward pass accumulated them and before the gradient all-reduce, held a NaN
    /// or an infinity. The all-reduce spreads one rank's NaN to every rank within the
    /// step, so this says where it began when the loss does not. Clients may send it
    /// only when `true`; absent: finite, or not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_grads_nonfinite: Option<bool>,
    /// v1.8: the model's output logits this step (`logz_mean`, `absmax`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_logits: Option<OutputLogits>,
    /// v1.8: each MoE layer's tokens per expert (and router z) this step.
    #[serde(
        default,
        deserialize_with = "null_as_empty",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub moe: Vec<MoeLayer>,
    /// v1.8: what the step trained on: the user's batch ids, each micro-batch's loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchInfo>,
    /// v1.9: how many times the watched optimizer stepped (`optimizer.step()` ran to
    /// its end) since the client's previous step record call (`gf.step`), reported or
    /// not. More than one means the gradients of this record were read at one of
    /// several updates. Absent: not counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_steps: Option<u32>,
}

/// A place where a module's output lost its path to the loss, as a client saw it
/// during the forward pass.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct GraphCut {
    /// The module with trainable parameters where the cut was seen.
    pub module: String,
    pub kind: GraphCutKind,
    /// The module's group, when the client knows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// `detached_input`: the group that ran with gradients just before, whose output
    /// the module most likely received without its history. `no_grad`: the group that
    /// ran with gradients just before the block, when the module after the block got
    /// its input without history (the block cut that group off too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
    /// The user's code that made the call, innermost frame first: the first frame
    /// outside the framework libraries, then its callers.
    #[serde(
        default,
        deserialize_with = "null_as_empty",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub stack: Vec<CallSite>,
    /// *(v1.6)* What ran the module cut off, when it was not the user's own code:
    /// `reentrant_checkpoint`, a reentrant activation checkpoint whose inputs do not
    /// require grad (it runs the block under `no_grad` and backward never enters it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<GraphCutVia>,
}

/// What cut the graph on the user's behalf (library code), when the client knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum GraphCutVia {
    /// `torch.utils.checkpoint(..., use_reentrant=True)` over inputs none of which
    /// requires grad: the checkpointed block's forward runs under `no_grad`.
    ReentrantCheckpoint,
}

/// How the graph was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum GraphCutKind {
    /// The module's forward ran with gradients disabled (`torch.no_grad()`,
    /// `torch.inference_mode()`, `torch.set_grad_enabled(False)`).
    NoGrad,
    /// Gradients were enabled, but the module's floating-point inputs had no autograd
    /// history although another group had just run with gradients: a `.detach()`, a
    /// tensor rebuilt from data, or a cached value.
    DetachedInput,
}

impl GraphCutKind {
    pub fn as_str(self) -> &'static str {
        match self {
            GraphCutKind::NoGrad => "no_grad",
            GraphCutKind::DetachedInput => "detached_input",
        }
    }
}

/// A frame of the user's code.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CallSite {
    pub file: String,
    pub line: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<String>,
}

impl fmt::Display for CallSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file, self.line)?;
        if let Some(function) = &self.function {
            write!(f, " in {function}")?;
        }
        Ok(())
    }
}

/// A module's gradient after this step's backward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ModuleStep {
    pub module: String,
    /// L2 norm over the gradients of the module's own parameters; `None`: none of
    /// them had a gradient.
    #[serde(default)]
    pub grad_norm: Option<Float>,
    /// Times the module's backward hook fired this step; `0`: backward never reached it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hook_hits: Option<u32>,
    /// v1.4: the sum of squares of the gradient elements the sending rank holds of
    /// the module's own parameters (f64; `NaN` or `Infinity` when one was not
    /// finite). The server adds a sharded module's partial sums across ranks; a rank
    /// that sends only `grad_norm` contributes its square.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_sumsq: Option<Float>,
    /// v1.4: how many gradient elements `grad_sumsq` covers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numel: Option<u64>,
    /// v1.4: how many of those elements are NaN or infinite.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nonfinite: Option<u64>,
    /// v1.5: a fingerprint of the module's weights after the step's optimizer step:
    /// the sum (f64) of the elements the sending rank holds of its own parameters.
    /// Sent by each rank of a multi-rank run now and then; the replicas of a
    /// replicated module must agree (`replica_divergence`, subject `weights`). Any
    /// run may send it now and then for the modules without a gradient on the step:
    /// weights that change with no gradient were moved by the training code (a
    /// target network, an EMA teacher), which `grad_stuck_zero` does not report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param_sum: Option<Float>,
    /// v1.8, attention modules: the largest pre-softmax logit q·k/√d_h over the batch,
    /// heads, queries and keys this step (masked positions excluded). Any number; a
    /// non-finite one is a finding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_max_logit: Option<Float>,
    /// v1.8, attention modules: the smallest over heads of the mean over queries of
    /// the attention's entropy −Σ_j A_ij ln A_ij, in nats.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_min_entropy: Option<Float>,
    /// v1.8: the RMS of the module's output this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub act_rms: Option<Float>,
    /// v1.8: the largest absolute value of the module's output this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub act_absmax: Option<Float>,
    /// v1.8: Adam(W)'s state over the module's own parameters, on sampled steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adam: Option<AdamState>,
}

/// A parameter's state after this step's optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ParamStep {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<Float>,
    /// L2 norm of (value after − value before) this step's optimizer step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_norm: Option<Float>,
    /// Largest absolute difference from the value at registration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drift: Option<Float>,
    /// Mean value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean: Option<Float>,
    /// v1.1: L2 norm of the update the optimizer computed this step, in f32 (or
    /// wider) before it was written in the parameter's dtype.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intended_update_norm: Option<Float>,
    /// v1.1: the largest per-element ratio |intended update| / ulp(weight), the ulp
    /// taken in the parameter's stored dtype at the element's value before the step
    /// (the spacing above it). Below 0.25, every element's update rounds away.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intended_update_max_ulp: Option<Float>,
    /// v1.1: how many elements had a non-zero intended update this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intended_nonzero: Option<u64>,
    /// v1.1: how many elements had a non-zero intended update and still hold the same
    /// stored value after the step (the update was rounded away).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rounded_away: Option<u64>,
    /// v1.4: how many elements of the parameter the sending rank holds (its shard,
    /// for a sharded parameter): the weight of its `mean` when shards are combined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numel: Option<u64>,
}

/// The loss scaler after this step's update (torch.amp.GradScaler semantics).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ScalerState {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<Float>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub growth_tracker: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub found_inf: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_skipped: Option<bool>,
}

/// One device's telemetry (NVML).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct GpuStat {
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_used_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_total_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization_pct: Option<Float>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_c: Option<Float>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_w: Option<Float>,
}

impl StepRecord {
    /// Checks one record; `path` is where it sits in its batch (`steps[3]`).
    pub(crate) fn validate(&self, path: &Path<'_>) -> Result<(), InvalidBody> {
        if self.step > MAX_STEP {
            return Err(path.field("step").error(format!(
                "step {} is larger than the largest allowed step {MAX_STEP} (2^53 - 1)",
                self.step
            )));
        }
        let modules = path.field("modules");
        if self.modules.len() > MAX_MODULES_PER_STEP {
            return Err(modules.error(format!(
                "{} modules is more than the limit of {MAX_MODULES_PER_STEP} per step",
                self.modules.len()
            )));
        }
        let mut seen = HashSet::with_capacity(self.modules.len());
        for (i, module) in self.modules.iter().enumerate() {
            let path = modules.index(i);
            check_name(&path.field("module"), &module.module)?;
            check_norm(&path.field("grad_norm"), module.grad_norm)?;
            check_norm(&path.field("grad_sumsq"), module.grad_sumsq)?;
            crate::signals::check_module(&path, module)?;
            if let (Some(nonfinite), Some(numel)) = (module.nonfinite, module.numel)
                && nonfinite > numel
            {
                return Err(path.field("nonfinite").error(format!(
                    "nonfinite ({nonfinite}) cannot exceed numel ({numel})"
                )));
            }
            if !seen.insert(module.module.as_str()) {
                return Err(path.field("module").error(format!(
                    "module {:?} appears twice in this step",
                    module.module
                )));
            }
        }
        let params = path.field("params");
        if self.params.len() > MAX_PARAMS_PER_STEP {
            return Err(params.error(format!(
                "{} parameters is more than the limit of {MAX_PARAMS_PER_STEP} per step",
                self.params.len()
            )));
        }
        seen.clear();
        for (i, param) in self.params.iter().enumerate() {
            let path = params.index(i);
            check_name(&path.field("name"), &param.name)?;
            check_norm(&path.field("grad_norm"), param.grad_norm)?;
            check_norm(&path.field("update_norm"), param.update_norm)?;
            check_norm(&path.field("drift"), param.drift)?;
            check_norm(
                &path.field("intended_update_norm"),
                param.intended_update_norm,
            )?;
            check_norm(
                &path.field("intended_update_max_ulp"),
                param.intended_update_max_ulp,
            )?;
            if let (Some(rounded), Some(nonzero)) = (param.rounded_away, param.intended_nonzero)
                && rounded > nonzero
            {
                return Err(path.field("rounded_away").error(format!(
                    "rounded_away ({rounded}) cannot exceed intended_nonzero ({nonzero})"
                )));
            }
            if !seen.insert(param.name.as_str()) {
                return Err(path.field("name").error(format!(
                    "parameter {:?} appears twice in this step",
                    param.name
                )));
            }
        }
        validate_graph_cuts(&path.field("graph_cuts"), &self.graph_cuts)?;
        crate::signals::check_step(
            path,
            self.output_logits.as_ref(),
            &self.moe,
            self.batch.as_ref(),
        )?;
        check_norm(&path.field("input_absmax"), self.input_absmax)?;
        if let Some(time) = self.step_time
            && !(time.is_finite() && time.get() >= 0.0)
        {
            return Err(path.field("step_time").error(format!(
                "a step time must be a finite number of seconds ≥ 0, got {}",
                crate::format_float(time.get())
            )));
        }
        if let Some(scaler) = &self.scaler
            && let Some(scale) = scaler.scale
            && scale.get() < 0.0
        {
            return Err(path.field("scaler").field("scale").error(format!(
                "a loss scale cannot be negative, got {}",
                crate::format_float(scale.get())
            )));
        }
        let gpus = path.field("gpu");
        if self.gpu.len() > MAX_GPUS_PER_STEP {
            return Err(gpus.error(format!(
                "{} devices is more than the limit of {MAX_GPUS_PER_STEP}",
                self.gpu.len()
            )));
        }
        let mut indices = HashSet::with_capacity(self.gpu.len());
        for (i, gpu) in self.gpu.iter().enumerate() {
            let path = gpus.index(i);
            if !indices.insert(gpu.index) {
                return Err(path
                    .field("index")
                    .error(format!("device {} appears twice in this step", gpu.index)));
            }
            if let Some(pct) = gpu.utilization_pct
                && !(0.0..=100.0).contains(&pct.get())
            {
                return Err(path.field("utilization_pct").error(format!(
                    "utilization must lie between 0 and 100, got {}",
                    crate::format_float(pct.get())
                )));
            }
        }
        let metrics = path.field("metrics");
        if self.metrics.len() > MAX_METRICS_PER_STEP {
            return Err(metrics.error(format!(
                "{} metrics is more than the limit of {MAX_METRICS_PER_STEP} per step",
                self.metrics.len()
            )));
        }
        for name in self.metrics.keys() {
            check_name(&metrics.field(name), name)?;
        }
        let lrs = path.field("lrs");
        for (name, lr) in &self.lrs {
            check_name(&lrs.field(name), name)?;
            if !(lr.is_finite() && lr.get() >= 0.0) {
                return Err(lrs.field(name).error(format!(
                    "an lr must be a finite number ≥ 0, got {}",
                    crate::format_float(lr.get())
                )));
            }
        }
        if let Some(amend) = &self.amend {
            amend.validate(&path.field("amend"))?;
        }
        Ok(())
    }
}

/// Checks every record of a batch and that steps strictly increase inside it.
fn validate_graph_cuts(path: &Path<'_>, cuts: &[GraphCut]) -> Result<(), InvalidBody> {
    if cuts.len() > MAX_GRAPH_CUTS_PER_STEP {
        return Err(path.error(format!(
            "{} graph cuts is more than the limit of {MAX_GRAPH_CUTS_PER_STEP} per step",
            cuts.len()
        )));
    }
    for (i, cut) in cuts.iter().enumerate() {
        let path = path.index(i);
        check_name(&path.field("module"), &cut.module)?;
        if let Some(group) = &cut.group {
            check_name(&path.field("group"), group)?;
        }
        if let Some(upstream) = &cut.upstream {
            check_name(&path.field("upstream"), upstream)?;
        }
        let stack = path.field("stack");
        if cut.stack.len() > MAX_STACK_FRAMES {
            return Err(stack.error(format!(
                "{} frames is more than the limit of {MAX_STACK_FRAMES}",
                cut.stack.len()
            )));
        }
        for (j, frame) in cut.stack.iter().enumerate() {
            let frame_path = stack.index(j);
            if frame.file.is_empty() {
                return Err(frame_path.field("file").error("file must not be empty"));
            }
            check_text(&frame_path.field("file"), &frame.file, MAX_TEXT_BYTES)?;
            if let Some(function) = &frame.function {
                check_name(&frame_path.field("function"), function)?;
            }
        }
    }
    Ok(())
}

pub fn validate_batch(records: &[StepRecord]) -> Result<(), InvalidBody> {
    let root = Path::root("steps");
    if records.len() > MAX_STEPS_PER_BATCH {
        return Err(root.error(format!(
            "{} step records is more than the limit of {MAX_STEPS_PER_BATCH} per batch",
            records.len()
        )));
    }
    let mut previous: Option<u64> = None;
    for (i, record) in records.iter().enumerate() {
        let path = root.index(i);
        record.validate(&path)?;
        if let Some(previous) = previous
            && record.step <= previous
        {
            return Err(path.field("step").error(format!(
                "step {} does not follow step {previous}: steps must strictly increase within a batch",
                record.step
            )));
        }
        previous = Some(record.step);
    }
    Ok(())
}

fn step_number<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    struct StepVisitor;

    impl Visitor<'_> for StepVisitor {
        type Value = u64;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a non-negative integer step")
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v)
                .map_err(|_| E::custom(format_args!("step must not be negative, got {v}")))
        }

        fn visit_f64<E: de::Error>(self, v: f64) -> Result<u64, E> {
            Err(E::custom(format_args!(
                "step must be an integer, got {}",
                crate::format_float(v)
            )))
        }
    }

    deserializer.deserialize_any(StepVisitor)
}

/// Reads `null` as the empty collection: the protocol says absent and `null` both
/// mean "not measured".
fn null_as_empty<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}
