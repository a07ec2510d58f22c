//! Dynamic loss scaling with `torch.amp.GradScaler` semantics: start at 2^16; after
//! `growth_interval` consecutive clean steps double the scale; on any inf/NaN
//! gradient halve it, reset the growth tracker and skip the optimizer step.

/// The scaler's state after each update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaler {
    pub scale: f64,
    pub growth_tracker: u64,
    growth_interval: u64,
}

pub const INITIAL_SCALE: f64 = 65536.0;
const GROWTH_FACTOR: f64 = 2.0;
const BACKOFF_FACTOR: f64 = 0.5;

impl LossScaler {
    pub fn new(growth_interval: u64) -> LossScaler {
        LossScaler {
            scale: INITIAL_SCALE,
            growth_tracker: 0,
            growth_interval: growth_interval.max(1),
        }
    }

    /// Records a step's outcome; returns whether the optimizer step must be skipped.
    pub fn update(&mut self, found_inf: bool) -> bool {
        if found_inf {
            self.scale *= BACKOFF_FACTOR;
            self.growth_tracker = 0;
            return true;
        }
        self.growth_tracker += 1;
        if self.growth_tracker == self.growth_interval {
            self.scale *= GROWTH_FACTOR;
            self.growth_tracker = 0;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_trace_follows_gradscaler() {
        let mut scaler = LossScaler::new(3);
        let pattern = [
            false, false, false, true, false, true, true, false, false, false,
        ];
        let trace: Vec<(f64, u64, bool)> = pattern
            .iter()
            .map(|&inf| {
                let skipped = scaler.update(inf);
                (scaler.scale, scaler.growth_tracker, skipped)
            })
            .collect();
        assert_eq!(
            trace,
            vec![
                (65536.0, 1, false),
                (65536.0, 2, false),
                (131072.0, 0, false), // three clean steps: grow
                (65536.0, 0, true),   // overflow: back off, skip
                (65536.0, 1, false),
                (32768.0, 0, true),
                (16384.0, 0, true),
                (16384.0, 1, false),
                (16384.0, 2, false),
                (32768.0, 0, false),
            ]
        );
    }
}
