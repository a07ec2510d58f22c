//! Building blocks written with differentiable primitive ops only.
//!
//! candle's fused kernels (`candle_nn::ops::rms_norm`, `softmax_last_dim`,
//! `rotary_emb::rope`, and `RmsNorm::forward` on contiguous input) build outputs
//! without a backward op: used in a training step, gradients silently stop at them.
//! Everything here is composed of ops candle differentiates.

use candle_core::{D, DType, Result, Tensor};

/// `x @ wᵀ + b` over the last dimension, for inputs of any rank.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let y = x.broadcast_matmul(&weight.t()?)?;
    match bias {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// At least f32: what reductions and normalisations are computed in (HF upcasts
/// half-precision activations to f32; f64 stays f64 for gradient checks).
pub fn upcast(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Qwen2's RMSNorm as Hugging Face computes it: normalise in f32, cast back to the
/// input dtype, then scale by the weight.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(upcast(dtype))?;
    let variance = x32.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = x32.broadcast_div(&(variance + eps)?.sqrt()?)?;
    normed.to_dtype(dtype)?.broadcast_mul(weight)
}

/// Softmax over the last dimension, computed in f32 (as HF does for attention) and
/// cast back.
pub fn softmax_f32(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    candle_nn::ops::softmax(&x.to_dtype(upcast(dtype))?, D::Minus1)?.to_dtype(dtype)
}

/// Rotary position embedding, `x·cos + rotate_half(x)·sin`, for `x` of shape
/// `(batch, heads, seq, head_dim)` and `cos`/`sin` of shape `(seq, head_dim)`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// The cos and sin tables of RoPE for positions `0..seq`, `(seq, head_dim)` in f32.
pub fn rope_tables(
    seq: usize,
    head_dim: usize,
    theta: f64,
    device: &candle_core::Device,
) -> Result<(Tensor, Tensor)> {
    let inv_freq: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64) as f32)
        .collect();
    let inv_freq = Tensor::from_vec(inv_freq, (1, head_dim / 2), device)?;
    let positions = Tensor::arange(0u32, seq as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((seq, 1))?;
    let freqs = positions.broadcast_mul(&inv_freq)?;
    let emb = Tensor::cat(&[&freqs, &freqs], D::Minus1)?;
    Ok((emb.cos()?, emb.sin()?))
}

/// Repeats key/value heads for grouped-query attention: `(b, kv, s, d)` →
/// `(b, kv·n_rep, s, d)`.
pub fn repeat_kv(x: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, kv, s, d) = x.dims4()?;
    x.unsqueeze(2)?
        .broadcast_as((b, kv, n_rep, s, d))?
        .reshape((b, kv * n_rep, s, d))
}

/// The causal mask `(seq, seq)`: 0 on and below the diagonal, −∞ above.
pub fn causal_mask(seq: usize, dtype: DType, device: &candle_core::Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..seq)
        .flat_map(|i| (0..seq).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Tensor::from_vec(mask, (seq, seq), device)?.to_dtype(dtype)
}
