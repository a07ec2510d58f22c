//! Procedurally generated ARC-like tasks: an input grid of colours, a text prompt
//! saying which transformation to apply, and the output grid it produces.

use rand::Rng;

use crate::model::config::COLOURS;

/// What a task asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transform {
    Recolour { from: u8, to: u8 },
    FlipLeftRight,
    FlipTopBottom,
    ShiftRight,
    ShiftDown,
    Transpose,
}

impl Transform {
    pub fn random(rng: &mut impl Rng) -> Transform {
        match rng.gen_range(0..6) {
            0 => {
                let from = rng.gen_range(1..COLOURS as u8);
                let mut to = rng.gen_range(1..COLOURS as u8);
                if to == from {
                    to = to % (COLOURS as u8 - 1) + 1;
                }
                Transform::Recolour { from, to }
            }
            1 => Transform::FlipLeftRight,
            2 => Transform::FlipTopBottom,
            3 => Transform::ShiftRight,
            4 => Transform::ShiftDown,
            _ => Transform::Transpose,
        }
    }

    /// The prompt a person would write.
    pub fn prompt(self) -> String {
        match self {
            Transform::Recolour { from, to } => format!("recolour every {from} to {to}"),
            Transform::FlipLeftRight => "flip the grid left to right".into(),
            Transform::FlipTopBottom => "flip the grid top to bottom".into(),
            Transform::ShiftRight => "shift every cell one to the right".into(),
            Transform::ShiftDown => "shift every cell one row down".into(),
            Transform::Transpose => "transpose the grid".into(),
        }
    }

    /// Applies the transformation to a `side × side` grid in row-major order.
    pub fn apply(self, grid: &[u8], side: usize) -> Vec<u8> {
        let at = |r: usize, c: usize| grid[r * side + c];
        let mut out = vec![0u8; grid.len()];
        for r in 0..side {
            for c in 0..side {
                out[r * side + c] = match self {
                    Transform::Recolour { from, to } => {
                        let v = at(r, c);
                        if v == from { to } else { v }
                    }
                    Transform::FlipLeftRight => at(r, side - 1 - c),
                    Transform::FlipTopBottom => at(side - 1 - r, c),
                    Transform::ShiftRight => at(r, (c + side - 1) % side),
                    Transform::ShiftDown => at((r + side - 1) % side, c),
                    Transform::Transpose => at(c, r),
                };
            }
        }
        out
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    pub transform: Transform,
    pub prompt: String,
    pub input: Vec<u8>,
    pub output: Vec<u8>,
}

impl Task {
    /// A random task on a `side × side` grid: background 0 with about 40 % of the
    /// cells coloured.
    pub fn random(rng: &mut impl Rng, side: usize) -> Task {
        let transform = Transform::random(rng);
        let mut input: Vec<u8> = (0..side * side)
            .map(|_| {
                if rng.gen_bool(0.4) {
                    rng.gen_range(1..COLOURS as u8)
                } else {
                    0
                }
            })
            .collect();
        if let Transform::Recolour { from, .. } = transform {
            // Make sure the colour to change is there.
            let cell = rng.gen_range(0..input.len());
            input[cell] = from;
        }
        let output = transform.apply(&input, side);
        Task {
            transform,
            prompt: transform.prompt(),
            input,
            output,
        }
    }
}

/// A batch of tasks as tensors: prompt ids `(B, L)`, input grids `(B, cells)`,
/// target colours `(B·cells)`.
pub struct Batch {
    pub ids: candle_core::Tensor,
    pub grids: candle_core::Tensor,
    pub targets: candle_core::Tensor,
}

impl Batch {
    pub fn new(
        tasks: &[Task],
        preset: &crate::model::config::Preset,
        tokenizer: &Tokenizer,
        device: &candle_core::Device,
    ) -> candle_core::Result<Batch> {
        use candle_core::Tensor;
        let cells = preset.agent.grid_side * preset.agent.grid_side;
        let ids: Vec<u32> = tasks
            .iter()
            .flat_map(|t| tokenizer.encode(&t.prompt, preset.prompt_len))
            .collect();
        let grids: Vec<u32> = tasks
            .iter()
            .flat_map(|t| t.input.iter().map(|&c| c as u32))
            .collect();
        let targets: Vec<u32> = tasks
            .iter()
            .flat_map(|t| t.output.iter().map(|&c| c as u32))
            .collect();
        Ok(Batch {
            ids: Tensor::from_vec(ids, (tasks.len(), preset.prompt_len), device)?,
            grids: Tensor::from_vec(grids, (tasks.len(), cells), device)?,
            targets: Tensor::from_vec(targets, tasks.len() * cells, device)?,
        })
    }
}

/// Token ids for prompts.
pub enum Tokenizer {
    /// One id per byte (id = byte + 4; 0 pad, 1 beginning of text): needs no files.
    Bytes,
    /// A Hugging Face `tokenizer.json`, padded with `pad`.
    Hf {
        tokenizer: Box<tokenizers::Tokenizer>,
        pad: u32,
    },
}

pub const PAD: u32 = 0;
pub const BOS: u32 = 1;

impl Tokenizer {
    /// The tokenizer of a checkpoint folder: its `tokenizer.json`, or the byte-level
    /// one when it has none.
    pub fn for_checkpoint(dir: &std::path::Path, vocab_size: usize) -> anyhow::Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            tracing::info!(dir = %dir.display(), "no tokenizer.json: prompts use the byte-level tokenizer");
            return Ok(Tokenizer::Bytes);
        }
        let tokenizer = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| anyhow::anyhow!("loading {}: {e}", path.display()))?;
        let size = tokenizer.get_vocab_size(true);
        anyhow::ensure!(
            size <= vocab_size,
            "{} has {size} tokens, more than the model's vocabulary of {vocab_size}",
            path.display()
        );
        // Qwen pads with <|endoftext|>.
        let pad = ["<|endoftext|>", "<pad>", "[PAD]"]
            .iter()
            .find_map(|t| tokenizer.token_to_id(t))
            .unwrap_or(0);
        Ok(Tokenizer::Hf {
            tokenizer: Box::new(tokenizer),
            pad,
        })
    }

    /// `text` as exactly `len` ids, padded (or truncated). The byte-level tokenizer
    /// starts with a beginning-of-text id.
    pub fn encode(&self, text: &str, len: usize) -> Vec<u32> {
        let (mut ids, pad) = match self {
            Tokenizer::Bytes => {
                let mut ids = Vec::with_capacity(len);
                ids.push(BOS);
                ids.extend(text.bytes().map(|b| b as u32 + 4));
                (ids, PAD)
            }
            Tokenizer::Hf { tokenizer, pad } => {
                let ids = tokenizer
                    .encode(text, false)
                    .map(|e| e.get_ids().to_vec())
                    .unwrap_or_default();
                (ids, *pad)
            }
        };
        ids.resize(len, pad);
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn transforms_do_what_their_prompt_says() {
        let grid: Vec<u8> = (0..9).collect(); // 0 1 2 / 3 4 5 / 6 7 8
        assert_eq!(
            Transform::FlipLeftRight.apply(&grid, 3),
            [2, 1, 0, 5, 4, 3, 8, 7, 6]
        );
        assert_eq!(
            Transform::FlipTopBottom.apply(&grid, 3),
            [6, 7, 8, 3, 4, 5, 0, 1, 2]
        );
        assert_eq!(
            Transform::ShiftRight.apply(&grid, 3),
            [2, 0, 1, 5, 3, 4, 8, 6, 7]
        );
        assert_eq!(
            Transform::ShiftDown.apply(&grid, 3),
            [6, 7, 8, 0, 1, 2, 3, 4, 5]
        );
        assert_eq!(
            Transform::Transpose.apply(&grid, 3),
            [0, 3, 6, 1, 4, 7, 2, 5, 8]
        );
        assert_eq!(
            Transform::Recolour { from: 4, to: 9 }.apply(&grid, 3),
            [0, 1, 2, 3, 9, 5, 6, 7, 8]
        );
    }

    #[test]
    fn random_tasks_are_consistent_and_reproducible() {
        let mut a = rand::rngs::StdRng::seed_from_u64(7);
        let mut b = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..50 {
            let task = Task::random(&mut a, 5);
            assert_eq!(task, Task::random(&mut b, 5));
            assert_eq!(task.output, task.transform.apply(&task.input, 5));
            assert!(task.input.iter().all(|c| (*c as usize) < COLOURS));
        }
    }

    #[test]
    fn byte_prompts_have_a_fixed_length() {
        let ids = Tokenizer::Bytes.encode("flip", 8);
        assert_eq!(
            ids,
            [
                BOS,
                b'f' as u32 + 4,
                b'l' as u32 + 4,
                b'i' as u32 + 4,
                b'p' as u32 + 4,
                0,
                0,
                0
            ]
        );
        assert_eq!(Tokenizer::Bytes.encode("a long prompt", 4).len(), 4);
    }
}
