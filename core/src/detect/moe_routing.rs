//! `moe_router_collapse` and `moe_load_imbalance` (v1.8): an MoE layer whose router
//! sends most tokens to one expert, or leaves half its experts without tokens — the
//! failure Switch Transformer, ST-MoE and DeepSeek-V3 guard against with a
//! load-balancing loss, a router z-loss or a bias on the routing — while the loss
//! can look fine, since the busy expert still learns.
//!
//! # The rules
//!
//! Per MoE layer (`moe[]`, sampled by the client), from its tokens per expert:
//!
//! - `moe_router_collapse` (critical): the busiest expert took more than
//!   [`COLLAPSE_SHARE`] of the tokens (judged with [`MIN_EXPERTS_FOR_SHARE`] experts
//!   or more: with two experts half the tokens is balance), or at least half the
//!   experts got none, on every report over at least [`COLLAPSE_STEPS`] steps (and
//!   [`MIN_REPORTS`] reports).
//! - `moe_load_imbalance` (warning): MaxVio — (the busiest expert's load − the mean
//!   load) / the mean — above [`MAX_VIO`] on every report over at least
//!   [`IMBALANCE_STEPS`] steps, the layer not collapsed.
//!
//! Subject: the layer. Each resolves on a report without its condition.
//!
//! # Why these numbers
//!
//! The thresholds are the literature's (ST-MoE, DeepSeek-V3's MaxVio). Measured on
//! a 2-layer top-1 MoE GPT with 8 experts (512 tokens a step,
//! `clients/python/tests/test_moe_routing.py`): a router whose bias starts large
//! (σ = 3) and no balancing loss sends 94–100 % of the tokens to one expert from
//! the first steps, 5 to 7 experts idle, MaxVio 6.5–7; the default initialisation
//! with a load-balancing loss of 1e-2 keeps the busiest expert at 16–33 % and MaxVio
//! mostly 0.3–1.1 (a step at 1.7 now and then, which the unbroken run of reports
//! over 100 steps passes). Without a balancing loss but with the default router
//! the busiest expert sat at 17–44 % with MaxVio 0.5–2.5, crossing 1 and back:
//! imbalanced, not collapsed, and not sustained.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::view::StepView;
use crate::columnar::signal_cells::{LoadSummary, load_summary};
use crate::model::alert::{AlertKind, Opened, Severity};

/// The busiest expert's share of the tokens above which a layer has collapsed.
pub const COLLAPSE_SHARE: f64 = 0.5;
/// Experts a layer needs before the busiest one's share is judged.
pub const MIN_EXPERTS_FOR_SHARE: usize = 8;
/// Steps a collapse must last before it is said.
pub const COLLAPSE_STEPS: u64 = 50;
/// MaxVio above which a layer is imbalanced.
pub const MAX_VIO: f64 = 1.0;
/// Steps an imbalance must last before it is said.
pub const IMBALANCE_STEPS: u64 = 100;
/// Reports either must last, however long the steps between them.
pub const MIN_REPORTS: u32 = 3;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct MoeRouting {
    collapse: BTreeMap<String, Streak>,
    imbalance: BTreeMap<String, Streak>,
}

impl MoeRouting {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let step = view.record.step;
        for layer in &view.record.moe {
            let experts = layer.tokens_per_expert.len();
            let Some(load) = load_summary(&layer.tokens_per_expert) else {
                continue;
            };
            let name = layer.module.as_str();
            let collapsed = collapsed(&load, experts);
            let streak = self.collapse.entry(name.to_owned()).or_default();
            if alerts.observe(AlertKind::MoeRouterCollapse, name, streak, collapsed, |s| {
                s.reports(MIN_REPORTS) && s.spans(COLLAPSE_STEPS, step)
            }) {
                alerts.open(collapse_alert(name, step, streak, &load, experts));
            }
            let imbalanced = !collapsed && load.max_vio > MAX_VIO;
            let streak = self.imbalance.entry(name.to_owned()).or_default();
            if alerts.observe(AlertKind::MoeLoadImbalance, name, streak, imbalanced, |s| {
                s.reports(MIN_REPORTS) && s.spans(IMBALANCE_STEPS, step)
            }) {
                alerts.open(imbalance_alert(name, step, streak, &load, experts));
            }
        }
    }
}

fn collapsed(load: &LoadSummary, experts: usize) -> bool {
    (experts >= MIN_EXPERTS_FOR_SHARE && load.top_share > COLLAPSE_SHARE)
        || (experts >= 2 && load.idle * 2 >= experts)
}

const FIX: &str = "Add a load-balancing loss (Switch Transformer's, coefficient about 1e-2) or \
                   DeepSeek-V3's auxiliary-loss-free bias on the routing scores; a router \
                   z-loss (1e-3) and an fp32 router keep its logits small; initialise the \
                   router near zero. Capacity limits alone drop the overflow tokens instead.";

fn collapse_alert(
    layer: &str,
    step: u64,
    streak: &Streak,
    load: &LoadSummary,
    experts: usize,
) -> Opened {
    let since = streak.first_step(step);
    Opened {
        kind: AlertKind::MoeRouterCollapse,
        subject: layer.into(),
        severity: Severity::Critical,
        first_step: Some(since),
        step: Some(step),
        title: format!(
            "The router of {layer} collapsed: expert {} takes {:.0} % of the tokens",
            load.busiest,
            load.top_share * 100.0
        ),
        detail: format!(
            "At step {step} expert {} of {layer} took {:.0} % of the tokens and {} of its \
             {experts} experts got none, on {} reports running since step {since}. The idle \
             experts get no gradient and stop learning, and the layer is a dense layer of \
             one expert's size: the capacity the other experts were meant to add is lost \
             while the loss may still fall.",
            load.busiest,
            load.top_share * 100.0,
            load.idle,
            streak.count,
        ),
        fix: FIX.into(),
        evidence: json!({
            "cause": "router_collapse",
            "top_share": load.top_share,
            "busiest_expert": load.busiest,
            "idle_experts": load.idle,
            "experts": experts,
            "max_vio": load.max_vio,
            "reports": streak.count,
        }),
    }
}

fn imbalance_alert(
    layer: &str,
    step: u64,
    streak: &Streak,
    load: &LoadSummary,
    experts: usize,
) -> Opened {
    let since = streak.first_step(step);
    Opened {
        kind: AlertKind::MoeLoadImbalance,
        subject: layer.into(),
        severity: Severity::Warning,
        first_step: Some(since),
        step: Some(step),
        title: format!(
            "{layer}'s experts are unevenly loaded: MaxVio {:.1} since step {since}",
            load.max_vio
        ),
        detail: format!(
            "At step {step} the busiest of {layer}'s {experts} experts (expert {}) took {:.0} % \
             of the tokens, MaxVio {:.2} ((its load − the mean) / the mean; above {MAX_VIO} on \
             every report over {} steps since step {since}). Under expert parallelism the \
             busiest expert sets the step's time, and capacity limits drop its overflow \
             tokens.",
            load.busiest,
            load.top_share * 100.0,
            load.max_vio,
            streak.span(step),
        ),
        fix: FIX.into(),
        evidence: json!({
            "cause": "load_imbalance",
            "max_vio": load.max_vio,
            "top_share": load.top_share,
            "busiest_expert": load.busiest,
            "idle_experts": load.idle,
            "experts": experts,
            "reports": streak.count,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::{record, viewed};
    use crate::model::alert::Transition;

    /// Reports every 10 steps of one layer's loads, `tokens(step)`.
    fn run(tokens: impl Fn(u64) -> Vec<u64>, reports: u64) -> Vec<(u64, Transition)> {
        let mut detector = MoeRouting::default();
        let records: Vec<_> = (0..reports)
            .map(|r| {
                record(json!({"step": r * 10, "loss": 2.0, "moe": [
                    {"module": "layers.0.moe", "tokens_per_expert": tokens(r * 10)}]}))
            })
            .collect();
        viewed(records, |view, alerts| detector.on_step(view, alerts))
    }

    #[test]
    fn one_expert_taking_the_tokens_for_fifty_steps_is_a_collapse() {
        let t = run(|_| vec![480, 20, 12, 0, 0, 0, 0, 0], 8);
        let [(50, Transition::Open(o))] = &t[..] else {
            panic!("{t:?}")
        };
        assert_eq!((o.kind, o.severity), (AlertKind::MoeRouterCollapse, Severity::Critical));
        assert_eq!((o.subject.as_str(), o.first_step), ("layers.0.moe", Some(0)));
        assert_eq!(o.evidence["busiest_expert"], 0);
        assert_eq!(o.evidence["idle_experts"], 5);
        // Half of four experts idle is a collapse too, whatever the busiest's share.
        let t = run(|_| vec![256, 256, 0, 0], 8);
        assert!(matches!(&t[..], [(50, Transition::Open(o))] if o.kind == AlertKind::MoeRouterCollapse));
    }

    #[test]
    fn a_sustained_imbalance_warns_and_a_recovery_resolves() {
        // MaxVio (160 − 64) / 64 = 1.5 on every report for 100 steps.
        let tokens = |s: u64| {
            if s < 150 {
                vec![160, 96, 64, 48, 48, 32, 32, 32]
            } else {
                vec![64; 8]
            }
        };
        let t = run(tokens, 20);
        let [(100, Transition::Open(o)), (150, Transition::Resolve { .. })] = &t[..] else {
            panic!("{t:?}")
        };
        assert_eq!((o.kind, o.severity), (AlertKind::MoeLoadImbalance, Severity::Warning));
    }

    #[test]
    fn balanced_routing_two_even_experts_and_a_flickering_imbalance_stay_silent() {
        assert!(run(|_| vec![70, 66, 64, 64, 62, 60, 58, 68], 30).is_empty());
        assert!(run(|_| vec![300, 212], 30).is_empty());
        // Above MaxVio 1 every other report: never 100 steps running.
        let flicker = |s: u64| {
            if (s / 10).is_multiple_of(2) {
                vec![160, 96, 64, 48, 48, 32, 32, 32]
            } else {
                vec![100, 70, 64, 60, 60, 50, 54, 54]
            }
        };
        assert!(run(flicker, 30).is_empty());
    }
}
