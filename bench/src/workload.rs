//! The telemetry the benchmarks send: runs shaped like a Qwen2.5-1.5B + agent model
//! (230 modules and 57 RMSNorm weights a step at the default size), in one of two
//! traces ([`Trace`]). The i.i.d. one draws every gradient norm independently
//! (log-normal), the worst case for storage; the realistic one lets each series wander
//! smoothly with noise, as a real run's do, so neighbouring steps share their high
//! bits.
//!
//! The same seeded generator feeds the HTTP clients and the bare-SQLite baseline, so
//! both store exactly the same numbers. The server's `block_codec` bench compiles this
//! file too, so it uses nothing but `rand`, `rand_distr` and `serde_json`.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal, Normal, StandardNormal};
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

/// Which telemetry a [`Generator`] produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trace {
    /// Every norm drawn independently: the worst case for storage, and what the
    /// recorded ingest figures were measured on.
    Iid,
    /// Smooth, noisy series shaped like a real run's (see [`Realistic`]).
    Realistic,
}

impl Trace {
    /// As the reports name it.
    pub fn name(self) -> &'static str {
        match self {
            Trace::Iid => "i.i.d.",
            Trace::Realistic => "realistic",
        }
    }
}

/// Seeded, so two generators of the same seed produce the same run.
pub struct Generator {
    shape: Shape,
    rng: StdRng,
    source: Source,
}

enum Source {
    Iid(Iid),
    Realistic(Box<Realistic>),
}

impl Generator {
    /// The i.i.d. trace.
    pub fn new(shape: Shape, seed: u64) -> Generator {
        Generator::with_trace(shape, seed, Trace::Iid)
    }

    pub fn with_trace(shape: Shape, seed: u64, trace: Trace) -> Generator {
        let mut rng = StdRng::seed_from_u64(seed);
        let source = match trace {
            Trace::Iid => Source::Iid(Iid::new()),
            Trace::Realistic => Source::Realistic(Box::new(Realistic::new(shape, &mut rng))),
        };
        Generator { shape, rng, source }
    }

    /// A healthy step: every gradient non-zero, every norm weight moving. The
    /// realistic trace moves on by the steps since the previous call, so a run that
    /// reports every tenth step sees ten steps' change between its records.
    pub fn step(&mut self, step: u64) -> Step {
        match &mut self.source {
            Source::Iid(iid) => iid.step(self.shape, &mut self.rng, step),
            Source::Realistic(realistic) => realistic.step(&mut self.rng, step),
        }
    }

    pub fn steps(&mut self, first: u64, count: u64) -> Vec<Step> {
        (first..first + count).map(|s| self.step(s)).collect()
    }
}

struct Iid {
    module_norm: LogNormal<f32>,
    param_grad: LogNormal<f32>,
    update: LogNormal<f32>,
    drift: LogNormal<f32>,
}

impl Iid {
    fn new() -> Iid {
        let log_normal = |mu, sigma| LogNormal::new(mu, sigma).expect("a valid sigma");
        Iid {
            module_norm: log_normal(-3.0, 1.0),
            param_grad: log_normal(-5.0, 1.0),
            update: log_normal(-9.0, 0.5),
            drift: log_normal(-6.0, 1.0),
        }
    }

    fn step(&self, shape: Shape, rng: &mut StdRng, step: u64) -> Step {
        let module_grad_norms = (0..shape.modules)
            .map(|_| self.module_norm.sample(rng))
            .collect();
        let params = (0..shape.norm_params)
            .map(|_| {
                let drift = self.drift.sample(rng);
                [
                    self.param_grad.sample(rng),
                    self.update.sample(rng),
                    drift,
                    1.0 - drift / 2.0,
                ]
            })
            .collect();
        Step {
            step,
            loss: 4.0 / (1.0 + step as f32 * 1e-4) + self.module_norm.sample(rng) * 0.01,
            lr: 3e-4,
            module_grad_norms,
            params,
        }
    }
}

/// The realistic trace. Each gradient norm (a module's, a norm weight's) is
/// `exp(level + trend(step) + x)`, where `x` is an AR(1) process in log space:
///
/// - `level`: per series, spread as the i.i.d. trace's (normal, σ = 1, around −3 for
///   modules and −5 for norm weights), so the two traces span the same magnitudes;
/// - `x ← PHI·x + σ·ε`: minibatch gradient norms fluctuate by several percent to
///   tens of percent from one step to the next, so each series draws its σ
///   log-uniformly between [`NOISE_MIN`] and [`NOISE_MAX`]. With [`PHI`] = 0.9 the
///   step-to-step change is ≈ σ, and a swing fades over ~10 steps (a run of hard
///   batches, a spike after a loss jump);
/// - `trend`: the early rise of gradient norms while the learning rate warms up
///   ([`RISE`] over [`RISE_STEPS`]), then their slow decay as the loss falls
///   ([`DECAY`], [`DECAY_STEPS`]). It moves far less per step than the noise.
///
/// A norm weight's update norm is noisy around its own level (i.i.d. σ =
/// [`UPDATE_NOISE`] in log space: the update is computed from one minibatch);
/// its drift (the largest distance from the registered value) grows smoothly, a small
/// positive increment a step; its mean stays near 1.0 and random-walks by
/// [`MEAN_STEP`] a step, as an RMSNorm weight under AdamW does. The loss decays from
/// ~4.5 towards 2 with 5 % noise.
struct Realistic {
    last_step: Option<u64>,
    modules: Vec<Ar1>,
    param_grads: Vec<Ar1>,
    params: Vec<NormWeight>,
}

const PHI: f64 = 0.9;
const NOISE_MIN: f64 = 0.03;
const NOISE_MAX: f64 = 0.20;
const RISE: f64 = 0.7;
const RISE_STEPS: f64 = 200.0;
const DECAY: f64 = 0.5;
const DECAY_STEPS: f64 = 2000.0;
const UPDATE_NOISE: f64 = 0.2;
const MEAN_STEP: f64 = 1e-4;
const LOSS_NOISE: f64 = 0.05;

/// One AR(1) series in log space, as a deviation from its level.
struct Ar1 {
    level: f64,
    sigma: f64,
    x: f64,
}

impl Ar1 {
    fn new(rng: &mut StdRng, level_mean: f64) -> Ar1 {
        let level = Normal::new(level_mean, 1.0)
            .expect("a valid sigma")
            .sample(rng);
        let sigma = (NOISE_MIN.ln() + rng.r#gen::<f64>() * (NOISE_MAX / NOISE_MIN).ln()).exp();
        // Started from the stationary distribution, so the first steps look like the rest.
        let x = sigma / (1.0 - PHI * PHI).sqrt() * standard_normal(rng);
        Ar1 { level, sigma, x }
    }

    /// Moves `steps` steps on: `PHI^k·x` plus the k innovations' sum, in closed form.
    fn advance(&mut self, rng: &mut StdRng, steps: u64) {
        let decay = PHI.powi(steps.min(i32::MAX as u64) as i32);
        let spread = self.sigma * ((1.0 - decay * decay) / (1.0 - PHI * PHI)).sqrt();
        self.x = decay * self.x + spread * standard_normal(rng);
    }

    fn value(&self, trend: f64) -> f32 {
        (self.level + trend + self.x).exp() as f32
    }
}

struct NormWeight {
    update_level: f64,
    drift_rate: f64,
    drift: f64,
    mean: f64,
}

impl Realistic {
    fn new(shape: Shape, rng: &mut StdRng) -> Realistic {
        let modules = (0..shape.modules).map(|_| Ar1::new(rng, -3.0)).collect();
        let param_grads = (0..shape.norm_params)
            .map(|_| Ar1::new(rng, -5.0))
            .collect();
        let params = (0..shape.norm_params)
            .map(|_| NormWeight {
                update_level: -9.0 + 0.5 * standard_normal(rng),
                // ~5e-5 a step: a drift of ~0.05 after a thousand steps.
                drift_rate: (-10.0 + 0.5 * standard_normal(rng)).exp(),
                drift: 0.0,
                mean: 1.0,
            })
            .collect();
        Realistic {
            last_step: None,
            modules,
            param_grads,
            params,
        }
    }

    fn step(&mut self, rng: &mut StdRng, step: u64) -> Step {
        let elapsed = match self.last_step {
            Some(last) => step.saturating_sub(last).max(1),
            None => 1,
        };
        self.last_step = Some(step);
        let t = step as f64;
        let trend = RISE * (1.0 - (-t / RISE_STEPS).exp()) - DECAY * (t / DECAY_STEPS).ln_1p();

        let mut module_grad_norms = Vec::with_capacity(self.modules.len());
        for module in &mut self.modules {
            module.advance(rng, elapsed);
            module_grad_norms.push(module.value(trend));
        }
        let mut params = Vec::with_capacity(self.params.len());
        for (grad, weight) in self.param_grads.iter_mut().zip(&mut self.params) {
            grad.advance(rng, elapsed);
            let update = (weight.update_level + UPDATE_NOISE * standard_normal(rng)).exp();
            let increment: f64 = LogNormal::new(0.0, 0.3).expect("a valid sigma").sample(rng);
            weight.drift += weight.drift_rate * elapsed as f64 * increment;
            weight.mean += MEAN_STEP * (elapsed as f64).sqrt() * standard_normal(rng);
            params.push([
                grad.value(trend),
                update as f32,
                weight.drift as f32,
                weight.mean as f32,
            ]);
        }
        let loss = (2.0 + 2.5 * (-t / 500.0).exp()) * (LOSS_NOISE * standard_normal(rng)).exp();
        Step {
            step,
            loss: loss as f32,
            lr: 3e-4,
            module_grad_norms,
            params,
        }
    }
}

fn standard_normal(rng: &mut StdRng) -> f64 {
    StandardNormal.sample(rng)
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

    /// FNV-1a over every number of three seeds' first 50 steps.
    fn fingerprint(trace: Trace) -> u64 {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        let mut mix = |bits: u32| {
            hash ^= u64::from(bits);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        };
        for seed in [0, 3, 42] {
            for s in Generator::with_trace(Shape::QWEN_1_5B, seed, trace).steps(0, 50) {
                mix(s.step as u32);
                mix(s.loss.to_bits());
                mix(s.lr.to_bits());
                s.module_grad_norms.iter().for_each(|v| mix(v.to_bits()));
                s.params.iter().flatten().for_each(|v| mix(v.to_bits()));
            }
        }
        hash
    }

    /// Recorded benchmark figures were measured on this exact i.i.d. data. (The value
    /// holds for this crate's build, where num-traits uses std's maths; with libm's
    /// `exp` the last bits of some draws differ.)
    #[test]
    fn the_iid_trace_is_unchanged() {
        assert_eq!(fingerprint(Trace::Iid), 0x6a61_0d40_31cb_2e33);
        assert_ne!(fingerprint(Trace::Realistic), fingerprint(Trace::Iid));
    }

    fn median(mut values: Vec<f64>) -> f64 {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    }

    /// Median |log change| of the module norms between consecutive records.
    fn median_module_change(steps: &[Step]) -> f64 {
        median(
            steps
                .windows(2)
                .flat_map(|w| {
                    w[0].module_grad_norms
                        .iter()
                        .zip(&w[1].module_grad_norms)
                        .map(|(a, b)| f64::from(b / a).ln().abs())
                })
                .collect(),
        )
    }

    #[test]
    fn the_realistic_trace_moves_as_a_run_does() {
        let shape = Shape::QWEN_1_5B;
        let steps = Generator::with_trace(shape, 5, Trace::Realistic).steps(0, 400);
        let again = Generator::with_trace(shape, 5, Trace::Realistic).steps(0, 400);
        assert_eq!(steps[399].module_grad_norms, again[399].module_grad_norms);
        assert_eq!(steps[399].params, again[399].params);
        for s in &steps {
            assert!(
                s.module_grad_norms
                    .iter()
                    .all(|n| *n > 0.0 && n.is_finite())
            );
            assert!(s.params.iter().flatten().all(|v| *v > 0.0 && v.is_finite()));
        }

        // A few percent to ~20 % a step: the median change is ~5 %.
        let change = median_module_change(&steps);
        assert!((0.02..0.12).contains(&change), "median change {change}");
        // Levels spread as the i.i.d. trace's: σ ≈ 1 in log space across modules.
        let levels: Vec<f64> = (0..shape.modules)
            .map(|m| {
                steps
                    .iter()
                    .map(|s| f64::from(s.module_grad_norms[m]).ln())
                    .sum::<f64>()
                    / 400.0
            })
            .collect();
        let mean = levels.iter().sum::<f64>() / levels.len() as f64;
        let spread =
            (levels.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / levels.len() as f64).sqrt();
        assert!((0.7..1.4).contains(&spread), "level spread {spread}");
        assert!((-3.6..-2.0).contains(&mean), "mean level {mean}");

        for p in 0..shape.norm_params {
            let drifts: Vec<f32> = steps.iter().map(|s| s.params[p][2]).collect();
            assert!(
                drifts.windows(2).all(|w| w[1] >= w[0]),
                "drift of {p} grows"
            );
            assert!(drifts[399] > drifts[0]);
            let means: Vec<f32> = steps.iter().map(|s| s.params[p][3]).collect();
            assert!(means.iter().all(|m| (m - 1.0).abs() < 0.05));
            let moves = means.windows(2).filter(|w| w[0] != w[1]).count();
            let largest = means
                .windows(2)
                .map(|w| (w[1] - w[0]).abs())
                .fold(0.0, f32::max);
            assert!(
                moves > 350 && largest < 1e-3,
                "mean of {p}: {moves} moves, largest {largest}"
            );
        }
        let loss =
            |range: std::ops::Range<usize>| steps[range].iter().map(|s| s.loss).sum::<f32>() / 50.0;
        assert!(loss(350..400) < loss(0..50) * 0.9);
    }

    #[test]
    fn a_sparse_realistic_run_moves_by_the_steps_between_records() {
        let shape = Shape::with_modules(100);
        let mut every_step = Generator::with_trace(shape, 8, Trace::Realistic);
        let mut every_tenth = Generator::with_trace(shape, 8, Trace::Realistic);
        let dense = every_step.steps(0, 200);
        let sparse: Vec<Step> = (0..200).map(|i| every_tenth.step(i * 10)).collect();
        assert_eq!(sparse[7].step, 70);
        let (dense, sparse) = (median_module_change(&dense), median_module_change(&sparse));
        assert!(
            sparse > 1.5 * dense,
            "every tenth {sparse}, every step {dense}"
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
