//! Writes the tiny random Qwen2 checkpoint the reference check uses, in the Hugging
//! Face layout: `cargo run -p gradflow-trainer --example reference_checkpoint -- DIR`.
//! See tests/reference/README.md.

use candle_core::{DType, Device};
use gradflow_trainer::model::config::Preset;
use gradflow_trainer::model::{HybridModel, checkpoint};

fn main() -> anyhow::Result<()> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "tests/reference/tiny-qwen2".into());
    let mut preset = Preset::named("tiny")?;
    // Untied would test lm_head too, but Qwen2.5's small models tie; keep their layout.
    preset.qwen.tie_word_embeddings = true;
    let model = HybridModel::random(&preset, DType::F32, &Device::Cpu, 42)?;
    // Make the norm weights and biases non-trivial, so the check covers them.
    for param in model.store.iter().filter(|p| p.group == "qwen") {
        let t = param.var.as_tensor();
        let noise = (t.randn_like(0.0, 0.1)? + t)?;
        if matches!(
            param.role,
            gradflow_protocol::Role::Norm | gradflow_protocol::Role::Bias
        ) {
            param.var.set(&noise)?;
        }
    }
    checkpoint::save(&model, std::path::Path::new(&dir))?;
    println!("wrote {dir}");
    Ok(())
}
