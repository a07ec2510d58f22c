//! The Qwen2 decoder: token embedding, RMSNorm, grouped-query attention with RoPE and
//! a causal mask, q/k/v biases, SwiGLU MLP, final norm, tied embeddings. Parameter
//! names follow the Hugging Face layout under `qwen.` (`model.` in HF checkpoints).

use candle_core::{D, DType, Result, Tensor, Var};
use gradflow_protocol::Role;

use super::config::Qwen2Config;
use super::layers::{Linear, RmsNorm};
use super::ops::{causal_mask, linear, repeat_kv, rope, rope_tables, softmax_f32};
use super::{ParamSource, cast, trace};

struct DecoderLayer {
    /// The attention module's name (`qwen.layers.N.self_attn`), under which its
    /// statistics are recorded.
    attention: String,
    input_layernorm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    post_attention_layernorm: RmsNorm,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

pub struct Qwen2 {
    pub config: Qwen2Config,
    embed_module: String,
    embed: Var,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Option<Var>,
}

impl Qwen2 {
    /// Builds the decoder, taking every parameter from `source` under `prefix`
    /// (`qwen`).
    pub fn new(
        config: &Qwen2Config,
        prefix: &str,
        source: &mut dyn ParamSource,
    ) -> anyhow::Result<Qwen2> {
        config.validate()?;
        let h = config.hidden_size;
        let head_dim = config.head_dim();
        let kv = config.num_key_value_heads * head_dim;
        let embed_module = format!("{prefix}.embed_tokens");
        let embed = source.param(
            &format!("{embed_module}.weight"),
            Role::Embedding,
            &[config.vocab_size, h],
        )?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let m = |name: &str| format!("{prefix}.layers.{i}.{name}");
            layers.push(DecoderLayer {
                attention: m("self_attn"),
                input_layernorm: RmsNorm::new(
                    source,
                    m("input_layernorm"),
                    h,
                    config.rms_norm_eps,
                )?,
                q_proj: Linear::new(source, m("self_attn.q_proj"), h, h, true)?,
                k_proj: Linear::new(source, m("self_attn.k_proj"), kv, h, true)?,
                v_proj: Linear::new(source, m("self_attn.v_proj"), kv, h, true)?,
                o_proj: Linear::new(source, m("self_attn.o_proj"), h, h, false)?,
                post_attention_layernorm: RmsNorm::new(
                    source,
                    m("post_attention_layernorm"),
                    h,
                    config.rms_norm_eps,
                )?,
                gate_proj: Linear::new(
                    source,
                    m("mlp.gate_proj"),
                    config.intermediate_size,
                    h,
                    false,
                )?,
                up_proj: Linear::new(source, m("mlp.up_proj"), config.intermediate_size, h, false)?,
                down_proj: Linear::new(
                    source,
                    m("mlp.down_proj"),
                    h,
                    config.intermediate_size,
                    false,
                )?,
            });
        }
        let norm = RmsNorm::new(source, format!("{prefix}.norm"), h, config.rms_norm_eps)?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(source.param(
                &format!("{prefix}.lm_head.weight"),
                Role::Linear,
                &[config.vocab_size, h],
            )?)
        };
        Ok(Qwen2 {
            config: config.clone(),
            embed_module,
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// The final hidden states `(batch, seq, hidden)` for token ids `(batch, seq)`.
    pub fn forward(&self, ids: &Tensor, dtype: DType) -> Result<Tensor> {
        let (batch, seq) = ids.dims2()?;
        let device = ids.device();
        let embed = cast(&self.embed, dtype)?;
        let embedded = embed.index_select(&ids.flatten_all()?, 0)?.reshape((
            batch,
            seq,
            self.config.hidden_size,
        ))?;
        trace::record(&self.embed_module, &embedded);
        let mut x = embedded;
        let (cos, sin) = rope_tables(seq, self.config.head_dim(), self.config.rope_theta, device)?;
        let (cos, sin) = (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?);
        let mask = causal_mask(seq, dtype, device)?;
        for layer in &self.layers {
            x = self.layer_forward(layer, &x, &cos, &sin, &mask, dtype)?;
        }
        self.norm.forward(&x, dtype)
    }

    /// Next-token logits `(batch, seq, vocab)` from hidden states (through the tied
    /// embedding, or `lm_head` when untied), in f32.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        linear(
            &hidden.to_dtype(DType::F32)?,
            &head.as_tensor().to_dtype(DType::F32)?,
            None,
        )
    }

    fn layer_forward(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        dtype: DType,
    ) -> Result<Tensor> {
        let (batch, seq, hidden) = x.dims3()?;
        let heads = self.config.num_attention_heads;
        let kv_heads = self.config.num_key_value_heads;
        let head_dim = self.config.head_dim();

        let h = layer.input_layernorm.forward(x, dtype)?;
        let split = |t: Tensor, n: usize| -> Result<Tensor> {
            t.reshape((batch, seq, n, head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = split(layer.q_proj.forward(&h, dtype)?, heads)?;
        let k = split(layer.k_proj.forward(&h, dtype)?, kv_heads)?;
        let v = split(layer.v_proj.forward(&h, dtype)?, kv_heads)?;
        let q = rope(&q, cos, sin)?;
        let k = rope(&k, cos, sin)?;
        let k = repeat_kv(&k, heads / kv_heads)?.contiguous()?;
        let v = repeat_kv(&v, heads / kv_heads)?.contiguous()?;
        let scores = (q.matmul(&k.t()?.contiguous()?)? * (1.0 / (head_dim as f64).sqrt()))?;
        let masked = scores.broadcast_add(mask)?;
        let probs = softmax_f32(&masked)?;
        if trace::attention_wanted() {
            trace::record_attention(&layer.attention, attention_statistics(&masked, &probs)?);
        }
        let attended = probs
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((batch, seq, hidden))?;
        let x = (x + layer.o_proj.forward(&attended, dtype)?)?;

        let h = layer.post_attention_layernorm.forward(&x, dtype)?;
        let gate = layer.gate_proj.forward(&h, dtype)?;
        let up = layer.up_proj.forward(&h, dtype)?;
        let mlp = layer.down_proj.forward(&(gate.silu()? * up)?, dtype)?;
        x + mlp
    }
}

/// `[max logit, min head entropy]` of one attention call, in f32, out of the graph:
/// the largest pre-softmax logit q·k/√d over the positions the mask allows (masked
/// ones are −∞), and the smallest over heads of each head's entropy −Σ p ln p
/// (nats), averaged over the batch and the queries — as the Python client measures
/// them, so that `attention_logit_growth` reads the same numbers from both.
fn attention_statistics(masked: &Tensor, probs: &Tensor) -> Result<Tensor> {
    let max_logit = masked
        .detach()
        .to_dtype(DType::F32)?
        .flatten_all()?
        .max(0)?
        .reshape(1)?;
    let p = probs.detach().to_dtype(DType::F32)?;
    // p ln p with 0 ln 0 = 0: the clamp keeps ln finite where p is 0.
    let p_ln_p = (&p * p.clamp(f32::MIN_POSITIVE, 1.0)?.log()?)?;
    let entropy = p_ln_p.sum(D::Minus1)?.neg()?; // (batch, heads, queries)
    let per_head = entropy.mean(2)?.mean(0)?;
    let min_entropy = per_head.min(0)?.reshape(1)?;
    Tensor::cat(&[max_logit, min_entropy], 0)
}
