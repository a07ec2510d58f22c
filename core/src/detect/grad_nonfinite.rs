//! `grad_nonfinite`: a module's gradient norm is NaN or infinite on a step where no
//! loss scaler reported `found_inf`. On a step where the scaler did, the non-finite
//! gradient is the scaler doing its job (it skips the step and lowers the scale), so
//! such steps neither open nor resolve anything.
//!
//! One alert per group: a NaN spreads through everything upstream of it, so the
//! modules of a group go non-finite together; the evidence names them.

use gradflow_protocol::StepRecord;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::Alerts;
use super::view::{GroupMap, StepView};
use super::wording::name_list;
use crate::model::alert::{AlertKind, Opened, Severity};

/// Keeps nothing of its own: one non-finite reading opens, one finite reading of
/// the group ends the episode (a stored state's `open` map is read and ignored: the
/// episodes are [`Alerts`]').
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GradNonfinite {}

impl GradNonfinite {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let record = view.record;
        if view.found_inf() {
            return;
        }
        // Per group reported this step: its non-finite modules, in report order.
        let mut groups: GroupMap<Vec<(&str, f64)>> = GroupMap::default();
        for (module, group) in view.modules_with_groups() {
            let bad = groups.entry(group);
            if let Some(norm) = module.grad_norm.map(|n| n.get())
                && !norm.is_finite()
            {
                bad.push((&module.module, norm));
            }
        }
        let kind = AlertKind::GradNonfinite;
        for (group, bad) in groups.iter() {
            if bad.is_empty() {
                alerts.clear(kind, group, record.step);
            } else if !alerts.holds(kind, group) {
                alerts.open(opened(group, bad, record));
            }
        }
    }
}

fn opened(group: &str, bad: &[(&str, f64)], record: &StepRecord) -> Opened {
    let any_nan = bad.iter().any(|(_, n)| n.is_nan());
    let cause = if any_nan { "nan" } else { "inf" };
    let names: Vec<&str> = bad.iter().map(|(m, _)| *m).collect();
    let scaler = match &record.scaler {
        Some(s) if s.found_inf == Some(false) => {
            " The loss scaler reported found_inf false: it did not see this, so the optimizer \
             step ran with non-finite gradients."
        }
        _ => " No loss scaler caught it.",
    };
    Opened {
        kind: AlertKind::GradNonfinite,
        subject: group.to_owned(),
        severity: Severity::Critical,
        first_step: Some(record.step),
        step: Some(record.step),
        title: format!(
            "{} gradients in {group} at step {}",
            if any_nan { "NaN" } else { "Infinite" },
            record.step
        ),
        detail: format!(
            "At step {} the gradient norm of {} module{} of {group} was {}: {}.{scaler}",
            record.step,
            bad.len(),
            if bad.len() == 1 { "" } else { "s" },
            if any_nan { "NaN" } else { "infinite" },
            name_list(&names, 5),
        ),
        fix: "Find where the non-finite value starts: run one step under \
              torch.autograd.set_detect_anomaly(True), or hook the forward outputs of the modules \
              named here. Usual causes: log/sqrt/division of 0, an fp16 overflow (use bf16 or \
              fp32 there), a too-high learning rate. Clip gradients (clip_grad_norm_) and skip \
              the optimizer step when they are not finite."
            .into(),
        evidence: json!({
            "cause": cause,
            "modules": names.iter().take(20).collect::<Vec<_>>(),
            "nonfinite_modules": bad.len(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::context::RunContext;
    use crate::detect::testing::{record, transitions};
    use crate::detect::thresholds::Thresholds;
    use crate::detect::view::StepView;
    use crate::model::alert::Transition;
    use gradflow_protocol::RunRegistration;
    use serde_json::Value;

    fn run(steps: &[(Value, Option<bool>)]) -> Vec<(u64, Transition)> {
        let registration: RunRegistration = serde_json::from_value(
            json!({"params": [{"name": "qwen.a.weight"}, {"name": "agent.b.weight"}]}),
        )
        .unwrap();
        let context = RunContext::new(&registration, Thresholds::default());
        let mut detector = GradNonfinite::default();
        let records = steps.iter().enumerate().map(|(step, (norm, found_inf))| {
            let mut value = json!({"step": step, "modules": [
                {"module": "qwen.a", "grad_norm": norm}, {"module": "agent.b", "grad_norm": 1.0}]});
            if let Some(inf) = found_inf {
                value["scaler"] = json!({"found_inf": inf});
            }
            record(value)
        });
        transitions(records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        })
    }

    #[test]
    fn opens_immediately_on_the_group_and_resolves() {
        let t = run(&[
            (json!(1.0), None),
            (json!("NaN"), None),
            (json!("Infinity"), None),
            (json!(1.0), None),
        ]);
        assert_eq!(t.len(), 2, "{t:?}");
        let (1, Transition::Open(o)) = &t[0] else {
            panic!("{t:?}")
        };
        assert_eq!(o.subject, "qwen");
        assert_eq!(o.evidence["cause"], "nan");
        assert_eq!(o.evidence["modules"], json!(["qwen.a"]));
        assert_eq!(
            t[1],
            (
                3,
                Transition::Resolve {
                    kind: AlertKind::GradNonfinite,
                    subject: "qwen".into(),
                    step: 3,
                    last_step: Some(2),
                }
            )
        );
        let t = run(&[(json!("Infinity"), Some(false))]);
        let (0, Transition::Open(o)) = &t[0] else {
            panic!("{t:?}")
        };
        assert_eq!(o.evidence["cause"], "inf");
        assert!(o.detail.contains("did not see this"));
    }

    #[test]
    fn steps_where_the_scaler_found_inf_are_the_scaler_doing_its_job() {
        let t = run(&[
            (json!("Infinity"), Some(true)),
            (json!("NaN"), Some(true)),
            (json!(1.0), Some(false)),
        ]);
        assert!(t.is_empty(), "{t:?}");
    }
}
