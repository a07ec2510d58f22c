//! A series' readings kept a few steps apart at fixed memory, each with the loss's
//! running mean when it was taken: what a trend rule compares a reading with (the
//! one a window of steps earlier, the highest since) to say that something grew while
//! the loss improved little or not at all for it.

use serde::{Deserialize, Serialize};

/// One kept reading.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Reading {
    pub step: u64,
    pub value: f64,
    /// The loss's running mean at that step, when the run had a loss.
    pub loss: Option<f64>,
}

/// The kept readings of one series, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Spaced {
    readings: Vec<Reading>,
}

impl Spaced {
    /// Keeps `reading` when it comes at least `spacing` steps after the last kept
    /// one, and forgets the oldest beyond `kept` readings.
    pub fn keep(&mut self, reading: Reading, spacing: u64, kept: usize) {
        if self
            .readings
            .last()
            .is_some_and(|last| reading.step < last.step + spacing)
        {
            return;
        }
        self.readings.push(reading);
        if self.readings.len() > kept {
            self.readings.remove(0);
        }
    }

    /// The readings from the newest one taken at least `steps` steps before `step`
    /// on, that one first; `None` when none is that old.
    pub fn since(&self, step: u64, steps: u64) -> Option<&[Reading]> {
        let start = self.readings.iter().rposition(|r| r.step + steps <= step)?;
        Some(&self.readings[start..])
    }
}

/// The loss's running mean over about its last [`LossMean::READINGS`] finite
/// readings: one step's loss is too noisy to say whether the loss improved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LossMean(Option<f64>);

impl LossMean {
    /// Readings the mean spans, about.
    pub const READINGS: f64 = 10.0;

    /// Folds in a finite `loss`; the mean after it.
    pub fn observe(&mut self, loss: f64) -> f64 {
        let mean = self
            .0
            .map_or(loss, |mean| mean + (loss - mean) / Self::READINGS);
        self.0 = Some(mean);
        mean
    }

    /// The mean so far, if any loss was seen.
    pub fn get(&self) -> Option<f64> {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(step: u64) -> Reading {
        Reading {
            step,
            value: step as f64,
            loss: None,
        }
    }

    #[test]
    fn readings_are_kept_apart_and_the_oldest_forgotten() {
        let mut spaced = Spaced::default();
        for step in 0..100 {
            spaced.keep(at(step), 10, 4);
        }
        let steps: Vec<u64> = spaced.readings.iter().map(|r| r.step).collect();
        assert_eq!(steps, [60, 70, 80, 90]);
        let since: Vec<u64> = spaced
            .since(95, 20)
            .unwrap()
            .iter()
            .map(|r| r.step)
            .collect();
        assert_eq!(since, [70, 80, 90]);
        assert!(spaced.since(95, 40).is_none());
    }

    #[test]
    fn the_loss_mean_moves_a_tenth_of_the_way_each_reading() {
        let mut mean = LossMean::default();
        assert_eq!(mean.get(), None);
        assert_eq!(mean.observe(2.0), 2.0);
        assert!((mean.observe(1.0) - 1.9).abs() < 1e-12);
    }
}
