//! `loss_nonfinite`: the loss is NaN or infinite. Opens at once; resolves on the
//! first step with a finite loss.

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::view::StepView;
use crate::model::alert::{AlertKind, Opened, Severity};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LossNonfinite {
    /// Flattened, as stored before [`Streak`].
    #[serde(flatten)]
    streak: Streak,
}

const SUBJECT: &str = "loss";

impl LossNonfinite {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let record = view.record;
        let Some(loss) = record.loss.map(|l| l.get()) else {
            return;
        };
        // One non-finite loss is enough: it opens at once.
        let kind = AlertKind::LossNonfinite;
        if !alerts.observe(kind, SUBJECT, &mut self.streak, !loss.is_finite(), |_| true) {
            return;
        }
        let cause = if loss.is_nan() { "nan" } else { "inf" };
        let spelled = gradflow_protocol::format_float(loss);
        let input_absmax = record.input_absmax.map(|x| x.get());
        let because = super::precision::input_explanation(input_absmax)
            .map(|(_, sentence)| sentence)
            .unwrap_or_default();
        alerts.open(Opened {
            kind: AlertKind::LossNonfinite,
            subject: SUBJECT.into(),
            severity: Severity::Critical,
            first_step: Some(record.step),
            step: Some(record.step),
            title: format!("Loss is {spelled} at step {}", record.step),
            detail: format!(
                "The loss reported at step {} is {spelled}. Every gradient computed from it is \
                 non-finite, and an optimizer step taken with it corrupts the weights.{because}",
                record.step
            ),
            fix: "Find the first non-finite value: run one step under \
                  torch.autograd.set_detect_anomaly(True), and check the batch (NaN inputs, \
                  labels out of range) and the loss (log of 0, division by a zero count of tokens \
                  when a mask is empty). Skip steps whose loss is not finite, clip gradients, and \
                  lower the lr if the loss rose before it broke."
                .into(),
            evidence: json!({
                "cause": cause,
                "loss": spelled,
                "input_absmax": super::precision::evidence_number(input_absmax),
            }),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::episode::{Episodes, Holds};
    use crate::detect::testing::{empty_context, record, transitions_from, viewed};
    use crate::model::alert::Transition;

    fn run(losses: &[serde_json::Value]) -> Vec<(u64, Transition)> {
        let mut detector = LossNonfinite::default();
        let records = losses
            .iter()
            .enumerate()
            .map(|(step, loss)| record(json!({"step": step, "loss": loss})));
        viewed(records, |v, out| detector.on_step(v, out))
    }

    #[test]
    fn an_open_alert_stored_before_the_shared_streak_still_resolves() {
        // The detector's old layout still reads; the episode is the one read back.
        let mut detector: LossNonfinite = serde_json::from_value(json!({"open": true})).unwrap();
        let mut episodes = Episodes::new(Holds::Immediate);
        episodes.restore(AlertKind::LossNonfinite, "loss".into(), Some(6));
        let context = empty_context();
        let records = [record(json!({"step": 7, "loss": 1.0}))];
        let t = transitions_from(&mut episodes, records, |r, alerts| {
            detector.on_step(&StepView::new(&context, r), alerts)
        });
        assert!(
            matches!(t.as_slice(), [(7, Transition::Resolve { .. })]),
            "{t:?}"
        );
    }

    #[test]
    fn opens_immediately_once_per_episode_and_resolves() {
        let t = run(&[
            json!(1.0),
            json!("NaN"),
            json!("Infinity"),
            json!(null),
            json!(0.9),
        ]);
        assert_eq!(t.len(), 2, "{t:?}");
        let (1, Transition::Open(o)) = &t[0] else {
            panic!("{t:?}")
        };
        assert_eq!(o.evidence["cause"], "nan");
        assert_eq!(
            t[1],
            (
                4,
                Transition::Resolve {
                    kind: AlertKind::LossNonfinite,
                    subject: "loss".into(),
                    step: 4,
                    last_step: Some(3),
                }
            )
        );
        let t = run(&[json!("-Infinity")]);
        let (0, Transition::Open(o)) = &t[0] else {
            panic!("{t:?}")
        };
        assert_eq!(o.evidence["cause"], "inf");
        assert!(run(&[json!(1.0), json!(0.5), json!(null)]).is_empty());
    }
}
