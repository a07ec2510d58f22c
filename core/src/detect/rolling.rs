//! A series' recent level: the mean and standard deviation of its last readings, the
//! window the spike rules of large-run trainers use (OLMo-core's and Levanter's
//! skip-step: mean + 6σ of the last 128 values).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// The last [`Rolling::CAPACITY`] readings of one series.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Rolling {
    values: VecDeque<f64>,
}

/// A window's summary.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Level {
    pub mean: f64,
    pub std: f64,
    /// Readings it summarises.
    pub count: usize,
}

impl Level {
    /// How many standard deviations `value` lies above the mean (infinite above a
    /// window that never moved).
    pub fn z(&self, value: f64) -> f64 {
        let excess = value - self.mean;
        if self.std > 0.0 {
            excess / self.std
        } else if excess > 0.0 {
            f64::INFINITY
        } else {
            0.0
        }
    }

    /// `mean + sigmas·std`.
    pub fn bar(&self, sigmas: f64) -> f64 {
        self.mean + sigmas * self.std
    }
}

impl Rolling {
    /// Readings kept: OLMo-core's and Levanter's window.
    pub const CAPACITY: usize = 128;

    /// Adds a finite reading, the oldest leaving a full window.
    pub fn push(&mut self, value: f64) {
        if !value.is_finite() {
            return;
        }
        if self.values.len() == Self::CAPACITY {
            self.values.pop_front();
        }
        self.values.push_back(value);
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The window's mean and (population) standard deviation; `None` when empty.
    pub fn level(&self) -> Option<Level> {
        let count = self.values.len();
        if count == 0 {
            return None;
        }
        let mean = self.values.iter().sum::<f64>() / count as f64;
        let var = self.values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / count as f64;
        Some(Level {
            mean,
            std: var.sqrt(),
            count,
        })
    }

    /// The window's median; `None` when empty.
    pub fn median(&self) -> Option<f64> {
        let mut sorted: Vec<f64> = self.values.iter().copied().collect();
        if sorted.is_empty() {
            return None;
        }
        sorted.sort_by(f64::total_cmp);
        Some(sorted[sorted.len() / 2])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_keeps_the_last_128_finite_readings() {
        let mut rolling = Rolling::default();
        for i in 0..200 {
            rolling.push(i as f64);
        }
        rolling.push(f64::NAN);
        let level = rolling.level().unwrap();
        assert_eq!(level.count, 128);
        assert_eq!(level.mean, (72..200).sum::<i32>() as f64 / 128.0);
        assert_eq!(rolling.median(), Some(136.0));
        let flat = Level {
            mean: 2.0,
            std: 0.0,
            count: 9,
        };
        assert_eq!((flat.z(2.0), flat.z(3.0)), (0.0, f64::INFINITY));
    }
}
