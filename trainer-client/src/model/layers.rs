//! The layers both models are built from.

use candle_core::{DType, Result, Tensor, Var};
use gradflow_protocol::Role;

use super::ops::{linear, rms_norm};
use super::{ParamSource, cast, trace};

/// A linear layer `x Wᵀ + b`, computed in the given dtype.
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

    pub fn forward(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let bias = self.bias.as_ref().map(|b| cast(b, dtype)).transpose()?;
        let output = linear(x, &cast(&self.weight, dtype)?, bias.as_ref())?;
        trace::record(&self.module, &output);
        Ok(output)
    }
}

/// Qwen2's RMSNorm.
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

    pub fn forward(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let output = rms_norm(x, &cast(&self.weight, dtype)?, self.eps)?;
        trace::record(&self.module, &output);
        Ok(output)
    }
}
