//! `adam_second_moment_stale` (v1.8, info): Adam's second moment lags the gradients it
//! divides, so some coordinates move several times farther than Adam's normalised
//! step allows — the time-domain instability Molybog et al. (2023, arXiv 2304.09871)
//! trace large runs' loss spikes to: a coordinate whose gradient was small for a
//! long time has a small v; when its gradient returns, m grows ten times faster
//! than v can follow (β₁ = 0.9 against β₂ = 0.999) and the update runs away.
//!
//! # The rule
//!
//! Per parameter group with β₂ ≥ [`MIN_BETA2`] (its own betas as registered, or the
//! optimizer's): a report where a module's largest |m̂/(√v̂+ε)| (`adam.update_absmax`,
//! sampled by the client) is above the group's bar, on [`REPORTS`] sampled reports
//! running. The bar is [`STALE_UPDATE`] at β₁ = 0.9, scaled by how widely m̂/σ spreads
//! under pure noise, √((1−β₁)/(1+β₁)) ([`bar`]): a faster first moment (a GAN's
//! β₁ = 0.5: bar 6.3) swings further with healthy noise alone. Modules that hold an embedding are left out: a rare token's row gets a
//! gradient once in a while, and its first update after a silence is up to
//! (1−β₁)/√(1−β₂) = 3.2 every time — sparse updates are healthy, not a finding.
//! Subject: the group; the worst module and the others above the bar are named.
//! Resolves on a report with every module back under the bar.
//!
//! # Why these numbers
//!
//! With bias correction, |m̂/√v̂| ≤ 1 while a coordinate's gradient is steady, and
//! noisy healthy runs stay at or under about 1.7 (the literature's measurements and
//! ours: docs/instabilities.md). A coordinate silent for long and then fed a steady
//! gradient reaches (1−β₁ᵏ)/√(1−β₂ᵏ): 3.2 after one step, 6.5 after ten, above 2.5
//! for about 150 steps at β₂ = 0.999 — so 2.5 on 3 sampled reports (30 steps at the
//! client's default interval of 10) passes a single rare hit, which falls back under
//! the bar within 3 steps, and catches the lag that lasts. With β₂ = 0.95 the second
//! moment follows within ~20 steps and the first step after a silence is 0.45: the
//! rule does not apply.
//!
//! # Info, until calibrated
//!
//! The rule was measured on one recipe and the development corpus. On other
//! healthy runs (adversarial training, Adam's first steps at a high lr) the largest
//! update of some module passed the bar for three reports while training was fine, so
//! the verdict is said as info, like `activation_norm_growth`, until more runs
//! calibrate it: it names a mechanism worth knowing about beside a loss spike, not a
//! fault on its own. On the DCGAN example's discriminator (β = (0.5, 0.999)) the
//! largest update reads 2.7–2.8 while it trains well: within β₁ = 0.5's spread of
//! noise, under its bar of 6.3; a stale coordinate there reaches 0.5/√(1−β₂) = 15.8.

use std::collections::BTreeMap;

use gradflow_protocol::Role;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::view::StepView;
use super::wording::name_list;
use crate::model::alert::{AlertKind, Opened, Severity};

/// The largest |m̂/(√v̂+ε)| above which a module's second moment is stale, at
/// β₁ = 0.9 ([`bar`] scales it to other β₁).
pub const STALE_UPDATE: f64 = 2.5;
/// The β₁ [`STALE_UPDATE`] was measured at.
const REFERENCE_BETA1: f64 = 0.9;
/// Sampled reports running above it before the alert opens.
pub const REPORTS: u32 = 3;
/// The smallest β₂ the rule applies to: below it v follows the gradient quickly.
pub const MIN_BETA2: f64 = 0.99;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AdamSecondMomentStale {
    groups: BTreeMap<String, Streak>,
}

/// One module's largest update on a report.
struct Reading<'a> {
    module: &'a str,
    absmax: f64,
}

impl AdamSecondMomentStale {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let step = view.record.step;
        let kind = AlertKind::AdamSecondMomentStale;
        for (group, ([beta1, beta2], readings)) in readings_by_group(view) {
            if beta2 < MIN_BETA2 {
                continue;
            }
            let bar = bar(beta1);
            let mut above: Vec<&Reading<'_>> =
                readings.iter().filter(|r| r.absmax > bar).collect();
            above.sort_by(|a, b| b.absmax.total_cmp(&a.absmax));
            let subject = format!("param group {group}");
            let streak = self.groups.entry(group.clone()).or_default();
            if !alerts.observe(kind, &subject, streak, !above.is_empty(), |s| {
                s.reports(REPORTS)
            }) {
                continue;
            }
            alerts.open(alert(subject, step, streak, [beta1, beta2], bar, &above));
        }
    }
}

/// The largest |m̂/(√v̂+ε)| a group with this β₁ may show without a stale second
/// moment: [`STALE_UPDATE`] times the spread of m̂/σ under noise at β₁ over its spread
/// at 0.9 (an exponential average of white noise with weight 1−β₁ has variance
/// (1−β₁)/(1+β₁) of the noise's).
pub fn bar(beta1: f64) -> f64 {
    let spread = |b: f64| ((1.0 - b) / (1.0 + b)).sqrt();
    STALE_UPDATE * spread(beta1.clamp(0.0, 0.999)) / spread(REFERENCE_BETA1)
}

/// Each parameter group's betas and its modules' readings on this report (groups
/// whose betas are not registered are left out: the rule cannot be judged there).
type GroupReadings<'a> = BTreeMap<String, ([f64; 2], Vec<Reading<'a>>)>;

fn readings_by_group<'a>(view: &StepView<'a>) -> GroupReadings<'a> {
    let mut groups: GroupReadings<'a> = BTreeMap::new();
    for module in &view.record.modules {
        let Some(absmax) = module
            .adam
            .as_ref()
            .and_then(|a| a.update_absmax)
            .map(|v| v.get())
            .filter(|v| v.is_finite())
        else {
            continue;
        };
        let Some((group, holds_embedding)) = group_of(view, &module.module) else {
            continue;
        };
        if holds_embedding {
            continue;
        }
        let Some(betas) = betas_of(view, &group) else {
            continue;
        };
        groups
            .entry(group)
            .or_insert_with(|| (betas, Vec::new()))
            .1
            .push(Reading {
                module: &module.module,
                absmax,
            });
    }
    groups
}

/// The parameter group of `module`'s parameters (PyTorch's index, "0" when the
/// registration names none) and whether one of them is an embedding.
fn group_of(view: &StepView<'_>, module: &str) -> Option<(String, bool)> {
    let mut group = None;
    let mut embedding = false;
    for param in view
        .context
        .registration
        .params
        .iter()
        .filter(|p| p.module.as_deref() == Some(module))
    {
        embedding |= param.role == Some(Role::Embedding);
        group.get_or_insert_with(|| param.param_group.clone().unwrap_or_else(|| "0".into()));
    }
    group.map(|g| (g, embedding))
}

/// The group's betas as registered (its own, or the optimizer's).
fn betas_of(view: &StepView<'_>, group: &str) -> Option<[f64; 2]> {
    view.context
        .group_setting(group, |g| g.betas, |o| o.betas)
        .map(|[beta1, beta2]| [beta1.get(), beta2.get()])
}

fn alert(
    subject: String,
    step: u64,
    streak: &Streak,
    [beta1, beta2]: [f64; 2],
    bar: f64,
    above: &[&Reading<'_>],
) -> Opened {
    let worst = above[0];
    let modules: Vec<&str> = above.iter().map(|r| r.module).collect();
    let since = streak.first_step(step);
    Opened {
        kind: AlertKind::AdamSecondMomentStale,
        subject: subject.clone(),
        severity: Severity::Info,
        first_step: Some(since),
        step: Some(step),
        title: format!(
            "Adam's second moment lags the gradients in {}: updates {:.1}× the normal step",
            worst.module, worst.absmax
        ),
        detail: format!(
            "At step {step} the largest |m̂/(√v̂+ε)| of {} ({subject}) was {:.2}, above \
             {bar:.1} on {} sampled reports running since step {since} (a steady gradient \
             keeps it at 1 or under; with β₁ = {beta1} noisy healthy training stays under \
             the bar). Modules above the bar: {}. With β₂ = {beta2} the second moment averages the last \
             ~{:.0} steps of squared gradients, so gradients that grew after a quiet stretch \
             are divided by a v that has not caught up, and those coordinates move several \
             times farther than Adam's step: the instability that precedes loss spikes \
             (Molybog et al. 2023).",
            worst.module,
            worst.absmax,
            streak.count,
            name_list(&modules, 6),
            1.0 / (1.0 - beta2),
        ),
        fix: "Clip the update (per-coordinate update clipping, as Adafactor and Levanter do, \
              or clip the update norm at a few σ of its recent level), or lower β₂ to 0.95 so \
              that v follows the gradients; clipping the spiky coordinates' gradients helps \
              too. A lower lr only scales the runaway step down."
            .into(),
        evidence: json!({
            "cause": "stale_second_moment",
            "update_absmax": worst.absmax,
            "bar": bar,
            "beta1": beta1,
            "beta2": beta2,
            "modules": modules,
            "reports": streak.count,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::context::RunContext;
    use crate::detect::testing::{record, transitions};
    use crate::detect::thresholds::Thresholds;
    use crate::model::alert::Transition;

    fn context(beta2: f64) -> RunContext {
        let registration = serde_json::from_value(json!({"params": [
            {"name": "tok.weight", "module": "tok", "role": "embedding"},
            {"name": "layers.0.mlp.weight", "module": "layers.0.mlp"},
            {"name": "layers.1.mlp.weight", "module": "layers.1.mlp"}],
            "optimizer": {"name": "AdamW", "lr": 1e-3, "betas": [0.9, beta2]}}))
        .unwrap();
        RunContext::new(&registration, Thresholds::default())
    }

    /// The transitions of `reports` sampled reports, every 10 steps, where
    /// `layers.1.mlp`'s largest update is `absmax(step)` and the embedding's 3.2.
    fn run(beta2: f64, absmax: impl Fn(u64) -> f64, reports: u64) -> Vec<(u64, Transition)> {
        let context = context(beta2);
        let mut detector = AdamSecondMomentStale::default();
        let records: Vec<_> = (0..reports)
            .map(|r| {
                record(json!({"step": r * 10, "loss": 2.0, "modules": [
                    {"module": "tok", "grad_norm": 0.1, "adam": {"update_absmax": 3.2}},
                    {"module": "layers.0.mlp", "grad_norm": 0.1, "adam": {"update_absmax": 1.1}},
                    {"module": "layers.1.mlp", "grad_norm": 0.1,
                     "adam": {"update_absmax": absmax(r * 10)}}]}))
            })
            .collect();
        transitions(records, |record, alerts| {
            detector.on_step(&StepView::new(&context, record), alerts)
        })
    }

    #[test]
    fn updates_that_outrun_the_second_moment_open_on_the_third_report_and_resolve() {
        let t = run(0.999, |s| if (30..80).contains(&s) { 5.8 } else { 1.2 }, 12);
        let [(50, Transition::Open(o)), (80, Transition::Resolve { .. })] = &t[..] else {
            panic!("{t:?}")
        };
        assert_eq!(o.subject, "param group 0");
        assert_eq!(o.first_step, Some(30));
        assert_eq!(o.evidence["modules"], json!(["layers.1.mlp"]));
        assert!(o.title.contains("layers.1.mlp"), "{}", o.title);
    }

    #[test]
    fn a_single_rare_hit_a_fast_beta2_and_the_embeddings_stay_silent() {
        // One sampled report above the bar: a rare coordinate's first update.
        assert!(run(0.999, |s| if s == 40 { 3.2 } else { 1.2 }, 12).is_empty());
        // β₂ = 0.95: v follows; the same readings prove nothing stale.
        assert!(run(0.95, |_| 5.8, 12).is_empty());
        // Healthy noisy training, the embedding at 3.2 every report.
        assert!(run(0.999, |s| 1.2 + 0.5 * ((s / 10) % 2) as f64, 30).is_empty());
    }

    #[test]
    fn the_bar_follows_the_first_moments_spread_under_noise() {
        assert!((bar(0.9) - STALE_UPDATE).abs() < 1e-12);
        assert!((bar(0.5) - 6.29).abs() < 0.01, "{}", bar(0.5));
        assert!(bar(0.0) > bar(0.5) && bar(0.99) < STALE_UPDATE);
    }
}
