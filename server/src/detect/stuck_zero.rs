//! `grad_stuck_zero`: a group or module with trainable parameters whose gradient norm
//! is exactly 0, or absent, on N consecutive reported steps.
//!
//! The case behind it: a hybrid model whose Qwen part trained for hours at
//! `Qwen_grad: 0.00e+00` because a stray `torch.no_grad()` or `.detach()` cut the
//! graph. Healthy patterns stay silent by construction: a zero on step 0 only is a
//! streak of one, and a model that back-propagates into Qwen every 10th step (prompt
//! caching) never gets past nine.
//!
//! A whole group stuck is one alert on the group. Modules are named individually
//! only when their group as a whole is not stuck (a few dead modules inside a
//! healthy group). Steps where an entity is not reported neither extend nor break
//! its streak: "not measured" is not "zero".

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{
    AlertKind, GroupMap, Opened, RunContext, Severity, StepView, Transition, sci, step_range,
};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StuckZeroGrad {
    groups: BTreeMap<String, Streak>,
    modules: BTreeMap<String, Streak>,
}

/// A run of consecutive zero-gradient steps of one group or module.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Streak {
    len: u32,
    first_step: u64,
    /// Steps of the streak on which every backward hook reported 0 hits.
    hooks_silent: u32,
    /// Steps of the streak on which no gradient tensor existed (`null`).
    missing: u32,
    open: bool,
}

/// One step's reading of a group or module.
#[derive(Debug, Clone, Copy)]
struct Reading {
    zero: bool,
    hooks_silent: bool,
    missing: bool,
    modules: usize,
    norm: f64,
}

impl Reading {
    fn merge(&mut self, other: Reading) {
        self.zero &= other.zero;
        self.hooks_silent &= other.hooks_silent;
        self.missing &= other.missing;
        self.modules += other.modules;
        self.norm = (self.norm * self.norm + other.norm * other.norm).sqrt();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    BackwardNotReached,
    ZeroGradient,
    GradMissing,
}

impl Cause {
    fn of(streak: &Streak) -> Cause {
        if streak.hooks_silent == streak.len {
            Cause::BackwardNotReached
        } else if streak.missing == streak.len {
            Cause::GradMissing
        } else {
            Cause::ZeroGradient
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Cause::BackwardNotReached => "backward_not_reached",
            Cause::ZeroGradient => "zero_gradient",
            Cause::GradMissing => "grad_missing",
        }
    }
}

impl Streak {
    /// Folds in one step; returns whether an open episode just ended.
    fn update(&mut self, step: u64, reading: Reading) -> bool {
        if !reading.zero {
            let was_open = self.open;
            *self = Streak::default();
            return was_open;
        }
        if self.len == 0 {
            self.first_step = step;
        }
        self.len += 1;
        self.hooks_silent += u32::from(reading.hooks_silent);
        self.missing += u32::from(reading.missing);
        false
    }
}

impl StuckZeroGrad {
    pub fn on_step(&mut self, view: &StepView<'_>, out: &mut Vec<Transition>) {
        let (context, record) = (view.context, view.record);
        let step = record.step;
        let threshold = context.thresholds.stuck_zero_steps;
        let mut module_readings: Vec<(&str, &str, Reading)> = Vec::new();
        let mut group_readings: GroupMap<Option<Reading>> = GroupMap::default();
        for (module, info) in view.trainable_modules() {
            let group = info.group.as_str();
            let norm = module.grad_norm.map(|n| n.get());
            let reading = Reading {
                zero: norm.is_none_or(|n| n == 0.0),
                hooks_silent: module.hook_hits == Some(0),
                missing: norm.is_none(),
                modules: 1,
                norm: norm.filter(|n| n.is_finite()).unwrap_or(0.0),
            };
            module_readings.push((&module.module, group, reading));
            match group_readings.entry(group) {
                Some(g) => g.merge(reading),
                slot => *slot = Some(reading),
            }
        }

        for (group, reading) in group_readings.iter() {
            let reading = reading.expect("set when the group was entered");
            let Some(streak) = streak_for(&mut self.groups, group, reading) else {
                continue;
            };
            if streak.update(step, reading) {
                out.push(resolve(group, step));
            }
            if streak.len >= threshold && !streak.open {
                streak.open = true;
                let others = healthy_others(&group_readings, group);
                out.push(open(
                    context,
                    group,
                    None,
                    reading.modules,
                    streak,
                    step,
                    &others,
                ));
            }
        }
        for (module, group, reading) in module_readings {
            let Some(streak) = streak_for(&mut self.modules, module, reading) else {
                continue;
            };
            if streak.update(step, reading) {
                out.push(resolve(module, step));
            }
            let group_stuck = self.groups.get(group).is_some_and(|g| g.open);
            if streak.len >= threshold && !streak.open && !group_stuck {
                streak.open = true;
                out.push(open(context, module, Some(group), 1, streak, step, &[]));
            }
        }
        // Keep only what carries information: streaks in progress and open episodes.
        self.groups.retain(|_, s| s.len > 0 || s.open);
        self.modules.retain(|_, s| s.len > 0 || s.open);
    }
}

/// The streak to update for a reading: the existing one, or a new one for a zero
/// reading. A healthy entity without a streak has nothing to update, and on the hot
/// path (every module of every step) that saves allocating its name.
fn streak_for<'a>(
    streaks: &'a mut BTreeMap<String, Streak>,
    name: &str,
    reading: Reading,
) -> Option<&'a mut Streak> {
    if !streaks.contains_key(name) {
        if !reading.zero {
            return None;
        }
        streaks.insert(name.to_owned(), Streak::default());
    }
    streaks.get_mut(name)
}

/// Groups with a non-zero gradient this step, for the contrast in the detail.
fn healthy_others(readings: &GroupMap<Option<Reading>>, stuck: &str) -> Vec<(String, f64)> {
    readings
        .iter()
        .filter_map(|(g, r)| r.map(|r| (g, r)))
        .filter(|(g, r)| *g != stuck && !r.zero)
        .map(|(g, r)| (g.to_owned(), r.norm))
        .collect()
}

fn resolve(subject: &str, step: u64) -> Transition {
    Transition::Resolve {
        kind: AlertKind::GradStuckZero,
        subject: subject.to_owned(),
        step,
    }
}

fn open(
    context: &RunContext,
    subject: &str,
    module_of_group: Option<&str>,
    modules: usize,
    streak: &Streak,
    step: u64,
    others: &[(String, f64)],
) -> Transition {
    let cause = Cause::of(streak);
    let what = match module_of_group {
        Some(group) => format!("Module {subject} (group {group})"),
        None => {
            let total = context
                .trainable_modules_per_group
                .get(subject)
                .copied()
                .unwrap_or(modules);
            format!("Group {subject} ({modules} of its {total} trainable modules reported)")
        }
    };
    let title = match cause {
        Cause::BackwardNotReached => format!("Backward never reaches {subject}"),
        Cause::ZeroGradient => format!("Gradient of {subject} is exactly zero"),
        Cause::GradMissing => format!("{subject} gets no gradient"),
    } + &format!(": gradient norm 0 for {} steps", streak.len);
    let why = match cause {
        Cause::BackwardNotReached => {
            "Their backward hooks never fired (hook_hits 0): backward never reached them, \
             so the graph is cut between them and the loss."
        }
        Cause::ZeroGradient => {
            "Their backward hooks fired, so backward reached them, but the gradient that \
             arrived was exactly zero."
        }
        Cause::GradMissing => {
            "No gradient tensor was produced for their parameters (grad is None after backward)."
        }
    };
    let mut detail = format!(
        "{what} had gradient norm 0.00e+00 or no gradient on each of the last {} reported steps \
         ({}). {why}",
        streak.len,
        step_range(streak.first_step, step),
    );
    if !others.is_empty() {
        let contrast: Vec<String> = others
            .iter()
            .map(|(g, n)| format!("{g} {}", sci(*n)))
            .collect();
        detail.push_str(&format!(
            " Meanwhile other groups train (gradient norm at step {step}: {}).",
            contrast.join(", ")
        ));
    }
    let fix = match cause {
        Cause::BackwardNotReached => format!(
            "Find where the path from {subject}'s output to the loss is cut: a torch.no_grad() or \
             torch.inference_mode() block, a .detach(), a .item()/.tolist()/.numpy() round trip, or \
             a cached tensor computed in an earlier step (e.g. a prompt embedding). Just before \
             the consumer, check that the tensor has requires_grad=True and a grad_fn."
        ),
        Cause::ZeroGradient => format!(
            "Backward reaches {subject} but carries zeros: look for a multiplicative mask or gate \
             that is all zero (a loss or attention mask, a zero-initialised gate), dead ReLUs, or \
             a loss term that does not depend on {subject}'s output."
        ),
        Cause::GradMissing => format!(
            "{subject}'s parameters are not in the graph that backward walks: check that forward \
             uses the same parameter objects the optimizer holds (not a copy made before \
             wrapping or loading), and that requires_grad was not switched off."
        ),
    };
    Transition::Open(Opened {
        kind: AlertKind::GradStuckZero,
        subject: subject.to_owned(),
        severity: Severity::Critical,
        first_step: Some(streak.first_step),
        step: Some(step),
        title,
        detail,
        fix,
        evidence: json!({
            "cause": cause.as_str(),
            "steps": streak.len,
            "first_step": streak.first_step,
            "modules": modules,
            "hooks_silent_steps": streak.hooks_silent,
            "missing_steps": streak.missing,
        }),
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

    /// A run with groups qwen (3 trainable modules) and agent (2), threshold 5.
    fn context() -> RunContext {
        let registration: RunRegistration = serde_json::from_value(json!({"params": [
            {"name": "qwen.a.weight"}, {"name": "qwen.b.weight"}, {"name": "qwen.c.weight"},
            {"name": "agent.x.weight"}, {"name": "agent.y.weight"},
            {"name": "qwen.frozen.weight", "requires_grad": false}
        ]}))
        .unwrap();
        let thresholds = Thresholds {
            stuck_zero_steps: 5,
            ..Thresholds::default()
        };
        RunContext::new(&registration, thresholds)
    }

    /// A step where each module has the given (grad_norm, hook_hits).
    fn record(step: u64, modules: &[(&str, Value, u32)]) -> StepRecord {
        let modules: Vec<Value> = modules
            .iter()
            .map(|(m, g, h)| json!({"module": m, "grad_norm": g, "hook_hits": h}))
            .collect();
        serde_json::from_value(json!({"step": step, "modules": modules})).unwrap()
    }

    fn detached(step: u64) -> StepRecord {
        record(
            step,
            &[
                ("qwen.a", Value::Null, 0),
                ("qwen.b", Value::Null, 0),
                ("qwen.c", Value::Null, 0),
                ("agent.x", json!(0.5), 1),
                ("agent.y", json!(0.25), 1),
            ],
        )
    }

    fn healthy(step: u64) -> StepRecord {
        record(
            step,
            &[
                ("qwen.a", json!(0.1), 1),
                ("qwen.b", json!(0.2), 1),
                ("qwen.c", json!(0.3), 1),
                ("agent.x", json!(0.5), 1),
                ("agent.y", json!(0.25), 1),
            ],
        )
    }

    fn run(records: &[StepRecord]) -> Vec<(u64, Transition)> {
        let context = context();
        let mut detector = StuckZeroGrad::default();
        transitions(records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        })
    }

    fn opened(t: &Transition) -> &Opened {
        match t {
            Transition::Open(o) => o,
            other => panic!("expected an open, got {other:?}"),
        }
    }

    #[test]
    fn a_cut_graph_opens_one_group_alert_exactly_at_the_threshold() {
        let transitions = run(&(0..8).map(detached).collect::<Vec<_>>());
        assert_eq!(transitions.len(), 1, "{transitions:?}");
        let (step, t) = &transitions[0];
        assert_eq!(*step, 4, "the 5th zero step opens it, not the 4th");
        let o = opened(t);
        assert_eq!(o.subject, "qwen");
        assert_eq!(o.evidence["cause"], "backward_not_reached");
        assert_eq!(o.evidence["modules"], 3);
        assert_eq!(o.step, Some(4));
        assert_eq!(o.first_step, Some(0));
        assert!(o.detail.contains("steps 0–4"), "{}", o.detail);
        assert!(o.detail.contains("agent 5.59e-1"), "{}", o.detail);
        assert!(o.fix.contains("no_grad"));
    }

    #[test]
    fn it_resolves_on_the_first_step_with_a_gradient() {
        let mut records: Vec<_> = (0..6).map(detached).collect();
        records.push(healthy(6));
        records.push(healthy(7));
        let transitions = run(&records);
        assert_eq!(transitions.len(), 2);
        assert_eq!(
            transitions[1],
            (
                6,
                Transition::Resolve {
                    kind: AlertKind::GradStuckZero,
                    subject: "qwen".into(),
                    step: 6
                }
            )
        );
    }

    #[test]
    fn causes_come_from_the_evidence() {
        let zero = |s| {
            record(
                s,
                &[
                    ("qwen.a", json!(0.0), 1),
                    ("qwen.b", json!(0.0), 1),
                    ("qwen.c", json!(0.0), 1),
                ],
            )
        };
        let missing = |s| {
            record(
                s,
                &[
                    ("qwen.a", Value::Null, 1),
                    ("qwen.b", Value::Null, 1),
                    ("qwen.c", Value::Null, 1),
                ],
            )
        };
        for (make, cause) in [
            (&zero as &dyn Fn(u64) -> StepRecord, "zero_gradient"),
            (&missing, "grad_missing"),
            (&detached, "backward_not_reached"),
        ] {
            let transitions = run(&(0..5).map(make).collect::<Vec<_>>());
            assert_eq!(opened(&transitions[0].1).evidence["cause"], cause);
        }
    }

    #[test]
    fn healthy_and_intermittent_streams_stay_silent() {
        // Zero at step 0 only, as in the original log.
        let mut records = vec![detached(0)];
        records.extend((1..100).map(healthy));
        assert!(run(&records).is_empty());
        // Qwen back-propagated only every 10th step (prompt caching): nine zeros in ten.
        let cached: Vec<_> = (0..200)
            .map(|s| if s % 10 == 0 { healthy(s) } else { detached(s) })
            .collect();
        let context = RunContext::new(&context().registration, Thresholds::default());
        let mut detector = StuckZeroGrad::default();
        let mut out = Vec::new();
        for r in &cached {
            detector.on_step(&StepView::new(&context, r), &mut out);
        }
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn unreported_steps_neither_extend_nor_break_a_streak() {
        let mut records = Vec::new();
        for s in 0..4 {
            records.push(detached(s));
        }
        records.push(record(4, &[("agent.x", json!(0.5), 1)])); // qwen not measured
        records.push(detached(5));
        let transitions = run(&records);
        assert_eq!(transitions.len(), 1);
        assert_eq!(transitions[0].0, 5);
    }

    #[test]
    fn a_few_dead_modules_in_a_healthy_group_are_named_individually() {
        let records: Vec<_> = (0..6)
            .map(|s| {
                record(
                    s,
                    &[
                        ("qwen.a", json!(0.0), 1),
                        ("qwen.b", json!(0.2), 1),
                        ("qwen.c", json!(0.3), 1),
                    ],
                )
            })
            .collect();
        let transitions = run(&records);
        assert_eq!(transitions.len(), 1);
        let o = opened(&transitions[0].1);
        assert_eq!(o.subject, "qwen.a");
        assert!(
            o.detail.starts_with("Module qwen.a (group qwen)"),
            "{}",
            o.detail
        );
    }

    #[test]
    fn modules_without_trainable_parameters_are_ignored() {
        let records: Vec<_> = (0..10)
            .map(|s| {
                record(
                    s,
                    &[("qwen.frozen", Value::Null, 0), ("qwen.a", json!(1.0), 1)],
                )
            })
            .collect();
        assert!(run(&records).is_empty());
    }

    #[test]
    fn state_survives_serialization_mid_streak() {
        let context = context();
        let mut detector = StuckZeroGrad::default();
        let mut out = Vec::new();
        for s in 0..3 {
            detector.on_step(&StepView::new(&context, &detached(s)), &mut out);
        }
        let saved = serde_json::to_string(&detector).unwrap();
        let mut restored: StuckZeroGrad = serde_json::from_str(&saved).unwrap();
        restored.on_step(&StepView::new(&context, &detached(3)), &mut out);
        assert!(out.is_empty());
        restored.on_step(&StepView::new(&context, &detached(4)), &mut out);
        assert_eq!(out.len(), 1);
    }
}
