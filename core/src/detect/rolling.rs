//! A series' recent level: the mean and standard deviation of its last readings, the
//! window the spike rules of large-run trainers use (OLMo-core's and Levanter's
//! skip-step: mean + 6σ of the last 128 values), and the same window's spread on a
//! log scale, measured robustly ([`LogSpread`]), which tells a heavy-tailed series'
//! own excursions from a reading far outside them.

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

/// A window of positive readings on a log scale: the median of their logarithms and
/// their median absolute deviation, scaled to read as a standard deviation for a
/// normal distribution. A loss whose ordinary spread covers orders of magnitude (a
/// batch of one, a return that varies by episode) has a wide one; a loss averaged
/// over many tokens a narrow one. Neither number moves for the few largest readings,
/// so the tail does not hide itself as the standard deviation lets it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogSpread {
    pub median: f64,
    pub mad: f64,
}

/// The MAD of a normal distribution is this fraction of its σ (1/1.4826).
const MAD_PER_SIGMA: f64 = 0.674_489_750_196_081_7;

impl LogSpread {
    /// How many robust standard deviations `value`'s logarithm lies above the median
    /// (infinite above a window whose readings are all equal; minus infinity for a
    /// value that is not positive).
    pub fn z(&self, value: f64) -> f64 {
        if value <= 0.0 {
            return f64::NEG_INFINITY;
        }
        let excess = value.ln() - self.median;
        let sigma = self.mad / MAD_PER_SIGMA;
        if sigma > 0.0 {
            excess / sigma
        } else if excess > 0.0 {
            f64::INFINITY
        } else {
            0.0
        }
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

    /// Readings that are `to` right after a reading that is `from`: the window's
    /// separate leaps from one region to another (a run the window begins with in
    /// `to`, a warm-up's, is none).
    pub fn leaps(&self, from: impl Fn(f64) -> bool, to: impl Fn(f64) -> bool) -> usize {
        let mut count = 0;
        let mut was_from = false;
        for &v in &self.values {
            if was_from && to(v) {
                count += 1;
            }
            was_from = from(v);
        }
        count
    }

    /// Times the window's readings rose to `value` or above from below it.
    pub fn rises_to(&self, value: f64) -> usize {
        self.leaps(|v| v < value, |v| v >= value)
    }

    /// The window's median; `None` when empty.
    pub fn median(&self) -> Option<f64> {
        median(self.values.iter().copied().collect())
    }

    /// The window's [`LogSpread`]; `None` when empty or when a reading is not
    /// positive (a series that reaches zero or below has no multiplicative scale).
    pub fn log_spread(&self) -> Option<LogSpread> {
        if self.values.iter().any(|v| *v <= 0.0) {
            return None;
        }
        let logs: Vec<f64> = self.values.iter().map(|v| v.ln()).collect();
        let centre = median(logs.clone())?;
        let mad = median(logs.iter().map(|l| (l - centre).abs()).collect())?;
        Some(LogSpread {
            median: centre,
            mad,
        })
    }
}

/// The upper median of `values`; `None` when empty.
fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    Some(values[values.len() / 2])
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

    #[test]
    fn rises_count_separate_excursions_not_a_warm_up() {
        let mut rolling = Rolling::default();
        // A warm-up above 4, then two excursions to 9 and one to 5.
        for v in [6.0, 5.0, 4.5, 1.0, 1.1, 9.0, 9.0, 1.0, 9.0, 1.2, 5.0, 1.0] {
            rolling.push(v);
        }
        assert_eq!(rolling.rises_to(4.0), 3);
        assert_eq!(rolling.rises_to(8.0), 2);
        assert_eq!(rolling.rises_to(10.0), 0);
    }

    #[test]
    fn the_log_spread_is_the_median_and_mad_of_the_logs_of_positive_windows() {
        let mut rolling = Rolling::default();
        for v in [1.0, 10.0, 100.0, 1000.0, 1e6] {
            rolling.push(v);
        }
        let spread = rolling.log_spread().unwrap();
        let ln10 = 10f64.ln();
        assert!((spread.median - 2.0 * ln10).abs() < 1e-12, "{spread:?}");
        // |log deviations| are 2, 1, 0, 1, 4 decades: their median is one decade,
        // and the largest reading does not move it.
        assert!((spread.mad - ln10).abs() < 1e-12, "{spread:?}");
        let sigma = ln10 / MAD_PER_SIGMA;
        assert!((spread.z(1e4) - 2.0 * ln10 / sigma).abs() < 1e-12);
        assert_eq!(spread.z(0.0), f64::NEG_INFINITY);
        rolling.push(0.0);
        assert_eq!(rolling.log_spread(), None);
        let mut flat = Rolling::default();
        flat.push(2.0);
        flat.push(2.0);
        let flat = flat.log_spread().unwrap();
        assert_eq!((flat.z(2.0), flat.z(2.5)), (0.0, f64::INFINITY));
    }
}
