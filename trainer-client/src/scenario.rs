//! Named stories for demos and tests: each bundles the options that reproduce one
//! failure (or the healthy case), with the symptom a user would see and what gradflow
//! says about it.

use candle_core::DType;

use crate::train::Faults;

/// What a scenario sets; explicit command-line flags override it.
#[derive(Debug, Clone, PartialEq)]
pub struct ScenarioSettings {
    pub param_dtype: DType,
    pub compute_dtype: DType,
    pub loss_scaler: bool,
    pub lr: f64,
    pub qwen_every: u64,
    pub faults: Faults,
}

impl Default for ScenarioSettings {
    fn default() -> Self {
        ScenarioSettings {
            param_dtype: DType::F32,
            compute_dtype: DType::F32,
            loss_scaler: false,
            lr: 3e-4,
            qwen_every: 1,
            faults: Faults::default(),
        }
    }
}

pub struct Scenario {
    pub name: &'static str,
    /// The symptom a user would see in their own logs.
    pub symptom: &'static str,
    /// The alert kinds gradflow raises for it.
    pub alerts: &'static [&'static str],
    /// Steps after which they have all opened (with the default thresholds).
    pub min_steps: u64,
    /// The trainer stops with an error before its first step, as PyTorch does for
    /// this misconfiguration.
    pub stops_at_once: bool,
}

impl Scenario {
    /// Steps a run of this scenario should train for its alerts to have opened,
    /// with a margin (and at least 60, so a healthy run shows a trend).
    pub fn steps_to_show_alerts(&self) -> u64 {
        (self.min_steps + 10).max(60)
    }
}

pub const SCENARIOS: [Scenario; 10] = [
    Scenario {
        name: "healthy",
        symptom: "loss falls, every module gets a gradient, norm weights move",
        alerts: &[],
        min_steps: 0,
        stops_at_once: false,
    },
    Scenario {
        name: "prompt-caching",
        symptom: "Qwen runs forward/backward every 10th step only (a cached prompt otherwise): healthy",
        alerts: &[],
        min_steps: 0,
        stops_at_once: false,
    },
    Scenario {
        name: "detached-prompt",
        symptom: "the prompt embedding is detached (a stray torch.no_grad()): Qwen_grad 0.00e+00 every step, loss still falls a little",
        alerts: &["grad_stuck_zero"],
        min_steps: 50,
        stops_at_once: false,
    },
    Scenario {
        name: "bf16-frozen-norms",
        symptom: "bf16 master weights with AdamW at lr 3e-4: RMSNorm weights stay exactly 1.0 while gradients flow",
        alerts: &["norm_weight_frozen"],
        min_steps: 20,
        stops_at_once: false,
    },
    Scenario {
        name: "scaler-on-bf16",
        symptom: "a dynamic loss scaler over bf16 parameters: the trainer stops at once, as GradScaler does in PyTorch",
        alerts: &["scaler_bf16_incompatible"],
        min_steps: 0,
        stops_at_once: true,
    },
    Scenario {
        name: "qwen-not-in-optimizer",
        symptom: "Qwen's parameters get gradients but are not in the optimizer: they never change",
        alerts: &["param_not_in_optimizer", "norm_weight_frozen"],
        min_steps: 20,
        stops_at_once: false,
    },
    Scenario {
        name: "fp16-overflow",
        symptom: "fp16 compute whose activations overflow: found_inf on every step, the scale collapses, no step is taken",
        // The loss itself is non-finite on every step too.
        alerts: &["scaler_overflow_streak", "loss_nonfinite"],
        min_steps: 10,
        stops_at_once: false,
    },
    Scenario {
        name: "nan-gradient",
        symptom: "one gradient turns NaN at step 30; with no scaler the weights and then the loss go NaN",
        alerts: &["grad_nonfinite", "loss_nonfinite"],
        min_steps: 32,
        stops_at_once: false,
    },
    Scenario {
        name: "lr-too-high",
        symptom: "AdamW at lr 1.0: the loss jumps to ten times its starting value on step 1, and the blow-up leaves a module of the agent with a gradient of exactly 0 from then on",
        alerts: &[
            "loss_divergence",
            "grad_stuck_zero",
            "attention_logit_growth",
        ],
        min_steps: 5,
        stops_at_once: false,
    },
    Scenario {
        name: "attention-logit-growth",
        symptom: "AdamW at lr 0.1 with no warm-up and no QK-norm: Qwen's attention logits climb from 0.05 past 100 within 15 steps and attention turns one-hot while the loss still falls; the same lr silences a gate of the agent for a while",
        alerts: &["attention_logit_growth", "grad_stuck_zero"],
        min_steps: 60,
        stops_at_once: false,
    },
];

pub fn names() -> Vec<&'static str> {
    SCENARIOS.iter().map(|s| s.name).collect()
}

pub fn find(name: &str) -> anyhow::Result<&'static Scenario> {
    SCENARIOS
        .iter()
        .find(|s| s.name == name)
        .ok_or_else(|| anyhow::anyhow!("unknown scenario {name:?}: one of {}", names().join(", ")))
}

/// The settings a scenario starts from.
pub fn settings(name: &str) -> anyhow::Result<ScenarioSettings> {
    find(name)?;
    let mut s = ScenarioSettings::default();
    match name {
        "prompt-caching" => s.qwen_every = 10,
        "detached-prompt" => s.faults.detach_prompt = true,
        "bf16-frozen-norms" => {
            s.param_dtype = DType::BF16;
            s.compute_dtype = DType::BF16;
        }
        "scaler-on-bf16" => {
            s.param_dtype = DType::BF16;
            s.compute_dtype = DType::BF16;
            s.loss_scaler = true;
        }
        "qwen-not-in-optimizer" => s.faults.qwen_not_in_optimizer = true,
        "fp16-overflow" => {
            s.compute_dtype = DType::F16;
            s.loss_scaler = true;
            s.faults.activation_overflow = true;
        }
        "nan-gradient" => s.faults.nan_grad_at = Some(30),
        "lr-too-high" => s.lr = 1.0,
        "attention-logit-growth" => s.lr = 0.1,
        _ => {}
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_has_settings() {
        for name in names() {
            settings(name).unwrap();
        }
        assert!(settings("nope").is_err());
        assert_eq!(settings("healthy").unwrap(), ScenarioSettings::default());
    }
}
