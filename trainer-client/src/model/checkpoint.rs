//! Hugging Face checkpoint folders: `config.json` and `model.safetensors`, or a
//! sharded `model.safetensors.index.json`. Tensor names map between HF's layout
//! (`model.layers.0…`, `lm_head.weight`) and the trainer's (`qwen.layers.0…`).

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use anyhow::Context;
use candle_core::{Device, Tensor};
use serde::Deserialize;

use super::HybridModel;
use super::config::Qwen2Config;

/// A checkpoint's configuration and tensors, named in the trainer's layout.
pub struct Loaded {
    pub config: Qwen2Config,
    pub tensors: HashMap<String, Tensor>,
}

/// The HF name of a trainer parameter name.
pub fn hf_name(name: &str) -> String {
    match name.strip_prefix("qwen.") {
        Some("lm_head.weight") => "lm_head.weight".to_owned(),
        Some(rest) => format!("model.{rest}"),
        None => name.to_owned(),
    }
}

/// The trainer name of an HF tensor name, or `None` for tensors the model does not use.
pub fn trainer_name(hf: &str) -> Option<String> {
    if hf == "lm_head.weight" {
        return Some("qwen.lm_head.weight".to_owned());
    }
    hf.strip_prefix("model.").map(|rest| format!("qwen.{rest}"))
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

pub fn load(dir: &Path, device: &Device) -> anyhow::Result<Loaded> {
    let config_path = dir.join("config.json");
    let config_text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("reading {}", config_path.display()))?;
    let config: Qwen2Config = serde_json::from_str(&config_text)
        .with_context(|| format!("parsing {}", config_path.display()))?;
    config
        .validate()
        .with_context(|| format!("checking {}", config_path.display()))?;

    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<std::path::PathBuf> = if single.exists() {
        vec![single]
    } else if index.exists() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("reading {}", index.display()))?;
        let index: ShardIndex =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", index.display()))?;
        let shards: BTreeSet<&String> = index.weight_map.values().collect();
        shards.into_iter().map(|f| dir.join(f)).collect()
    } else {
        anyhow::bail!(
            "{} has neither model.safetensors nor model.safetensors.index.json",
            dir.display()
        );
    };
    let mut tensors = HashMap::new();
    for file in files {
        let loaded = candle_core::safetensors::load(&file, device)
            .with_context(|| format!("loading {}", file.display()))?;
        for (hf, tensor) in loaded {
            if let Some(name) = trainer_name(&hf) {
                tensors.insert(name, tensor);
            }
        }
    }
    if config.tie_word_embeddings {
        tensors.remove("qwen.lm_head.weight");
    }
    Ok(Loaded { config, tensors })
}

/// Writes the Qwen part of `model` as an HF checkpoint folder (f32 tensors), with a
/// `config.json` that `transformers.Qwen2ForCausalLM` reads.
pub fn save(model: &HybridModel, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let c = &model.qwen.config;
    let config = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "use_sliding_window": false,
        "attention_dropout": 0.0,
        "torch_dtype": "float32"
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )
    .with_context(|| format!("writing {}/config.json", dir.display()))?;
    let mut tensors = HashMap::new();
    for param in model.store.iter().filter(|p| p.group == "qwen") {
        tensors.insert(
            hf_name(&param.name),
            param.var.as_tensor().to_dtype(candle_core::DType::F32)?,
        );
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))
        .with_context(|| format!("writing {}/model.safetensors", dir.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        for (trainer, hf) in [
            ("qwen.embed_tokens.weight", "model.embed_tokens.weight"),
            (
                "qwen.layers.3.self_attn.q_proj.bias",
                "model.layers.3.self_attn.q_proj.bias",
            ),
            ("qwen.norm.weight", "model.norm.weight"),
            ("qwen.lm_head.weight", "lm_head.weight"),
        ] {
            assert_eq!(hf_name(trainer), hf);
            assert_eq!(trainer_name(hf).as_deref(), Some(trainer));
        }
        assert_eq!(trainer_name("visual.patch_embed.weight"), None);
    }
}
