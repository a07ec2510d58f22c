//! Each module's level of Adam's update RMS (`modules[].adam.update_rms`, the update
//! over the lr), and the readings far above it: the update spikes that precede loss
//! spikes in large runs (Marin 32B: "Adam update norm spikes (2x) precede loss
//! spikes").
//!
//! The level is a running average of the logarithm over about the last
//! [`SPAN`] readings (a geometric mean, which a multiplicative spike moves less than
//! an arithmetic one), each reading clipped to [`SPIKE_FACTOR`]× the level before it
//! goes in, so a spike does not raise the bar for the next one. Beside it, the
//! module's jitter: the running average, over the same span, of how far the clipped
//! logarithm moved from one reading to the next. A spike is a reading at least
//! [`SPIKE_FACTOR`]× the level whose logarithm is also at least [`JITTERS`] jitters
//! above the level's: a module whose update swings by 2× from one sampled step to
//! the next (a policy gradient whose return varies by episode) is not spiking when
//! it does so again, while one whose update moved a few percent between readings is.
//! Five numbers a module keep the detectors' stored state small at any module count,
//! where a window of 128 readings a module would not.
//!
//! # Why [`JITTERS`] = 4.5
//!
//! Measured on the update RMS the client samples every 10 steps (its default):
//! REINFORCE on the corpus' episodic task, 30 seeds of 200 episodes, had readings up
//! to 4.0× their level and at most 3.6 jitters above it; a batch of one repeated
//! token in the 0.13 M-parameter GPT of docs/instabilities.md with β₂ = 0.999 gave
//! 5.7 jitters at step 100 (2.4×, the level still holding Adam's first readings),
//! 9.8 at step 150 and 17.9 at step 250, and 89 when sampled every step. 4.5 is the
//! geometric middle of 3.6 and 5.7. A stored state from before the jitter was kept
//! starts it at the next reading, and judges by the factor alone until then.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::view::StepView;

/// A reading this many times its module's level is an update spike.
pub const SPIKE_FACTOR: f64 = 2.0;
/// Readings a module needs before one is judged.
pub const MIN_READINGS: u32 = 5;
/// About how many readings the level averages over.
pub const SPAN: u32 = 20;
/// A spike's logarithm is also this many jitters above the level's.
pub const JITTERS: f64 = 4.5;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct UpdateLevels {
    /// Per module: the level's logarithm and the readings folded in so far.
    modules: BTreeMap<String, (f64, u32)>,
    /// Per module: how far its readings move from one to the next.
    jitter: BTreeMap<String, Jitter>,
}

/// The running average of the change in a module's clipped log reading from one
/// reading to the next.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Jitter {
    /// The last reading's clipped logarithm.
    last: f64,
    /// The average absolute change.
    mean: f64,
    /// Changes folded in so far.
    changes: u32,
}

/// One module's reading far above its level.
#[derive(Debug, Clone, PartialEq)]
pub struct UpdateSpike<'a> {
    pub module: &'a str,
    pub update_rms: f64,
    pub level: f64,
    /// The module's jitter: the mean change of its log reading between readings.
    pub jitter: f64,
}

impl UpdateSpike<'_> {
    pub fn ratio(&self) -> f64 {
        self.update_rms / self.level
    }
}

impl UpdateLevels {
    /// Folds this step's readings in; the modules whose reading was a spike.
    pub fn observe<'a>(&mut self, view: &StepView<'a>) -> Vec<UpdateSpike<'a>> {
        let mut spikes = Vec::new();
        for module in &view.record.modules {
            let Some(rms) = module
                .adam
                .as_ref()
                .and_then(|a| a.update_rms)
                .map(|r| r.get())
                .filter(|r| r.is_finite() && *r > 0.0)
            else {
                continue;
            };
            let (log_level, count) = self
                .modules
                .entry(module.module.clone())
                .or_insert((rms.ln(), 0));
            let jitter = self.jitter.get(&module.module).map_or(0.0, |j| j.mean);
            let level = log_level.exp();
            let beyond_jitter = rms.ln() - *log_level >= JITTERS * jitter;
            if *count >= MIN_READINGS && rms >= SPIKE_FACTOR * level && beyond_jitter {
                spikes.push(UpdateSpike {
                    module: &module.module,
                    update_rms: rms,
                    level,
                    jitter,
                });
            }
            let clipped = fold_level(log_level, count, rms);
            match self.jitter.get_mut(&module.module) {
                Some(j) => {
                    let change = (clipped - j.last).abs();
                    j.mean += (change - j.mean) / f64::from((j.changes + 1).min(SPAN));
                    j.changes = j.changes.saturating_add(1);
                    j.last = clipped;
                }
                None => {
                    let first = Jitter {
                        last: clipped,
                        ..Jitter::default()
                    };
                    self.jitter.insert(module.module.clone(), first);
                }
            }
        }
        spikes
    }
}

/// Folds `reading` into a level (`log_level`, over `count` readings so far): the
/// running mean of the logarithm over about [`SPAN`] readings, each clipped to
/// [`SPIKE_FACTOR`]× the level first, so that a spike does not raise the bar for the
/// next. The clipped logarithm that went in.
pub fn fold_level(log_level: &mut f64, count: &mut u32, reading: f64) -> f64 {
    let clipped = reading.ln().min(*log_level + SPIKE_FACTOR.ln());
    *log_level += (clipped - *log_level) / f64::from((*count + 1).min(SPAN));
    *count = count.saturating_add(1);
    clipped
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::{empty_context, record};
    use serde_json::json;

    fn reading(levels: &mut UpdateLevels, step: u64, rms: f64) -> Vec<f64> {
        let context = empty_context();
        let record = record(json!({"step": step, "modules": [
            {"module": "layers.0.mlp", "adam": {"update_rms": rms}}]}));
        let view = StepView::new(&context, &record);
        levels
            .observe(&view)
            .iter()
            .map(UpdateSpike::ratio)
            .collect()
    }

    #[test]
    fn a_reading_twice_the_level_is_a_spike_and_does_not_raise_the_bar() {
        let mut levels = UpdateLevels::default();
        // Adam's first updates are near 1 (sign(g)), then settle at 0.22: no spike.
        for (i, rms) in [1.0, 0.5, 0.4, 0.3]
            .into_iter()
            .chain([0.22; 30])
            .enumerate()
        {
            assert!(reading(&mut levels, i as u64, rms).is_empty(), "{i}");
        }
        let spike = reading(&mut levels, 40, 1.02);
        assert_eq!(spike.len(), 1);
        assert!(spike[0] > 4.0, "{spike:?}");
        // The next, smaller one is still judged against the old level.
        assert_eq!(reading(&mut levels, 41, 0.5).len(), 1);
        assert!(reading(&mut levels, 42, 0.22).is_empty());
    }

    #[test]
    fn a_reading_within_the_module_s_own_swing_is_not_a_spike() {
        // A policy gradient's update, sampled every 10 steps, moving by 1.44× from
        // one reading to the next (REINFORCE's moved by 1.3× to 3×): a reading of
        // 2.5× its level of 0.3 is within its own swing; one of 10× is not.
        let mut levels = UpdateLevels::default();
        for i in 0..40 {
            let rms = if i % 2 == 0 { 0.25 } else { 0.36 };
            assert!(reading(&mut levels, i, rms).is_empty(), "{i}");
        }
        assert!(reading(&mut levels, 40, 0.75).is_empty());
        let spike = reading(&mut levels, 41, 3.0);
        assert_eq!(spike.len(), 1);
        assert!(spike[0] > 9.0, "{spike:?}");
    }

    #[test]
    fn a_state_stored_before_the_jitter_was_kept_still_reads() {
        let stored = json!({"modules": {"layers.0.mlp": [-1.5, 30]}});
        let mut levels: UpdateLevels = serde_json::from_value(stored).unwrap();
        assert_eq!(reading(&mut levels, 300, 0.23 * 4.0).len(), 1);
    }
}
