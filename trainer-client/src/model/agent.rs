//! The agent: reads the prompt embedding the LLM wrote and an input grid, and predicts
//! the output grid's cells (10 colours).
//!
//! Cells are embedded with their position; the projected prompt is added to every
//! cell and also chooses, by softmax, a mix of learned cell-mixing matrices (a flip
//! or a shift moves colours between cells, and which one the prompt says). Residual
//! MLP blocks with RMSNorm follow, then a per-cell head. Without the prompt the agent
//! can learn colour statistics but cannot know which transformation to apply, which
//! is what makes a cut from Qwen matter.

use candle_core::{D, DType, Result, Tensor, Var};
use gradflow_protocol::Role;

use super::config::{AgentConfig, COLOURS};
use super::layers::{Linear, RmsNorm};
use super::ops::softmax_f32;
use super::{ParamSource, cast, trace};

struct Block {
    norm: RmsNorm,
    up: Linear,
    down: Linear,
}

pub struct Agent {
    pub config: AgentConfig,
    /// The names of the modules that hold a bare parameter (`agent.mixer`), for
    /// recording their outputs.
    cell_embed_module: String,
    pos_embed_module: String,
    mixer_module: String,
    cell_embed: Var,
    pos_embed: Var,
    prompt_proj: Linear,
    mix_select: Linear,
    mixer: Var,
    blocks: Vec<Block>,
    norm: RmsNorm,
    head: Linear,
}

impl Agent {
    /// `prompt_width`: the width of the prompt embedding (Qwen's hidden size).
    pub fn new(
        config: AgentConfig,
        prompt_width: usize,
        prefix: &str,
        source: &mut dyn ParamSource,
    ) -> anyhow::Result<Agent> {
        let d = config.hidden;
        let cells = config.grid_side * config.grid_side;
        let m = |name: &str| format!("{prefix}.{name}");
        let cell_embed = source.param(&m("cell_embed.weight"), Role::Embedding, &[COLOURS, d])?;
        let pos_embed = source.param(&m("pos_embed.weight"), Role::Embedding, &[cells, d])?;
        let prompt_proj = Linear::new(source, m("prompt_proj"), d, prompt_width, true)?;
        let mix_select = Linear::new(source, m("mix_select"), config.mixers, d, true)?;
        let mixer = source.param(
            &m("mixer.weight"),
            Role::Other,
            &[config.mixers, cells, cells],
        )?;
        let mut blocks = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            blocks.push(Block {
                norm: RmsNorm::new(source, m(&format!("layers.{i}.norm")), d, 1e-6)?,
                up: Linear::new(
                    source,
                    m(&format!("layers.{i}.mlp.up_proj")),
                    2 * d,
                    d,
                    false,
                )?,
                down: Linear::new(
                    source,
                    m(&format!("layers.{i}.mlp.down_proj")),
                    d,
                    2 * d,
                    false,
                )?,
            });
        }
        let norm = RmsNorm::new(source, m("norm"), d, 1e-6)?;
        let head = Linear::new(source, m("head"), COLOURS, d, true)?;
        Ok(Agent {
            config,
            cell_embed_module: m("cell_embed"),
            pos_embed_module: m("pos_embed"),
            mixer_module: m("mixer"),
            cell_embed,
            pos_embed,
            prompt_proj,
            mix_select,
            mixer,
            blocks,
            norm,
            head,
        })
    }

    /// Cell logits `(batch, cells, 10)` for grids `(batch, cells)` of colour ids and
    /// prompt embeddings `(batch, prompt_width)`.
    pub fn forward(&self, grids: &Tensor, prompt: &Tensor, dtype: DType) -> Result<Tensor> {
        let (batch, cells) = grids.dims2()?;
        let d = self.config.hidden;
        let cells_embedded = cast(&self.cell_embed, dtype)?
            .index_select(&grids.flatten_all()?, 0)?
            .reshape((batch, cells, d))?;
        trace::record(&self.cell_embed_module, &cells_embedded);
        let positions = cast(&self.pos_embed, dtype)?;
        trace::record(&self.pos_embed_module, &positions);

        let x = cells_embedded.broadcast_add(&positions)?;

        let p = self.prompt_proj.forward(&prompt.to_dtype(dtype)?, dtype)?;
        let x = x.broadcast_add(&p.unsqueeze(1)?)?;
        let choice = softmax_f32(&self.mix_select.forward(&p, dtype)?)?;
        let mixers = cast(&self.mixer, dtype)?;
        trace::record(&self.mixer_module, &mixers);
        let mixing = choice
            .reshape((batch, self.config.mixers, 1, 1))?
            .broadcast_mul(&mixers.unsqueeze(0)?)?
            .sum(1)?;

        let mut x = (&x + mixing.matmul(&x.contiguous()?)?)?;
        for block in &self.blocks {
            let h = block.norm.forward(&x, dtype)?;
            let h = block.up.forward(&h, dtype)?.silu()?;
            x = (x + block.down.forward(&h, dtype)?)?;
        }
        let h = self.norm.forward(&x, dtype)?;
        self.head.forward(&h, dtype)
    }
}

/// Mean over the sequence: `(batch, seq, hidden)` → `(batch, hidden)`.
pub fn mean_pool(hidden: &Tensor) -> Result<Tensor> {
    hidden.mean(D::Minus2)
}
