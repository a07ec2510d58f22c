//! `loss_scale_collapse` (v1.8): an fp16 loss scaler whose scale keeps halving — the
//! gradients overflow step after step, and a scale that reaches 1 no longer protects
//! small gradients from underflow. Read from the `scaler` state clients already send.
//!
//! # The rule
//!
//! - critical: the scale is at most 1 (`MIN_SCALE`): fp16 training has no headroom
//!   left (DeepSpeed stops at its minimum with "Current loss scale already at
//!   minimum");
//! - warning: the scale is [`HALVINGS`] halvings (2⁸ = 256×) below its highest value
//!   within the last [`GROWTH_INTERVAL`] steps, torch.amp.GradScaler's default growth
//!   interval: a healthy scaler grows back once per interval, so eight net halvings
//!   within one are overflows that keep coming;
//! - warning: more than [`SKIP_FRACTION`] of the reports over the last
//!   [`SKIP_WINDOW`] steps skipped their optimizer step (`found_inf`), judged once the
//!   run has that many steps past its first [`CALIBRATION_STEPS`] (where the scaler
//!   halves from 65536 to its working level by design).
//!
//! Halvings count only when a step since the peak did not overflow, and nothing opens
//! while a `scaler_overflow_streak` is open: overflows on every step are that alert's
//! (and its consequence, the scale falling, is said there): the collapse is measured
//! again from the scale the streak left. Resolves when none holds.
//! `scaler_overflow_streak` catches ten overflows running; this catches the slower
//! collapse between them (NVIDIA/DeepLearningExamples#543:
//! 524288 → 8192 within minutes, each halving a few steps apart).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::Alerts;
use super::view::StepView;
use super::wording::sci;
use crate::model::alert::{AlertKind, Opened, Severity};

/// Net halvings within the growth interval that make a collapse.
pub const HALVINGS: u32 = 8;
/// torch.amp.GradScaler's default `growth_interval`.
pub const GROWTH_INTERVAL: u64 = 2000;
/// A scale at or below this has no headroom.
pub const MIN_SCALE: f64 = 1.0;
/// Skipped steps over the window that make a collapse.
pub const SKIP_FRACTION: f64 = 0.01;
/// The window skipped steps are counted over (step numbers).
pub const SKIP_WINDOW: u64 = 1000;
/// The first steps, where the scaler finds its level.
pub const CALIBRATION_STEPS: u64 = 100;
/// Steps per bucket of the skipped-step count.
const BUCKET: u64 = 100;

const SUBJECT: &str = "scaler";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LossScaleCollapse {
    /// The scales that may still be the window's highest: steps rising, scales
    /// falling (a monotonic queue: its front is the window's highest).
    peaks: VecDeque<(u64, f64)>,
    /// Reports and skipped steps per bucket of [`BUCKET`] steps, past calibration.
    buckets: VecDeque<(u64, u32, u32)>,
    first_step: Option<u64>,
    /// The last reported step whose gradients did not overflow.
    last_clean: Option<u64>,
}

/// Which of the rule's conditions holds on a step.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Collapse {
    AtMinimum,
    Halved { peak: f64, peak_step: u64 },
    Skipping { skipped: u32, reports: u32 },
}

impl LossScaleCollapse {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let Some(scaler) = view.record.scaler.as_ref() else {
            return;
        };
        let Some(scale) = scaler.scale.map(|s| s.get()).filter(|s| s.is_finite()) else {
            return;
        };
        let step = view.record.step;
        let first = *self.first_step.get_or_insert(step);
        self.follow(step, scale, view.found_inf(), first);
        if !view.found_inf() {
            self.last_clean = Some(step);
        }
        let kind = AlertKind::LossScaleCollapse;
        // Overflows on every step are `scaler_overflow_streak`'s: the collapse is its
        // consequence, already said.
        // Its halvings and skipped steps are the streak's, so the collapse is measured
        // again from where the streak left the scale.
        if alerts.is_open(AlertKind::ScalerOverflowStreak, "scaler") {
            self.peaks.retain(|&(s, _)| s == step);
            self.buckets.clear();
            alerts.clear(kind, SUBJECT, step);
            return;
        }
        let Some(collapse) = self.judge(step, scale, first) else {
            alerts.clear(kind, SUBJECT, step);
            return;
        };
        if alerts.holds(kind, SUBJECT) {
            return;
        }
        alerts.open(alert(step, scale, collapse));
    }

    fn follow(&mut self, step: u64, scale: f64, skipped: bool, first: u64) {
        while self.peaks.back().is_some_and(|&(_, s)| s <= scale) {
            self.peaks.pop_back();
        }
        self.peaks.push_back((step, scale));
        while self
            .peaks
            .front()
            .is_some_and(|&(s, _)| s + GROWTH_INTERVAL <= step)
        {
            self.peaks.pop_front();
        }
        if step < first + CALIBRATION_STEPS {
            return;
        }
        let bucket = step / BUCKET;
        match self.buckets.back_mut() {
            Some(last) if last.0 == bucket => {
                last.1 += 1;
                last.2 += u32::from(skipped);
            }
            _ => self.buckets.push_back((bucket, 1, u32::from(skipped))),
        }
        let oldest = bucket.saturating_sub(SKIP_WINDOW / BUCKET - 1);
        while self.buckets.front().is_some_and(|b| b.0 < oldest) {
            self.buckets.pop_front();
        }
    }

    fn judge(&self, step: u64, scale: f64, first: u64) -> Option<Collapse> {
        if scale <= MIN_SCALE {
            return Some(Collapse::AtMinimum);
        }
        // Halvings count only with a clean step since the peak: the scaler tried to
        // recover and overflowed again, not one unbroken run of overflows.
        let recovered_since = |peak_step: u64| self.last_clean.is_some_and(|c| c > peak_step);
        if let Some(&(peak_step, peak)) = self.peaks.front() {
            if peak >= scale * f64::from(1u32 << HALVINGS) && recovered_since(peak_step) {
                return Some(Collapse::Halved { peak, peak_step });
            }
        }
        if step >= first + CALIBRATION_STEPS + SKIP_WINDOW {
            let (reports, skipped) = self
                .buckets
                .iter()
                .fold((0, 0), |(r, s), b| (r + b.1, s + b.2));
            if reports > 0 && f64::from(skipped) > SKIP_FRACTION * f64::from(reports) {
                return Some(Collapse::Skipping { skipped, reports });
            }
        }
        None
    }
}

fn alert(step: u64, scale: f64, collapse: Collapse) -> Opened {
    let (severity, title, what, evidence) = match collapse {
        Collapse::AtMinimum => (
            Severity::Critical,
            format!("Loss scale collapsed to {} at step {step}", sci(scale)),
            format!(
                "The fp16 loss scale is {} at step {step}: at 1 or below it no longer lifts \
                 small gradients out of fp16's underflow, and a scaler at its floor stops \
                 skipping the steps that overflow.",
                sci(scale)
            ),
            json!({"cause": "at_minimum", "scale": scale}),
        ),
        Collapse::Halved { peak, peak_step } => {
            let halvings = (peak / scale).log2();
            (
                Severity::Warning,
                format!("Loss scale halved {halvings:.0} times since step {peak_step}"),
                format!(
                    "The fp16 loss scale fell from {} at step {peak_step} to {} at step {step}: \
                     {halvings:.0} net halvings within one growth interval ({GROWTH_INTERVAL} \
                     steps), each one a step whose gradients overflowed.",
                    sci(peak),
                    sci(scale)
                ),
                json!({"cause": "halvings", "scale": scale, "peak": peak,
                       "peak_step": peak_step, "halvings": halvings}),
            )
        }
        Collapse::Skipping { skipped, reports } => (
            Severity::Warning,
            format!("{skipped} of {reports} recent steps overflowed the loss scale"),
            format!(
                "Over the last {SKIP_WINDOW} steps, {skipped} of {reports} reported steps found \
                 inf or NaN gradients and were skipped (more than {:.0} %); the scale is now {}.",
                SKIP_FRACTION * 100.0,
                sci(scale)
            ),
            json!({"cause": "skipped_steps", "scale": scale, "skipped": skipped,
                   "reports": reports}),
        ),
    };
    Opened {
        kind: AlertKind::LossScaleCollapse,
        subject: SUBJECT.into(),
        severity,
        first_step: Some(step),
        step: Some(step),
        title,
        detail: what,
        fix: "Train in bf16 if the hardware has it (no loss scaler needed); otherwise keep the \
              softmax and attention in fp32 (GLM-130B), and find the first module that \
              overflows (the step records' input_absmax, a grad_nonfinite alert, or the \
              modules' activations)."
            .into(),
        evidence,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::{record, viewed};
    use crate::model::alert::Transition;

    fn run(scales: impl Fn(u64) -> (f64, bool), steps: u64) -> Vec<(u64, Transition)> {
        let mut detector = LossScaleCollapse::default();
        let records: Vec<_> = (0..steps)
            .map(|step| {
                let (scale, found_inf) = scales(step);
                record(json!({"step": step, "loss": 2.0,
                    "scaler": {"scale": scale, "found_inf": found_inf}}))
            })
            .collect();
        viewed(records, |view, alerts| detector.on_step(view, alerts))
    }

    fn opened(t: &[(u64, Transition)]) -> Vec<(u64, Severity, String)> {
        t.iter()
            .filter_map(|(s, t)| match t {
                Transition::Open(o) => Some((*s, o.severity, o.evidence["cause"].to_string())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_scale_that_keeps_halving_is_caught_before_it_reaches_one() {
        // 65536, halved every 20 steps from step 100.
        let t = run(
            |s| {
                let halvings = s.saturating_sub(100) / 20;
                (
                    65536.0 / 2f64.powi(halvings as i32),
                    s >= 100 && s % 20 == 0,
                )
            },
            400,
        );
        let o = opened(&t);
        assert_eq!(
            o[0],
            (260, Severity::Warning, "\"halvings\"".into()),
            "{t:?}"
        );
        // And once at 1: critical (a second episode after the first resolves is not
        // needed; the first stays open while it keeps falling).
        assert_eq!(o.len(), 1, "{t:?}");
        let t = run(|s| (if s < 50 { 8.0 } else { 1.0 }, false), 60);
        assert_eq!(opened(&t)[0].1, Severity::Critical);
        // Overflowing on every step, the scale halving each time: no clean step since
        // the peak, so the streak's alert (another detector) speaks, not this one.
        let t = run(|s| (32768.0 / 2f64.powi(s as i32), true), 14);
        assert!(t.is_empty(), "{t:?}");
    }

    #[test]
    fn a_streak_of_overflows_is_the_streak_s_alert_not_a_collapse() {
        // Ten overflows running (65536 → 64), then clean steps: the server's trace.
        let mut streak = crate::detect::scaler_overflow::ScalerOverflowStreak::default();
        let mut collapse = LossScaleCollapse::default();
        let mut scale = 65536.0;
        let records: Vec<_> = (0..40u64)
            .map(|s| {
                let inf = (2..12).contains(&s);
                if inf {
                    scale /= 2.0;
                }
                record(json!({"step": s, "loss": 2.0,
                    "scaler": {"scale": scale, "found_inf": inf}}))
            })
            .collect();
        let t = viewed(records, |view, alerts| {
            streak.on_step(view, alerts);
            collapse.on_step(view, alerts);
        });
        let kinds = crate::detect::testing::opened_kinds(&t);
        assert_eq!(kinds, [AlertKind::ScalerOverflowStreak], "{t:?}");
    }

    #[test]
    fn steps_skipped_more_than_one_in_a_hundred_are_a_collapse() {
        let t = run(|s| (1024.0, s % 50 == 7), 1300);
        let o = opened(&t);
        assert_eq!(o.len(), 1, "{t:?}");
        assert_eq!(o[0].0, 1100);
        assert_eq!(o[0].2, "\"skipped_steps\"");
    }

    #[test]
    fn a_healthy_scaler_stays_silent() {
        // The start: 65536 halved 5 times in the first steps; then growth every 2000
        // steps and the overflow that follows it.
        let t = run(
            |s| {
                if s < 5 {
                    (65536.0 / 2f64.powi(s as i32), true)
                } else {
                    let grown = (s - 5) % 2000 == 1999;
                    (if grown { 4096.0 } else { 2048.0 }, grown)
                }
            },
            6000,
        );
        assert!(t.is_empty(), "{t:?}");
    }
}
