//! The hybrid model: a Qwen2 decoder encodes a task prompt into a prompt embedding
//! (the mean of its final hidden states) that the agent consumes.
//!
//! # Layout
//!
//! - [`config`]: presets and the Qwen2 configuration.
//! - [`params`]: every parameter by name, in its master dtype.
//! - [`ops`]: differentiable building blocks (RMSNorm, RoPE, softmax, GQA).
//! - [`layers`]: linear and norm layers that record their outputs.
//! - [`trace`]: which modules' outputs backward reached (hook hits).
//! - [`qwen2`], [`agent`]: the two models.
//! - [`checkpoint`]: Hugging Face checkpoint folders.

pub mod agent;
pub mod checkpoint;
pub mod config;
pub mod layers;
pub mod ops;
pub mod params;
pub mod qwen2;
pub mod trace;

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor, Var};
use gradflow_protocol::Role;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use agent::Agent;
use config::Preset;
use params::ParamStore;
use qwen2::Qwen2;

/// A variable's value in the compute dtype: the autocast analogue. Differentiable,
/// so gradients arrive in the master dtype.
pub fn cast(var: &Var, dtype: DType) -> Result<Tensor> {
    let tensor = var.as_tensor();
    if tensor.dtype() == dtype {
        Ok(tensor.clone())
    } else {
        tensor.to_dtype(dtype)
    }
}

/// Where parameters come from while a model is built.
pub trait ParamSource {
    fn param(&mut self, name: &str, role: Role, shape: &[usize]) -> anyhow::Result<Var>;
}

/// Fresh parameters as Hugging Face initialises Qwen2: weights Normal(0, 0.02),
/// biases 0, norm weights 1. Seeded, so a run is reproducible.
pub struct RandomInit<'a> {
    pub store: &'a mut ParamStore,
    pub dtype: DType,
    pub device: Device,
    rng: StdRng,
}

impl<'a> RandomInit<'a> {
    pub fn new(store: &'a mut ParamStore, dtype: DType, device: Device, seed: u64) -> Self {
        RandomInit {
            store,
            dtype,
            device,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    fn normal(&mut self, count: usize, std: f32) -> Vec<f32> {
        // Box–Muller: two uniforms give two independent normals.
        let mut values = Vec::with_capacity(count + 1);
        while values.len() < count {
            let u1: f32 = self.rng.gen_range(f32::EPSILON..1.0);
            let u2: f32 = self.rng.r#gen();
            let radius = (-2.0 * u1.ln()).sqrt() * std;
            let angle = std::f32::consts::TAU * u2;
            values.push(radius * angle.cos());
            values.push(radius * angle.sin());
        }
        values.truncate(count);
        values
    }
}

impl ParamSource for RandomInit<'_> {
    fn param(&mut self, name: &str, role: Role, shape: &[usize]) -> anyhow::Result<Var> {
        let count: usize = shape.iter().product();
        let values = match role {
            Role::Norm => vec![1.0f32; count],
            Role::Bias => vec![0.0f32; count],
            _ => self.normal(count, 0.02),
        };
        let tensor = Tensor::from_vec(values, shape, &self.device)?.to_dtype(self.dtype)?;
        Ok(self.store.insert(name, role, tensor)?)
    }
}

/// Parameters from a loaded checkpoint (names already in `qwen.` form); names the
/// checkpoint does not hold (the agent's) are initialised fresh.
pub struct CheckpointSource<'a> {
    pub tensors: HashMap<String, Tensor>,
    pub fresh: RandomInit<'a>,
}

impl ParamSource for CheckpointSource<'_> {
    fn param(&mut self, name: &str, role: Role, shape: &[usize]) -> anyhow::Result<Var> {
        let Some(tensor) = self.tensors.remove(name) else {
            anyhow::ensure!(
                !name.starts_with("qwen."),
                "the checkpoint has no tensor for {name} (expected {})",
                checkpoint::hf_name(name)
            );
            return self.fresh.param(name, role, shape);
        };
        anyhow::ensure!(
            tensor.dims() == shape,
            "checkpoint tensor {} has shape {:?}, the model expects {shape:?}",
            checkpoint::hf_name(name),
            tensor.dims()
        );
        let tensor = tensor
            .to_device(&self.fresh.device)?
            .to_dtype(self.fresh.dtype)?;
        Ok(self.fresh.store.insert(name, role, tensor)?)
    }
}

/// Qwen2 and the agent, with every parameter in one store.
pub struct HybridModel {
    pub store: ParamStore,
    pub qwen: Qwen2,
    pub agent: Agent,
    pub preset: Preset,
}

impl HybridModel {
    /// A randomly initialised model with master weights in `dtype`.
    pub fn random(
        preset: &Preset,
        dtype: DType,
        device: &Device,
        seed: u64,
    ) -> anyhow::Result<HybridModel> {
        let mut store = ParamStore::default();
        let (qwen, agent) = Self::build(
            preset,
            &mut RandomInit::new(&mut store, dtype, device.clone(), seed),
        )?;
        Ok(HybridModel {
            store,
            qwen,
            agent,
            preset: preset.clone(),
        })
    }

    /// Both models, every parameter taken from `source`.
    fn build(preset: &Preset, source: &mut dyn ParamSource) -> anyhow::Result<(Qwen2, Agent)> {
        let qwen = Qwen2::new(&preset.qwen, "qwen", source)?;
        let agent = Agent::new(preset.agent, preset.qwen.hidden_size, "agent", source)?;
        Ok((qwen, agent))
    }

    /// Qwen from a Hugging Face checkpoint folder (its `config.json` decides the
    /// shape), the agent fresh.
    pub fn from_checkpoint(
        dir: &std::path::Path,
        preset: &Preset,
        dtype: DType,
        device: &Device,
        seed: u64,
    ) -> anyhow::Result<HybridModel> {
        let loaded = checkpoint::load(dir, device)?;
        let mut preset = preset.clone();
        preset.qwen = loaded.config.clone();
        let mut store = ParamStore::default();
        let mut source = CheckpointSource {
            tensors: loaded.tensors,
            fresh: RandomInit::new(&mut store, dtype, device.clone(), seed),
        };
        let (qwen, agent) = Self::build(&preset, &mut source)?;
        Ok(HybridModel {
            store,
            qwen,
            agent,
            preset,
        })
    }

    /// Cross-entropy of the agent's cell predictions against `targets` `(B·cells)`,
    /// computed in at least f32, with the logits `(B·cells, 10)` it came from.
    pub fn loss(
        &self,
        ids: &Tensor,
        grids: &Tensor,
        targets: &Tensor,
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        let prompt = self.prompt_embedding(ids, dtype)?;
        let logits = self.agent.forward(grids, &prompt, dtype)?;
        let flat = logits
            .to_dtype(ops::upcast(logits.dtype()))?
            .flatten_to(1)?;
        Ok((candle_nn::loss::cross_entropy(&flat, targets)?, flat))
    }

    /// The prompt embedding `(batch, hidden)`: the mean of Qwen's final hidden states.
    pub fn prompt_embedding(&self, ids: &Tensor, dtype: DType) -> Result<Tensor> {
        agent::mean_pool(&self.qwen.forward(ids, dtype)?)
    }
}
