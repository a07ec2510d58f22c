//! `norm_weight_frozen`: norm weights that receive a gradient, under a learning rate,
//! yet do not move: `update_norm` exactly 0 on M consecutive reported steps.
//!
//! The case behind it: RMSNorm weights that stayed at exactly 1.0 for a whole run
//! because the parameters were bf16, and every AdamW update (~lr) was below half a
//! bf16 ulp at 1.0. The verdict `low_precision_underflow` is arithmetic on the run's
//! own numbers — the weight's dtype, its magnitude (`mean`), the learning rate and
//! the optimizer's step model — never the dtype alone: bf16 at 1.0 with lr 0.05, or
//! bf16 near 0.1 with lr 3e-4, updates fine and gets another cause.
//!
//! One alert per group: the weights of a group freeze together (one dtype, one lr).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::context::{NormParam, RunContext};
use super::precision::{describe_magnitude, smallest_change};
use super::{AlertKind, Opened, Severity, StepView, Transition, name_list, sci, step_range};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FrozenNormWeight {
    params: BTreeMap<String, Streak>,
    /// Groups with an open episode.
    open_groups: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Streak {
    len: u32,
    first_step: u64,
}

/// What one frozen weight looked like on the step its streak reached the threshold.
struct Frozen<'a> {
    name: &'a str,
    info: &'a NormParam,
    grad_norm: f64,
    mean: Option<f64>,
    streak: Streak,
}

impl FrozenNormWeight {
    pub fn on_step(&mut self, view: &StepView<'_>, out: &mut Vec<Transition>) {
        let (context, record) = (view.context, view.record);
        let step = record.step;
        let threshold = context.thresholds.frozen_norm_steps;
        let lr = record.lr.map(|f| f.get()).or(context.optimizer.lr);
        let mut reached: BTreeMap<&str, Vec<Frozen<'_>>> = BTreeMap::new();
        let mut thawed_groups: Vec<&str> = Vec::new();
        for param in &record.params {
            let Some(info) = context.norm_params.get(&param.name) else {
                continue;
            };
            let (Some(grad), Some(update)) = (param.grad_norm, param.update_norm) else {
                continue; // not measured this step
            };
            let frozen = grad.get() > 0.0 && grad.is_finite() && update.get() == 0.0;
            if !frozen {
                if self
                    .params
                    .remove(&param.name)
                    .is_some_and(|s| s.len >= threshold)
                {
                    thawed_groups.push(&info.group);
                }
                continue;
            }
            let streak = self.params.entry(param.name.clone()).or_default();
            if streak.len == 0 {
                streak.first_step = step;
            }
            streak.len += 1;
            if streak.len >= threshold {
                reached.entry(&info.group).or_default().push(Frozen {
                    name: &param.name,
                    info,
                    grad_norm: grad.get(),
                    mean: param.mean.map(|m| m.get()),
                    streak: streak.clone(),
                });
            }
        }
        // An episode ends when none of its group's weights is frozen any longer.
        for group in thawed_groups {
            let still_frozen = self.params.iter().any(|(name, s)| {
                s.len >= threshold
                    && context
                        .norm_params
                        .get(name)
                        .is_some_and(|p| p.group == group)
            });
            if !still_frozen && self.open_groups.remove(group).is_some() {
                out.push(Transition::Resolve {
                    kind: AlertKind::NormWeightFrozen,
                    subject: group.to_owned(),
                    step,
                });
            }
        }
        for (group, frozen) in reached {
            if self.open_groups.contains_key(group) {
                continue;
            }
            self.open_groups.insert(group.to_owned(), step);
            out.push(open(context, group, &frozen, lr, step));
        }
    }
}

/// Why the updates are exactly zero, with the numbers that say so.
enum Verdict {
    NotInOptimizer,
    ZeroLr,
    Underflow {
        step_size: f64,
        smallest: f64,
        magnitude: f64,
    },
    Unknown(String),
}

impl Verdict {
    fn cause(&self) -> &'static str {
        match self {
            Verdict::NotInOptimizer => "not_in_optimizer",
            Verdict::ZeroLr => "zero_lr",
            Verdict::Underflow { .. } => "low_precision_underflow",
            Verdict::Unknown(_) => "unknown",
        }
    }
}

fn verdict(context: &RunContext, example: &Frozen<'_>, lr: Option<f64>) -> Verdict {
    if !example.info.in_optimizer {
        return Verdict::NotInOptimizer;
    }
    let Some(lr) = lr else {
        return Verdict::Unknown("the run reports no learning rate".into());
    };
    if lr == 0.0 {
        return Verdict::ZeroLr;
    }
    let Some(dtype) = example.info.dtype else {
        return Verdict::Unknown("the registration gives no dtype for these weights".into());
    };
    let Some(mean) = example.mean else {
        return Verdict::Unknown("the steps report no mean value for these weights".into());
    };
    let Some(smallest) = smallest_change(mean, dtype) else {
        return Verdict::Unknown(format!("their mean is {}", sci(mean)));
    };
    let optimizer = &context.optimizer;
    // Adam-family: an element moves by about lr·|m̂/√v̂| ≤ lr, plus decoupled weight
    // decay lr·wd·|w|. Otherwise (SGD): lr times the gradient's RMS element.
    let step_size = if optimizer.normalises_gradient {
        lr * (1.0 + optimizer.weight_decay * mean.abs())
    } else {
        let numel = example.info.numel.unwrap_or(1).max(1) as f64;
        lr * example.grad_norm / numel.sqrt()
    };
    if step_size <= smallest {
        Verdict::Underflow {
            step_size,
            smallest,
            magnitude: mean,
        }
    } else {
        Verdict::Unknown(format!(
            "{} step ≈ {} is above {}, the smallest change {} can make {}, so rounding does not explain it",
            optimizer.display_name,
            sci(step_size),
            sci(smallest),
            dtype.as_str(),
            describe_magnitude(mean)
        ))
    }
}

fn open(
    context: &RunContext,
    group: &str,
    frozen: &[Frozen<'_>],
    lr: Option<f64>,
    step: u64,
) -> Transition {
    let example = &frozen[0];
    let verdict = verdict(context, example, lr);
    let total = context
        .norm_params
        .values()
        .filter(|p| p.group == group)
        .count();
    let names: Vec<&str> = frozen.iter().map(|f| f.name).collect();
    let dtype = example.info.dtype.map_or("unknown dtype", |d| d.as_str());
    let lr_text = lr.map_or("unknown".to_owned(), sci);
    let mean_text = example
        .mean
        .map_or("not reported".to_owned(), |m| format!("{m:.6}"));
    let mut detail = format!(
        "{} of the {total} norm weights of {group} ({}) had a gradient (e.g. norm {}) and \
         lr {lr_text}, yet update_norm was exactly 0 on each of the last {} reported steps ({}). \
         They are {dtype} with mean {mean_text}. ",
        frozen.len(),
        name_list(&names, 3),
        sci(example.grad_norm),
        example.streak.len,
        step_range(example.streak.first_step, step),
    );
    let (title, fix) = match &verdict {
        Verdict::Underflow {
            step_size,
            smallest,
            magnitude,
        } => {
            detail.push_str(&format!(
                "{} step ≈ {} < {}, the smallest change {dtype} can make {}: every update rounds \
                 away, so the weights never move although gradients flow.",
                context.optimizer.display_name,
                sci(*step_size),
                sci(*smallest),
                describe_magnitude(*magnitude),
            ));
            (
                format!("Norm weights of {group} are frozen: {dtype} rounds every update away"),
                format!(
                    "Keep fp32 master weights: store the parameters in float32 and run the forward \
                     under autocast (torch.autocast(device_type='cuda', dtype=torch.bfloat16)), or \
                     at least keep norm weights in float32. For pure-{dtype} training use an \
                     optimizer with Kahan summation or stochastic rounding. Raising the learning \
                     rate until updates exceed half an ulp is not a fix."
                ),
            )
        }
        Verdict::NotInOptimizer => {
            detail.push_str(
                "The registration says they are not in the optimizer, so nothing updates them.",
            );
            (
                format!("Norm weights of {group} are frozen: not in the optimizer"),
                "Pass these parameters to the optimizer (build it from model.parameters() after \
                 every module is created and wrapped), or set requires_grad=False on purpose."
                    .to_owned(),
            )
        }
        Verdict::ZeroLr => {
            detail.push_str("The learning rate is 0, so every update is 0.");
            (
                format!("Norm weights of {group} are frozen: learning rate is 0"),
                "Check the scheduler (a warm-up that starts at 0 and never rises, a decay that \
                 reached 0) and the lr of this parameter group."
                    .to_owned(),
            )
        }
        Verdict::Unknown(why) => {
            detail.push_str(&format!("No cause is certain: {why}."));
            (
                format!("Norm weights of {group} are frozen"),
                "Check that optimizer.step() runs and updates these tensors in place (not a copy), \
                 that no code restores them each step, and the parameter group's lr and dtype."
                    .to_owned(),
            )
        }
    };
    let mut evidence = json!({
        "cause": verdict.cause(),
        "steps": example.streak.len,
        "first_step": example.streak.first_step,
        "params": names.iter().take(20).collect::<Vec<_>>(),
        "frozen_params": frozen.len(),
        "dtype": example.info.dtype.map(|d| d.as_str()),
        "lr": lr,
        "mean": example.mean,
        "grad_norm": example.grad_norm,
    });
    if let Verdict::Underflow {
        step_size,
        smallest,
        ..
    } = verdict
    {
        evidence["update_estimate"] = json!(step_size);
        evidence["smallest_change"] = json!(smallest);
    }
    Transition::Open(Opened {
        kind: AlertKind::NormWeightFrozen,
        subject: group.to_owned(),
        severity: Severity::Critical,
        first_step: Some(example.streak.first_step),
        step: Some(step),
        title,
        detail,
        fix,
        evidence,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::StepView;
    use crate::detect::Thresholds;
    use crate::detect::testing::transitions;
    use gradflow_protocol::RunRegistration;
    use gradflow_protocol::StepRecord;
    use serde_json::Value;

    fn context(dtype: &str, lr: f64, optimizer: &str, in_optimizer: bool) -> RunContext {
        let registration: RunRegistration = serde_json::from_value(json!({
            "precision": {"param_dtype": dtype},
            "optimizer": {"name": optimizer, "lr": lr, "weight_decay": 0.01},
            "params": [
                {"name": "qwen.layers.0.input_layernorm.weight", "role": "norm", "shape": [896], "in_optimizer": in_optimizer},
                {"name": "qwen.norm.weight", "role": "norm", "shape": [896], "in_optimizer": in_optimizer},
                {"name": "qwen.layers.0.mlp.weight", "role": "linear"}
            ]
        }))
        .unwrap();
        RunContext::new(
            &registration,
            Thresholds {
                frozen_norm_steps: 4,
                ..Thresholds::default()
            },
        )
    }

    fn step(step: u64, update: f64, mean: f64, lr: Option<f64>) -> StepRecord {
        let params: Vec<Value> = ["qwen.layers.0.input_layernorm.weight", "qwen.norm.weight"]
            .iter()
            .map(|n| json!({"name": n, "grad_norm": 3.1e-3, "update_norm": update, "drift": 0.0, "mean": mean}))
            .collect();
        let mut record = json!({"step": step, "params": params});
        if let Some(lr) = lr {
            record["lr"] = json!(lr);
        }
        serde_json::from_value(record).unwrap()
    }

    fn run(context: &RunContext, records: &[StepRecord]) -> Vec<(u64, Transition)> {
        let mut detector = FrozenNormWeight::default();
        transitions(records, |r, out| {
            detector.on_step(&StepView::new(context, r), out)
        })
    }

    fn cause_of(context: &RunContext, mean: f64, lr: Option<f64>) -> (u64, Opened) {
        let records: Vec<_> = (0..6).map(|s| step(s, 0.0, mean, lr)).collect();
        let transitions = run(context, &records);
        assert_eq!(transitions.len(), 1, "{transitions:?}");
        match &transitions[0] {
            (s, Transition::Open(o)) => (*s, o.clone()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bf16_at_one_with_lr_3e_4_is_rounding_and_says_so_with_the_numbers() {
        let ctx = context("bf16", 3e-4, "adamw", true);
        let (step, o) = cause_of(&ctx, 1.0, None);
        assert_eq!(step, 3, "the 4th frozen step opens it");
        assert_eq!(o.subject, "qwen");
        assert_eq!(o.evidence["cause"], "low_precision_underflow");
        assert_eq!(o.evidence["frozen_params"], 2);
        assert!(
            o.detail.contains(
                "adamw step ≈ 3.03e-4 < 1.95e-3, the smallest change bf16 can make just below 1.0"
            ),
            "{}",
            o.detail
        );
        assert!(o.fix.contains("fp32 master weights"));
    }

    #[test]
    fn the_same_dtype_with_other_numbers_gets_another_cause() {
        // bf16 at 1.0 with lr 0.05: updates would survive.
        let (_, o) = cause_of(&context("bf16", 0.05, "adamw", true), 1.0, None);
        assert_eq!(o.evidence["cause"], "unknown");
        assert!(
            o.detail.contains("rounding does not explain it"),
            "{}",
            o.detail
        );
        // bf16 near 0.1 with lr 3e-4: the spacing there is 2^-11.
        let (_, o) = cause_of(&context("bf16", 3e-4, "adamw", true), 0.1, None);
        assert_eq!(o.evidence["cause"], "unknown");
        // f32 at 1.0 with lr 3e-4.
        let (_, o) = cause_of(&context("f32", 3e-4, "adamw", true), 1.0, None);
        assert_eq!(o.evidence["cause"], "unknown");
        // Not in the optimizer, and a zero learning rate.
        let (_, o) = cause_of(&context("bf16", 3e-4, "adamw", false), 1.0, None);
        assert_eq!(o.evidence["cause"], "not_in_optimizer");
        let (_, o) = cause_of(&context("f32", 3e-4, "adamw", true), 1.0, Some(0.0));
        assert_eq!(o.evidence["cause"], "zero_lr");
        // SGD moves by lr × RMS gradient element: tiny here, so it rounds away in bf16.
        let (_, o) = cause_of(&context("bf16", 0.1, "sgd", true), 1.0, None);
        assert_eq!(o.evidence["cause"], "low_precision_underflow");
    }

    #[test]
    fn it_resolves_when_the_weights_move_and_stays_silent_when_they_do() {
        let ctx = context("f32", 3e-4, "adamw", true);
        let mut records: Vec<_> = (0..5).map(|s| step(s, 0.0, 1.0, None)).collect();
        records.push(step(5, 1e-4, 1.0, None));
        let transitions = run(&ctx, &records);
        assert_eq!(transitions.len(), 2);
        assert_eq!(
            transitions[1],
            (
                5,
                Transition::Resolve {
                    kind: AlertKind::NormWeightFrozen,
                    subject: "qwen".into(),
                    step: 5
                }
            )
        );
        let healthy: Vec<_> = (0..50).map(|s| step(s, 1e-4, 1.0, None)).collect();
        assert!(run(&ctx, &healthy).is_empty());
        // Frozen for fewer steps than the threshold, again and again: silent.
        let flicker: Vec<_> = (0..50)
            .map(|s| step(s, if s % 3 == 0 { 1e-4 } else { 0.0 }, 1.0, None))
            .collect();
        assert!(run(&ctx, &flicker).is_empty());
    }

    #[test]
    fn no_gradient_is_not_frozen() {
        let ctx = context("bf16", 3e-4, "adamw", true);
        let records: Vec<StepRecord> = (0..10)
            .map(|s| {
                serde_json::from_value(json!({"step": s, "params": [
                    {"name": "qwen.norm.weight", "grad_norm": 0.0, "update_norm": 0.0, "mean": 1.0}
                ]}))
                .unwrap()
            })
            .collect();
        assert!(run(&ctx, &records).is_empty());
    }
}
