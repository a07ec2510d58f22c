//! `norm_weight_frozen`: norm weights that receive a gradient yet do not move:
//! `update_norm` exactly 0 on every reported step over M step numbers.
//!
//! The case behind it: RMSNorm weights that stayed at exactly 1.0 for a whole run
//! because the parameters were bf16 and every AdamW update was below half a bf16 ulp.
//! The cause is decided from the run's own numbers, best first:
//!
//! 1. the registration: not in the optimizer, or registered as frozen
//!    (`requires_grad: false`) although gradients arrive → `not_in_optimizer`;
//! 2. the intended update (protocol v1.1), exact: every element whose intended update
//!    was non-zero kept its stored value (`rounded_away == intended_nonzero`), or the
//!    largest intended update is under a quarter of the weight's spacing → certainly
//!    `low_precision_underflow`; an intended update of a full spacing or more → not
//!    rounding;
//! 3. without it, a bound: for the Adam family an element moves by `lr·|m̂/√v̂|`, at
//!    most about `lr·(1 + wd·|w|)` and often far less with noisy gradients; if even
//!    that bound is below half the spacing, rounding is certain, otherwise the server
//!    cannot know and says so (cause `unknown`, naming what would decide it). For SGD
//!    the step is estimated as `lr × the RMS gradient element`. Other optimizers
//!    (Adagrad, RMSprop, Muon, …) have no step model here: only intended updates
//!    decide for them.
//!
//! Weights whose parameter group's lr is 0 are not judged (since v1.11; the cause
//! was `zero_lr`): they do not move because of the lr alone, which
//! `lr_vanished` judges for the whole run — a fault when no group trains or a
//! schedule reached 0, a choice when one group is held at 0 beside others that
//! train (a backbone frozen by its lr). Two alerts of one cause said it twice.
//! Nor are weights that moved under their group's higher lr and froze once it had
//! fallen [`LR_FALLEN`] times below its peak (v1.12): the schedule's fall stopped
//! them — a decay at the end of a run, or a per-epoch scheduler stepped per batch,
//! which `lr_vanished` names — and no precision would have kept an update so small.
//!
//! One alert per group: the weights of a group freeze together (one dtype, one lr).
//! The threshold counts step numbers: a weight frozen on every report from step 10
//! to step 29 has been frozen for 20 steps whether the client reported every step or
//! every fifth.
//!
//! The runs are each weight's ([`Streak`]), the episode is the group's. The first
//! weight of a group to reach the threshold opens it and later ones join it
//! silently; it ends when a weight whose run had spanned the threshold thaws and no
//! weight of the group is still frozen for the threshold's span, both judged by the
//! step numbers up to the step at hand, whether the weight was reported on it or
//! not (an episode per weight would end at other steps when weights are reported
//! unevenly).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::context::{NormParam, OptimizerFamily, RunContext};
use super::episode::{Alerts, Streak};
use super::precision::{describe_magnitude, smallest_change};
use super::view::StepView;
use super::wording::{name_list, sci, step_range};
use crate::model::alert::{AlertKind, Opened, Severity};

/// How many times below its group's peak an lr has fallen when a weight that moved
/// under the peak and froze since is the schedule's doing, not the precision's.
pub const LR_FALLEN: f64 = 100.0;

/// A stored state's `open_groups` is read and ignored: the episodes are [`Alerts`]'.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FrozenNormWeight {
    params: BTreeMap<String, WeightRun>,
    /// The highest lr each weight's parameter group has had (by the weight: the
    /// groups' lrs are looked up per weight).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    lr_peaks: BTreeMap<String, f64>,
    /// The weights seen to move (a non-zero update) at least once.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    moved: BTreeSet<String>,
}

/// One weight's run of frozen reports, stored in the layout it had before it
/// counted with [`Streak`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(from = "StoredRun", into = "StoredRun")]
struct WeightRun(Streak);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredRun {
    len: u32,
    first_step: u64,
}

impl From<StoredRun> for WeightRun {
    fn from(stored: StoredRun) -> Self {
        WeightRun(Streak::from_count(stored.len, stored.first_step))
    }
}

impl From<WeightRun> for StoredRun {
    fn from(run: WeightRun) -> Self {
        StoredRun {
            len: run.0.count,
            first_step: run.0.since.unwrap_or_default(),
        }
    }
}

/// What one frozen weight looked like on the step its streak reached the threshold.
struct Frozen<'a> {
    name: &'a str,
    info: &'a NormParam,
    grad_norm: f64,
    mean: Option<f64>,
    lr: Option<f64>,
    /// The weight moved before, and its group's lr has since fallen [`LR_FALLEN`]
    /// times below its peak.
    fallen: bool,
    intended_norm: Option<f64>,
    intended_max_ulp: Option<f64>,
    intended_nonzero: Option<u64>,
    rounded_away: Option<u64>,
    /// The first step of its run, and the run's reports.
    first_step: u64,
    reports: u32,
}

impl FrozenNormWeight {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let (context, record) = (view.context, view.record);
        let step = record.step;
        let threshold = u64::from(context.thresholds.frozen_norm_steps);
        let mut reached: BTreeMap<&str, Vec<Frozen<'_>>> = BTreeMap::new();
        let mut thawed_groups: Vec<&str> = Vec::new();
        for param in &record.params {
            let Some(info) = context.norm_params.get(&param.name) else {
                continue;
            };
            let lr = context.optimizer.lr_of(info.param_group.as_deref(), record);
            if !self.lr_peaks.contains_key(&param.name) {
                self.lr_peaks.insert(param.name.clone(), 0.0);
            }
            let peak = self.lr_peaks.get_mut(&param.name).expect("inserted above");
            if let Some(lr) = lr.filter(|lr| lr.is_finite()) {
                *peak = peak.max(lr);
            }
            let peak = *peak;
            let (Some(grad), Some(update)) = (param.grad_norm, param.update_norm) else {
                continue; // not measured this step
            };
            let frozen = grad.get() > 0.0 && grad.is_finite() && update.get() == 0.0;
            if update.get() > 0.0 && !self.moved.contains(&param.name) {
                self.moved.insert(param.name.clone());
            }
            if !frozen {
                if self
                    .params
                    .remove(&param.name)
                    .is_some_and(|s| s.0.span(step.saturating_sub(1)) >= threshold)
                {
                    thawed_groups.push(&info.group);
                }
                continue;
            }
            let WeightRun(streak) = self.params.entry(param.name.clone()).or_default();
            streak.observe(true, step);
            if streak.spans(threshold, step) {
                reached.entry(&info.group).or_default().push(Frozen {
                    name: &param.name,
                    info,
                    grad_norm: grad.get(),
                    mean: param.mean.map(|m| m.get()),
                    lr,
                    fallen: self.moved.contains(&param.name)
                        && lr.is_some_and(|lr| lr * LR_FALLEN <= peak),
                    intended_norm: param.intended_update_norm.map(|f| f.get()),
                    intended_max_ulp: param.intended_update_max_ulp.map(|f| f.get()),
                    intended_nonzero: param.intended_nonzero,
                    rounded_away: param.rounded_away,
                    first_step: streak.first_step(step),
                    reports: streak.count,
                });
            }
        }
        // An episode ends when none of its group's weights is frozen any longer.
        for group in thawed_groups {
            let still_frozen = self.params.iter().any(|(name, s)| {
                s.0.spans(threshold, step)
                    && context
                        .norm_params
                        .get(name)
                        .is_some_and(|p| p.group == group)
            });
            if !still_frozen {
                alerts.clear(AlertKind::NormWeightFrozen, group, step);
            }
        }
        for (group, frozen) in reached {
            if alerts.holds(AlertKind::NormWeightFrozen, group) || held_by_lr(&frozen[0]) {
                continue;
            }
            alerts.open(open(context, group, &frozen, step));
            // A client that cannot amend its registration (protocol v1) still shows
            // the late unfreeze: weights registered frozen that receive gradients and
            // never move are outside the optimizer.
            let unfrozen: Vec<&str> = frozen
                .iter()
                .filter(|f| !f.info.requires_grad)
                .map(|f| f.name)
                .collect();
            if !unfrozen.is_empty() {
                alerts.open(unfrozen_outside_optimizer(
                    group, &unfrozen, &frozen[0], step,
                ));
            }
        }
    }
}

/// `param_not_in_optimizer` from the steps alone: parameters registered frozen whose
/// records carry gradients while they never change.
fn unfrozen_outside_optimizer(
    group: &str,
    names: &[&str],
    example: &Frozen<'_>,
    step: u64,
) -> Opened {
    Opened {
        kind: AlertKind::ParamNotInOptimizer,
        subject: group.to_owned(),
        severity: Severity::Critical,
        first_step: Some(example.first_step),
        step: Some(step),
        title: format!(
            "{} parameters of {group} were unfrozen but are not in the optimizer",
            names.len()
        ),
        detail: format!(
            "{} parameters of {group} ({}) were registered frozen (requires_grad false), yet \
             since {} their records carry gradients (e.g. norm {}) while they never change: \
             something set requires_grad=True after the optimizer was built, without adding \
             them to it.",
            names.len(),
            name_list(names, 3),
            step_range(example.first_step, step),
            sci(example.grad_norm),
        ),
        fix: "Add the unfrozen parameters to the optimizer (optimizer.add_param_group(\
              {'params': [...]})) or rebuild it after unfreezing; a client that sends \
              registration amendments (protocol v1.1) gets this on the step it happens."
            .into(),
        evidence: json!({
            "cause": "not_in_optimizer",
            "params": names.iter().take(20).collect::<Vec<_>>(),
            "missing_params": names.len(),
            "from_steps": true,
        }),
    }
}

/// Whether the weights are trainable, in the optimizer, and in a parameter group
/// whose lr is 0, or has fallen [`LR_FALLEN`] times below the peak they moved under:
/// the lr alone explains them, and `lr_vanished` judges it.
fn held_by_lr(example: &Frozen<'_>) -> bool {
    example.info.requires_grad
        && example.info.in_optimizer
        && (example.lr == Some(0.0) || example.fallen)
}

/// Why the updates are exactly zero, with the numbers that say so.
enum Verdict {
    /// Registered as frozen, yet gradients arrive: unfrozen without the optimizer.
    UnfrozenOutsideOptimizer,
    NotInOptimizer,
    Underflow(Basis),
    Unknown(String),
}

/// What proves rounding.
enum Basis {
    /// The client counted it: every element with a non-zero intended update kept
    /// its stored value.
    Counted {
        rounded: u64,
        max_ulp: Option<f64>,
        intended_norm: Option<f64>,
    },
    /// The client's largest intended update is under a quarter of the spacing.
    Ratio { max_ulp: f64 },
    /// Even the optimizer's largest plausible step is under half the spacing.
    Bound {
        step_size: f64,
        smallest: f64,
        magnitude: f64,
    },
}

impl Verdict {
    fn cause(&self) -> &'static str {
        match self {
            Verdict::NotInOptimizer | Verdict::UnfrozenOutsideOptimizer => "not_in_optimizer",
            Verdict::Underflow(_) => "low_precision_underflow",
            Verdict::Unknown(_) => "unknown",
        }
    }
}

/// Below this many ulps (the spacing above the weight) an update rounds away in
/// either direction: at a power of two the spacing below is half the one above.
const CERTAIN_ULP: f64 = 0.25;
/// At this many ulps or more an update always changes the stored value.
const MOVES_ULP: f64 = 1.0;

fn verdict(context: &RunContext, example: &Frozen<'_>) -> Verdict {
    if !example.info.requires_grad {
        return Verdict::UnfrozenOutsideOptimizer;
    }
    if !example.info.in_optimizer {
        return Verdict::NotInOptimizer;
    }
    if let (Some(nonzero), Some(rounded)) = (example.intended_nonzero, example.rounded_away) {
        if nonzero == 0 {
            return Verdict::Unknown(
                "the optimizer computed an update of exactly 0 for every element \
                 (intended_nonzero 0), so nothing was rounded away: its state or this \
                 parameter group's settings make it step by nothing"
                    .into(),
            );
        }
        if rounded == nonzero {
            return Verdict::Underflow(Basis::Counted {
                rounded,
                max_ulp: example.intended_max_ulp,
                intended_norm: example.intended_norm,
            });
        }
        return Verdict::Unknown(format!(
            "{rounded} of the {nonzero} elements with a non-zero intended update were rounded \
             away, yet update_norm is 0: the computed update is not reaching these tensors"
        ));
    }
    if let Some(max_ulp) = example.intended_max_ulp {
        if max_ulp < CERTAIN_ULP {
            return Verdict::Underflow(Basis::Ratio { max_ulp });
        }
        if max_ulp >= MOVES_ULP {
            return Verdict::Unknown(format!(
                "the optimizer meant to move some elements by {} ulp, which no rounding \
                 undoes, so rounding is excluded: the computed update is not reaching these \
                 tensors",
                sci(max_ulp)
            ));
        }
    }
    let Some(lr) = example.lr else {
        return Verdict::Unknown("the run reports no learning rate".into());
    };
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
    let wd = optimizer.weight_decay_of(example.info.param_group.as_deref());
    let ask = "send the intended update (protocol v1.1: intended_update_max_ulp, \
               rounded_away) to decide";
    match optimizer.family {
        OptimizerFamily::Adam => {
            // An element moves by lr·|m̂/√v̂| (about lr at most) plus decoupled weight
            // decay lr·wd·|w|.
            let bound = lr * (1.0 + wd * mean.abs());
            if bound <= smallest {
                Verdict::Underflow(Basis::Bound {
                    step_size: bound,
                    smallest,
                    magnitude: mean,
                })
            } else {
                Verdict::Unknown(format!(
                    "rounding may explain it but the numbers sent cannot tell: {}'s step is at \
                     most about lr·(1 + wd·|w|) ≈ {}, above {}, the smallest change {} can make \
                     {}, but its real step lr·m̂/(√v̂+ε) is often far smaller with noisy \
                     gradients; {ask}",
                    optimizer.display_name,
                    sci(bound),
                    sci(smallest),
                    dtype.as_str(),
                    describe_magnitude(mean)
                ))
            }
        }
        OptimizerFamily::Sgd => {
            let numel = example.info.numel.unwrap_or(1).max(1) as f64;
            let estimate = lr * example.grad_norm / numel.sqrt();
            if estimate <= smallest {
                Verdict::Underflow(Basis::Bound {
                    step_size: estimate,
                    smallest,
                    magnitude: mean,
                })
            } else {
                Verdict::Unknown(format!(
                    "{}'s step ≈ lr × the RMS gradient element ≈ {} is above {}, the smallest \
                     change {} can make {}, so rounding does not explain a plain SGD step; \
                     momentum or clipping would change that, so {ask}",
                    optimizer.display_name,
                    sci(estimate),
                    sci(smallest),
                    dtype.as_str(),
                    describe_magnitude(mean)
                ))
            }
        }
        OptimizerFamily::Other => Verdict::Unknown(format!(
            "gradflow has no model of {}'s step size; {ask}",
            optimizer.display_name
        )),
    }
}

fn open(context: &RunContext, group: &str, frozen: &[Frozen<'_>], step: u64) -> Opened {
    let example = &frozen[0];
    let lr = example.lr;
    let verdict = verdict(context, example);
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
        example.reports,
        step_range(example.first_step, step),
    );
    let (title, fix) = match &verdict {
        Verdict::Underflow(basis) => {
            detail.push_str(&match basis {
                Basis::Counted {
                    rounded,
                    max_ulp,
                    intended_norm,
                } => format!(
                    "{} meant to change {rounded} elements (intended update norm {}, the largest \
                     {} of an ulp), and every one of them kept its stored value: each update is \
                     below half the spacing of {dtype} at the weight, so it rounds away and the \
                     weights never move although gradients flow.",
                    context.optimizer.display_name,
                    intended_norm.map_or("not reported".to_owned(), sci),
                    max_ulp.map_or("not reported".to_owned(), sci),
                ),
                Basis::Ratio { max_ulp } => format!(
                    "{}'s largest intended update is {} of an ulp of {dtype} at the weight, under \
                     the quarter ulp below which every update rounds away, so the weights never \
                     move although gradients flow.",
                    context.optimizer.display_name,
                    sci(*max_ulp),
                ),
                Basis::Bound {
                    step_size,
                    smallest,
                    magnitude,
                } => format!(
                    "{} step ≈ {} < {}, the smallest change {dtype} can make {}: every update \
                     rounds away, so the weights never move although gradients flow.",
                    context.optimizer.display_name,
                    sci(*step_size),
                    sci(*smallest),
                    describe_magnitude(*magnitude),
                ),
            });
            (
                format!("Norm weights of {group} are frozen: {dtype} rounds every update away"),
                super::precision::MASTER_WEIGHTS_FIX.to_owned(),
            )
        }
        Verdict::UnfrozenOutsideOptimizer => {
            detail.push_str(
                "They were registered as frozen (requires_grad false), yet their records carry \
                 gradients: something unfroze them after registration without adding them to \
                 the optimizer, so nothing updates them.",
            );
            (
                format!("Norm weights of {group} are frozen: unfrozen outside the optimizer"),
                "After setting requires_grad=True on parameters the optimizer was built without, \
                 add them to it (optimizer.add_param_group({'params': [...]})), or rebuild the \
                 optimizer. A client that can send registration amendments (protocol v1.1) \
                 lets gradflow say this on the step it happens."
                    .to_owned(),
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
    let evidence = evidence(&verdict, example, &names, frozen.len(), lr);
    Opened {
        kind: AlertKind::NormWeightFrozen,
        subject: group.to_owned(),
        severity: Severity::Critical,
        first_step: Some(example.first_step),
        step: Some(step),
        title,
        detail,
        fix,
        evidence,
    }
}

/// The alert's evidence: what was measured, and the numbers behind the verdict.
fn evidence(
    verdict: &Verdict,
    example: &Frozen<'_>,
    names: &[&str],
    frozen: usize,
    lr: Option<f64>,
) -> serde_json::Value {
    let mut evidence = json!({
        "cause": verdict.cause(),
        "steps": example.reports,
        "first_step": example.first_step,
        "params": names.iter().take(20).collect::<Vec<_>>(),
        "frozen_params": frozen,
        "dtype": example.info.dtype.map(|d| d.as_str()),
        "lr": lr,
        "mean": example.mean,
        "grad_norm": example.grad_norm,
    });
    match *verdict {
        Verdict::Underflow(Basis::Bound {
            step_size,
            smallest,
            ..
        }) => {
            evidence["update_estimate"] = json!(step_size);
            evidence["smallest_change"] = json!(smallest);
            evidence["basis"] = json!("lr_bound");
        }
        Verdict::Underflow(Basis::Counted { rounded, .. }) => {
            evidence["basis"] = json!("rounded_away");
            evidence["rounded_away"] = json!(rounded);
        }
        Verdict::Underflow(Basis::Ratio { .. }) => {
            evidence["basis"] = json!("intended_update_max_ulp");
        }
        _ => {}
    }
    if example.intended_max_ulp.is_some() {
        evidence["intended_update_max_ulp"] = json!(example.intended_max_ulp);
        evidence["intended_update_norm"] = json!(example.intended_norm);
        evidence["intended_nonzero"] = json!(example.intended_nonzero);
    }
    evidence
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::transitions;
    use crate::detect::thresholds::Thresholds;
    use crate::detect::view::StepView;
    use crate::model::alert::Transition;
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
        // bf16 at 1.0 with lr 0.05: Adam's step could be large enough, or far smaller;
        // without intended updates the server says it cannot tell, and what would.
        let (_, o) = cause_of(&context("bf16", 0.05, "adamw", true), 1.0, None);
        assert_eq!(o.evidence["cause"], "unknown");
        assert!(o.detail.contains("cannot tell"), "{}", o.detail);
        assert!(o.detail.contains("rounded_away"), "{}", o.detail);
        assert!(!o.detail.contains("does not explain"), "{}", o.detail);
        // An optimizer gradflow has no step model for is not taken for SGD.
        let (_, o) = cause_of(&context("bf16", 1e-9, "Adagrad", true), 1.0, None);
        assert_eq!(o.evidence["cause"], "unknown");
        assert!(o.detail.contains("no model of Adagrad"), "{}", o.detail);
        // bf16 near 0.1 with lr 3e-4: the spacing there is 2^-11.
        let (_, o) = cause_of(&context("bf16", 3e-4, "adamw", true), 0.1, None);
        assert_eq!(o.evidence["cause"], "unknown");
        // f32 at 1.0 with lr 3e-4.
        let (_, o) = cause_of(&context("f32", 3e-4, "adamw", true), 1.0, None);
        assert_eq!(o.evidence["cause"], "unknown");
        // Not in the optimizer; a zero learning rate is lr_vanished's to judge.
        let (_, o) = cause_of(&context("bf16", 3e-4, "adamw", false), 1.0, None);
        assert_eq!(o.evidence["cause"], "not_in_optimizer");
        let records: Vec<_> = (0..6).map(|s| step(s, 0.0, 1.0, Some(0.0))).collect();
        assert!(run(&context("f32", 3e-4, "adamw", true), &records).is_empty());
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
                    step: 5,
                    last_step: Some(4),
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

    /// Six frozen steps of both norm weights with the given intended-update fields.
    fn intended_cause(ctx: &RunContext, fields: Value) -> Opened {
        let records: Vec<StepRecord> = (0..6)
            .map(|s| {
                let mut r = serde_json::to_value(step(s, 0.0, 1.0, None)).unwrap();
                for p in r["params"].as_array_mut().unwrap() {
                    for (k, v) in fields.as_object().unwrap() {
                        p[k] = v.clone();
                    }
                }
                serde_json::from_value(r).unwrap()
            })
            .collect();
        let t = run(ctx, &records);
        match &t[..] {
            [(_, Transition::Open(o))] => o.clone(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn intended_updates_decide_where_lr_cannot() {
        // bf16 at lr 2e-2: the lr bound (2e-2) is far above half an ulp at 1.0, yet
        // Adam's real steps with noisy gradients were tiny: the client's count proves
        // rounding.
        let ctx = context("bf16", 2e-2, "adamw", true);
        let o = intended_cause(
            &ctx,
            json!({"intended_update_norm": 4.4e-3, "intended_update_max_ulp": 0.31,
                   "intended_nonzero": 896, "rounded_away": 896}),
        );
        assert_eq!(o.evidence["cause"], "low_precision_underflow");
        assert_eq!(o.evidence["basis"], "rounded_away");
        assert!(
            o.detail.contains("meant to change 896 elements"),
            "{}",
            o.detail
        );
        // Only the ratio: under a quarter ulp is certain.
        let o = intended_cause(&ctx, json!({"intended_update_max_ulp": 0.1}));
        assert_eq!(o.evidence["cause"], "low_precision_underflow");
        assert_eq!(o.evidence["basis"], "intended_update_max_ulp");
        // A full ulp or more: rounding is excluded, whatever the lr says.
        let ctx_small_lr = context("bf16", 3e-4, "adamw", true);
        let o = intended_cause(&ctx_small_lr, json!({"intended_update_max_ulp": 3.0}));
        assert_eq!(o.evidence["cause"], "unknown");
        assert!(o.detail.contains("rounding is excluded"), "{}", o.detail);
        // Some elements were not rounded away and still nothing moved: not rounding.
        let o = intended_cause(
            &ctx,
            json!({"intended_update_max_ulp": 0.4, "intended_nonzero": 896, "rounded_away": 100}),
        );
        assert_eq!(o.evidence["cause"], "unknown");
        // f32 and f16 weights with the client's count.
        for dtype in ["f32", "f16"] {
            let o = intended_cause(
                &context(dtype, 1e-9, "sgd", true),
                json!({"intended_update_max_ulp": 0.2, "intended_nonzero": 4, "rounded_away": 4}),
            );
            assert_eq!(o.evidence["cause"], "low_precision_underflow", "{dtype}");
        }
    }

    #[test]
    fn a_group_held_at_lr_zero_is_not_judged_even_when_the_record_says_another_lr() {
        let registration: RunRegistration = serde_json::from_value(json!({
            "precision": {"param_dtype": "f32"},
            "optimizer": {"name": "adamw", "lr": 1e-3, "param_groups": [
                {"name": "decay", "lr": 1e-3}, {"name": "no_decay", "lr": 0.0}]},
            "params": [
                {"name": "qwen.layers.0.input_layernorm.weight", "role": "norm", "shape": [896], "param_group": "no_decay"},
                {"name": "qwen.norm.weight", "role": "norm", "shape": [896], "param_group": "no_decay"}
            ]
        }))
        .unwrap();
        let ctx = RunContext::new(
            &registration,
            Thresholds {
                frozen_norm_steps: 4,
                ..Thresholds::default()
            },
        );
        // The group's own lr (0, registered) decides, not the record's run-wide one.
        let records: Vec<_> = (0..6).map(|s| step(s, 0.0, 1.0, Some(1e-3))).collect();
        assert!(run(&ctx, &records).is_empty());
    }

    #[test]
    fn weights_that_froze_once_the_schedule_cut_their_lr_a_hundredfold_are_the_lrs() {
        let ctx = context("f32", 1e-3, "sgd", true);
        // They moved under lr 1e-3, then a step schedule took the lr down tenfold
        // every 2 steps: the updates round away from 1e-7 on.
        let mut records: Vec<_> = (0..4).map(|s| step(s, 1e-4, 1.0, Some(1e-3))).collect();
        records.extend((4..14).map(|s| {
            let lr = 1e-3 * 0.1f64.powi((s as i32 - 2) / 2);
            step(s, if lr > 1e-7 { 1e-6 } else { 0.0 }, 1.0, Some(lr))
        }));
        assert!(run(&ctx, &records).is_empty(), "the schedule's fall stopped them");
        // The same weights frozen while the lr stays at its peak are judged.
        let mut records: Vec<_> = (0..4).map(|s| step(s, 1e-4, 1.0, Some(1e-3))).collect();
        records.extend((4..14).map(|s| step(s, 0.0, 1.0, Some(1e-3))));
        assert_eq!(run(&ctx, &records).len(), 1);
        // And weights that never moved, with the lr fallen since: the precision was
        // theirs from the start.
        let records: Vec<_> = (0..10)
            .map(|s| step(s, 0.0, 1.0, Some(if s < 2 { 1e-3 } else { 1e-6 })))
            .collect();
        assert_eq!(run(&ctx, &records).len(), 1);
    }

    #[test]
    fn a_weight_registered_frozen_that_gets_gradients_was_unfrozen_outside_the_optimizer() {
        let registration: RunRegistration = serde_json::from_value(json!({
            "precision": {"param_dtype": "f32"},
            "optimizer": {"name": "adamw", "lr": 1e-3},
            "params": [
                {"name": "qwen.norm.weight", "role": "norm", "requires_grad": false, "in_optimizer": false}
            ]
        }))
        .unwrap();
        let ctx = RunContext::new(
            &registration,
            Thresholds {
                frozen_norm_steps: 4,
                ..Thresholds::default()
            },
        );
        let records: Vec<_> = (0..6).map(|s| step(s, 0.0, 1.0, None)).collect();
        let t = run(&ctx, &records);
        let opened: Vec<&Opened> = t
            .iter()
            .filter_map(|(_, t)| match t {
                Transition::Open(o) => Some(o),
                Transition::Resolve { .. } => None,
            })
            .collect();
        assert_eq!(opened.len(), 2, "{t:?}");
        assert_eq!(opened[0].evidence["cause"], "not_in_optimizer");
        assert!(
            opened[0].title.contains("unfrozen outside the optimizer"),
            "{}",
            opened[0].title
        );
        // The steps alone prove the parameter is outside the optimizer.
        assert_eq!(opened[1].kind, AlertKind::ParamNotInOptimizer);
        assert_eq!(opened[1].subject, "qwen");
    }

    #[test]
    fn the_threshold_counts_step_numbers_not_reports() {
        let ctx = context("bf16", 3e-4, "adamw", true);
        // Reported every 2nd step: the 4-step threshold is reached at step 3 whether
        // or not steps 1 and 3 were reported.
        let sparse: Vec<_> = (0..8).step_by(2).map(|s| step(s, 0.0, 1.0, None)).collect();
        let t = run(&ctx, &sparse);
        assert_eq!(t.len(), 1, "{t:?}");
        assert_eq!(t[0].0, 4, "step 4 is the first report at or past step 3");
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
