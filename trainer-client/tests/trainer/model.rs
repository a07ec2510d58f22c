//! The model and the training step, on the tiny preset: gradients reach every tensor
//! when healthy and no Qwen tensor when the prompt is detached; backward agrees with
//! finite differences in f64; bf16 master weights freeze the norm weights that f32
//! moves; HF checkpoints load back.

use candle_core::{DType, Device, Tensor};
use gradflow_trainer::model::config::Preset;
use gradflow_trainer::model::{HybridModel, checkpoint};
use gradflow_trainer::tasks::{Batch, Task, Tokenizer};
use gradflow_trainer::train::{TrainOptions, Trainer};
use rand::SeedableRng;

fn tiny() -> Preset {
    Preset::named("tiny").unwrap()
}

fn batch(preset: &Preset, seed: u64) -> Batch {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let tasks: Vec<Task> = (0..preset.batch)
        .map(|_| Task::random(&mut rng, preset.agent.grid_side))
        .collect();
    Batch::new(&tasks, preset, &Tokenizer::Bytes, &Device::Cpu).unwrap()
}

fn options(param: DType, compute: DType) -> TrainOptions {
    TrainOptions::new(param, compute)
}

#[test]
fn a_healthy_step_gives_every_trainable_tensor_a_gradient() {
    let preset = tiny();
    let model = HybridModel::random(&preset, DType::F32, &Device::Cpu, 1).unwrap();
    let b = batch(&preset, 2);
    let (loss, _) = model
        .loss(&b.ids, &b.grids, &b.targets, DType::F32)
        .unwrap();
    let grads = loss.backward().unwrap();
    let missing: Vec<&str> = model
        .store
        .iter()
        .filter(|p| grads.get(&p.var).is_none())
        .map(|p| p.name.as_str())
        .collect();
    assert!(missing.is_empty(), "no gradient for {missing:?}");
    assert!(model.store.len() > 30, "{} tensors", model.store.len());
    // The trainer's record: every module reached by backward, with a gradient norm.
    let mut trainer = Trainer::new(model, options(DType::F32, DType::F32), &Device::Cpu).unwrap();
    let record = trainer.step(0).unwrap().record.unwrap();
    let trained: Vec<_> = record
        .modules
        .iter()
        .filter(|m| m.attn_max_logit.is_none())
        .collect();
    assert_eq!(trained.len(), trainer.model.store.modules().len());
    for module in trained {
        assert_eq!(module.hook_hits, Some(1), "{}", module.module);
        assert!(module.grad_norm.unwrap().get() > 0.0, "{}", module.module);
    }
}

#[test]
fn a_detached_prompt_leaves_every_qwen_tensor_without_a_gradient() {
    let preset = tiny();
    let model = HybridModel::random(&preset, DType::F32, &Device::Cpu, 1).unwrap();
    let b = batch(&preset, 2);
    let prompt = model.prompt_embedding(&b.ids, DType::F32).unwrap().detach();
    let logits = model.agent.forward(&b.grids, &prompt, DType::F32).unwrap();
    let loss = candle_nn::loss::cross_entropy(&logits.flatten_to(1).unwrap(), &b.targets).unwrap();
    let grads = loss.backward().unwrap();
    for param in model.store.iter() {
        let has = grads.get(&param.var).is_some();
        assert_eq!(has, param.group == "agent", "{}", param.name);
    }
    // And the trainer's record says backward never reached Qwen's modules.
    let mut opts = options(DType::F32, DType::F32);
    opts.faults.detach_prompt = true;
    let mut trainer = Trainer::new(model, opts, &Device::Cpu).unwrap();
    let record = trainer.step(0).unwrap().record.unwrap();
    // The attention modules' entries carry their statistics, not hooks or gradients.
    for module in record.modules.iter().filter(|m| m.attn_max_logit.is_none()) {
        let qwen = module.module.starts_with("qwen.");
        assert_eq!(
            module.hook_hits,
            Some(u32::from(!qwen)),
            "{}",
            module.module
        );
        assert_eq!(module.grad_norm.is_none(), qwen, "{}", module.module);
    }
}

#[test]
fn hook_hits_count_the_modules_backward_reached_on_each_step() {
    let preset = tiny();
    let model = HybridModel::random(&preset, DType::F32, &Device::Cpu, 1).unwrap();
    let mut opts = options(DType::F32, DType::F32);
    opts.qwen_every = 2; // Qwen runs on even steps; odd steps reuse its cached output
    let mut trainer = Trainer::new(model, opts, &Device::Cpu).unwrap();
    for step in 0..4u64 {
        let record = trainer.step(step).unwrap().record.unwrap();
        let (attention, trained): (Vec<_>, Vec<_>) = record
            .modules
            .iter()
            .partition(|m| m.attn_max_logit.is_some());
        // Qwen's attention is measured on the steps it runs, and only those.
        let measured = if step % 2 == 0 {
            preset.qwen.num_hidden_layers
        } else {
            0
        };
        assert_eq!(attention.len(), measured, "step {step}");
        for module in trained {
            let reached = !module.module.starts_with("qwen.") || step % 2 == 0;
            assert_eq!(
                module.hook_hits,
                Some(u32::from(reached)),
                "step {step}: {}",
                module.module
            );
        }
    }
    // Uninstrumented steps record nothing.
    let model = HybridModel::random(&preset, DType::F32, &Device::Cpu, 1).unwrap();
    let mut opts = options(DType::F32, DType::F32);
    opts.instrument = false;
    let mut trainer = Trainer::new(model, opts, &Device::Cpu).unwrap();
    assert!(trainer.step(0).unwrap().record.is_none());
}

/// Sets one element of a parameter.
fn poke(var: &candle_core::Var, index: usize, value: f64) {
    let shape = var.shape().clone();
    let mut values: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
    values[index] = value;
    var.set(&Tensor::from_vec(values, shape, &Device::Cpu).unwrap())
        .unwrap();
}

fn element(tensor: &Tensor, index: usize) -> f64 {
    tensor.flatten_all().unwrap().to_vec1::<f64>().unwrap()[index]
}

#[test]
fn backward_agrees_with_finite_differences_in_f64() {
    let preset = tiny();
    let model = HybridModel::random(&preset, DType::F64, &Device::Cpu, 3).unwrap();
    let b = batch(&preset, 4);
    let loss = |model: &HybridModel| -> f64 {
        let (loss, _) = model
            .loss(&b.ids, &b.grids, &b.targets, DType::F64)
            .unwrap();
        loss.to_scalar::<f64>().unwrap()
    };
    let (l, _) = model
        .loss(&b.ids, &b.grids, &b.targets, DType::F64)
        .unwrap();
    let grads = l.backward().unwrap();
    // One element of a tensor of every kind, on both sides of the prompt embedding.
    let probes = [
        ("qwen.embed_tokens.weight", 4 * 32 + 3),
        ("qwen.layers.0.input_layernorm.weight", 5),
        ("qwen.layers.0.self_attn.q_proj.bias", 7),
        ("qwen.layers.1.self_attn.k_proj.weight", 11),
        ("qwen.layers.1.mlp.down_proj.weight", 13),
        ("qwen.norm.weight", 2),
        ("agent.prompt_proj.weight", 17),
        ("agent.mixer.weight", 30),
        ("agent.layers.0.norm.weight", 1),
        ("agent.head.bias", 3),
    ];
    let eps = 1e-5;
    for (name, index) in probes {
        let var = &model.store.get(name).unwrap().var;
        let analytic = element(grads.get(var).unwrap(), index);
        let original = element(var.as_tensor(), index);
        poke(var, index, original + eps);
        let up = loss(&model);
        poke(var, index, original - eps);
        let down = loss(&model);
        poke(var, index, original);
        let numeric = (up - down) / (2.0 * eps);
        // Relative 1e-4, with an absolute floor for tiny gradients, where the central
        // difference's round-off (~1e-16 · loss / eps) dominates.
        let tolerance = 1e-4 * analytic.abs().max(numeric.abs()) + 1e-9;
        assert!(
            (analytic - numeric).abs() <= tolerance,
            "{name}[{index}]: backward {analytic:e}, finite difference {numeric:e}"
        );
    }
}

/// The norm weights' values after `steps` training steps.
fn norm_weights_after(param: DType, compute: DType, steps: u64) -> Vec<f32> {
    let preset = tiny();
    let model = HybridModel::random(&preset, param, &Device::Cpu, 5).unwrap();
    let mut trainer = Trainer::new(model, options(param, compute), &Device::Cpu).unwrap();
    for step in 0..steps {
        trainer.step(step).unwrap();
    }
    trainer
        .model
        .store
        .iter()
        .filter(|p| p.role == gradflow_protocol::Role::Norm)
        .flat_map(|p| {
            p.var
                .as_tensor()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .collect()
}

#[test]
fn bf16_master_weights_at_lr_3e_4_leave_norm_weights_at_exactly_one_while_f32_moves_them() {
    let bf16 = norm_weights_after(DType::BF16, DType::BF16, 5);
    assert!(
        bf16.iter().all(|w| *w == 1.0),
        "bf16 norm weights moved: {:?}",
        &bf16[..8]
    );
    let f32 = norm_weights_after(DType::F32, DType::F32, 5);
    let moved = f32.iter().filter(|w| **w != 1.0).count();
    assert!(
        moved > f32.len() * 9 / 10,
        "only {moved} of {} f32 norm weights moved",
        f32.len()
    );
    // The trainer's own record says so too: gradient > 0, update exactly 0, mean 1.
    let preset = tiny();
    let model = HybridModel::random(&preset, DType::BF16, &Device::Cpu, 5).unwrap();
    let mut trainer = Trainer::new(model, options(DType::BF16, DType::BF16), &Device::Cpu).unwrap();
    let record = trainer.step(0).unwrap().record.unwrap();
    assert!(!record.params.is_empty());
    for p in &record.params {
        assert!(p.grad_norm.unwrap().get() > 0.0, "{}", p.name);
        assert_eq!(p.update_norm.unwrap().get(), 0.0, "{}", p.name);
        assert_eq!(p.mean.unwrap().get(), 1.0, "{}", p.name);
    }
}

#[test]
fn a_hugging_face_checkpoint_round_trips_single_and_sharded() {
    let preset = tiny();
    let model = HybridModel::random(&preset, DType::F32, &Device::Cpu, 7).unwrap();
    let dir = tempfile::tempdir().unwrap();
    checkpoint::save(&model, dir.path()).unwrap();
    let b = batch(&preset, 8);
    let logits = |m: &HybridModel| -> Vec<f32> {
        let hidden = m.qwen.forward(&b.ids, DType::F32).unwrap();
        m.qwen
            .logits(&hidden)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let loaded =
        HybridModel::from_checkpoint(dir.path(), &preset, DType::F32, &Device::Cpu, 0).unwrap();
    assert_eq!(logits(&model), logits(&loaded));
    assert_eq!(loaded.store.len(), model.store.len());

    // The same tensors behind a shard index.
    std::fs::rename(
        dir.path().join("model.safetensors"),
        dir.path().join("model-00001-of-00001.safetensors"),
    )
    .unwrap();
    let names: Vec<String> = model
        .store
        .iter()
        .filter(|p| p.group == "qwen")
        .map(|p| checkpoint::hf_name(&p.name))
        .collect();
    let index = serde_json::json!({
        "weight_map": names.iter().map(|n| (n.clone(), "model-00001-of-00001.safetensors")).collect::<std::collections::HashMap<_, _>>()
    });
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let sharded =
        HybridModel::from_checkpoint(dir.path(), &preset, DType::F32, &Device::Cpu, 0).unwrap();
    assert_eq!(logits(&model), logits(&sharded));

    // A checkpoint missing a tensor says which.
    std::fs::remove_file(dir.path().join("model.safetensors.index.json")).unwrap();
    let error = HybridModel::from_checkpoint(dir.path(), &preset, DType::F32, &Device::Cpu, 0)
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("neither model.safetensors"), "{error}");
}

#[test]
fn healthy_training_lowers_the_loss() {
    let preset = tiny();
    let model = HybridModel::random(&preset, DType::F32, &Device::Cpu, 9).unwrap();
    let mut trainer = Trainer::new(model, options(DType::F32, DType::F32), &Device::Cpu).unwrap();
    let losses: Vec<f64> = (0..150).map(|s| trainer.step(s).unwrap().loss).collect();
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let (early, late) = (mean(&losses[..20]), mean(&losses[130..]));
    assert!(late < early * 0.8, "loss {early:.3} → {late:.3}");
}

#[test]
fn a_checkpoint_folder_s_tokenizer_json_encodes_the_prompts() {
    let dir = tempfile::tempdir().unwrap();
    // Without a tokenizer.json the byte-level tokenizer is used.
    assert!(matches!(
        Tokenizer::for_checkpoint(dir.path(), 320).unwrap(),
        Tokenizer::Bytes
    ));
    std::fs::write(
        dir.path().join("tokenizer.json"),
        r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "unk_token": "[UNK]",
                      "vocab": {"[UNK]": 0, "<|endoftext|>": 1, "flip": 2, "the": 3, "grid": 4}}}"#,
    )
    .unwrap();
    let tokenizer = Tokenizer::for_checkpoint(dir.path(), 320).unwrap();
    assert_eq!(tokenizer.encode("flip the grid", 6), [2, 3, 4, 1, 1, 1]);
    assert_eq!(tokenizer.encode("flip the grid left", 3), [2, 3, 4]);
    // A tokenizer larger than the model's vocabulary is refused.
    let error = Tokenizer::for_checkpoint(dir.path(), 4)
        .err()
        .unwrap()
        .to_string();
    assert!(
        error.contains("more than the model's vocabulary"),
        "{error}"
    );
    // And training runs on its ids.
    let preset = tiny();
    let model = HybridModel::random(&preset, DType::F32, &Device::Cpu, 1).unwrap();
    let mut trainer = Trainer::with_tokenizer(
        model,
        options(DType::F32, DType::F32),
        tokenizer,
        &Device::Cpu,
    )
    .unwrap();
    assert!(trainer.step(0).unwrap().loss.is_finite());
}

#[test]
fn each_attention_layer_reports_its_largest_logit_and_its_most_focused_heads_entropy() {
    let preset = tiny();
    let model = HybridModel::random(&preset, DType::F32, &Device::Cpu, 1).unwrap();
    let layers = preset.qwen.num_hidden_layers;
    let mut trainer = Trainer::new(model, options(DType::F32, DType::F32), &Device::Cpu).unwrap();
    let record = trainer.step(0).unwrap().record.unwrap();
    let attention: Vec<_> = record
        .modules
        .iter()
        .filter(|m| m.attn_max_logit.is_some())
        .collect();
    let names: Vec<String> = (0..layers)
        .map(|i| format!("qwen.layers.{i}.self_attn"))
        .collect();
    assert_eq!(
        attention
            .iter()
            .map(|m| m.module.clone())
            .collect::<Vec<_>>(),
        names
    );
    for module in attention {
        let logit = module.attn_max_logit.unwrap().0;
        let entropy = module.attn_min_entropy.unwrap().0;
        // Random init (std 0.02): q·k/√d is small, and attention nearly uniform over
        // the causal prefix: entropy between 0 and ln(prompt length).
        assert!(logit.is_finite() && logit.abs() < 1.0, "{logit}");
        assert!(
            entropy > 0.0 && entropy < (preset.prompt_len as f64).ln(),
            "{entropy}"
        );
        assert_eq!((module.grad_norm, module.hook_hits), (None, None));
    }
}

#[test]
fn without_attention_statistics_a_record_has_no_attention_entries_and_the_rest_unchanged() {
    let preset = tiny();
    let record_of = |attention_statistics: bool| {
        let model = HybridModel::random(&preset, DType::F32, &Device::Cpu, 1).unwrap();
        let opts = TrainOptions {
            attention_statistics,
            ..options(DType::F32, DType::F32)
        };
        let mut trainer = Trainer::new(model, opts, &Device::Cpu).unwrap();
        trainer.step(0).unwrap().record.unwrap()
    };
    let with = record_of(true);
    let without = record_of(false);
    let is_attention = |m: &&gradflow_protocol::ModuleStep| {
        m.attn_max_logit.is_some() || m.attn_min_entropy.is_some()
    };
    assert_eq!(
        with.modules.iter().filter(is_attention).count(),
        preset.qwen.num_hidden_layers
    );
    let left: Vec<_> = without.modules.iter().filter(is_attention).collect();
    assert!(left.is_empty(), "attention entries left: {left:?}");
    // Everything else is measured as before: the same modules, hook hits and
    // gradient norms from the same seed.
    let trained: Vec<_> = with.modules.iter().filter(|m| !is_attention(m)).collect();
    assert_eq!(without.modules.iter().collect::<Vec<_>>(), trained);
    assert_eq!(without.loss, with.loss);
}

#[test]
fn norm_weights_are_measured_on_the_first_steps_then_every_kth_and_training_is_unchanged() {
    let preset = tiny();
    let records_of = |norm_weights_every: u64| {
        let model = HybridModel::random(&preset, DType::F32, &Device::Cpu, 1).unwrap();
        let opts = TrainOptions {
            norm_weights_every,
            ..options(DType::F32, DType::F32)
        };
        let mut trainer = Trainer::new(model, opts, &Device::Cpu).unwrap();
        (0..10)
            .map(|step| trainer.step(step).unwrap().record.unwrap())
            .collect::<Vec<_>>()
    };
    let every = records_of(1);
    let sampled = records_of(4);
    for (step, (all, some)) in every.iter().zip(&sampled).enumerate() {
        // The same training: the loss and every module's gradient norm.
        assert_eq!(all.loss, some.loss, "step {step}");
        assert_eq!(all.modules, some.modules, "step {step}");
        assert!(!all.params.is_empty());
        assert!(all.params.iter().all(|p| p.update_norm.is_some()));
        let due = step < 4 || step % 4 == 0;
        if due {
            assert_eq!(all.params, some.params, "step {step}");
        } else {
            // Not measured: each norm weight's gradient norm alone.
            for (a, s) in all.params.iter().zip(&some.params) {
                assert_eq!(
                    (&a.name, a.grad_norm),
                    (&s.name, s.grad_norm),
                    "step {step}"
                );
                assert!(
                    s.update_norm.is_none() && s.drift.is_none() && s.mean.is_none(),
                    "step {step}: {s:?}"
                );
                assert!(s.intended_update_norm.is_none(), "step {step}: {s:?}");
            }
        }
    }
}
