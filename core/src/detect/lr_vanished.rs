//! `lr_vanished`: an optimizer group's lr fell to a hundred-millionth of the highest it
//! had ([`FLOOR`]), or to 0, and stayed there for [`REPORTS`] reports and at least a
//! [`SHARE`] of the reports the run has made: every step since moves the weights by
//! less than 10⁻⁸ of what the run's steps did. The model has stopped training while
//! the loop goes on.
//!
//! # The rule
//!
//! Per parameter group (the record's `lrs`, v1.1; else the run-wide `lr` as one group),
//! the detector keeps the highest lr the group has had. A report counts when the
//! group's lr is at most [`FLOOR`] × that peak (0 included) and the peak is above 0,
//! or (v1.11) when no group of the run has had an lr above 0 and this one's is 0:
//! nothing has trained since the start. A group at 0 from the start beside groups
//! that train is frozen on purpose and never counts.
//! The alert opens when such reports have run [`REPORTS`] long and make up at least
//! [`SHARE`] of every report so far; an lr back above the floor (a warm restart) ends
//! it. Subject: `run` when every group that had an lr vanished, else each group's
//! `param group {name}`. Cause: `lr_zero` when the lr is exactly 0, else `lr_decayed`.
//!
//! # Why these numbers
//!
//! A schedule meant to reach (near) 0 gets there at the end of the run it was built
//! for, and spends almost none of it below the floor: a cosine to 0 over T steps is
//! below 10⁻⁸ of its peak for the last 6.4·10⁻⁵ T steps, a linear decay for the last
//! 10⁻⁸ T; both are far from a twentieth of the run, however long it is. A schedule
//! that vanishes early stays there for the rest of the run: SRGAN's per-epoch
//! `StepLR(step_size=10, gamma=0.1)` stepped after every batch
//! (Lornatang/SRGAN-PyTorch#1) is at 10⁻⁸ of its lr by step 80 and keeps falling; a
//! warm-up/decay schedule built for fewer steps than the loop runs sits at 0. At 10⁻⁸
//! of the peak an fp32 weight's update is below its rounding for any weight more
//! than ten times the peak lr's own size: the steps do nothing at all, and no
//! gradient rule sees it, because the gradients are healthy.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::view::StepView;
use super::wording::{sci, step_range};
use crate::model::alert::{AlertKind, Opened, Severity};

const KIND: AlertKind = AlertKind::LrVanished;

/// The lr at or below which a group's steps count as vanished, as a share of its peak.
pub const FLOOR: f64 = 1e-8;
/// Reports running below the floor before the alert opens.
pub const REPORTS: u32 = 20;
/// The least share of the run's reports the streak must make up (a schedule's end
/// spends far less of a run below the floor).
pub const SHARE: f64 = 0.05;
/// The name under which the run-wide `lr` is judged when the record has no `lrs`.
const RUN_WIDE: &str = "";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LrVanished {
    /// Reports seen that carried an lr.
    reports: u64,
    groups: BTreeMap<String, Group>,
    /// The subject of the open alert, if any.
    open: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
struct Group {
    peak: f64,
    peak_step: u64,
    lr: f64,
    streak: Streak,
}

impl Group {
    /// Whether the group's lr is at the floor: under [`FLOOR`] of its peak, or, when
    /// no group of the run has had an lr above 0 (`nothing_trained`), exactly 0.
    fn below(&self, nothing_trained: bool) -> bool {
        if self.peak > 0.0 {
            self.lr <= self.peak * FLOOR
        } else {
            nothing_trained && self.lr == 0.0
        }
    }

    /// Whether the group has never had an lr above 0.
    fn never_above_zero(&self) -> bool {
        self.peak <= 0.0
    }
}

impl LrVanished {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let record = view.record;
        let step = record.step;
        let lrs: Vec<(String, f64)> = if record.lrs.is_empty() {
            record
                .lr
                .map(|lr| vec![(RUN_WIDE.to_owned(), lr.get())])
                .unwrap_or_default()
        } else {
            record
                .lrs
                .iter()
                .map(|(name, lr)| (name.clone(), lr.get()))
                .collect()
        };
        let lrs: Vec<_> = lrs.into_iter().filter(|(_, lr)| lr.is_finite()).collect();
        if lrs.is_empty() {
            return;
        }
        self.reports += 1;
        // A group at 0 from the start while another trains is frozen on purpose (a
        // backbone given lr 0); when no group has ever had an lr, nothing trains.
        let nothing_trained = lrs.iter().all(|(_, lr)| *lr <= 0.0)
            && self.groups.values().all(Group::never_above_zero);
        for (name, lr) in lrs {
            let group = self.groups.entry(name).or_default();
            group.lr = lr;
            if lr > group.peak {
                group.peak = lr;
                group.peak_step = step;
            }
            let below = group.below(nothing_trained);
            group.streak.observe(below, step);
        }
        let vanished: Vec<(&String, &Group)> = self
            .groups
            .iter()
            .filter(|(_, g)| g.below(nothing_trained) && self.long_enough(&g.streak))
            .collect();
        let held = if nothing_trained {
            self.groups.len()
        } else {
            self.groups.values().filter(|g| g.peak > 0.0).count()
        };
        let subject = match vanished.len() {
            0 => None,
            n if n == held => Some("run".to_owned()),
            _ => Some(format!("param group {}", vanished[0].0)),
        };
        // One cause, one alert: a scheduler that steps k times per optimizer step
        // (`scheduler_per_micro_batch`, named from the loop's first steps) spends its
        // schedule in 1/k of the run, and its alert says the lr then sits at its floor.
        // The lr's fall is what that cause does, not a second finding; an alert
        // already open stays as it is.
        let subject = subject.filter(|_| {
            self.open.is_some()
                || alerts
                    .open_subjects(AlertKind::SchedulerPerMicroBatch)
                    .next()
                    .is_none()
        });
        match (&self.open, subject) {
            (Some(open), Some(now)) if *open == now => {
                alerts.holds(KIND, open);
            }
            (open, Some(now)) => {
                if let Some(before) = open {
                    alerts.clear(KIND, before, step);
                }
                let opened = self.opened(step, &now, &vanished);
                alerts.open(opened);
                self.open = Some(now);
            }
            (Some(open), None) => {
                alerts.clear(KIND, open, step);
                self.open = None;
            }
            (None, None) => {}
        }
    }

    fn long_enough(&self, streak: &Streak) -> bool {
        streak.count >= REPORTS && f64::from(streak.count) >= SHARE * self.reports as f64
    }

    fn opened(&self, step: u64, subject: &str, vanished: &[(&String, &Group)]) -> Opened {
        let first = vanished
            .iter()
            .map(|(_, g)| g.streak.first_step(step))
            .min()
            .unwrap_or(step);
        let reports = vanished
            .iter()
            .map(|(_, g)| g.streak.count)
            .min()
            .unwrap_or(0);
        let zero = vanished.iter().all(|(_, g)| g.lr == 0.0);
        let never = vanished.iter().all(|(_, g)| g.never_above_zero());
        let said: Vec<String> = vanished
            .iter()
            .map(|(name, g)| {
                let who = if name.is_empty() {
                    "the lr".to_owned()
                } else {
                    format!("group {name}'s lr")
                };
                if g.never_above_zero() {
                    format!("{who} has been 0 on every report")
                } else {
                    format!(
                        "{who} is {} after a peak of {} at step {}",
                        sci(g.lr),
                        sci(g.peak),
                        g.peak_step
                    )
                }
            })
            .collect();
        let (cause, how) = if never {
            (
                "lr_zero",
                "No parameter group has had an lr above 0 since the run began: a warm-up \
                 or schedule that starts at 0 and is not stepped (or asked for a step it \
                 is past), or an lr of 0 set by mistake."
                    .to_owned(),
            )
        } else if zero {
            (
                "lr_zero",
                "The schedule reached 0 and stays there: it was built for fewer steps \
                 than the loop runs (a num_training_steps or T_max smaller than the \
                 steps taken, an epoch count that does not match)."
                    .to_owned(),
            )
        } else {
            (
                "lr_decayed",
                "The schedule decays far faster than the run: a scheduler meant to step \
                 once per epoch stepped after every batch, or a decay factor applied \
                 per step that was meant per epoch."
                    .to_owned(),
            )
        };
        let groups: Vec<_> = vanished
            .iter()
            .map(|(name, g)| {
                json!({
                    "group": if name.is_empty() { None } else { Some(name.as_str()) },
                    "lr": g.lr,
                    "peak": g.peak,
                    "peak_step": g.peak_step,
                })
            })
            .collect();
        Opened {
            kind: KIND,
            subject: subject.to_owned(),
            severity: Severity::Warning,
            first_step: Some(first),
            step: Some(step),
            title: format!(
                "The learning rate has vanished: {} for {reports} reports",
                if zero {
                    "0".to_owned()
                } else {
                    "below 1e-8 of its peak".to_owned()
                }
            ),
            detail: format!(
                "{} ({}). Each step since moves the weights by less than a hundred-\
                 millionth of what the run's steps did: the model has stopped training, \
                 while the gradients, which no lr touches, look healthy. {how}",
                said.join("; "),
                step_range(first, step)
            ),
            fix: "Step the scheduler as often as it counts (per epoch: once after each \
                  epoch; per step: build it with the loop's real number of optimizer \
                  steps), and print scheduler.get_last_lr() over a few steps to check. \
                  If the run is meant to have ended, stop the loop."
                .to_owned(),
            evidence: json!({
                "cause": cause,
                "reports": reports,
                "first_step": first,
                "floor": FLOOR,
                "groups": groups,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::episode::{Episodes, Holds};
    use crate::detect::testing::{record, transitions_from};
    use crate::detect::{RunContext, Thresholds};
    use crate::model::alert::Transition;
    use serde_json::Value;

    fn run(lrs: impl Iterator<Item = Value>) -> Vec<(u64, Transition)> {
        run_from(&mut Episodes::new(Holds::Immediate), lrs)
    }

    /// [`run`] beside the episodes already open in `episodes`.
    fn run_from(
        episodes: &mut Episodes,
        lrs: impl Iterator<Item = Value>,
    ) -> Vec<(u64, Transition)> {
        let registration =
            serde_json::from_value(json!({"params": [{"name": "a.weight"}]})).unwrap();
        let context = RunContext::new(&registration, Thresholds::default());
        let mut detector = LrVanished::default();
        let records = lrs.enumerate().map(|(step, lr)| {
            let mut r = json!({"step": step, "loss": 1.0});
            if lr.is_object() {
                r["lrs"] = lr;
            } else {
                r["lr"] = lr;
            }
            record(r)
        });
        transitions_from(episodes, records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        })
    }

    #[test]
    fn a_scheduler_named_for_stepping_per_micro_batch_is_the_one_alert() {
        // get_scheduler("linear", warm-up 30, 300 steps) stepped twice per optimizer
        // step: 0 from step 150, with scheduler_per_micro_batch open since the start.
        let lr = |s: i32| {
            let t = 2 * s;
            1e-3 * if t < 30 {
                f64::from(t) / 30.0
            } else {
                (f64::from(300 - t) / 270.0).max(0.0)
            }
        };
        let mut episodes = Episodes::new(Holds::Immediate);
        episodes.restore(AlertKind::SchedulerPerMicroBatch, "LambdaLR".into(), Some(0));
        let t = run_from(&mut episodes, (0..300).map(|s| json!(lr(s))));
        assert!(t.is_empty(), "{t:?}");

        // The same schedule with no such finding: the lr's fall is the finding.
        let t = run((0..300).map(|s| json!(lr(s))));
        let (step, o) = opened(&t);
        assert!((169..=180).contains(&step), "{step}");
        assert_eq!(o.evidence["cause"], "lr_zero");
    }

    fn opened(t: &[(u64, Transition)]) -> (u64, &Opened) {
        let [(step, Transition::Open(o))] = t else {
            panic!("{t:?}")
        };
        (*step, o)
    }

    #[test]
    fn a_per_epoch_step_schedule_stepped_per_batch_opens_it() {
        // StepLR(step_size=10, gamma=0.1) from 1e-4, stepped at every report.
        let t = run((0..150).map(|s| json!(1e-4 * 0.1f64.powi(s / 10))));
        let (step, o) = opened(&t);
        assert!((99..=110).contains(&step), "{step}");
        assert_eq!(o.severity, Severity::Warning);
        assert_eq!(o.subject, "run");
        assert_eq!(o.evidence["cause"], "lr_decayed");
        assert_eq!(o.evidence["groups"][0]["peak"], 1e-4);
        assert!(o.detail.contains("after a peak of 1.00e-4 at step 0"), "{}", o.detail);
    }

    #[test]
    fn schedules_that_end_near_zero_at_the_end_stay_silent() {
        let total = 100_000u32;
        let peak = 3e-4;
        // Cosine to 0 with a warm-up, and a linear decay to 0, to the last step.
        let cosine = (0..=total).map(|s| {
            let t = f64::from(s) / f64::from(total);
            let warm = (f64::from(s) / 1000.0).min(1.0);
            json!(peak * warm * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()))
        });
        assert!(run(cosine).is_empty());
        let linear = (0..=total).map(|s| json!(peak * (1.0 - f64::from(s) / f64::from(total))));
        assert!(run(linear).is_empty());
        // A warm-up from exactly 0, and step decays by 10x three times.
        let warm = (0..3000).map(|s| json!(peak * (f64::from(s) / 100.0).min(1.0)));
        assert!(run(warm).is_empty());
        let steps = (0..3000).map(|s| json!(peak * 0.1f64.powi(s / 1000)));
        assert!(run(steps).is_empty());
    }

    #[test]
    fn a_schedule_built_for_fewer_steps_sits_at_zero_and_a_restart_ends_it() {
        // Linear decay over 1000 steps, the loop runs on; then a warm restart.
        let lrs = (0..2000u32).map(|s| match s {
            0..1000 => json!(1e-3 * (1.0 - f64::from(s) / 1000.0)),
            1000..1500 => json!(0.0),
            _ => json!(1e-3),
        });
        let t = run(lrs);
        assert_eq!(t.len(), 2, "{t:?}");
        let (step, o) = opened(&t[..1]);
        // A twentieth of the run: 53 reports at 0 once the run has made 1053.
        assert!((1050..=1056).contains(&step), "{step}");
        assert_eq!(o.evidence["cause"], "lr_zero");
        assert!(o.title.contains(": 0 for"), "{}", o.title);
        assert!(matches!(t[1].1, Transition::Resolve { .. }), "{t:?}");
    }

    #[test]
    fn one_group_of_several_is_named_by_its_group() {
        let lrs = (0..400).map(|s| {
            json!({"backbone": 1e-4 * 0.5f64.powi(s / 5), "head": 1e-3})
        });
        let t = run(lrs);
        let (_, o) = opened(&t);
        assert_eq!(o.subject, "param group backbone");
        assert_eq!(o.evidence["groups"][0]["group"], "backbone");
    }

    #[test]
    fn an_lr_of_zero_from_the_start_on_every_group_opens_it() {
        // A warm-up asked for its last step at every step: lr 0 throughout.
        let t = run((0..100).map(|_| json!({"0": 0.0, "1": 0.0})));
        let (step, o) = opened(&t);
        assert_eq!(step, 19);
        assert_eq!(o.subject, "run");
        assert_eq!(o.evidence["cause"], "lr_zero");
        assert!(o.detail.contains("has been 0 on every report"), "{}", o.detail);
        assert!(o.detail.contains("since the run began"), "{}", o.detail);
    }

    #[test]
    fn a_group_held_at_zero_beside_groups_that_train_is_frozen_on_purpose() {
        let lrs = (0..400).map(|s| json!({"stem": 0.0, "head": 1e-3 * 0.999f64.powi(s)}));
        assert!(run(lrs).is_empty());
        // Nor does a warm-up that starts later make the zero steps before it count.
        let late = (0..400u32).map(|s| json!(if s < 10 { 0.0 } else { 1e-3 }));
        assert!(run(late).is_empty());
    }
}
