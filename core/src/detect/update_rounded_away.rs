//! `update_rounded_away`: (almost) every update the optimizer meant to apply to a
//! group's low-precision parameters (embeddings, linear layers: anything but norm
//! weights, which `norm_weight_frozen` watches) is lost when the result is rounded to
//! their dtype, so the group does not train.
//!
//! # The rule
//!
//! A client reports, for some steps, each such parameter's intended update:
//! `intended_nonzero` elements meant to change and `rounded_away` of them that kept
//! their stored value. A group is *frozen by rounding* on a step when, over its
//! reported parameters, at least [`LOST_FRACTION`] of the intended changes were lost,
//! and *mostly frozen* when at least [`WARN_FRACTION`] were. The alert opens
//! when that holds on every report over at least `frozen_norm_steps` steps (by step
//! number) and at least two reports, and resolves on the first report where any
//! intended change survived. Parameters without intended-update fields say nothing.
//! A report whose lr is above the previous report's (a warm-up still rising) starts
//! the streak over: a bf16 run warming up from 0 loses most of its first updates by
//! design, and the alert waits for the lr the run is meant to train at.
//!
//! # Why
//!
//! Only the update the optimizer computed can prove rounding (`lr` alone cannot: an
//! Adam step is often far below it). Not all of it: elements near 0 have a tiny
//! spacing and still move, so a frozen layer loses 99 %, not 100 %. Measured on a
//! tiny bf16 Qwen2 + agent under AdamW (steps 6–10): lr 1e-6 loses 99.1 % (Qwen) and
//! 100 % (agent) of the intended changes; 1e-5, 95–96 % and 99.3–99.5 %; 1e-4, 59–66 %
//! and 92–93 %; 1e-3, 8–11 % and 35–46 %. A group that loses 98 % learns through a
//! few near-zero elements only; one that loses 95 % learns through a twentieth of its
//! elements, which is a warning (a healthy bf16 run at a usual lr loses far less: the
//! 1e-4 figures above). Either way the remedy is the same as for frozen norm weights
//! ([`super::precision::MASTER_WEIGHTS_FIX`]): f32 master weights, not a higher lr.
//!
//! Measured again through the Python client on a tiny bf16 Qwen2 (hidden 32 and
//! 128, 52 steps, a report every 10th step), the share of `model.layers`' intended
//! changes lost after the first step: AdamW lr 1e-5, 96–97 %; 3e-5, 88–92 %; 5e-5,
//! 81–87 %; 1e-4, 65–76 %; 3e-4, 30–48 %; 1e-3, 11–27 %; SGD with momentum at lr
//! 1e-3 to 0.1, 92 % down to 25–68 %. AdamW's first step is `lr·sign(g)` on every
//! element, the largest it ever is (84 % lost at 1e-5): a streak begins after it.
//! bf16 weights under f32 master copies (autocast) and f32 runs report nothing.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::view::StepView;
use super::wording::{name_list, sci, step_range};
use crate::model::alert::{AlertKind, Opened, Severity};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct UpdateRoundedAway {
    groups: BTreeMap<String, LostRun>,
}

/// A group's run of reports that lost (almost) every intended change: its
/// [`Streak`], and what the reports of the run showed.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(from = "StoredRun", into = "StoredRun")]
struct LostRun {
    streak: Streak,
    /// The largest |intended update| / ulp seen over the run.
    max_ulp: f64,
    /// The smallest share of intended changes lost on a report of the run.
    min_lost: f64,
    /// The lr of the run's last report, when the record says it.
    lr: Option<f64>,
}

impl Default for LostRun {
    fn default() -> Self {
        LostRun {
            streak: Streak::default(),
            max_ulp: 0.0,
            min_lost: 1.0,
            lr: None,
        }
    }
}

/// How a [`LostRun`] is stored: the layout it had before it counted with
/// [`Streak`], so that stored detector states carry on where they were.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
struct StoredRun {
    first_step: u64,
    reports: u32,
    max_ulp: f64,
    #[serde(default = "one")]
    min_lost: f64,
    lr: Option<f64>,
}

impl From<StoredRun> for LostRun {
    fn from(stored: StoredRun) -> Self {
        LostRun {
            streak: Streak::from_count(stored.reports, stored.first_step),
            max_ulp: stored.max_ulp,
            min_lost: stored.min_lost,
            lr: stored.lr,
        }
    }
}

impl From<LostRun> for StoredRun {
    fn from(run: LostRun) -> Self {
        StoredRun {
            first_step: run.first_step(),
            reports: run.streak.count,
            max_ulp: run.max_ulp,
            min_lost: run.min_lost,
            lr: run.lr,
        }
    }
}

impl LostRun {
    /// The first step of the run (0 when none has begun).
    fn first_step(&self) -> u64 {
        self.streak.since.unwrap_or_default()
    }
}

/// The share of a group's intended changes that must round away to call it frozen
/// (critical).
pub const LOST_FRACTION: f64 = 0.98;
/// The share that calls it mostly frozen (warning).
pub const WARN_FRACTION: f64 = 0.95;

fn one() -> f64 {
    1.0
}

/// One step's reading of a group.
#[derive(Default)]
struct Reading<'a> {
    params: Vec<&'a str>,
    intended: u64,
    lost: u64,
    max_ulp: f64,
}

impl Reading<'_> {
    fn lost_fraction(&self) -> f64 {
        if self.intended == 0 {
            0.0
        } else {
            self.lost as f64 / self.intended as f64
        }
    }
}

impl UpdateRoundedAway {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let (context, record) = (view.context, view.record);
        let mut readings: BTreeMap<&str, Reading> = BTreeMap::new();
        for param in &record.params {
            let Some(group) = context.other_trainable.get(&param.name) else {
                continue;
            };
            let (Some(nonzero), Some(rounded)) = (param.intended_nonzero, param.rounded_away)
            else {
                continue;
            };
            let reading = readings.entry(group.as_str()).or_default();
            reading.params.push(&param.name);
            reading.intended += nonzero;
            reading.lost += rounded.min(nonzero);
            if let Some(ratio) = param.intended_update_max_ulp.map(|r| r.get())
                && ratio.is_finite()
            {
                reading.max_ulp = reading.max_ulp.max(ratio);
            }
        }
        let threshold = u64::from(context.thresholds.frozen_norm_steps);
        let lr = step_lr(record);
        for (group, reading) in readings {
            let kind = AlertKind::UpdateRoundedAway;
            if reading.lost_fraction() < WARN_FRACTION {
                self.groups.remove(group);
                alerts.clear(kind, group, record.step);
                continue;
            }
            let run = self.groups.entry(group.to_owned()).or_default();
            let warming_up = matches!((run.lr, lr), (Some(before), Some(now)) if now > before);
            if run.streak.count == 0 || (warming_up && !alerts.is_open(kind, group)) {
                *run = LostRun::default();
            }
            run.lr = lr;
            run.min_lost = run.min_lost.min(reading.lost_fraction());
            run.max_ulp = run.max_ulp.max(reading.max_ulp);
            // At least two reports, over the threshold's step numbers.
            let step = record.step;
            let long_enough = |s: &Streak| s.reports(2) && s.spans(threshold, step);
            if alerts.observe(kind, group, &mut run.streak, true, long_enough) {
                alerts.open(opened(group, &reading, run, step));
            }
        }
    }
}

/// The step's largest lr over its parameter groups (a warm-up raises them together),
/// else its single lr.
fn step_lr(record: &gradflow_protocol::StepRecord) -> Option<f64> {
    let most = record
        .lrs
        .values()
        .map(|lr| lr.get())
        .fold(None, |most: Option<f64>, lr| {
            Some(most.map_or(lr, |m| m.max(lr)))
        });
    most.or(record.lr.map(|lr| lr.get()))
}

fn opened(group: &str, reading: &Reading<'_>, run: &LostRun, step: u64) -> Opened {
    let n = reading.params.len();
    let frozen = run.min_lost >= LOST_FRACTION;
    let (severity, title, share, outcome) = if frozen {
        (
            Severity::Critical,
            format!(
                "Every update of {group}'s low-precision weights rounds away: it does not train"
            ),
            LOST_FRACTION,
            "Its gradients flow; its updates do not land.",
        )
    } else {
        (
            Severity::Warning,
            format!(
                "{:.1} % of the updates of {group}'s low-precision weights round away",
                reading.lost_fraction() * 100.0
            ),
            WARN_FRACTION,
            "It learns through a few elements only, far more slowly than the optimizer \
             means it to.",
        )
    };
    Opened {
        kind: AlertKind::UpdateRoundedAway,
        subject: group.to_owned(),
        severity,
        first_step: Some(run.first_step()),
        step: Some(step),
        title,
        detail: format!(
            "On each of the {} reports over {}, at least {:.0} % of the changes the \
             optimizer meant to make to {group}'s {n} low-precision parameter(s) ({}) were lost \
             when the result was rounded to their dtype: on the last, {} of {} elements kept \
             their values exactly. Only elements near 0, whose spacing is tiny, still move \
             (the largest intended change was {} of the spacing at its value). {outcome}",
            run.streak.count,
            step_range(run.first_step(), step),
            share * 100.0,
            name_list(&reading.params, 6),
            reading.lost,
            reading.intended,
            sci(run.max_ulp),
        ),
        fix: super::precision::MASTER_WEIGHTS_FIX.into(),
        evidence: json!({
            "cause": "low_precision_underflow",
            "params": n,
            "param_names": reading.params.iter().take(50).collect::<Vec<_>>(),
            "intended_nonzero": reading.intended,
            "rounded_away": reading.lost,
            "max_intended_update_ulp": run.max_ulp,
            "reports": run.streak.count,
            "first_step": run.first_step(),
            "min_lost_fraction": run.min_lost,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::context::RunContext;
    use crate::detect::testing::transitions;
    use crate::detect::thresholds::Thresholds;
    use crate::model::alert::Transition;
    use gradflow_protocol::{RunRegistration, StepRecord};

    fn context() -> RunContext {
        let registration: RunRegistration = serde_json::from_value(json!({
            "precision": {"param_dtype": "bf16"},
            "params": [
                {"name": "qwen.embed.weight", "role": "embedding"},
                {"name": "qwen.proj.weight", "role": "linear"},
                {"name": "qwen.norm.weight", "role": "norm"},
                {"name": "agent.head.weight", "role": "linear"}
            ]
        }))
        .unwrap();
        RunContext::new(
            &registration,
            Thresholds {
                frozen_norm_steps: 10,
                ..Thresholds::default()
            },
        )
    }

    /// A report every 5th step: qwen's two parameters lose `qwen_lost` of 100 changes;
    /// agent's head always lands its changes.
    fn record(step: u64, qwen_lost: u64) -> StepRecord {
        serde_json::from_value(json!({"step": step, "params": [
            {"name": "qwen.embed.weight", "update_norm": 0.0, "intended_update_norm": 1e-4,
             "intended_update_max_ulp": 0.2, "intended_nonzero": 100, "rounded_away": qwen_lost},
            {"name": "qwen.proj.weight", "update_norm": 0.0, "intended_update_norm": 1e-4,
             "intended_update_max_ulp": 0.1, "intended_nonzero": 100, "rounded_away": 100},
            {"name": "agent.head.weight", "update_norm": 1e-3, "intended_update_norm": 1e-3,
             "intended_update_max_ulp": 3.0, "intended_nonzero": 100, "rounded_away": 10}
        ]}))
        .unwrap()
    }

    fn run(records: &[StepRecord]) -> Vec<(u64, Transition)> {
        let context = context();
        let mut detector = UpdateRoundedAway::default();
        transitions(records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        })
    }

    #[test]
    fn a_group_whose_every_update_rounds_away_is_named_once_by_step_number() {
        let mut records: Vec<StepRecord> = (0..4).map(|i| record(i * 5, 100)).collect();
        records.push(record(20, 50)); // half the embedding's changes landed: it trains
        let t = run(&records);
        assert_eq!(t.len(), 2, "{t:?}");
        assert_eq!(t[0].0, 10, "reports at 0, 5, 10 span 11 >= 10 steps");
        let Transition::Open(o) = &t[0].1 else {
            panic!("{t:?}")
        };
        assert_eq!(o.subject, "qwen");
        assert_eq!(o.evidence["cause"], "low_precision_underflow");
        assert_eq!(o.evidence["params"], 2);
        assert_eq!(o.evidence["max_intended_update_ulp"], 0.2);
        assert!(
            o.detail
                .contains("on the last, 200 of 200 elements kept their values"),
            "{}",
            o.detail
        );
        assert!(matches!(t[1], (20, Transition::Resolve { .. })));
    }

    #[test]
    fn a_warm_up_still_rising_starts_the_streak_over() {
        let with_lr = |step: u64, lr: f64| {
            let mut r = record(step, 100);
            r.lrs.insert("0".into(), lr.into());
            r
        };
        // A warm-up from 0: every report loses every change, and the lr still rises.
        let rising: Vec<StepRecord> = (0..6)
            .map(|i| with_lr(i * 5, 1e-6 * (i + 1) as f64))
            .collect();
        assert!(run(&rising).is_empty(), "{:?}", run(&rising));
        // The warm-up ends at 6e-6, which still rounds everything away: the alert
        // opens once the lr stayed there for 10 steps.
        let mut then = rising;
        then.extend((6..9).map(|i| with_lr(i * 5, 6e-6)));
        let t = run(&then);
        assert!(matches!(t[..], [(35, Transition::Open(_))]), "{t:?}");
    }

    #[test]
    fn a_state_stored_in_the_earlier_layout_carries_on_mid_streak() {
        // Reports at 0 and 5 so far, stored as the run was laid out before it counted
        // with episode::Streak (the keys it is still stored under).
        let stored = json!({"groups": {"qwen": {"first_step": 0, "reports": 2, "max_ulp": 0.2,
            "min_lost": 1.0, "lr": null, "open": false}}});
        let mut detector: UpdateRoundedAway = serde_json::from_value(stored).unwrap();
        let context = context();
        let out = transitions([record(10, 100)], |r, alerts| {
            detector.on_step(&StepView::new(&context, r), alerts)
        });
        let [(10, Transition::Open(o))] = &out[..] else {
            panic!("{out:?}")
        };
        assert_eq!((o.first_step, &o.evidence["reports"]), (Some(0), &json!(3)));
        let saved = serde_json::to_value(&detector).unwrap();
        assert_eq!(
            saved["groups"]["qwen"],
            json!({"first_step": 0, "reports": 3, "max_ulp": 0.2, "min_lost": 1.0,
                   "lr": null})
        );
    }

    #[test]
    fn partial_rounding_and_norm_weights_say_nothing_here() {
        // A healthy bf16 layer loses some small changes every step and still trains:
        // 170 of 200 lost is 85 %.
        assert!(run(&(0..8).map(|i| record(i * 5, 70)).collect::<Vec<_>>()).is_empty());
        // 99 % lost is frozen: only elements near 0 move.
        let frozen = run(&(0..3).map(|i| record(i * 5, 98)).collect::<Vec<_>>());
        let [(_, Transition::Open(o))] = &frozen[..] else {
            panic!("{frozen:?}")
        };
        assert_eq!(o.severity, Severity::Critical);
        // 97.5 % lost (195 of 200) is mostly frozen: a warning, with the same remedy.
        let mostly = run(&(0..3).map(|i| record(i * 5, 95)).collect::<Vec<_>>());
        let [(_, Transition::Open(o))] = &mostly[..] else {
            panic!("{mostly:?}")
        };
        assert_eq!(o.severity, Severity::Warning);
        assert!(o.title.starts_with("97.5 % of the updates"), "{}", o.title);
        assert!(o.fix.contains("not a fix"), "{}", o.fix);
        assert!(!o.fix.contains("'cuda'"), "{}", o.fix);
        // Norm weights are norm_weight_frozen's.
        let norm: StepRecord = serde_json::from_value(json!({"step": 0, "params": [
            {"name": "qwen.norm.weight", "intended_nonzero": 8, "rounded_away": 8}]}))
        .unwrap();
        assert!(run(&[norm.clone(), norm]).is_empty());
    }
}
