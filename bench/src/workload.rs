//! The telemetry the benchmarks send: runs shaped like a Qwen2.5-1.5B + agent model
//! (230 modules and 57 RMSNorm weights a step at the default size), with gradient
//! norms drawn i.i.d. log-normal. Independent draws are the worst case for storage:
//! a real run's norms drift smoothly, so neighbouring steps share their high bits.
//!
//! The same seeded generator feeds the HTTP clients and the bare-SQLite baseline, so
//! both store exactly the same numbers.

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, LogNormal};
use serde_json::{Value, json};

/// Module names of the model's layers, eight per decoder layer.
const LAYER_MODULES: [&str; 8] = [
    "self_attn",
    "mlp",
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.down_proj",
];

/// How wide a run's steps are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Module records a step (each a gradient norm and hook hits).
    pub modules: usize,
    /// `role: norm` parameters a step (each four values).
    pub norm_params: usize,
}

impl Shape {
    /// The ingest target's shape: ~230 modules plus 57 norm weights.
    pub const QWEN_1_5B: Shape = Shape {
        modules: 230,
        norm_params: 57,
    };

    /// `modules` modules and, as in Qwen2, one norm weight for every four modules.
    pub fn with_modules(modules: usize) -> Shape {
        Shape {
            modules,
            norm_params: modules / 4,
        }
    }

    /// Numbers stored for one step: loss, lr, two per module, four per parameter.
    pub fn values_per_step(&self) -> usize {
        2 + 2 * self.modules + 4 * self.norm_params
    }

    /// Module names: Qwen's layers, then the last ~4 % in the agent.
    pub fn module_names(&self) -> Vec<String> {
        let agent = self.modules / 23;
        (0..self.modules)
            .map(|i| {
                if i < self.modules - agent {
                    format!("qwen.layers.{}.{}", i / 8, LAYER_MODULES[i % 8])
                } else {
                    format!("agent.blocks.{}", i - (self.modules - agent))
                }
            })
            .collect()
    }

    /// Whether the norm weights registered reach a layer beyond the last one whose
    /// modules are reported (Qwen2's one norm weight per four modules does, for
    /// most widths): the server then rightly says that layer never reports.
    pub fn registers_unreported_layer(&self) -> bool {
        let agent = self.modules / 23;
        let qwen_modules = self.modules - agent;
        let last_module_layer = qwen_modules.saturating_sub(1) / 8;
        let last_param_layer = self.norm_params.saturating_sub(1) / 2;
        self.norm_params > 0 && (qwen_modules == 0 || last_param_layer > last_module_layer)
    }

    pub fn param_names(&self) -> Vec<String> {
        (0..self.norm_params)
            .map(|i| {
                let which = ["input_layernorm", "post_attention_layernorm"][i % 2];
                format!("qwen.layers.{}.{which}.weight", i / 2)
            })
            .collect()
    }

    /// The registration body (`PUT /api/v1/runs/{id}`): f32 master weights, every
    /// norm weight declared.
    pub fn registration(&self, name: &str) -> Value {
        let params: Vec<Value> = self
            .param_names()
            .into_iter()
            .map(|name| json!({"name": name, "role": "norm", "dtype": "f32", "shape": [1536]}))
            .collect();
        json!({
            "name": name,
            "precision": {"param_dtype": "f32", "compute_dtype": "bf16", "loss_scaler": "none"},
            "optimizer": {"name": "adamw", "lr": 3e-4},
            "params": params,
        })
    }
}

/// One step's numbers.
#[derive(Debug, Clone)]
pub struct Step {
    pub step: u64,
    pub loss: f32,
    pub lr: f32,
    pub module_grad_norms: Vec<f32>,
    /// Per norm parameter: gradient norm, update norm, drift, mean.
    pub params: Vec<[f32; 4]>,
}

/// Seeded, so two generators of the same seed produce the same run.
pub struct Generator {
    shape: Shape,
    rng: StdRng,
    module_norm: LogNormal<f32>,
    param_grad: LogNormal<f32>,
    update: LogNormal<f32>,
    drift: LogNormal<f32>,
}

impl Generator {
    pub fn new(shape: Shape, seed: u64) -> Generator {
        let log_normal = |mu, sigma| LogNormal::new(mu, sigma).expect("a valid sigma");
        Generator {
            shape,
            rng: StdRng::seed_from_u64(seed),
            module_norm: log_normal(-3.0, 1.0),
            param_grad: log_normal(-5.0, 1.0),
            update: log_normal(-9.0, 0.5),
            drift: log_normal(-6.0, 1.0),
        }
    }

    /// A healthy step: every gradient non-zero, every norm weight moving.
    pub fn step(&mut self, step: u64) -> Step {
        let module_grad_norms = (0..self.shape.modules)
            .map(|_| self.module_norm.sample(&mut self.rng))
            .collect();
        let params = (0..self.shape.norm_params)
            .map(|_| {
                let drift = self.drift.sample(&mut self.rng);
                [
                    self.param_grad.sample(&mut self.rng),
                    self.update.sample(&mut self.rng),
                    drift,
                    1.0 - drift / 2.0,
                ]
            })
            .collect();
        Step {
            step,
            loss: 4.0 / (1.0 + step as f32 * 1e-4) + self.module_norm.sample(&mut self.rng) * 0.01,
            lr: 3e-4,
            module_grad_norms,
            params,
        }
    }

    pub fn steps(&mut self, first: u64, count: u64) -> Vec<Step> {
        (first..first + count).map(|s| self.step(s)).collect()
    }
}

/// Names resolved once, so that writing a batch is only formatting numbers.
pub struct BatchWriter {
    module_names: Vec<String>,
    param_names: Vec<String>,
}

impl BatchWriter {
    pub fn new(shape: Shape) -> BatchWriter {
        BatchWriter {
            module_names: shape.module_names(),
            param_names: shape.param_names(),
        }
    }

    /// The JSON array of step records (`POST /api/v1/runs/{id}/steps`). Written by
    /// hand rather than through serde so that building bodies stays cheap next to
    /// what is measured; `json_round_trips` checks it against serde_json.
    pub fn batch(&self, steps: &[Step]) -> Vec<u8> {
        use std::fmt::Write;
        let mut body = String::with_capacity(steps.len() * (self.module_names.len() * 72 + 1024));
        body.push('[');
        for (i, s) in steps.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            let _ = write!(
                body,
                r#"{{"step":{},"loss":{},"lr":{},"modules":["#,
                s.step, s.loss, s.lr
            );
            for (m, (name, norm)) in self
                .module_names
                .iter()
                .zip(&s.module_grad_norms)
                .enumerate()
            {
                if m > 0 {
                    body.push(',');
                }
                let _ = write!(
                    body,
                    r#"{{"module":"{name}","grad_norm":{norm},"hook_hits":1}}"#
                );
            }
            body.push_str(r#"],"params":["#);
            for (p, (name, [grad, update, drift, mean])) in
                self.param_names.iter().zip(&s.params).enumerate()
            {
                if p > 0 {
                    body.push(',');
                }
                let _ = write!(
                    body,
                    r#"{{"name":"{name}","grad_norm":{grad},"update_norm":{update},"drift":{drift},"mean":{mean}}}"#
                );
            }
            body.push_str("]}");
        }
        body.push(']');
        body.into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_shape_is_the_targets() {
        let shape = Shape::QWEN_1_5B;
        assert_eq!(shape.module_names().len(), 230);
        assert_eq!(shape.param_names().len(), 57);
        assert_eq!(shape.values_per_step(), 690);
        let names = shape.module_names();
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "module names are distinct");
        assert_eq!(Shape::with_modules(1000).norm_params, 250);
    }

    #[test]
    fn knows_when_it_registers_a_layer_it_never_reports() {
        // 220 Qwen modules (layers 0-27), 57 norm weights (layers 0-28).
        assert!(Shape::QWEN_1_5B.registers_unreported_layer());
        // 192 Qwen modules (layers 0-23), 50 norm weights (layers 0-24).
        assert!(Shape::with_modules(200).registers_unreported_layer());
        // 48 Qwen modules (layers 0-5), 12 norm weights (layers 0-5).
        assert!(!Shape::with_modules(50).registers_unreported_layer());
    }

    #[test]
    fn json_round_trips() {
        let shape = Shape::with_modules(12);
        let steps = Generator::new(shape, 7).steps(40, 3);
        let body = BatchWriter::new(shape).batch(&steps);
        let parsed: Value = serde_json::from_slice(&body).unwrap();
        let records = parsed.as_array().unwrap();
        assert_eq!(records.len(), 3);
        assert_eq!(records[2]["step"], 42);
        let norm = records[1]["modules"][5]["grad_norm"].as_f64().unwrap() as f32;
        assert_eq!(norm, steps[1].module_grad_norms[5]);
        assert_eq!(records[0]["params"].as_array().unwrap().len(), 3);
        assert_eq!(
            records[0]["params"][2]["mean"].as_f64().unwrap() as f32,
            steps[0].params[2][3]
        );
    }

    #[test]
    fn the_same_seed_gives_the_same_run() {
        let shape = Shape::QWEN_1_5B;
        let a = Generator::new(shape, 3).steps(0, 2);
        let b = Generator::new(shape, 3).steps(0, 2);
        assert_eq!(a[1].module_grad_norms, b[1].module_grad_norms);
        assert!(
            a[0].module_grad_norms
                .iter()
                .all(|n| *n > 0.0 && n.is_finite())
        );
    }
}
