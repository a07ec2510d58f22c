//! `model_in_eval_mode` (gradflow's own kind): a model that trained in training
//! mode and then kept training in eval mode, usually left there by an evaluation
//! that called `model.eval()` and never `model.train()` again.
//!
//! # The rule
//!
//! The Python client sends the model's training flag at each `gf.step` as the
//! metric [`METRIC`] (1 or 0; since v1.10 also 0 when the flag is on but every
//! dropout and running-statistics batch norm is in eval mode: an evaluation helper
//! that switched the model's parts, facebookresearch/clevr-iep#22). The alert opens when the flag, after at least one
//! reported step at 1, is 0 on every reported step spanning [`STEPS`] step numbers,
//! and resolves on a step at 1. A run in eval mode from its first step never opens
//! it: some setups train that way on purpose, and nothing in the numbers tells a
//! mistake from a choice; a switch in the middle of the run does.
//!
//! Eval mode changes what a model computes only through modules that read the
//! flag. When the registration says the model holds none of PyTorch's own
//! (`mode_dependent_modules` is 0: no dropout, no batch norm with running
//! statistics), the alert opens as `info`: training computes what it would in
//! training mode unless one of the user's own modules reads `self.training`, which
//! the client cannot see. A count above 0, or none sent, keeps it a warning.
//!
//! # Why
//!
//! Gradients keep flowing and the loss keeps falling, so nothing looks wrong:
//! dropout is off and batch norm stops updating its statistics, so the model trains
//! without the regularisation it was configured with and overfits.

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::{Alerts, Streak};
use super::view::StepView;
use super::wording::step_range;
use crate::model::alert::{AlertKind, Opened, Severity};
use crate::model::metric::DetectorMetric;
use gradflow_protocol::StepRecord;

/// The metric the Python client sends: `model.training` at `gf.step`, 1 or 0.
pub const METRIC: &str = DetectorMetric::ModelTraining.as_str();
/// Step numbers in eval mode that open the alert.
pub const STEPS: u64 = 20;
const SUBJECT: &str = "model";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct EvalMode {
    /// The last step reported in training mode.
    last_training: Option<u64>,
    /// The current run of eval-mode reports. Flattened, as stored before [`Streak`];
    /// a run still counting starts again.
    #[serde(flatten)]
    eval: Streak,
}

impl EvalMode {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let record = view.record;
        let Some(flag) = view.metric(METRIC) else {
            return;
        };
        let training = flag >= 0.5;
        if training {
            self.last_training = Some(record.step);
        }
        let Some(last_training) = self.last_training else {
            return;
        };
        // Judged by step numbers (docs/PROTOCOL.md), not by reports.
        let (kind, step) = (AlertKind::ModelInEvalMode, record.step);
        if alerts.observe(kind, SUBJECT, &mut self.eval, !training, |s| {
            s.spans(STEPS, step)
        }) {
            let first = self.eval.first_step(step);
            let mode_dependent = view.context.registration.mode_dependent_modules;
            alerts.open(opened(record, first, last_training, mode_dependent));
        }
    }
}

/// The alert: a warning, or `info` when the registration says no module of
/// PyTorch's in the model depends on the mode (`mode_dependent == Some(0)`).
fn opened(
    record: &StepRecord,
    first: u64,
    last_training: u64,
    mode_dependent: Option<u32>,
) -> Opened {
    let since = format!(
        "The model was in training mode up to step {last_training} and has been in eval \
         mode (model.training is False at gf.step) on every reported step since, {}, while \
         the optimizer keeps stepping",
        step_range(first, record.step),
    );
    let changes_nothing_known = mode_dependent == Some(0);
    let (severity, detail, fix) = if changes_nothing_known {
        (
            Severity::Info,
            format!(
                "{since}. The model holds none of PyTorch's modules whose behaviour depends \
                 on the mode (no dropout, no batch or instance norm with running \
                 statistics), so it computes what it would in training mode, unless one of \
                 its own modules reads self.training."
            ),
            "Nothing to change if no module of the model reads self.training; otherwise, or \
             before adding dropout or batch norm, call model.train() after each evaluation."
                .to_owned(),
        )
    } else {
        (
            Severity::Warning,
            format!(
                "{since}: dropout is off and batch norm no longer updates its running \
                 statistics, so the model trains without the regularisation it was built \
                 with."
            ),
            "Call model.train() after each evaluation (or at the top of every training \
             iteration); evaluation code usually calls model.eval() and leaves the model that \
             way."
                .to_owned(),
        )
    };
    let mut evidence = json!({
        "cause": "left_in_eval",
        "last_training_step": last_training,
        "first_step": first,
        "steps": record.step + 1 - first,
    });
    if let Some(count) = mode_dependent {
        evidence["mode_dependent_modules"] = json!(count);
    }
    Opened {
        kind: AlertKind::ModelInEvalMode,
        subject: SUBJECT.into(),
        severity,
        first_step: Some(first),
        step: Some(record.step),
        title: if changes_nothing_known {
            "The model trains in eval mode, which changes none of its known modules".into()
        } else {
            "The model trains in eval mode".into()
        },
        detail,
        fix,
        evidence,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::context::RunContext;
    use crate::detect::testing::{record, transitions, viewed};
    use crate::detect::thresholds::Thresholds;
    use crate::model::alert::Transition;

    fn step(step: u64, training: f64) -> StepRecord {
        record(json!({"step": step, "metrics": {METRIC: training}}))
    }

    #[test]
    fn eval_mode_after_training_opens_after_twenty_steps_and_train_resolves() {
        let mut detector = EvalMode::default();
        let records: Vec<StepRecord> = (0..5)
            .map(|s| step(s, 1.0))
            .chain((5..40).map(|s| step(s, 0.0)))
            .chain([step(40, 1.0)])
            .collect();
        let t = viewed(&records, |v, out| detector.on_step(v, out));
        assert_eq!(t.len(), 2, "{t:?}");
        let (24, Transition::Open(opened)) = &t[0] else {
            panic!("{t:?}")
        };
        assert_eq!(opened.first_step, Some(5));
        assert_eq!(opened.evidence["last_training_step"], 4);
        assert!(opened.fix.contains("model.train()"));
        assert!(matches!(t[1], (40, Transition::Resolve { .. })));
    }

    #[test]
    fn eval_from_the_start_periodic_evaluation_and_no_flag_stay_silent() {
        let mut detector = EvalMode::default();
        // Eval mode from step 0 on: a choice the numbers cannot tell from a mistake.
        let from_start: Vec<StepRecord> = (0..100).map(|s| step(s, 0.0)).collect();
        assert!(viewed(&from_start, |v, out| detector.on_step(v, out)).is_empty());
        // An evaluation every 10 steps that leaves the flag at 0 on that step only.
        let mut detector = EvalMode::default();
        let periodic: Vec<StepRecord> = (0..100)
            .map(|s| step(s, if s % 10 == 9 { 0.0 } else { 1.0 }))
            .collect();
        assert!(viewed(&periodic, |v, out| detector.on_step(v, out)).is_empty());
        let mut detector = EvalMode::default();
        let none: Vec<StepRecord> = (0..50).map(|s| record(json!({"step": s}))).collect();
        assert!(viewed(&none, |v, out| detector.on_step(v, out)).is_empty());
    }

    /// The alert a run left in eval mode from step 5 opens, registered with
    /// `registration`.
    fn opened_with(registration: serde_json::Value) -> Opened {
        let registration = serde_json::from_value(registration).unwrap();
        let context = RunContext::new(&registration, Thresholds::default());
        let records: Vec<StepRecord> = (0..5)
            .map(|s| step(s, 1.0))
            .chain((5..40).map(|s| step(s, 0.0)))
            .collect();
        let mut detector = EvalMode::default();
        let t = transitions(&records, |record, alerts| {
            detector.on_step(&StepView::new(&context, record), alerts)
        });
        match t.as_slice() {
            [(24, Transition::Open(opened))] => opened.clone(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_model_without_mode_dependent_modules_is_told_as_info() {
        let none = opened_with(json!({"params": [], "mode_dependent_modules": 0}));
        assert_eq!(none.severity, Severity::Info);
        assert_eq!(none.evidence["cause"], "left_in_eval");
        assert_eq!(none.evidence["mode_dependent_modules"], 0);
        assert!(none.detail.contains("self.training"), "{}", none.detail);
        // Dropout or batch norm held, or nothing said: the warning.
        let held = opened_with(json!({"params": [], "mode_dependent_modules": 3}));
        assert_eq!(held.severity, Severity::Warning);
        assert_eq!(held.evidence["mode_dependent_modules"], 3);
        assert!(held.detail.contains("dropout is off"), "{}", held.detail);
        let unsaid = opened_with(json!({"params": []}));
        assert_eq!(unsaid.severity, Severity::Warning);
        assert!(unsaid.evidence.get("mode_dependent_modules").is_none());
    }
}
