//! `adam_eps_dominated` (v1.8): Adam's ε larger than the gradients' scale, so the
//! update m̂/(√v̂+ε) is damped by ε rather than normalised by √v̂ — a silent slowdown
//! that a higher learning rate does not fix (Wortsman et al. 2023; Everett et al.
//! 2024).
//!
//! # The rule
//!
//! On each step with Adam's state (`modules[].adam`, sampled by the client), per
//! optimizer parameter group: the fraction of its updated elements (v > 0; rows never
//! updated are left out by the client, and since v1.10 the Python client also leaves
//! out elements whose √v̂ is below 10⁻⁴ of their parameter's largest, the rows of
//! tokens a model learnt to rule out) with √v̂ < ε, over its modules weighted by
//! their updated elements. The alert opens when it is at least [`FRACTION`] on
//! [`REPORTS`] reports running. It is `info` (a setting that slows training, said
//! with its numbers) unless the group's update RMS / lr is also below
//! [`DAMPED_UPDATE`], a tenth of the floor of Adam's healthy 0.2–0.4: then the
//! steps are too small to train at the lr the user set, a `warning`. Resolves on a
//! report under [`FRACTION`]. The subject is `param group NAME`.
//!
//! # Why these numbers
//!
//! On a 2-layer GPT at lr 3e-3, ε = 1e-3 put 62–79 % of the elements below ε and the
//! update RMS / lr at 0.20–0.25; with ε = 1e-8 at
//! most 3.1 % were (exactly the never-seen vocabulary rows, which the client leaves
//! out) and the update RMS / lr was 0.30–0.54 (torch's own Adam state read at steps
//! 10, 30 and 59). Half the elements is far from both.
//!
//! Whether ε costs the run is a matter of degree, not of the fraction: DCRNN's
//! published setting (Adam lr 0.01, ε = 1e-3, clip 5) trains a GRU forecaster well
//! with 46–82 % of its elements below ε and update RMS / lr 0.05–0.20; the GPT at
//! ε = 1e-2 reads 0.07. Those are settings to revisit, not failures. At ε = 0.1 the
//! GPT's update RMS / lr is 0.010 and at ε = 1 it is 0.001: every step is a
//! twentieth to a two-hundredth of what Adam would take, and the run barely moves.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::view::StepView;
use super::wording::{name_list, sci};
use crate::model::alert::{AlertKind, Opened, Severity};

/// The fraction of a group's updated elements below ε that dominates it.
pub const FRACTION: f64 = 0.5;
/// Reports running.
pub const REPORTS: u32 = 3;
/// An update RMS / lr below this (a tenth of the floor of Adam's healthy 0.2–0.4)
/// means the steps are too small to train: a warning; above it the alert is info.
pub const DAMPED_UPDATE: f64 = 0.02;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AdamEpsDominated {
    groups: BTreeMap<String, Streak>,
}

/// One group's Adam state on one step.
#[derive(Default)]
struct GroupState<'a> {
    updated: f64,
    below: f64,
    squares: f64,
    modules: Vec<&'a str>,
}

impl AdamEpsDominated {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let groups = group_states(view);
        let step = view.record.step;
        for (group, state) in &groups {
            if state.updated <= 0.0 {
                continue;
            }
            let fraction = state.below / state.updated;
            let subject = format!("param group {group}");
            let streak = self.groups.entry(group.clone()).or_default();
            let kind = AlertKind::AdamEpsDominated;
            if !alerts.observe(kind, &subject, streak, fraction >= FRACTION, |s| {
                s.reports(REPORTS)
            }) {
                continue;
            }
            let update_rms = (state.squares / state.updated).sqrt();
            let eps = eps_of(view, group);
            alerts.open(alert(
                subject, step, streak, fraction, update_rms, eps, state,
            ));
        }
    }
}

/// Each optimizer group's Adam state on this step, from its modules' entries.
fn group_states<'a>(view: &StepView<'a>) -> BTreeMap<String, GroupState<'a>> {
    let mut groups: BTreeMap<String, GroupState<'a>> = BTreeMap::new();
    let params = &view.context.registration.params;
    for module in &view.record.modules {
        let Some(adam) = module.adam.as_ref() else {
            continue;
        };
        let (Some(updated), Some(below)) = (adam.updated, adam.below_eps.map(|b| b.get())) else {
            continue;
        };
        let group = params
            .iter()
            .find(|p| p.module_name() == module.module)
            .and_then(|p| p.param_group.clone())
            .unwrap_or_else(|| "0".to_owned());
        let state = groups.entry(group).or_default();
        let n = updated as f64;
        state.updated += n;
        state.below += below * n;
        if let Some(rms) = adam.update_rms.map(|r| r.get()).filter(|r| r.is_finite()) {
            state.squares += rms * rms * n;
        }
        state.modules.push(&module.module);
    }
    groups
}

/// The group's ε as registered (its own, or the optimizer's).
fn eps_of(view: &StepView<'_>, group: &str) -> Option<f64> {
    view.context
        .group_setting(group, |g| g.eps, |o| o.eps)
        .map(|e| e.get())
}

fn alert(
    subject: String,
    step: u64,
    streak: &Streak,
    fraction: f64,
    update_rms: f64,
    eps: Option<f64>,
    state: &GroupState<'_>,
) -> Opened {
    let severity = if update_rms < DAMPED_UPDATE {
        Severity::Warning
    } else {
        Severity::Info
    };
    let eps_text = eps.map_or("ε".to_owned(), |e| format!("ε = {}", sci(e)));
    let since = streak.first_step(step);
    Opened {
        kind: AlertKind::AdamEpsDominated,
        subject: subject.clone(),
        severity,
        first_step: Some(since),
        step: Some(step),
        title: format!(
            "Adam's {eps_text} dominates {:.0} % of {subject}",
            fraction * 100.0
        ),
        detail: format!(
            "At step {step}, {:.0} % of the updated elements of {subject} ({}) have √v̂ below \
             {eps_text}, on {} reports running since step {since}: their updates are damped by \
             ε, not normalised by the gradient's scale. The update's RMS is {update_rms:.3} × \
             the lr (Adam's healthy range is about 0.2–0.4). {}",
            fraction * 100.0,
            name_list(&state.modules, 4),
            streak.count,
            if severity == Severity::Warning {
                "The steps are under a tenth of what Adam takes at this lr: the group barely \
                 trains."
            } else {
                "The group still trains, more slowly than its lr says: ε acts as a smaller lr \
                 on its damped elements."
            },
        ),
        fix: "Lower Adam's eps (1e-15 in Wortsman et al. 2023; OLMo 2 went from 1e-5 to 1e-8), \
              or use Adam-atan2, which has no ε. A higher learning rate does not fix this: the \
              damped elements stay damped relative to the others."
            .into(),
        evidence: json!({
            "cause": "eps_above_sqrt_v",
            "below_eps": fraction,
            "update_rms_over_lr": update_rms,
            "eps": eps,
            "updated": state.updated,
            "modules": state.modules,
            "reports": streak.count,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::{record, viewed};
    use crate::model::alert::Transition;

    fn run(below: f64, rms: f64, reports: u64) -> Vec<(u64, Transition)> {
        let mut detector = AdamEpsDominated::default();
        let records: Vec<_> = (0..reports)
            .map(|r| {
                record(json!({"step": r * 10, "loss": 2.0, "modules": [
                    {"module": "layers.0.attn.qkv", "grad_norm": 0.1,
                     "adam": {"updated": 12288, "below_eps": below, "update_rms": rms}},
                    {"module": "tok", "grad_norm": 0.1,
                     "adam": {"updated": 16384, "below_eps": below, "update_rms": rms}},
                    {"module": "layers.0.attn", "attn_max_logit": 3.0}]}))
            })
            .collect();
        viewed(records, |view, alerts| detector.on_step(view, alerts))
    }

    #[test]
    fn eps_above_most_elements_opens_on_the_third_sampled_report() {
        // ε = 1e-3 at lr 3e-3: 98–100 % below ε, update RMS / lr 0.13.
        let t = run(0.99, 0.13, 5);
        let [(20, Transition::Open(o))] = &t[..] else {
            panic!("{t:?}")
        };
        assert_eq!(o.subject, "param group 0");
        assert_eq!(o.severity, Severity::Info);
        assert_eq!(o.first_step, Some(0));
        // DCRNN's ε = 1e-3 at its most damped (update RMS / lr 0.05) still trains: info.
        let t = run(0.8, 0.05, 3);
        assert!(matches!(&t[..], [(20, Transition::Open(o))] if o.severity == Severity::Info));
        // ε = 0.1 on the GPT: update RMS / lr 0.010, steps too small to train.
        let t = run(1.0, 0.010, 3);
        let [(20, Transition::Open(o))] = &t[..] else {
            panic!("{t:?}")
        };
        assert_eq!(o.severity, Severity::Warning);
        assert!(o.detail.contains("barely trains"), "{}", o.detail);
    }

    #[test]
    fn a_healthy_eps_stays_silent() {
        // ε = 1e-8: at most the never-seen rows' 3 %, update RMS / lr 0.22.
        assert!(run(0.031, 0.22, 30).is_empty());
    }
}
