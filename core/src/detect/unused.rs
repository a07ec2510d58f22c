//! `unused_parameters` (gradflow's own kind): trainable modules of the registration
//! that no step reported during the run's first N steps (N = `stuck_zero_steps`,
//! counted in step numbers from the first step that reported modules): their parameters take part in no forward pass that reaches
//! the loss. Hook-based reporters only see modules that backward reaches, so these
//! are absent rather than zero; modules reported with zeros are `grad_stuck_zero`'s.
//!
//! A client may report modules at another granularity than its parameters' modules
//! (whole blocks, say). Then most registered modules are never seen, which says
//! nothing: the check stays silent unless at least half of them were seen.
//!
//! Decided once, on the first report at or past the N-th step; a listed module that later arrives with a
//! gradient leaves the list, and the alert resolves when its list is empty.

use std::collections::BTreeMap;

// Looked up for every reported module of every step while a list is open: Fx
// hashing beats comparing long module names down a B-tree. Order only matters in
// the alert's text, which sorts.
use rustc_hash::FxHashSet;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::context::RunContext;
use super::episode::Alerts;
use super::view::StepView;
use super::wording::name_list;
use crate::model::alert::{AlertKind, Opened, Severity};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct UnusedParameters {
    reported_steps: u32,
    /// The first step that reported modules.
    first_step: Option<u64>,
    /// Trainable modules seen so far; emptied once decided.
    seen: FxHashSet<String>,
    decided: bool,
    /// Per group, the modules still unused.
    unused: BTreeMap<String, FxHashSet<String>>,
}

impl UnusedParameters {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let (context, record) = (view.context, view.record);
        if record.modules.is_empty() {
            return;
        }
        if self.decided {
            self.forgive_arrivals(view, alerts);
            return;
        }
        for (module, _) in view.trainable_modules() {
            if !self.seen.contains(&module.module) {
                self.seen.insert(module.module.clone());
            }
        }
        self.reported_steps += 1;
        let first = *self.first_step.get_or_insert(record.step);
        if record.step - first + 1 < u64::from(context.thresholds.stuck_zero_steps) {
            return;
        }
        self.decided = true;
        let seen = std::mem::take(&mut self.seen);
        let total = context.trainable_modules.len();
        if seen.len() * 2 < total {
            return; // reported at another granularity: absence says nothing
        }
        for (module, info) in &context.trainable_modules {
            if !seen.contains(module) {
                self.unused
                    .entry(info.group.clone())
                    .or_default()
                    .insert(module.clone());
            }
        }
        for (group, modules) in &self.unused {
            alerts.open(opened(
                context,
                group,
                modules,
                self.reported_steps,
                record.step,
            ));
        }
    }

    fn forgive_arrivals(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        if self.unused.is_empty() {
            return;
        }
        for (module, info) in view.trainable_modules() {
            if !module.grad_norm.is_some_and(|n| n.get() != 0.0) {
                continue;
            }
            let group = info.group.as_str();
            let Some(list) = self.unused.get_mut(group) else {
                continue;
            };
            if list.remove(&module.module) && list.is_empty() {
                self.unused.remove(group);
                alerts.clear(AlertKind::UnusedParameters, group, view.record.step);
            }
        }
    }
}

fn opened(
    context: &RunContext,
    group: &str,
    modules: &FxHashSet<String>,
    steps: u32,
    step: u64,
) -> Opened {
    let mut names: Vec<&str> = modules.iter().map(String::as_str).collect();
    names.sort_unstable();
    let total = context
        .trainable_modules_per_group
        .get(group)
        .copied()
        .unwrap_or(names.len());
    Opened {
        kind: AlertKind::UnusedParameters,
        subject: group.to_owned(),
        severity: Severity::Warning,
        first_step: Some(step),
        step: Some(step),
        title: format!(
            "{} trainable modules of {group} are never used",
            names.len()
        ),
        detail: format!(
            "{} of the {total} trainable modules of {group} were not reported on any of the \
             run's first {steps} steps ({}): backward never reaches them, so their parameters \
             never train, and they still cost memory and optimizer state.",
            names.len(),
            name_list(&names, 5),
        ),
        fix: "Remove the modules that are never used, or find the branch that is never taken \
              (a config flag that disables a path, a head used only at evaluation). Under DDP \
              these are what find_unused_parameters=True works around, at a cost every step."
            .into(),
        evidence: json!({
            "cause": "never_reached",
            "modules": names.iter().take(20).collect::<Vec<_>>(),
            "unused_modules": names.len(),
            "steps": steps,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::{record, transitions};
    use crate::detect::thresholds::Thresholds;
    use crate::detect::view::StepView;
    use crate::model::alert::Transition;
    use gradflow_protocol::RunRegistration;
    use serde_json::Value;

    fn context() -> RunContext {
        let registration: RunRegistration = serde_json::from_value(json!({"params": [
            {"name": "qwen.a.weight"}, {"name": "qwen.b.weight"}, {"name": "qwen.c.weight"},
            {"name": "agent.head.weight"}, {"name": "agent.aux_head.weight"}
        ]}))
        .unwrap();
        RunContext::new(
            &registration,
            Thresholds {
                stuck_zero_steps: 5,
                ..Thresholds::default()
            },
        )
    }

    fn run(modules_per_step: &[&[&str]]) -> Vec<(u64, Transition)> {
        let context = context();
        let mut detector = UnusedParameters::default();
        let records = modules_per_step.iter().enumerate().map(|(step, modules)| {
            let modules: Vec<Value> = modules
                .iter()
                .map(|m| json!({"module": m, "grad_norm": 1.0}))
                .collect();
            record(json!({"step": step, "modules": modules}))
        });
        transitions(records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        })
    }

    #[test]
    fn the_window_is_step_numbers_when_a_client_reports_every_third_step() {
        let context = context();
        let mut detector = UnusedParameters::default();
        let used = ["qwen.a", "qwen.b", "qwen.c", "agent.head"];
        let records = [0u64, 3, 6].map(|step| {
            let modules: Vec<Value> = used
                .iter()
                .map(|m| json!({"module": m, "grad_norm": 1.0}))
                .collect();
            record(json!({"step": step, "modules": modules}))
        });
        let t = transitions(&records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        });
        // Threshold 5: decided on step 6, the first report past step 4, after
        // three reports rather than five.
        assert_eq!(t.len(), 1, "{t:?}");
        assert_eq!(t[0].0, 6);
    }

    #[test]
    fn a_module_no_step_reports_is_named_at_the_nth_step_and_forgiven_when_it_arrives() {
        let used: &[&str] = &["qwen.a", "qwen.b", "qwen.c", "agent.head"];
        let mut steps = vec![used; 5];
        steps.push(&["agent.aux_head"]);
        let t = run(&steps);
        assert_eq!(t.len(), 2, "{t:?}");
        let (4, Transition::Open(o)) = &t[0] else {
            panic!("{t:?}")
        };
        assert_eq!(o.subject, "agent");
        assert_eq!(o.evidence["modules"], json!(["agent.aux_head"]));
        assert_eq!(
            t[1],
            (
                5,
                Transition::Resolve {
                    kind: AlertKind::UnusedParameters,
                    subject: "agent".into(),
                    step: 5,
                    last_step: Some(4),
                }
            )
        );
    }

    #[test]
    fn every_module_used_or_another_granularity_stays_silent() {
        let all: &[&str] = &["qwen.a", "qwen.b", "qwen.c", "agent.head", "agent.aux_head"];
        assert!(run(&[all; 10]).is_empty());
        // Modules used on alternate steps are used.
        assert!(
            run(&[
                &["qwen.a", "qwen.b", "qwen.c"],
                &["agent.head", "agent.aux_head"],
                &["qwen.a"],
                &["qwen.a"],
                &["qwen.a"]
            ])
            .is_empty()
        );
        // A client that reports whole blocks only.
        assert!(run(&[&["qwen", "agent"][..]; 10]).is_empty());
    }
}
