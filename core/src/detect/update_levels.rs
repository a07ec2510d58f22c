//! Each module's level of Adam's update RMS (`modules[].adam.update_rms`, the update
//! over the lr), and the readings far above it: the update spikes that precede loss
//! spikes in large runs (Marin 32B: "Adam update norm spikes (2x) precede loss
//! spikes").
//!
//! The level is a running average of the logarithm over about the last
//! [`SPAN`] readings (a geometric mean, which a multiplicative spike moves less than
//! an arithmetic one), each reading clipped to [`SPIKE_FACTOR`]× the level before it
//! goes in, so a spike does not raise the bar for the next one. Two numbers a module
//! keep the detectors' stored state small at any module count, where a window of 128
//! readings a module would not.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::view::StepView;

/// A reading this many times its module's level is an update spike.
pub const SPIKE_FACTOR: f64 = 2.0;
/// Readings a module needs before one is judged.
pub const MIN_READINGS: u32 = 5;
/// About how many readings the level averages over.
pub const SPAN: u32 = 20;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct UpdateLevels {
    /// Per module: the level's logarithm and the readings folded in so far.
    modules: BTreeMap<String, (f64, u32)>,
}

/// One module's reading far above its level.
#[derive(Debug, Clone, PartialEq)]
pub struct UpdateSpike<'a> {
    pub module: &'a str,
    pub update_rms: f64,
    pub level: f64,
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
            let level = log_level.exp();
            if *count >= MIN_READINGS && rms >= SPIKE_FACTOR * level {
                spikes.push(UpdateSpike {
                    module: &module.module,
                    update_rms: rms,
                    level,
                });
            }
            let clipped = rms.ln().min(*log_level + SPIKE_FACTOR.ln());
            *log_level += (clipped - *log_level) / f64::from((*count + 1).min(SPAN));
            *count = count.saturating_add(1);
        }
        spikes
    }
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
}
