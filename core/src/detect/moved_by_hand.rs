//! Modules whose weights move without a gradient: a target network copied in by hand
//! (DQN's hard update), an EMA teacher or momentum encoder averaged in place.
//!
//! A graph cut (a stray `torch.no_grad()` or `.detach()` in front of a module) leaves
//! that module's weights exactly where they started: backward never gives it a
//! gradient, and an optimizer skips a parameter without one. A module that backward
//! never reaches and whose weights still change was moved by the training code itself,
//! on purpose: `grad_stuck_zero` is not the place to report it.
//!
//! The evidence is the weights' fingerprint (`modules[].param_sum`, the sum of the
//! module's weights after the step), which the Python client sends now and then for
//! the modules that had no gradient on the step. Two fingerprints of one module, each
//! read on a step where it had no gradient tensor at all and with no step between them
//! on which it had one, that differ: the weights moved without a gradient. A module
//! whose gradient exists but is zero (zero-filled by `zero_grad(set_to_none=False)`
//! after an earlier backward) may be moved by the optimizer's weight decay alone, so
//! only modules without a gradient tensor are judged.
//!
//! A decay is not a move. A weight decay applied by hand outside the optimizer
//! (`p.mul_(1 - wd * lr)` over every parameter, as Ada-CM's `WeightEMA` does) shrinks
//! a module cut off from the graph too, by the same factor every step: its
//! fingerprint falls at one steady rate, `ln(sum / before) / steps` the same from one
//! pair of fingerprints to the next, from the first on. A target network copied in or
//! an EMA teacher follows the trained weights, whose sum moves by no fixed factor: it
//! grows on some intervals, and its rate drifts (a Polyak-averaged target's sum
//! follows a smooth curve whose rate held within 5 % of the one before for several
//! intervals in MADDPG's corpus look-alike, but not within 1 % of its first). A module
//! whose fingerprint shrank at its first interval's rate on every interval since it
//! last had a gradient, [`STEADY_INTERVALS`] or more, is decayed, not moved; one
//! interval off that rate makes it a module moved by hand for good.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// Modules known to be moved without a gradient kept at most.
const MAX_MODULES: usize = 4096;

/// Two fingerprints closer than this (relative to the larger) are the same weights:
/// the sum is taken in f64 over weights held in 32 bits or fewer, so untouched
/// weights give the same sum to the last bits even if the reduction order changes.
const SAME: f64 = 1e-12;

/// Intervals between fingerprints at one shrinking rate that make a decay: one
/// rate is any pair of readings, and two intervals agreeing by chance is possible for
/// a target network copied in at every fingerprint; three is not.
const STEADY_INTERVALS: u32 = 3;

/// How far an interval's rate may differ from the first one's, relative to it, and
/// be the same rate. The fingerprint of a module decayed by hand by 4e-5 a step, read
/// every 10 steps (Ada-CM's WeightEMA), kept its rate to 0.3 % over 30 readings. A
/// decay too small for its fingerprint's digits to show a steady rate falls back to
/// moved: silence, as before, not a false alarm.
const SAME_RATE: f64 = 0.01;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct MovedByHand {
    /// The last fingerprint of each module read while it had no gradient, since it
    /// last had one.
    last: BTreeMap<String, f64>,
    /// Modules whose weights changed between two such fingerprints.
    moved: BTreeSet<String>,
    /// Per module, how its fingerprint changed from the one before, while it had no
    /// gradient: a weight decay by hand shows as a steady shrink.
    trend: BTreeMap<String, Trend>,
}

/// The step of a module's last fingerprint, and how its fingerprint has changed
/// since its first without a gradient.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Trend {
    step: u64,
    /// `ln(sum / before)` per step over the first interval, when the sum shrank
    /// (kept its sign and came closer to 0).
    rate: Option<f64>,
    /// Intervals that shrank at that rate, the first included.
    intervals: u32,
    /// An interval did not shrink at that rate: not a decay.
    broken: bool,
}

impl Trend {
    /// Folds in the interval from `before` (at `self.step`) to `sum` at `step`;
    /// whether every interval so far, at least [`STEADY_INTERVALS`] of them, shrank
    /// the fingerprint at the first one's rate.
    fn follow(&mut self, step: u64, before: f64, sum: f64) -> bool {
        let steps = step.saturating_sub(self.step);
        self.step = step;
        if self.broken || steps == 0 {
            return false;
        }
        let shrank = before * sum > 0.0 && sum.abs() < before.abs();
        let rate = shrank.then(|| (sum / before).ln() / steps as f64);
        match (self.rate, rate) {
            (None, Some(rate)) if self.intervals == 0 => {
                self.rate = Some(rate);
                self.intervals = 1;
            }
            (Some(first), Some(rate)) if (rate - first).abs() <= SAME_RATE * first.abs() => {
                self.intervals = self.intervals.saturating_add(1);
            }
            _ => self.broken = true,
        }
        !self.broken && self.intervals >= STEADY_INTERVALS
    }
}

impl MovedByHand {
    /// Folds in one report of `module` at `step`: `gradless` when it had no gradient
    /// tensor (`grad_norm` null), with its fingerprint when one was sent. Whether its
    /// weights have been seen to move without a gradient (and not by a decay alone).
    pub fn observe(
        &mut self,
        module: &str,
        step: u64,
        gradless: bool,
        param_sum: Option<f64>,
    ) -> bool {
        if !gradless {
            // A gradient reached it: the optimizer may move it from here on, so a
            // fingerprint read before no longer tells a move by hand.
            if !self.last.is_empty() {
                self.last.remove(module);
                self.trend.remove(module);
            }
            return self.moved.contains(module);
        }
        if let Some(sum) = param_sum.filter(|s| s.is_finite()) {
            match self.last.get_mut(module) {
                Some(before) => {
                    let trend = self.trend.entry(module.to_owned()).or_default();
                    let decayed = trend.follow(step, *before, sum);
                    if decayed {
                        self.moved.remove(module);
                    } else if differ(*before, sum) && self.moved.len() < MAX_MODULES {
                        self.moved.insert(module.to_owned());
                    }
                    *before = sum;
                }
                None => {
                    if self.last.len() < MAX_MODULES {
                        self.last.insert(module.to_owned(), sum);
                        let first = Trend {
                            step,
                            ..Trend::default()
                        };
                        self.trend.insert(module.to_owned(), first);
                    }
                }
            }
        }
        self.moved.contains(module)
    }
}

fn differ(a: f64, b: f64) -> bool {
    (a - b).abs() > SAME * a.abs().max(b.abs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_that_change_without_a_gradient_were_moved_by_hand() {
        let mut seen = MovedByHand::default();
        assert!(!seen.observe("target", 0, true, Some(1.5)));
        assert!(!seen.observe("target", 0, true, None));
        assert!(!seen.observe("target", 0, true, Some(1.5)), "unchanged");
        assert!(seen.observe("target", 0, true, Some(1.75)), "copied in");
        // Known from then on, between fingerprints too.
        assert!(seen.observe("target", 0, true, None));
    }

    #[test]
    fn weights_that_only_decay_at_one_rate_are_not_moved() {
        // A cut-off module decayed by hand by 4e-5 a step, fingerprinted every 10
        // steps: provisionally moved at the first change, decayed from the third
        // interval at one rate on.
        let mut seen = MovedByHand::default();
        let sum = |step: u64| 6.62 * (1.0f64 - 4e-5).powi(step as i32);
        let moved: Vec<bool> = (0..8)
            .map(|i| seen.observe("head", i * 10, true, Some(sum(i * 10))))
            .collect();
        assert_eq!(
            moved,
            [false, true, true, false, false, false, false, false]
        );
        // A copy in (a jump off the rate) is a move, for good.
        assert!(seen.observe("head", 80, true, Some(7.5)));
        assert!(seen.observe("head", 90, true, Some(7.5 * (1.0f64 - 4e-5).powi(10))));
    }

    #[test]
    fn weights_that_follow_a_trained_network_are_moved() {
        // A target network averaged toward trained weights (Polyak, tau 0.01) shrinks
        // by no fixed factor: moved, at every fingerprint from the first change on,
        // even where its sum's curve flattens for a while.
        let mut seen = MovedByHand::default();
        let mut target = 5.0f64;
        for i in 0..30u64 {
            let online = 3.0 + (i as f64 * 0.7).sin();
            if i > 0 {
                for _ in 0..10 {
                    target += 0.01 * (online - target);
                }
            }
            let moved = seen.observe("target", i * 10, true, Some(target));
            assert_eq!(moved, i > 0, "{i}");
        }
    }

    #[test]
    fn weights_that_stay_put_or_had_a_gradient_in_between_are_not() {
        let mut seen = MovedByHand::default();
        for _ in 0..10 {
            assert!(!seen.observe("cut", 0, true, Some(-3.25)));
        }
        // The same sum up to the reduction's last bits.
        assert!(!seen.observe("cut", 0, true, Some(-3.25 * (1.0 + 1e-15))));
        // A gradient between two fingerprints: the optimizer may have moved it.
        assert!(!seen.observe("late_cut", 0, true, Some(2.0)));
        assert!(!seen.observe("late_cut", 0, false, None));
        assert!(!seen.observe("late_cut", 0, true, Some(2.5)));
        assert!(!seen.observe("late_cut", 0, true, Some(2.5)));
        // A zero-filled gradient (not gradless) is never judged.
        assert!(!seen.observe("decayed", 0, false, Some(1.0)));
        assert!(!seen.observe("decayed", 0, false, Some(0.9)));
        // Non-finite fingerprints say nothing.
        assert!(!seen.observe("nan", 0, true, Some(1.0)));
        assert!(!seen.observe("nan", 0, true, Some(f64::NAN)));
        assert!(!seen.observe("nan", 0, true, Some(1.0)));
    }
}
