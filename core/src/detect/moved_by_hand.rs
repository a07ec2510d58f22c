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

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// Modules known to be moved without a gradient kept at most.
const MAX_MODULES: usize = 4096;

/// Two fingerprints closer than this (relative to the larger) are the same weights:
/// the sum is taken in f64 over weights held in 32 bits or fewer, so untouched
/// weights give the same sum to the last bits even if the reduction order changes.
const SAME: f64 = 1e-12;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct MovedByHand {
    /// The last fingerprint of each module read while it had no gradient, since it
    /// last had one.
    last: BTreeMap<String, f64>,
    /// Modules whose weights changed between two such fingerprints.
    moved: BTreeSet<String>,
}

impl MovedByHand {
    /// Folds in one report of `module`: `gradless` when it had no gradient tensor
    /// (`grad_norm` null), with its fingerprint when one was sent. Whether its weights
    /// have been seen to move without a gradient.
    pub fn observe(&mut self, module: &str, gradless: bool, param_sum: Option<f64>) -> bool {
        if !gradless {
            // A gradient reached it: the optimizer may move it from here on, so a
            // fingerprint read before no longer tells a move by hand.
            if !self.last.is_empty() {
                self.last.remove(module);
            }
            return self.moved.contains(module);
        }
        if let Some(sum) = param_sum.filter(|s| s.is_finite()) {
            match self.last.get_mut(module) {
                Some(before) => {
                    if differ(*before, sum) && self.moved.len() < MAX_MODULES {
                        self.moved.insert(module.to_owned());
                    }
                    *before = sum;
                }
                None => {
                    if self.last.len() < MAX_MODULES {
                        self.last.insert(module.to_owned(), sum);
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
        assert!(!seen.observe("target", true, Some(1.5)));
        assert!(!seen.observe("target", true, None));
        assert!(!seen.observe("target", true, Some(1.5)), "unchanged");
        assert!(seen.observe("target", true, Some(1.75)), "copied in");
        // Known from then on, between fingerprints too.
        assert!(seen.observe("target", true, None));
    }

    #[test]
    fn weights_that_stay_put_or_had_a_gradient_in_between_are_not() {
        let mut seen = MovedByHand::default();
        for _ in 0..10 {
            assert!(!seen.observe("cut", true, Some(-3.25)));
        }
        // The same sum up to the reduction's last bits.
        assert!(!seen.observe("cut", true, Some(-3.25 * (1.0 + 1e-15))));
        // A gradient between two fingerprints: the optimizer may have moved it.
        assert!(!seen.observe("late_cut", true, Some(2.0)));
        assert!(!seen.observe("late_cut", false, None));
        assert!(!seen.observe("late_cut", true, Some(2.5)));
        assert!(!seen.observe("late_cut", true, Some(2.5)));
        // A zero-filled gradient (not gradless) is never judged.
        assert!(!seen.observe("decayed", false, Some(1.0)));
        assert!(!seen.observe("decayed", false, Some(0.9)));
        // Non-finite fingerprints say nothing.
        assert!(!seen.observe("nan", true, Some(1.0)));
        assert!(!seen.observe("nan", true, Some(f64::NAN)));
        assert!(!seen.observe("nan", true, Some(1.0)));
    }
}
