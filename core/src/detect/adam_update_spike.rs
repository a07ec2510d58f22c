//! `adam_update_spike` (v1.8): a module whose Adam update (RMS of m̂/(√v̂+ε), the
//! update over the lr) jumps to twice its own level — in Marin 32B's loss spikes the
//! update-norm spike came first, larger in the lower layers, with the first moment
//! doubling while the second moment had not caught up (marin-community/marin#1368;
//! Molybog et al. 2023 on Adam's time-domain instability).
//!
//! # The rule
//!
//! Per module with `adam.update_rms` (sampled by the client): the reading is at least
//! [`SPIKE_FACTOR`]× the module's level ([`UpdateLevels`]: a geometric running mean
//! over about 20 readings, spikes clipped out) and its logarithm at least [`JITTERS`]
//! times the module's jitter (the running mean of how far its log reading moves from
//! one reading to the next) above the level's, after [`MIN_READINGS`] readings.
//! Opens on that reading (subject: the module); resolves on the first reading back
//! under the bar. One alert a step at most: the module with the largest ratio, the
//! others listed.
//!
//! # Why these numbers
//!
//! On a 2-layer GPT with AdamW, the median update RMS / lr sat at 0.21–0.23 in every
//! healthy run, Adam's first steps excepted (near 1, falling). One bad batch took it
//! to 1.02 with β₂ = 0.999 (4.6×) and 0.40 with β₂ = 0.95 (1.8×, under the bar: with
//! a fast second moment Adam damps the batch itself). 2× is Marin's "2x" and the
//! factor of Levanter's update clipping at mean + 2σ, roughly.
//!
//! The factor alone calls a heavy-tailed healthy update a spike: REINFORCE's update,
//! sampled every 10 steps (the client's default), swings from 0.14 to 1.0 as the
//! episodes' returns do, and reached 2× its level in 18 of 30 seeds (up to 4.0×);
//! InfoNCE over batches of four reached 2.3×. Its jitter is what tells it apart: those
//! readings were at most 3.6 jitters above the level (InfoNCE 2.1), the GPT's bad
//! batches with β₂ = 0.999 5.7 (step 100, the level still holding Adam's first
//! readings), 9.8 (step 150), 17.9 (step 250), and 89 when sampled every step; see
//! [`JITTERS`].

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::accumulation_reset::SUBJECT as RESET_SUBJECT;
use super::episode::Alerts;
use super::update_levels::{JITTERS, MIN_READINGS, SPIKE_FACTOR, UpdateLevels, UpdateSpike};
use super::view::StepView;
use super::wording::name_list;
use crate::model::alert::{AlertKind, Opened, Severity};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AdamUpdateSpike {
    levels: UpdateLevels,
}

impl AdamUpdateSpike {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let step = view.record.step;
        let mut spikes = self.levels.observe(view);
        let kind = AlertKind::AdamUpdateSpike;
        let sampled = view.record.modules.iter().any(|m| m.adam.is_some());
        if !sampled {
            return;
        }
        let spiking: Vec<&str> = spikes.iter().map(|s| s.module).collect();
        let open: Vec<String> = alerts.open_subjects(kind).map(str::to_owned).collect();
        for subject in open {
            if !spiking.contains(&subject.as_str()) {
                alerts.clear(kind, &subject, step);
            }
        }
        // Gradients reset between the backward passes of one optimizer step
        // (`accumulation_reset`, judged before this rule): every step is taken on one
        // micro-batch's gradient, as noisy as that batch, so its updates jump. The
        // spike is that verdict's consequence, not a second cause.
        if alerts.is_open(AlertKind::AccumulationReset, RESET_SUBJECT) {
            return;
        }
        spikes.sort_by(|a, b| b.ratio().total_cmp(&a.ratio()));
        let Some(worst) = spikes.first() else {
            return;
        };
        if spikes.iter().any(|s| alerts.holds(kind, s.module)) {
            return;
        }
        alerts.open(alert(step, worst, &spiking));
    }
}

fn alert(step: u64, worst: &UpdateSpike<'_>, all: &[&str]) -> Opened {
    let module = worst.module;
    let others: Vec<&str> = all.iter().copied().filter(|m| *m != module).collect();
    let also = if others.is_empty() {
        String::new()
    } else {
        format!(" Also above twice their level: {}.", name_list(&others, 6))
    };
    Opened {
        kind: AlertKind::AdamUpdateSpike,
        subject: module.into(),
        severity: Severity::Warning,
        first_step: Some(step),
        step: Some(step),
        title: format!(
            "Adam's update in {module} jumped {:.1}× at step {step}",
            worst.ratio()
        ),
        detail: format!(
            "At step {step} the RMS of Adam's update in {module} (m̂/(√v̂+ε), the update over \
             the lr) was {:.3}, {:.1}× its level of {:.3} (at least {MIN_READINGS} readings, \
             the bar {SPIKE_FACTOR}× and {JITTERS} times the {:.0} % its reading moves by \
             from one reading to the next).{also} An update far above its level while the \
             gradient's second moment lags behind is what precedes loss spikes in large runs.",
            worst.update_rms,
            worst.ratio(),
            worst.level,
            worst.jitter.exp_m1() * 100.0,
        ),
        fix: "Clip the update, not only the gradient (Levanter's ClipUpdateNorm: mean + 2–3σ \
              of the last 128 update norms), or skip the step when it spikes; β₂ = 0.95 lets \
              the second moment follow sudden gradients. If a loss_spike follows, its cause \
              says whether the data was behind it."
            .into(),
        evidence: json!({
            "cause": "update_spike",
            "update_rms": worst.update_rms,
            "level": worst.level,
            "ratio": worst.ratio(),
            "jitter": worst.jitter,
            "modules": all,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::{record, viewed};
    use crate::model::alert::Transition;

    fn run(rms: impl Fn(u64) -> f64, reports: u64) -> Vec<(u64, Transition)> {
        let mut detector = AdamUpdateSpike::default();
        let records: Vec<_> = (0..reports)
            .map(|r| {
                record(json!({"step": r * 10, "loss": 2.0, "modules": [
                    {"module": "tok", "adam": {"update_rms": rms(r * 10)}},
                    {"module": "layers.0.mlp", "adam": {"update_rms": 0.22}}]}))
            })
            .collect();
        viewed(records, |view, alerts| detector.on_step(view, alerts))
    }

    #[test]
    fn an_update_twice_its_level_opens_on_its_module_and_resolves_after() {
        let t = run(|s| if s == 150 { 1.02 } else { 0.22 }, 30);
        let [
            (150, Transition::Open(o)),
            (160, Transition::Resolve { .. }),
        ] = &t[..]
        else {
            panic!("{t:?}")
        };
        assert_eq!(o.subject, "tok");
        assert!(o.evidence["ratio"].as_f64().unwrap() > 4.0);
    }

    #[test]
    fn a_spike_under_an_accumulation_reset_is_its_consequence() {
        let mut detector = AdamUpdateSpike::default();
        let mut reset = crate::detect::accumulation_reset::AccumulationReset::default();
        // Three micro-batches a step, the gradients reset before each of the later
        // two, from the first step: each step is one micro-batch's, and its update
        // jumps 4.6× at step 150.
        let records: Vec<_> = (0..30)
            .map(|r| {
                let rms = if r == 15 { 1.02 } else { 0.22 };
                record(json!({"step": r * 10, "loss": 2.0,
                    "metrics": {crate::detect::accumulation_reset::METRIC: 2},
                    "modules": [{"module": "tok", "adam": {"update_rms": rms}}]}))
            })
            .collect();
        let t = viewed(records, |view, alerts| {
            reset.on_step(view, alerts);
            detector.on_step(view, alerts);
        });
        let kinds = crate::detect::testing::opened_kinds(&t);
        assert_eq!(kinds, [AlertKind::AccumulationReset], "{t:?}");
    }

    #[test]
    fn adam_s_first_steps_and_a_damped_batch_stay_silent() {
        // Near 1 at first, falling to 0.22; one batch at 1.8× (β₂ = 0.95).
        let t = run(
            |s| match s {
                0 => 1.0,
                10 => 0.6,
                20 => 0.4,
                150 => 0.40,
                _ => 0.22,
            },
            40,
        );
        assert!(t.is_empty(), "{t:?}");
    }
}
