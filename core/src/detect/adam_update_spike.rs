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
//!
//! # A spike the gradient led, and kept
//!
//! A change of objective moves Adam's update too: a loss term switched on after a
//! warm-up (a VAE's KL weight raised from 0 to 1 over ten steps) turns the gradient
//! at once, its norm rising about tenfold and staying at two to four times its former
//! level, and the update RMS jumps 2.3–3.2× while the second moment catches up
//! (the corpus' `test_a_kl_weight_switched_on_after_a_warm_up`, three seeds). Adam
//! absorbs it: the update is back at its level within 30 steps. A bad batch also
//! raises the gradient with the update, for its own step only; and the update spike
//! that precedes a loss spike comes before the gradient moves. So a spike is judged
//! with its module's gradient norm: at most [`SPIKE_FACTOR`]× its level (the
//! geometric running mean of its readings on the sampled steps) on the spike's step,
//! and the alert opens at once, as before; above, it waits for the module's next
//! reports, and opens (its first step the spike's) on the first whose gradient is
//! back under the bar — a batch's — or stands down once [`RISEN_REPORTS`] in a row
//! keep it above: the objective changed, and the gradient with it.
//!
//! # A module whose ε sets the update
//!
//! A module with most of its elements' √v̂ below ε (its `below_eps` at least
//! `adam_eps_dominated`'s 50 %) is not judged: its update is m̂/ε, which follows the
//! gradient's size as momentum SGD's does. DCRNN's published setting (Adam lr 0.01,
//! ε = 1e-3; 46–82 % of the elements below ε) fed its decoder its own forecasts more
//! and more often (scheduled sampling), the gradient grew with the harder task, and
//! the encoder's update read over twice its level in two of three seeds of a
//! healthy run.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::accumulation_reset::SUBJECT as RESET_SUBJECT;
use super::adam_eps_dominated::FRACTION;
use super::episode::Alerts;
use super::update_levels::{
    JITTERS, MIN_READINGS, SPIKE_FACTOR, UpdateLevels, UpdateSpike, fold_level,
};
use super::view::StepView;
use super::wording::name_list;
use crate::model::alert::{AlertKind, Opened, Severity};

/// Reports in a row after a spike whose gradient stays above [`SPIKE_FACTOR`]× its
/// level that make it a change of objective: a bad batch is one report, the KL term
/// coming in kept its modules' gradients above the bar for more than 20.
pub const RISEN_REPORTS: u32 = 3;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AdamUpdateSpike {
    levels: UpdateLevels,
    /// Per module: the logarithm of its gradient norm's level over the sampled
    /// steps (a geometric running mean over about [`SPAN`](super::update_levels::SPAN) readings, each clipped to
    /// [`SPIKE_FACTOR`]× the level), and the readings folded in.
    grads: BTreeMap<String, (f64, u32)>,
    /// A spike that came with its module's gradient above the bar, waiting for the
    /// next reports to say whether the gradient stays there.
    pending: Option<Spike>,
}

/// A spike, as its alert tells it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Spike {
    step: u64,
    module: String,
    update_rms: f64,
    level: f64,
    jitter: f64,
    /// Every module above twice its level on that step.
    modules: Vec<String>,
    /// The module's gradient level before the spike (infinite when not known).
    grad_level: f64,
    /// Reports since the spike whose gradient stayed above the bar.
    risen: u32,
}

/// What a module's next report says of a pending spike.
enum Settled {
    /// The gradient is back under the bar: the update spiked on a batch's gradient.
    Lone,
    /// The gradient stayed up for [`RISEN_REPORTS`]: the objective changed.
    Risen,
    Waiting,
}

impl Spike {
    fn new(step: u64, worst: &UpdateSpike<'_>, modules: Vec<String>, grad_level: f64) -> Spike {
        Spike {
            step,
            module: worst.module.to_owned(),
            update_rms: worst.update_rms,
            level: worst.level,
            jitter: worst.jitter,
            modules,
            grad_level,
            risen: 0,
        }
    }

    fn ratio(&self) -> f64 {
        self.update_rms / self.level
    }

    /// Whether `grad` is above the bar of the module's gradient level.
    fn risen_at(&self, grad: f64) -> bool {
        grad >= SPIKE_FACTOR * self.grad_level
    }

    fn settle(&mut self, view: &StepView<'_>) -> Settled {
        let Some(grad) = grad_norm(view, &self.module) else {
            return Settled::Waiting; // not reported: not measured
        };
        if !self.risen_at(grad) {
            return Settled::Lone;
        }
        self.risen += 1;
        if self.risen >= RISEN_REPORTS {
            Settled::Risen
        } else {
            Settled::Waiting
        }
    }
}

/// Whether most of `module`'s updated elements have √v̂ below ε on this step (its
/// `adam.below_eps` at least `adam_eps_dominated`'s [`FRACTION`]). Their update is
/// m̂/ε, not m̂/√v̂: no longer normalised, it grows and shrinks with the gradient as
/// momentum SGD's does, and a jump in it says the gradient moved, not that Adam's
/// second moment lagged its first.
fn damped_by_eps(view: &StepView<'_>, module: &str) -> bool {
    view.module(module)
        .and_then(|m| m.adam.as_ref())
        .and_then(|adam| adam.below_eps)
        .is_some_and(|below| below.get() >= FRACTION)
}

/// `module`'s finite, positive gradient norm on this step.
fn grad_norm(view: &StepView<'_>, module: &str) -> Option<f64> {
    view.module(module)
        .and_then(|m| m.grad_norm)
        .map(|n| n.get())
        .filter(|n| n.is_finite() && *n > 0.0)
}

impl AdamUpdateSpike {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let step = view.record.step;
        let mut spikes = self.levels.observe(view);
        spikes.retain(|spike| !damped_by_eps(view, spike.module));
        let kind = AlertKind::AdamUpdateSpike;
        // Gradients reset between the backward passes of one optimizer step
        // (`accumulation_reset`, judged before this rule): every step is taken on one
        // micro-batch's gradient, as noisy as that batch, so its updates jump. The
        // spike is that verdict's consequence, not a second cause.
        let reset = alerts.is_open(AlertKind::AccumulationReset, RESET_SUBJECT);
        let sampled = view.record.modules.iter().any(|m| m.adam.is_some());
        if sampled {
            let spiking: Vec<&str> = spikes.iter().map(|s| s.module).collect();
            let open: Vec<String> = alerts.open_subjects(kind).map(str::to_owned).collect();
            for subject in open {
                if !spiking.contains(&subject.as_str()) {
                    alerts.clear(kind, &subject, step);
                }
            }
        }
        if let Some(mut pending) = self.pending.take() {
            match pending.settle(view) {
                Settled::Lone if !reset && !alerts.holds(kind, &pending.module) => {
                    alerts.open(alert(step, &pending));
                }
                Settled::Waiting => self.pending = Some(pending),
                Settled::Lone | Settled::Risen => {}
            }
        }
        if !sampled {
            return;
        }
        spikes.sort_by(|a, b| b.ratio().total_cmp(&a.ratio()));
        let worst_level = spikes.first().and_then(|w| self.grad_level(w.module));
        self.fold_grads(view);
        let Some(worst) = spikes.first() else {
            return;
        };
        if reset || spikes.iter().any(|s| alerts.holds(kind, s.module)) {
            return;
        }
        let modules = spikes.iter().map(|s| s.module.to_owned()).collect();
        let spike = Spike::new(
            step,
            worst,
            modules,
            worst_level.unwrap_or(f64::INFINITY),
        );
        // The gradient rose with the update: the next reports say whether it stays.
        let led = grad_norm(view, worst.module).is_some_and(|g| spike.risen_at(g));
        if !led {
            alerts.open(alert(step, &spike));
        } else if self.pending.is_none() {
            self.pending = Some(spike);
        }
    }

    /// `module`'s gradient level, after [`MIN_READINGS`] readings.
    fn grad_level(&self, module: &str) -> Option<f64> {
        self.grads
            .get(module)
            .filter(|(_, count)| *count >= MIN_READINGS)
            .map(|(log_level, _)| log_level.exp())
    }

    /// Folds the gradient norms of the modules sampled for Adam's update into their
    /// levels.
    fn fold_grads(&mut self, view: &StepView<'_>) {
        for module in view.record.modules.iter().filter(|m| m.adam.is_some()) {
            let Some(grad) = module
                .grad_norm
                .map(|n| n.get())
                .filter(|n| n.is_finite() && *n > 0.0)
            else {
                continue;
            };
            let (log_level, count) = self
                .grads
                .entry(module.module.clone())
                .or_insert((grad.ln(), 0));
            fold_level(log_level, count, grad);
        }
    }
}

fn alert(step: u64, spike: &Spike) -> Opened {
    let module = spike.module.as_str();
    let at = spike.step;
    let ratio = spike.ratio();
    let others: Vec<&str> = spike
        .modules
        .iter()
        .map(String::as_str)
        .filter(|m| *m != module)
        .collect();
    let also = if others.is_empty() {
        String::new()
    } else {
        format!(" Also above twice their level: {}.", name_list(&others, 6))
    };
    Opened {
        kind: AlertKind::AdamUpdateSpike,
        subject: module.into(),
        severity: Severity::Warning,
        first_step: Some(at),
        step: Some(step),
        title: format!("Adam's update in {module} jumped {ratio:.1}× at step {at}"),
        detail: format!(
            "At step {at} the RMS of Adam's update in {module} (m̂/(√v̂+ε), the update over \
             the lr) was {:.3}, {ratio:.1}× its level of {:.3} (at least {MIN_READINGS} \
             readings, the bar {SPIKE_FACTOR}× and {JITTERS} times the {:.0} % its reading \
             moves by from one reading to the next).{also} An update far above its level \
             while the gradient's second moment lags behind is what precedes loss spikes in \
             large runs.",
            spike.update_rms,
            spike.level,
            spike.jitter.exp_m1() * 100.0,
        ),
        fix: "Clip the update, not only the gradient (Levanter's ClipUpdateNorm: mean + 2–3σ \
              of the last 128 update norms), or skip the step when it spikes; β₂ = 0.95 lets \
              the second moment follow sudden gradients. If a loss_spike follows, its cause \
              says whether the data was behind it."
            .into(),
        evidence: json!({
            "cause": "update_spike",
            "update_rms": spike.update_rms,
            "level": spike.level,
            "ratio": ratio,
            "jitter": spike.jitter,
            "modules": spike.modules,
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
    fn a_jump_in_an_update_that_eps_sets_is_not_judged() {
        // The same jump as above, on a module with most elements below ε: the update
        // is m̂/ε and jumps with the gradient. Under half below ε it is judged.
        let jump = |below: f64| {
            let mut detector = AdamUpdateSpike::default();
            let records: Vec<_> = (0..30u64)
                .map(|r| {
                    let rms = if r == 15 { 1.02 } else { 0.22 };
                    record(json!({"step": r * 10, "loss": 2.0, "modules": [
                        {"module": "encoder", "adam": {"update_rms": rms, "below_eps": below}}]}))
                })
                .collect();
            viewed(records, |view, alerts| detector.on_step(view, alerts))
        };
        assert!(jump(0.8).is_empty());
        assert!(matches!(&jump(0.3)[..], [(150, Transition::Open(_)), (160, _)]));
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

    /// Every step reports `tok`'s gradient norm `grad(step)`; every `every`-th step
    /// also Adam's update RMS `rms(step)`.
    fn with_grads(
        rms: impl Fn(u64) -> f64,
        grad: impl Fn(u64) -> f64,
        every: u64,
        steps: u64,
    ) -> Vec<(u64, Transition)> {
        let mut detector = AdamUpdateSpike::default();
        let records: Vec<_> = (0..steps)
            .map(|s| {
                let mut module = json!({"module": "tok", "grad_norm": grad(s)});
                if s % every == 0 {
                    module["adam"] = json!({"update_rms": rms(s)});
                }
                record(json!({"step": s, "loss": 2.0, "modules": [module]}))
            })
            .collect();
        viewed(records, |view, alerts| detector.on_step(view, alerts))
    }

    #[test]
    fn a_spike_on_a_gradient_that_rose_and_stays_risen_is_a_change_of_objective() {
        // A loss term comes in at step 151: the gradient rises tenfold and stays at
        // three times its level; the update, sampled every 10 steps, jumps 2.5× at
        // step 160 and settles. Measured on the corpus' KL warm-up.
        let grad = |s: u64| match s {
            0..=150 => 0.5,
            151..=165 => 5.0,
            _ => 1.5,
        };
        let rms = |s: u64| if s == 160 { 0.55 } else { 0.22 };
        let t = with_grads(rms, grad, 10, 300);
        assert!(t.is_empty(), "{t:?}");
    }

    #[test]
    fn a_spike_on_one_batch_s_gradient_opens_when_the_gradient_is_back() {
        // A bad batch at step 150, sampled every step: its gradient 38× for one step.
        let grad = |s: u64| if s == 150 { 19.0 } else { 0.5 };
        let rms = |s: u64| if s == 150 { 1.02 } else { 0.22 };
        let t = with_grads(rms, grad, 1, 160);
        let [
            (151, Transition::Open(o)),
            (152, Transition::Resolve { .. }),
        ] = &t[..]
        else {
            panic!("{t:?}")
        };
        assert_eq!((o.first_step, o.step), (Some(150), Some(151)));
        assert_eq!(o.subject, "tok");
        // A spike before the gradient moves (what precedes a loss spike) opens at
        // once, whatever the gradient does next.
        let grad = |s: u64| if s > 150 { 5.0 } else { 0.5 };
        let t = with_grads(rms, grad, 1, 160);
        assert!(matches!(t[0], (150, Transition::Open(_))), "{t:?}");
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
