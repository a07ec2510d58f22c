//! The layers both models are built from; each records its output in the trace.

use candle_core::{Result, Tensor, Var};
use gradflow_protocol::Role;

use super::ops::{linear, rms_norm};
use super::{ParamSource, Trace, cast};

/// A linear layer `x Wᵀ + b` whose output is recorded in the trace.
pub struct Linear {
    pub module: String,
    pub weight: Var,
    pub bias: Option<Var>,
}

impl Linear {
    pub fn new(
        source: &mut dyn ParamSource,
        module: String,
        out: usize,
        input: usize,
        bias: bool,
    ) -> anyhow::Result<Linear> {
        let weight = source.param(&format!("{module}.weight"), Role::Linear, &[out, input])?;
        let bias = if bias {
            Some(source.param(&format!("{module}.bias"), Role::Bias, &[out])?)
        } else {
            None
        };
        Ok(Linear {
            module,
            weight,
            bias,
        })
    }

    pub fn forward(&self, x: &Tensor, trace: &mut Trace) -> Result<Tensor> {
        let dtype = trace.compute;
        let bias = self.bias.as_ref().map(|b| cast(b, dtype)).transpose()?;
        let y = linear(x, &cast(&self.weight, dtype)?, bias.as_ref())?;
        trace.record(&self.module, y)
    }
}

/// Qwen2's RMSNorm, output recorded in the trace.
pub struct RmsNorm {
    pub module: String,
    pub weight: Var,
    pub eps: f64,
}

impl RmsNorm {
    pub fn new(
        source: &mut dyn ParamSource,
        module: String,
        size: usize,
        eps: f64,
    ) -> anyhow::Result<RmsNorm> {
        let weight = source.param(&format!("{module}.weight"), Role::Norm, &[size])?;
        Ok(RmsNorm {
            module,
            weight,
            eps,
        })
    }

    pub fn forward(&self, x: &Tensor, trace: &mut Trace) -> Result<Tensor> {
        let y = rms_norm(x, &cast(&self.weight, trace.compute)?, self.eps)?;
        trace.record(&self.module, y)
    }
}
