//! The Qwen2 implementation against Hugging Face transformers: the committed fixture
//! (tests/reference/, made by generate.py with transformers' Qwen2ForCausalLM from
//! the same tiny checkpoint) must agree with what this crate computes, in f32, to a
//! relative error of 1e-4: logits, the causal-LM loss, and every parameter's
//! gradient norm.

use std::path::PathBuf;

use candle_core::{D, DType, Device, Tensor};
use gradflow_trainer::model::config::Preset;
use gradflow_trainer::model::{HybridModel, checkpoint};
use serde_json::Value;

fn reference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/reference")
}

fn relative(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

#[test]
fn qwen2_matches_hugging_face_transformers() {
    let dir = reference_dir();
    let fixture: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("fixture.json")).unwrap()).unwrap();
    let preset = Preset::named("tiny").unwrap();
    let model = HybridModel::from_checkpoint(
        &dir.join("tiny-qwen2"),
        &preset,
        DType::F32,
        &Device::Cpu,
        0,
    )
    .unwrap();
    let ids: Vec<Vec<u32>> = serde_json::from_value(fixture["ids"].clone()).unwrap();
    let (batch, seq) = (ids.len(), ids[0].len());
    let ids = Tensor::new(ids, &Device::Cpu).unwrap();

    let hidden = model.qwen.forward(&ids, DType::F32).unwrap();
    let logits = model.qwen.logits(&hidden).unwrap();
    let ours: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
    let theirs: Vec<f64> = serde_json::from_value(fixture["logits"].clone()).unwrap();
    assert_eq!(ours.len(), theirs.len());
    let largest = theirs.iter().fold(0f64, |m, x| m.max(x.abs()));
    let worst = ours
        .iter()
        .zip(&theirs)
        .fold(0f64, |m, (a, b)| m.max((*a as f64 - b).abs()));
    assert!(
        worst / largest <= 1e-4,
        "logits differ by up to {worst:e} (largest logit {largest:e})"
    );

    // transformers' causal-LM loss: predict token t+1 from position t, mean over tokens.
    let vocab = logits.dim(D::Minus1).unwrap();
    let predicted = logits
        .narrow(1, 0, seq - 1)
        .unwrap()
        .reshape((batch * (seq - 1), vocab))
        .unwrap();
    let targets = ids.narrow(1, 1, seq - 1).unwrap().flatten_all().unwrap();
    let loss = candle_nn::loss::cross_entropy(&predicted, &targets).unwrap();
    let ours_loss = loss.to_scalar::<f32>().unwrap() as f64;
    let theirs_loss = fixture["loss"].as_f64().unwrap();
    assert!(
        relative(ours_loss, theirs_loss) <= 1e-4,
        "loss {ours_loss} vs {theirs_loss}"
    );

    let grads = loss.backward().unwrap();
    let theirs_grads = fixture["grad_norms"].as_object().unwrap();
    let mut compared = 0;
    for param in model.store.iter().filter(|p| p.group == "qwen") {
        let name = checkpoint::hf_name(&param.name);
        let theirs = theirs_grads[&name]
            .as_f64()
            .unwrap_or_else(|| panic!("no reference for {name}"));
        let ours = grads
            .get(&param.var)
            .unwrap_or_else(|| panic!("no gradient for {name}"))
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .sqrt()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64;
        assert!(
            relative(ours, theirs) <= 1e-4,
            "{name}: gradient norm {ours:e} vs {theirs:e}"
        );
        compared += 1;
    }
    assert_eq!(
        compared,
        theirs_grads.len(),
        "every parameter transformers has is compared"
    );
}
