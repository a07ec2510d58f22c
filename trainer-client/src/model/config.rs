//! Model shapes: the presets, and the Qwen2 configuration read from a Hugging Face
//! `config.json`.

use serde::Deserialize;

/// The Qwen2 decoder's shape (the fields of HF's `Qwen2Config` the model uses).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Qwen2Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_tie")]
    pub tie_word_embeddings: bool,
}

fn default_rope_theta() -> f64 {
    1_000_000.0
}

fn default_rms_norm_eps() -> f64 {
    1e-6
}

fn default_tie() -> bool {
    true
}

impl Qwen2Config {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Checks the shape is one the model can run.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.hidden_size.is_multiple_of(self.num_attention_heads),
            "hidden_size {} is not a multiple of num_attention_heads {}",
            self.hidden_size,
            self.num_attention_heads
        );
        anyhow::ensure!(
            self.num_attention_heads
                .is_multiple_of(self.num_key_value_heads),
            "num_attention_heads {} is not a multiple of num_key_value_heads {}",
            self.num_attention_heads,
            self.num_key_value_heads
        );
        anyhow::ensure!(
            self.head_dim().is_multiple_of(2),
            "head_dim {} must be even for RoPE",
            self.head_dim()
        );
        anyhow::ensure!(
            self.vocab_size >= 260,
            "vocab_size {} cannot hold the byte-level tokenizer's 260 ids",
            self.vocab_size
        );
        Ok(())
    }
}

/// The agent's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AgentConfig {
    /// Width of the agent's cell features.
    pub hidden: usize,
    /// Residual MLP blocks.
    pub layers: usize,
    /// Side of the square grid (cells = side²).
    pub grid_side: usize,
    /// Mixing matrices the prompt chooses between.
    pub mixers: usize,
}

pub const COLOURS: usize = 10;

/// A named pair of shapes.
#[derive(Debug, Clone, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    pub qwen: Qwen2Config,
    pub agent: AgentConfig,
    /// Prompt tokens per task.
    pub prompt_len: usize,
    /// Tasks per step.
    pub batch: usize,
}

pub const PRESETS: [&str; 4] = ["tiny", "small", "qwen2.5-0.5b", "qwen2.5-1.5b"];

fn qwen(
    vocab: usize,
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv: usize,
) -> Qwen2Config {
    Qwen2Config {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
    }
}

impl Preset {
    pub fn named(name: &str) -> anyhow::Result<Preset> {
        let agent = |hidden, layers| AgentConfig {
            hidden,
            layers,
            grid_side: 5,
            mixers: 6,
        };
        let preset = match name {
            // CPU tests: a step in tens of milliseconds.
            "tiny" => Preset {
                name: "tiny",
                qwen: qwen(320, 32, 64, 2, 4, 2),
                agent: agent(32, 2),
                prompt_len: 24,
                batch: 8,
            },
            "small" => Preset {
                name: "small",
                qwen: qwen(4096, 256, 704, 4, 8, 2),
                agent: agent(128, 2),
                prompt_len: 32,
                batch: 16,
            },
            // The real shapes of Qwen2.5-0.5B and -1.5B.
            "qwen2.5-0.5b" => Preset {
                name: "qwen2.5-0.5b",
                qwen: qwen(151_936, 896, 4864, 24, 14, 2),
                agent: agent(256, 2),
                prompt_len: 32,
                batch: 8,
            },
            "qwen2.5-1.5b" => Preset {
                name: "qwen2.5-1.5b",
                qwen: qwen(151_936, 1536, 8960, 28, 12, 2),
                agent: agent(256, 2),
                prompt_len: 32,
                batch: 8,
            },
            other => anyhow::bail!("unknown preset {other:?}: one of {}", PRESETS.join(", ")),
        };
        preset.qwen.validate()?;
        Ok(preset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_the_real_ones_have_qwen_shapes() {
        for name in PRESETS {
            Preset::named(name).unwrap();
        }
        let half_b = Preset::named("qwen2.5-0.5b").unwrap().qwen;
        assert_eq!(
            (
                half_b.hidden_size,
                half_b.head_dim(),
                half_b.num_hidden_layers
            ),
            (896, 64, 24)
        );
        assert!(Preset::named("7b").is_err());
    }

    #[test]
    fn hf_config_json_parses() {
        let cfg: Qwen2Config = serde_json::from_str(
            r#"{"architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
                "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                "num_key_value_heads": 2, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
                "tie_word_embeddings": true, "torch_dtype": "bfloat16"}"#,
        )
        .unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg, Preset::named("qwen2.5-0.5b").unwrap().qwen);
    }
}
