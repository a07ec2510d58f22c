//! `scaler_overflow_streak`: the loss scaler reports `found_inf` on K consecutive
//! steps. One overflow now and then is the dynamic scaler doing its job (it halves
//! the scale and skips the step); K in a row means the gradients are non-finite at
//! any scale, and no optimizer step has happened for K steps.

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::view::StepView;
use super::wording::{sci, step_range};
use crate::model::alert::{AlertKind, Opened, Severity};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScalerOverflowStreak {
    /// The run of `found_inf` steps. Flattened, as stored before [`Streak`]; a run
    /// still counting starts again.
    #[serde(flatten)]
    streak: Streak,
    /// The scale reported just before the streak began, and the latest.
    scale_before: Option<f64>,
    scale_now: Option<f64>,
    skipped: u32,
    /// The largest input absolute value over the streak (NaN sticks).
    #[serde(default)]
    input_absmax: Option<f64>,
}

const SUBJECT: &str = "scaler";

impl ScalerOverflowStreak {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let (context, record) = (view.context, view.record);
        let Some(scaler) = &record.scaler else { return };
        let scale = scaler.scale.map(|s| s.get());
        match scaler.found_inf {
            None => {}
            Some(false) => {
                alerts.clear(AlertKind::ScalerOverflowStreak, SUBJECT, record.step);
                *self = ScalerOverflowStreak {
                    scale_before: scale.or(self.scale_now),
                    scale_now: scale.or(self.scale_now),
                    ..ScalerOverflowStreak::default()
                };
            }
            Some(true) => {
                if self.streak.since.is_none() {
                    self.scale_before = self.scale_now;
                }
                self.skipped += u32::from(scaler.step_skipped != Some(false));
                if let Some(x) = record.input_absmax.map(|x| x.get()) {
                    self.input_absmax = Some(match self.input_absmax {
                        Some(m) if m.is_nan() || x.is_nan() => f64::NAN,
                        Some(m) => m.max(x),
                        None => x,
                    });
                }
                self.scale_now = scale.or(self.scale_now);
                // Step numbers, not reports: a client reporting every k-th step
                // reaches the threshold on the same step number.
                let threshold = u64::from(context.thresholds.overflow_streak_steps);
                let (kind, step) = (AlertKind::ScalerOverflowStreak, record.step);
                if alerts.observe(kind, SUBJECT, &mut self.streak, true, |s| {
                    s.spans(threshold, step)
                }) {
                    alerts.open(self.opened(step));
                }
            }
        }
    }

    fn opened(&self, step: u64) -> Opened {
        let first_step = self.streak.first_step(step);
        let len = self.streak.count;
        let scale = match (self.scale_before, self.scale_now) {
            (Some(before), Some(now)) => {
                format!(" The loss scale fell from {} to {}.", sci(before), sci(now))
            }
            (None, Some(now)) => format!(" The loss scale is now {}.", sci(now)),
            _ => String::new(),
        };
        let inputs = super::precision::input_explanation(self.input_absmax);
        let (cause, because) = inputs.unwrap_or(("overflow", String::new()));
        Opened {
            kind: AlertKind::ScalerOverflowStreak,
            subject: SUBJECT.into(),
            severity: Severity::Critical,
            first_step: Some(first_step),
            step: Some(step),
            title: format!("Loss scaler overflows on every step: {} in a row", len),
            detail: format!(
                "The loss scaler found inf/NaN gradients on each of the last {} steps ({}), so {} \
                 optimizer steps were skipped and the model has not trained since step {}.{scale} \
                 Halving the scale has not helped: the gradients are non-finite at any scale.\
                 {because}",
                len,
                step_range(first_step, step),
                self.skipped,
                first_step,
            ),
            fix: "Find the non-finite value at its source: an fp16 overflow in forward (attention \
                  logits, large activations; compute them in fp32 or train in bf16), a NaN in the \
                  inputs or labels, log/sqrt/division of 0 in the loss, or a diverged model (lower \
                  the lr, clip gradients, restore a checkpoint)."
                .into(),
            evidence: json!({
                "cause": cause,
                "input_absmax": super::precision::evidence_number(self.input_absmax),
                "steps": len,
                "first_step": first_step,
                "skipped_steps": self.skipped,
                "scale_before": self.scale_before,
                "scale_now": self.scale_now,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::context::RunContext;
    use crate::detect::testing::{record, transitions};
    use crate::detect::thresholds::Thresholds;
    use crate::model::alert::Transition;
    use gradflow_protocol::RunRegistration;

    fn run(found_inf: &[Option<bool>]) -> Vec<(u64, Transition)> {
        run_with_inputs(found_inf, None)
    }

    fn run_with_inputs(
        found_inf: &[Option<bool>],
        input_absmax: Option<serde_json::Value>,
    ) -> Vec<(u64, Transition)> {
        let registration: RunRegistration = serde_json::from_value(json!({"params": []})).unwrap();
        let context = RunContext::new(
            &registration,
            Thresholds {
                overflow_streak_steps: 3,
                ..Thresholds::default()
            },
        );
        let mut detector = ScalerOverflowStreak::default();
        let mut scale = 65536.0;
        let records = found_inf.iter().enumerate().map(|(step, inf)| {
            if *inf == Some(true) {
                scale /= 2.0;
            }
            let mut value = json!({"step": step});
            if let Some(x) = &input_absmax {
                value["input_absmax"] = x.clone();
            }
            if let Some(inf) = inf {
                value["scaler"] = json!({"scale": scale, "found_inf": inf, "step_skipped": inf});
            }
            record(value)
        });
        transitions(records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        })
    }

    #[test]
    fn inputs_past_float16_range_are_named_as_the_cause() {
        let streak = [Some(true), Some(true), Some(true)];
        let Transition::Open(o) = &run_with_inputs(&streak, Some(json!(3.0e5)))[0].1 else {
            panic!("expected an open")
        };
        assert_eq!(o.evidence["cause"], "input_overflow");
        assert_eq!(o.evidence["input_absmax"], 3.0e5);
        assert!(o.detail.contains("inputs reached 3.00e5"), "{}", o.detail);
        let Transition::Open(o) = &run_with_inputs(&streak, Some(json!("NaN")))[0].1 else {
            panic!("expected an open")
        };
        assert_eq!(o.evidence["cause"], "input_nonfinite");
        assert_eq!(o.evidence["input_absmax"], "NaN");
        // Ordinary inputs: the model is the suspect, as before.
        let Transition::Open(o) = &run_with_inputs(&streak, Some(json!(4.0)))[0].1 else {
            panic!("expected an open")
        };
        assert_eq!(o.evidence["cause"], "overflow");
        assert!(!o.detail.contains("inputs"), "{}", o.detail);
    }

    #[test]
    fn opens_on_the_kth_overflow_and_resolves_on_the_first_clean_step() {
        let t = run(&[
            Some(false),
            Some(true),
            Some(true),
            Some(true),
            Some(true),
            Some(false),
        ]);
        assert_eq!(t.len(), 2, "{t:?}");
        assert_eq!(t[0].0, 3);
        let Transition::Open(o) = &t[0].1 else {
            panic!()
        };
        assert_eq!(o.evidence["scale_before"], 65536.0);
        assert_eq!(o.evidence["scale_now"], 8192.0);
        assert!(
            o.detail.contains("fell from 6.55e4 to 8.19e3"),
            "{}",
            o.detail
        );
        assert_eq!(
            t[1],
            (
                5,
                Transition::Resolve {
                    kind: AlertKind::ScalerOverflowStreak,
                    subject: "scaler".into(),
                    step: 5,
                    last_step: Some(4),
                }
            )
        );
    }

    #[test]
    fn occasional_overflows_and_unreported_steps_are_silent() {
        assert!(
            run(&[
                Some(true),
                Some(true),
                Some(false),
                Some(true),
                Some(true),
                Some(false)
            ])
            .is_empty()
        );
        // Steps without scaler state do not break a streak; the threshold counts step
        // numbers, so the streak of steps 0–2 is three steps long.
        let t = run(&[Some(true), None, Some(true), None, Some(true)]);
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].0, 2);
    }
}
