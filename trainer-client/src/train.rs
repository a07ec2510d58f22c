//! One training step of the hybrid model, with the precision, loss-scaling and fault
//! options that reproduce what goes wrong in real runs, and the instrumentation that
//! turns a step into a protocol step record.
//!
//! Hook hits come from the forward pass's module outputs: those backward reached
//! (`model::trace`), which a gradient store cannot tell since candle frees every
//! gradient but the variables'.
//!
//! Instrumentation is computed on the device and brought to the host in one transfer
//! per step: every gradient's sum of squares, the norm weights' update, drift and
//! mean, the loss and the accuracy are stacked into one vector. With a loss scaler
//! there are two: whether to skip the optimizer step depends on `found_inf`, exactly
//! as PyTorch's `GradScaler.step` synchronises.

use candle_core::{D, DType, Device, Tensor, Var};
use gradflow_protocol::{Float, ModuleStep, ParamStep, Role, ScalerState, StepRecord, Timestamp};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::grad_sums::{self, GradSums};
use crate::model::HybridModel;
use crate::model::trace::{self, Outputs};
use crate::norm_watch::NormWatch;
use crate::optim::{AdamW, ParamsAdamW, StepMoments};
use crate::phases::Phases;
use crate::scaler::LossScaler;
use crate::tasks::{Batch, Task, Tokenizer};

/// Failures to reproduce on demand.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Faults {
    /// Detach the prompt embedding (the stray `torch.no_grad()` / `.detach()`).
    pub detach_prompt: bool,
    /// Leave every Qwen parameter out of the optimizer.
    pub qwen_not_in_optimizer: bool,
    /// Make one gradient NaN at this step.
    pub nan_grad_at: Option<u64>,
    /// Scale the prompt embedding past fp16's range in forward (an activation
    /// overflow: the gradients are non-finite at any loss scale).
    pub activation_overflow: bool,
}

/// The gradient made NaN by `Faults::nan_grad_at`.
/// Steps on which the norm weights are always measured, whatever
/// [`TrainOptions::norm_weights_every`]: `first_step_hint` judges the first reports.
pub const NORM_WEIGHTS_FIRST: u64 = 4;

pub const NAN_GRAD_PARAM: &str = "qwen.layers.0.mlp.down_proj.weight";

#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Master weights: what the optimizer updates.
    pub param_dtype: DType,
    /// Forward/backward dtype; a compute copy is cast each step when it differs.
    pub compute_dtype: DType,
    /// The peak learning rate; `schedule` shapes it over the run.
    pub lr: f64,
    pub schedule: LrSchedule,
    pub weight_decay: f64,
    pub loss_scaler: bool,
    pub growth_interval: u64,
    /// Qwen runs forward/backward only every K-th step; other steps reuse the cached,
    /// detached prompt embedding (prompt caching: healthy).
    pub qwen_every: u64,
    pub faults: Faults,
    pub seed: u64,
    /// Compute and report telemetry (off: train only, to measure the overhead).
    pub instrument: bool,
    /// With `instrument`: compute each attention call's largest logit and smallest
    /// head entropy (off: to measure what they cost apart).
    pub attention_statistics: bool,
    /// With `attention_statistics`: on every K-th step only (step numbers that are
    /// multiples of K; 1 or 0: every step).
    pub attention_every: u64,
    /// With `instrument`: the norm weights' update, drift, mean and intended update
    /// on the first [`NORM_WEIGHTS_FIRST`] steps, then on every K-th step only (step
    /// numbers that are multiples of K; 1 or 0: every step). A record without them
    /// says they were not measured.
    pub norm_weights_every: u64,
    /// How the instrumented step sums each gradient's squares.
    pub grad_sums: GradSums,
}

impl TrainOptions {
    /// Healthy defaults in the given dtypes: AdamW at lr 3e-4, weight decay 0.01, no
    /// loss scaler, Qwen every step, no faults, seed 0, instrumented.
    pub fn new(param_dtype: DType, compute_dtype: DType) -> TrainOptions {
        TrainOptions {
            param_dtype,
            compute_dtype,
            lr: 3e-4,
            schedule: LrSchedule::Constant,
            weight_decay: 0.01,
            loss_scaler: false,
            growth_interval: 2000,
            qwen_every: 1,
            faults: Faults::default(),
            seed: 0,
            instrument: true,
            attention_statistics: true,
            attention_every: 1,
            norm_weights_every: 1,
            grad_sums: GradSums::Auto,
        }
    }
}

/// How the learning rate moves over a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrSchedule {
    Constant,
    /// Linear warm-up from `lr / warmup` to `lr` over the first `warmup` steps, then
    /// cosine decay to a tenth of `lr` at step `total − 1`: the common LLM schedule.
    WarmupCosine {
        warmup: u64,
        total: u64,
    },
}

impl LrSchedule {
    /// The learning rate at `step` for a peak of `lr`.
    pub fn lr_at(self, lr: f64, step: u64) -> f64 {
        match self {
            LrSchedule::Constant => lr,
            LrSchedule::WarmupCosine { warmup, total } => {
                if step < warmup {
                    return lr * (step + 1) as f64 / warmup as f64;
                }
                let span = total.saturating_sub(warmup).saturating_sub(1).max(1);
                let progress = ((step - warmup) as f64 / span as f64).min(1.0);
                let floor = 0.1 * lr;
                floor + (lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

/// The name of the optimizer's one parameter group (PyTorch's index as text).
pub const PARAM_GROUP: &str = "0";

pub const BETAS: (f64, f64) = (0.9, 0.999);
pub const EPS: f64 = 1e-8;

/// What one step produced.
#[derive(Debug, Clone)]
pub struct StepOutput {
    pub loss: f64,
    pub accuracy: Option<f64>,
    pub qwen_grad_norm: Option<f64>,
    pub record: Option<StepRecord>,
}

/// A module and the indices of its parameters in the store.
struct ModuleParams {
    name: String,
    params: Vec<usize>,
}

pub struct Trainer {
    pub model: HybridModel,
    pub options: TrainOptions,
    pub scaler: Option<LossScaler>,
    optimizer: AdamW,
    vars: Vec<Var>,
    modules: Vec<ModuleParams>,
    /// The norm weights whose update, drift and mean are reported.
    watched: NormWatch,
    /// `options.grad_sums` for this trainer's device.
    grad_sums: GradSums,
    rng: StdRng,
    tokenizer: Tokenizer,
    device: Device,
    cached_prompt: Option<Tensor>,
    /// Set to time each phase of every step (`--phases`).
    pub phases: Option<Phases>,
}

impl Trainer {
    pub fn new(
        model: HybridModel,
        options: TrainOptions,
        device: &Device,
    ) -> anyhow::Result<Trainer> {
        Self::with_tokenizer(model, options, Tokenizer::Bytes, device)
    }

    /// A trainer whose prompts are encoded by `tokenizer`.
    pub fn with_tokenizer(
        mut model: HybridModel,
        options: TrainOptions,
        tokenizer: Tokenizer,
        device: &Device,
    ) -> anyhow::Result<Trainer> {
        if options.faults.qwen_not_in_optimizer {
            model.store.exclude_group_from_optimizer("qwen");
        }
        let optimizer = AdamW::new(
            model.store.optimizer_vars(),
            ParamsAdamW {
                lr: options.lr,
                beta1: BETAS.0,
                beta2: BETAS.1,
                eps: EPS,
                weight_decay: options.weight_decay,
            },
        )?;
        let vars: Vec<Var> = model.store.iter().map(|p| p.var.clone()).collect();
        let modules = model
            .store
            .modules()
            .into_iter()
            .map(|name| ModuleParams {
                name: name.to_owned(),
                params: model
                    .store
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.module == name)
                    .map(|(i, _)| i)
                    .collect(),
            })
            .collect();
        let norms = model
            .store
            .iter()
            .enumerate()
            .filter(|(_, p)| p.role == Role::Norm)
            .map(|(i, _)| i)
            .collect();
        let watched = NormWatch::new(&vars, norms)?;
        let scaler = options
            .loss_scaler
            .then(|| LossScaler::new(options.growth_interval));
        Ok(Trainer {
            rng: StdRng::seed_from_u64(options.seed ^ 0x7a5c),
            model,
            scaler,
            optimizer,
            vars,
            modules,
            watched,
            grad_sums: options.grad_sums.resolve(device),
            tokenizer,
            device: device.clone(),
            cached_prompt: None,
            phases: None,
            options,
        })
    }

    /// The next batch of random tasks.
    fn sample_batch(&mut self) -> candle_core::Result<Batch> {
        let preset = &self.model.preset;
        let tasks: Vec<Task> = (0..preset.batch)
            .map(|_| Task::random(&mut self.rng, preset.agent.grid_side))
            .collect();
        Batch::new(&tasks, preset, &self.tokenizer, &self.device)
    }

    /// The agent's cell logits for one batch: Qwen's prompt embedding (or the cached
    /// one), with the forward-pass faults applied.
    fn forward(&mut self, step: u64, ids: &Tensor, grids: &Tensor) -> candle_core::Result<Tensor> {
        let dtype = self.options.compute_dtype;
        let faults = &self.options.faults;
        let every = self.options.qwen_every.max(1);
        let run_qwen = every == 1 || step.is_multiple_of(every) || self.cached_prompt.is_none();
        let prompt = if run_qwen {
            let prompt = self.model.prompt_embedding(ids, dtype)?;
            let prompt = if faults.detach_prompt {
                prompt.detach()
            } else {
                prompt
            };
            if every > 1 {
                self.cached_prompt = Some(prompt.detach());
            }
            prompt
        } else {
            self.cached_prompt
                .clone()
                .expect("cached on an earlier step")
        };
        let prompt = if faults.activation_overflow {
            (prompt * 1e6)?
        } else {
            prompt
        };
        self.model.agent.forward(grids, &prompt, dtype)
    }

    /// Ends a phase of the step when phases are timed.
    fn mark(&mut self, phase: &'static str) -> candle_core::Result<()> {
        match &mut self.phases {
            Some(phases) => phases.mark(phase),
            None => Ok(()),
        }
    }

    /// Runs step `step`.
    pub fn step(&mut self, step: u64) -> anyhow::Result<StepOutput> {
        if let Some(phases) = &mut self.phases {
            phases.start()?;
        }
        let Batch {
            ids,
            grids,
            targets,
        } = self.sample_batch()?;
        let lr = self.options.schedule.lr_at(self.options.lr, step);
        self.optimizer.set_learning_rate(lr);
        self.mark("batch")?;
        // Module outputs are recorded only when instrumented: hook hits are read
        // from them once the loss is known.
        let (logits, outputs) = if self.options.instrument {
            let attention = self.options.attention_statistics
                && step.is_multiple_of(self.options.attention_every.max(1));
            let (logits, outputs) = trace::capture(attention, || self.forward(step, &ids, &grids));
            (logits?, outputs)
        } else {
            (self.forward(step, &ids, &grids)?, Outputs::default())
        };
        let flat = logits.to_dtype(DType::F32)?.flatten_to(1)?;
        let loss = candle_nn::loss::cross_entropy(&flat, &targets)?;
        self.mark("forward")?;
        let scale = self.scaler.map_or(1.0, |s| s.scale);
        let mut grads = if self.scaler.is_some() {
            (&loss * scale)?.backward()?
        } else {
            loss.backward()?
        };
        if self.options.faults.nan_grad_at == Some(step)
            && let Some(param) = self.model.store.get(NAN_GRAD_PARAM)
            && let Some(grad) = grads.remove(&param.var)
        {
            grads.insert(&param.var, (grad * f64::NAN)?);
        }
        self.mark("backward")?;
        if self.scaler.is_some() {
            for var in &self.vars {
                if let Some(grad) = grads.remove(var) {
                    grads.insert(var, (grad * (1.0 / scale))?);
                }
            }
        }

        if !self.options.instrument {
            let skipped = match &mut self.scaler {
                Some(scaler) => {
                    let found_inf = !all_finite(&self.vars, &grads, self.grad_sums)?;
                    scaler.update(found_inf)
                }
                None => false,
            };
            if !skipped {
                self.optimizer.step(&grads, &[])?;
            }
            self.mark("optimizer")?;
            let loss = loss.to_scalar::<f32>()? as f64;
            self.mark("loss to host")?;
            return Ok(StepOutput {
                loss,
                accuracy: None,
                qwen_grad_norm: None,
                record: None,
            });
        }

        // Stage A: loss, correct cells, each gradient's sum of squares (NaN/Inf in any
        // element makes the sum non-finite, which is also how found_inf is decided).
        let correct = flat
            .argmax(D::Minus1)?
            .eq(&targets)?
            .to_dtype(DType::F32)?
            .sum_all()?;
        let hook_hits = {
            let module_names: Vec<&str> = self.modules.iter().map(|m| m.name.as_str()).collect();
            outputs.hits(&loss, &module_names)
        };
        self.mark("hook hits")?;
        let mut stage_a = vec![loss.reshape(1)?, correct.reshape(1)?];
        let has_grad: Vec<bool> = self.vars.iter().map(|v| grads.get(v).is_some()).collect();
        let present: Vec<&Tensor> = self.vars.iter().filter_map(|v| grads.get(v)).collect();
        let gradient_sums = 2..2 + present.len();
        stage_a.extend(grad_sums::sums_of_squares(&present, self.grad_sums)?);
        self.mark("gradient sums")?;
        // After the sums: each attention call's [max logit, min entropy].
        let (attention, statistics): (Vec<String>, Vec<Tensor>) =
            outputs.attention.into_iter().unzip();
        stage_a.extend(statistics);

        let norms_due = step < NORM_WEIGHTS_FIRST
            || step.is_multiple_of(self.options.norm_weights_every.max(1));
        let before = if norms_due {
            Some(self.watched.before(&self.vars)?)
        } else {
            None
        };
        self.mark("norm weights before")?;

        let stage_a_host = if self.scaler.is_some() {
            Some(Tensor::cat(&stage_a, 0)?.to_vec1::<f32>()?)
        } else {
            None
        };
        let (found_inf, skipped) = match (&mut self.scaler, &stage_a_host) {
            (Some(scaler), Some(host)) => {
                let found_inf = host[gradient_sums.clone()].iter().any(|v| !v.is_finite());
                (Some(found_inf), scaler.update(found_inf))
            }
            _ => (None, false),
        };
        let moments = if skipped {
            StepMoments::none(self.watched.params().len())
        } else {
            self.optimizer_step(&grads, before.is_some())?
        };
        self.mark("optimizer, with intended updates")?;

        // Stage B: per watched norm weight, squared update, drift, mean — on the
        // values in their own dtype (converting bf16 to f32 is exact) — then, where
        // the optimizer updated it, the summary of its intended update.
        let stage_b = match &before {
            Some(before) => self.watched.statistics(&self.vars, before, &moments)?,
            None => None,
        };
        let has_intended = moments.updated();
        self.mark("norm weight stats")?;
        let (host_a, host_b) = match stage_a_host {
            Some(a) => {
                let b = match stage_b {
                    Some(b) => b.to_vec1::<f32>()?,
                    None => Vec::new(),
                };
                (a, b)
            }
            None => {
                let stage_a = Tensor::cat(&stage_a, 0)?;
                let n = stage_a.dim(0)?;
                let all = match stage_b {
                    Some(b) => Tensor::cat(&[stage_a, b], 0)?,
                    None => stage_a,
                };
                let all = all.to_vec1::<f32>()?;
                (all[..n].to_vec(), all[n..].to_vec())
            }
        };
        self.mark("to host")?;
        let measured = Measured {
            lr,
            host_a: &host_a,
            host_b: &host_b,
            has_grad: &has_grad,
            hook_hits: &hook_hits,
            has_intended: &has_intended,
            norm_weights: before.is_some(),
            attention: (&attention, &host_a[gradient_sums.end..]),
        };
        let output = self.record(step, &measured, found_inf, skipped);
        self.mark("record")?;
        Ok(output)
    }

    /// The optimizer step, handing over the watched norm weights' moments when
    /// `norm_weights` (their intended update is computed on this step).
    fn optimizer_step(
        &mut self,
        grads: &candle_core::backprop::GradStore,
        norm_weights: bool,
    ) -> candle_core::Result<StepMoments> {
        let watch: Vec<&Var> = if norm_weights {
            self.watched
                .params()
                .iter()
                .map(|&i| &self.vars[i])
                .collect()
        } else {
            Vec::new()
        };
        self.optimizer.step(grads, &watch)
    }

    fn record(
        &self,
        step: u64,
        measured: &Measured<'_>,
        found_inf: Option<bool>,
        skipped: bool,
    ) -> StepOutput {
        let Measured {
            lr,
            host_a,
            host_b,
            has_grad,
            hook_hits,
            has_intended,
            norm_weights,
            attention,
        } = *measured;
        let loss = host_a[0] as f64;
        let cells = (self.model.preset.batch * self.model.preset.agent.grid_side.pow(2)) as f64;
        let accuracy = host_a[1] as f64 / cells;
        // Each parameter's gradient sum of squares, None where it had no gradient.
        let mut sums = host_a[2..].iter();
        let sumsq: Vec<Option<f64>> = has_grad
            .iter()
            .map(|&has| {
                if has {
                    sums.next().map(|v| *v as f64)
                } else {
                    None
                }
            })
            .collect();
        let params: Vec<_> = self.model.store.iter().collect();
        let mut qwen_sum = None::<f64>;
        let mut modules: Vec<ModuleStep> = self
            .modules
            .iter()
            .zip(hook_hits)
            .map(|(module, &hits)| {
                let sum = module
                    .params
                    .iter()
                    .filter_map(|&i| sumsq[i])
                    .fold(None, |acc: Option<f64>, s| Some(acc.unwrap_or(0.0) + s));
                if let Some(s) = sum
                    && params[module.params[0]].group == "qwen"
                {
                    qwen_sum = Some(qwen_sum.unwrap_or(0.0) + s);
                }
                ModuleStep {
                    module: module.name.clone(),
                    grad_norm: sum.map(|s| Float(s.sqrt())),
                    hook_hits: Some(hits),
                    ..Default::default()
                }
            })
            .collect();
        modules.extend(attention_modules(attention.0, attention.1));
        let param_steps: Vec<ParamStep> = if !norm_weights {
            // Not measured on this step: the gradient norms alone.
            self.watched
                .params()
                .iter()
                .map(|&i| ParamStep {
                    name: params[i].name.clone(),
                    grad_norm: sumsq[i].map(|s| Float(s.sqrt())),
                    ..Default::default()
                })
                .collect()
        } else {
            let stats = self.watched.decode(host_b, has_intended);
            self.watched
                .params()
                .iter()
                .zip(stats)
                .map(|(&i, stats)| {
                    let mut param = ParamStep {
                        name: params[i].name.clone(),
                        grad_norm: sumsq[i].map(|s| Float(s.sqrt())),
                        update_norm: Some(norm((stats.update_squared as f64).sqrt())),
                        drift: Some(norm(stats.drift as f64)),
                        mean: Some(Float(stats.mean as f64)),
                        ..Default::default()
                    };
                    if let Some([squared, max_ulp, nonzero, rounded]) = stats.intended {
                        param.intended_update_norm = Some(norm((squared as f64).sqrt()));
                        param.intended_update_max_ulp = Some(norm(max_ulp as f64));
                        param.intended_nonzero = Some(nonzero as u64);
                        param.rounded_away = Some(rounded as u64);
                    }
                    param
                })
                .collect()
        };
        let scaler = self.scaler.map(|s| ScalerState {
            scale: Some(Float(s.scale)),
            growth_tracker: Some(s.growth_tracker),
            found_inf,
            step_skipped: Some(skipped),
        });
        let record = StepRecord {
            step,
            time: Some(Timestamp::now()),
            loss: Some(Float(loss)),
            lr: Some(Float(lr)),
            lrs: [(PARAM_GROUP.to_owned(), Float(lr))].into_iter().collect(),
            modules,
            params: param_steps,
            scaler,
            gpu: Vec::new(),
            metrics: [("accuracy".to_owned(), Some(Float(accuracy)))]
                .into_iter()
                .collect(),
            // The reporter fills it in when its spool has dropped records.
            dropped_steps: None,
            ..Default::default()
        };
        StepOutput {
            loss,
            accuracy: Some(accuracy),
            qwen_grad_norm: qwen_sum.map(f64::sqrt).or(Some(0.0)),
            record: Some(record),
        }
    }
}

/// What one step's transfers brought to the host.
struct Measured<'a> {
    lr: f64,
    host_a: &'a [f32],
    host_b: &'a [f32],
    has_grad: &'a [bool],
    /// Per module: how many of its outputs backward reached.
    hook_hits: &'a [u32],
    /// Per watched parameter: whether `host_b` holds its intended-update summary.
    has_intended: &'a [bool],
    /// Whether the norm weights' statistics were measured on this step.
    norm_weights: bool,
    /// Per attention call: its module, and on the host its two statistics in a row.
    attention: (&'a [String], &'a [f32]),
}

/// The attention modules' entries of a record: each module's largest logit and
/// smallest head entropy over its calls this step (`values`: two per call, in the
/// order of `calls`). They own no parameter, so they carry no gradient norm.
fn attention_modules(calls: &[String], values: &[f32]) -> Vec<ModuleStep> {
    let mut modules: Vec<ModuleStep> = Vec::new();
    for (module, pair) in calls.iter().zip(values.chunks_exact(2)) {
        let (logit, entropy) = (pair[0] as f64, pair[1] as f64);
        match modules.iter_mut().find(|m| &m.module == module) {
            Some(entry) => {
                let top = entry.attn_max_logit.map_or(logit, |t| t.0.max(logit));
                let low = entry.attn_min_entropy.map_or(entropy, |l| l.0.min(entropy));
                entry.attn_max_logit = Some(Float(top));
                entry.attn_min_entropy = Some(norm(low));
            }
            None => modules.push(ModuleStep {
                module: module.clone(),
                attn_max_logit: Some(Float(logit)),
                attn_min_entropy: Some(norm(entropy)),
                ..Default::default()
            }),
        }
    }
    modules
}

/// A norm-like reading as the protocol takes it: never negative. A reduction that
/// went wrong on a non-finite input is sent as NaN, which is what it is.
fn norm(value: f64) -> Float {
    if value.is_nan() || value < 0.0 {
        Float(f64::NAN)
    } else {
        Float(value)
    }
}

/// Whether every gradient is finite: their sums of squares, computed `how` the
/// instrumented step computes them, in one transfer.
fn all_finite(
    vars: &[Var],
    grads: &candle_core::backprop::GradStore,
    how: GradSums,
) -> candle_core::Result<bool> {
    let present: Vec<&Tensor> = vars.iter().filter_map(|v| grads.get(v)).collect();
    if present.is_empty() {
        return Ok(true);
    }
    let sums = grad_sums::sums_of_squares(&present, how)?;
    Ok(Tensor::cat(&sums, 0)?
        .to_vec1::<f32>()?
        .iter()
        .all(|v| v.is_finite()))
}
