//! The verdicts only distributed training has, judged on each combined step of a
//! multi-rank run (v1.4): what the ranks' records of one step showed together.
//!
//! - `rank_missing`: a step was completed without a rank's record — the rank
//!   stopped reporting, or fell so far behind that the others could not wait for
//!   it, or closed (v1.5: its client finished) without having sent it. Resolves
//!   when the rank's records reach the combined steps again.
//! - `rank_straggler`: a rank's own work on each step (`step_time`) takes at least
//!   [`STRAGGLER_RATIO`]× the other ranks' median, on [`STRAGGLER_STEPS`] step
//!   numbers running. In lockstep data parallelism every rank's wall-clock step is
//!   the same (the fast ranks wait at the all-reduce), so only each rank's own work
//!   tells which one the others wait for.
//! - `rank_nonfinite`: a NaN or infinite reading (loss, a module's gradient) on some
//!   ranks but not all. After the gradient all-reduce a rank's NaN spreads to every
//!   rank, so the step where it shows on a few ranks only names where it began: that
//!   rank's batch, or rank-local code after the reduce. When a NaN in one rank's
//!   batch reaches every rank's gradients within the step (the all-reduce comes
//!   before the record is read), the ranks' own losses still tell: the loss is
//!   computed before the reduce, so the ranks whose loss alone is not finite are
//!   where it began.
//! - `replica_divergence`: modules or parameters laid out `replicated` whose ranks
//!   disagree, beyond float noise, on [`DIVERGENCE_STEPS`] step numbers running.
//!   After the all-reduce every replica holds the same gradient and takes the same
//!   optimizer step, so a disagreement is a desynchronised replica: a rank that
//!   skipped the reduce (`no_sync` left on), unsynchronised buffers, a module outside
//!   the data-parallel wrapper.
//!   *(v1.5)* Under DDP the gradients are all-reduced whatever the weights are, so
//!   replicas whose weights have come apart (a rank that changes its weights outside
//!   the optimizer, or steps with other settings) still agree on every gradient:
//!   each rank then sends now and then a fingerprint of each module's weights (the
//!   sum of its elements), and replicas that disagree on [`WEIGHTS_READINGS`]
//!   fingerprints running are `replica_divergence` on the subject `weights`.
//! - `shard_reported_as_global`: a parameter's module registered `replicated` whose
//!   ranks each report a part of its elements, the parts adding up to the whole: a
//!   client read each rank's local shard of a sharded tensor (FSDP2, ZeRO) as if it
//!   were the whole. Its combined norm is then wrong (the first rank's shard only),
//!   and a rank whose shard is empty reports a false zero.
//!
//! Like every detector these are pure: the combined step's view in, transitions out.
//! The thresholds count step numbers, as elsewhere.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::episode::Alerts;

mod divergence;
mod missing;
mod nonfinite;
mod shard;
mod straggler;
pub mod view;

pub use view::{
    DIVERGENCE_STEPS, DIVERGENCE_TOLERANCE, Divergence, RankView, SHARD_SUM_TOLERANCE,
    STRAGGLER_MIN_EXCESS, STRAGGLER_RATIO, STRAGGLER_STEPS, ShardSuspect, WEIGHTS_READINGS,
    WEIGHTS_SERIES,
};

/// The rank detectors' state. What a stored state of an older layout kept of its
/// open episodes (`missing`, `nonfinite`, `shards`) is read and ignored: the
/// episodes are [`Alerts`]'.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RankDetectors {
    stragglers: BTreeMap<u32, view::Sampled>,
    divergence: view::Sampled,
    /// Of the weights' fingerprints (v1.5): counted in readings, not steps.
    weights: view::Sampled,
    /// Ranks whose client said it closed (v1.5, `POST .../finish?rank=N`): the
    /// steps they did not send are completed at once, without waiting for them. A
    /// record from a closed rank reopens it. Kept here so that it is stored with the
    /// run's detector state.
    pub closed: BTreeSet<u32>,
}

impl RankDetectors {
    pub fn on_step(&mut self, view: &RankView, alerts: &mut Alerts<'_>) {
        missing::on_step(view, alerts);
        straggler::on_step(&mut self.stragglers, view, alerts);
        nonfinite::on_step(view, alerts);
        divergence::on_gradients(&mut self.divergence, view, alerts);
        divergence::on_weights(&mut self.weights, view, alerts);
        shard::on_step(view, alerts);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::detect::testing::Run;
    use crate::model::alert::{AlertKind, Transition};

    fn view(step: u64) -> RankView {
        RankView {
            step,
            world_size: 4,
            reported: 4,
            ..RankView::default()
        }
    }

    /// Step `step` of four ranks, completed without `rank` (last seen at `last`).
    fn missing(step: u64, rank: u32, last: u64) -> RankView {
        RankView {
            reported: 3,
            missing: vec![(rank, Some(last))],
            ..view(step)
        }
    }

    /// Runs `steps` through `detectors`, each view shaped by `shape`; collects the
    /// transitions in `all` and returns (step, opened) for each.
    fn drive(
        detectors: &mut RankDetectors,
        run: &mut Run,
        all: &mut Vec<(u64, Transition)>,
        steps: std::ops::Range<u64>,
        shape: impl Fn(u64, &mut RankView),
    ) -> Vec<(u64, bool)> {
        for step in steps {
            let mut v = view(step);
            shape(step, &mut v);
            let mut out = Vec::new();
            judge(detectors, run, &v, &mut out);
            all.extend(out.into_iter().map(|t| (step, t)));
        }
        all.iter()
            .map(|(s, t)| (*s, matches!(t, Transition::Open(_))))
            .collect()
    }

    /// One step of the rank detectors, its transitions added to `out`.
    fn judge(
        detectors: &mut RankDetectors,
        run: &mut Run,
        view: &RankView,
        out: &mut Vec<Transition>,
    ) {
        out.extend(run.step(view.step, |alerts| detectors.on_step(view, alerts)));
    }

    fn opened(out: &[Transition]) -> Vec<(AlertKind, String)> {
        out.iter()
            .filter_map(|t| match t {
                Transition::Open(o) => Some((o.kind, o.subject.clone())),
                Transition::Resolve { .. } => None,
            })
            .collect()
    }

    fn resolved(out: &[Transition]) -> Vec<(AlertKind, String, u64)> {
        out.iter()
            .filter_map(|t| match t {
                Transition::Resolve {
                    kind,
                    subject,
                    step,
                    ..
                } => Some((*kind, subject.clone(), *step)),
                Transition::Open(_) => None,
            })
            .collect()
    }

    #[test]
    fn a_healthy_run_of_equal_ranks_is_silent() {
        let mut detectors = RankDetectors::default();
        let mut run = Run::default();
        for step in 0..200 {
            let mut v = view(step);
            // Noisy but even step times; identical replicated values.
            v.step_times = (0..4)
                .map(|r| (r, 0.1 + 0.01 * (((step * 7 + r as u64) % 5) as f64)))
                .collect();
            v.divergences = vec![Divergence {
                subject: "agent.head".into(),
                series: "grad_norm",
                min: (0.5, 0),
                max: (0.5, 3),
            }];
            let mut out = Vec::new();
            judge(&mut detectors, &mut run, &v, &mut out);
            assert!(out.is_empty(), "step {step}: {out:?}");
        }
    }

    #[test]
    fn a_missing_rank_opens_once_and_resolves_when_back() {
        let mut detectors = RankDetectors::default();
        let mut run = Run::default();
        let mut out = Vec::new();
        judge(&mut detectors, &mut run, &missing(10, 2, 7), &mut out);
        assert_eq!(
            opened(&out),
            [(AlertKind::RankMissing, "rank 2".to_owned())]
        );
        let Transition::Open(o) = &out[0] else {
            unreachable!()
        };
        assert_eq!(o.evidence["last_step"], 7);
        out.clear();
        judge(&mut detectors, &mut run, &missing(11, 2, 7), &mut out);
        assert!(out.is_empty(), "{out:?}");
        judge(&mut detectors, &mut run, &view(12), &mut out);
        assert_eq!(
            resolved(&out),
            [(AlertKind::RankMissing, "rank 2".to_owned(), 12)]
        );
    }

    #[test]
    fn a_slow_rank_is_named_after_ten_steps_and_cleared_after_ten() {
        let mut detectors = RankDetectors::default();
        let mut run = Run::default();
        let mut all = Vec::new();
        for step in 0..40 {
            let slow = step < 20;
            let mut v = view(step);
            v.step_times = (0..4)
                .map(|r| (r, if r == 1 && slow { 0.3 } else { 0.1 }))
                .collect();
            let mut out = Vec::new();
            judge(&mut detectors, &mut run, &v, &mut out);
            all.extend(out.into_iter().map(|t| (step, t)));
        }
        let opens: Vec<u64> = all
            .iter()
            .filter(|(_, t)| matches!(t, Transition::Open(_)))
            .map(|(s, _)| *s)
            .collect();
        assert_eq!(opens, [9], "{all:?}");
        let Transition::Open(o) = &all[0].1 else {
            unreachable!()
        };
        assert_eq!(o.subject, "rank 1");
        assert!((o.evidence["ratio"].as_f64().unwrap() - 3.0).abs() < 1e-9);
        let resolves: Vec<u64> = all
            .iter()
            .filter(|(_, t)| matches!(t, Transition::Resolve { .. }))
            .map(|(s, _)| *s)
            .collect();
        assert_eq!(resolves, [29]);
    }

    #[test]
    fn tiny_steps_do_not_make_stragglers_of_noise() {
        let mut detectors = RankDetectors::default();
        let mut run = Run::default();
        for step in 0..50 {
            let mut v = view(step);
            // 2× slower, but only by 1 ms.
            v.step_times = vec![(0, 0.001), (1, 0.002), (2, 0.001), (3, 0.001)];
            let mut out = Vec::new();
            judge(&mut detectors, &mut run, &v, &mut out);
            assert!(out.is_empty(), "{out:?}");
        }
    }

    #[test]
    fn nan_on_one_rank_names_it_and_spreading_to_all_keeps_it_open() {
        let mut detectors = RankDetectors::default();
        let mut run = Run::default();
        let mut out = Vec::new();
        let mut v = view(30);
        v.nonfinite = vec![(1, vec!["loss".into(), "agent.head".into()])];
        v.nonfinite_count = 1;
        judge(&mut detectors, &mut run, &v, &mut out);
        assert_eq!(
            opened(&out),
            [(AlertKind::RankNonfinite, "rank 1".to_owned())]
        );
        out.clear();
        // The next step every rank is NaN: nothing new, rank 1 stays open.
        let mut v = view(31);
        v.nonfinite = (0..4).map(|r| (r, vec!["loss".into()])).collect();
        v.nonfinite_count = 4;
        judge(&mut detectors, &mut run, &v, &mut out);
        assert!(out.is_empty(), "{out:?}");
        judge(&mut detectors, &mut run, &view(32), &mut out);
        assert_eq!(
            resolved(&out),
            [(AlertKind::RankNonfinite, "rank 1".to_owned(), 32)]
        );
    }

    #[test]
    fn nan_spread_within_the_step_is_traced_to_the_rank_whose_loss_is_not_finite() {
        let mut detectors = RankDetectors::default();
        let mut run = Run::default();
        let mut out = Vec::new();
        // Every rank's gradients are NaN (the all-reduce spread them), only rank 1's
        // own loss is.
        let mut v = view(10);
        v.nonfinite = vec![
            (0, vec!["agent.head".into()]),
            (1, vec!["loss".into(), "agent.head".into()]),
            (2, vec!["agent.head".into()]),
            (3, vec!["agent.head".into()]),
        ];
        v.nonfinite_count = 4;
        v.loss_nonfinite = vec![1];
        judge(&mut detectors, &mut run, &v, &mut out);
        assert_eq!(
            opened(&out),
            [(AlertKind::RankNonfinite, "rank 1".to_owned())]
        );
        let Transition::Open(o) = &out[0] else {
            unreachable!()
        };
        assert_eq!(o.evidence["origin"], "loss");
        assert_eq!(o.evidence["spread_to"], json!([0, 2, 3]));
        out.clear();
        // Then every loss is NaN too: nothing new.
        let mut v = view(11);
        v.nonfinite = (0..4).map(|r| (r, vec!["loss".into()])).collect();
        v.nonfinite_count = 4;
        v.loss_nonfinite = vec![0, 1, 2, 3];
        judge(&mut detectors, &mut run, &v, &mut out);
        assert!(out.is_empty(), "{out:?}");
    }

    /// Every rank's readings NaN (the all-reduce spread them), every loss finite.
    fn spread_with_finite_losses(step: u64, local: Vec<u32>) -> RankView {
        let mut v = view(step);
        v.nonfinite = (0..4).map(|r| (r, vec!["agent.head".into()])).collect();
        v.nonfinite_count = 4;
        v.local_grads_nonfinite = local;
        v
    }

    #[test]
    fn nan_from_one_rank_s_backward_is_traced_by_its_local_gradients() {
        let mut detectors = RankDetectors::default();
        let mut run = Run::default();
        let mut out = Vec::new();
        judge(
            &mut detectors,
            &mut run,
            &spread_with_finite_losses(10, vec![2]),
            &mut out,
        );
        assert_eq!(
            opened(&out),
            [(AlertKind::RankNonfinite, "rank 2".to_owned())]
        );
        let Transition::Open(o) = &out[0] else {
            unreachable!()
        };
        assert_eq!(o.evidence["origin"], "local_grads");
        assert_eq!(o.evidence["spread_to"], json!([0, 1, 3]));
        assert!(o.title.contains("gradients on rank 2 only"), "{}", o.title);
        assert!(o.detail.contains("before the all-reduce"), "{}", o.detail);
        assert!(o.fix.contains("set_detect_anomaly"), "{}", o.fix);
        out.clear();
        // Every rank's local gradients non-finite too: no single origin, nothing new.
        judge(
            &mut detectors,
            &mut run,
            &spread_with_finite_losses(11, vec![0, 1, 2, 3]),
            &mut out,
        );
        assert!(out.is_empty(), "{out:?}");
        judge(&mut detectors, &mut run, &view(12), &mut out);
        assert_eq!(
            resolved(&out),
            [(AlertKind::RankNonfinite, "rank 2".to_owned(), 12)]
        );
    }

    #[test]
    fn one_rank_s_overflow_that_the_loss_scaler_skipped_is_not_traced() {
        let mut detectors = RankDetectors::default();
        let mut run = Run::default();
        let mut out = Vec::new();
        let mut v = spread_with_finite_losses(10, vec![1]);
        v.scaler_skipped = true;
        judge(&mut detectors, &mut run, &v, &mut out);
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn a_rank_s_non_finite_loss_names_the_origin_before_its_local_gradients() {
        let mut detectors = RankDetectors::default();
        let mut run = Run::default();
        let mut out = Vec::new();
        let mut v = spread_with_finite_losses(10, vec![1, 3]);
        v.loss_nonfinite = vec![3];
        judge(&mut detectors, &mut run, &v, &mut out);
        assert_eq!(
            opened(&out),
            [(AlertKind::RankNonfinite, "rank 3".to_owned())]
        );
        let Transition::Open(o) = &out[0] else {
            unreachable!()
        };
        assert_eq!(o.evidence["origin"], "loss");
    }

    #[test]
    fn a_closed_rank_s_missing_steps_say_it_closed() {
        let mut detectors = RankDetectors::default();
        let mut run = Run::default();
        let mut out = Vec::new();
        let v = RankView {
            closed: vec![1],
            ..missing(21, 1, 20)
        };
        judge(&mut detectors, &mut run, &v, &mut out);
        let Transition::Open(o) = &out[0] else {
            unreachable!()
        };
        assert_eq!(
            (o.kind, o.subject.as_str()),
            (AlertKind::RankMissing, "rank 1")
        );
        assert_eq!(o.evidence["closed"], true);
        assert_eq!(o.evidence["last_step"], 20);
        assert!(o.detail.contains("closed"), "{}", o.detail);
    }

    #[test]
    fn nan_on_every_rank_at_once_is_not_rank_local() {
        let mut detectors = RankDetectors::default();
        let mut run = Run::default();
        let mut out = Vec::new();
        let mut v = view(5);
        v.nonfinite = (0..4).map(|r| (r, vec!["loss".into()])).collect();
        v.nonfinite_count = 4;
        judge(&mut detectors, &mut run, &v, &mut out);
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn disagreeing_replicas_open_after_three_steps() {
        let mut detectors = RankDetectors::default();
        let mut run = Run::default();
        let mut all = Vec::new();
        let steps = drive(&mut detectors, &mut run, &mut all, 0..10, |step, v| {
            if (2..7).contains(&step) {
                v.divergences = vec![Divergence {
                    subject: "agent.head".into(),
                    series: "grad_norm",
                    min: (0.5, 0),
                    max: (0.51, 1),
                }];
            }
        });
        assert_eq!(steps, [(4, true), (9, false)], "{all:?}");
    }

    #[test]
    fn weights_that_come_apart_open_on_two_readings_and_steps_between_do_not_count() {
        let mut detectors = RankDetectors::default();
        let mut run = Run::default();
        let mut all = Vec::new();
        // Fingerprints every 5 steps; from step 10 rank 1's weights are off.
        let steps = drive(&mut detectors, &mut run, &mut all, 0..40, |step, v| {
            if step % 5 == 0 {
                v.fingerprinted = true;
                let off = if (10..30).contains(&step) { 0.01 } else { 0.0 };
                v.divergences = vec![Divergence {
                    subject: "agent.head".into(),
                    series: WEIGHTS_SERIES,
                    min: (0.5, 0),
                    max: (0.5 + off, 1),
                }];
            }
        });
        assert_eq!(steps, [(15, true), (30, false)], "{all:?}");
        let Transition::Open(o) = &all[0].1 else {
            unreachable!()
        };
        assert_eq!((o.subject.as_str(), o.first_step), ("weights", Some(10)));
        assert_eq!(o.evidence["subjects"][0]["max_rank"], 1);
    }

    #[test]
    fn shards_reported_as_whole_tensors_are_one_alert_per_group() {
        let mut detectors = RankDetectors::default();
        let mut run = Run::default();
        let mut out = Vec::new();
        let mut v = view(0);
        v.shard_suspects = ["a.q", "a.k"]
            .iter()
            .map(|m| ShardSuspect {
                module: (*m).into(),
                group: "a".into(),
                registered: 64,
                largest: 16,
                sum: 64,
                ranks: 4,
            })
            .collect();
        judge(&mut detectors, &mut run, &v, &mut out);
        assert_eq!(
            opened(&out),
            [(AlertKind::ShardReportedAsGlobal, "a".to_owned())]
        );
        out.clear();
        judge(&mut detectors, &mut run, &v, &mut out);
        assert!(out.is_empty());
    }
}
