//! Where a step's time goes: the device is synchronised at each phase boundary and
//! the wall time since the last one is charged to the phase that just ended. The
//! synchronisations serialise what would overlap (the host queueing kernels while
//! the device runs earlier ones), so the phases add up to more than a free-running
//! step: a profile of where the time is, not a measure of the overhead.

use std::time::Instant;

use candle_core::Device;
use serde::Serialize;

/// Per-phase wall times of the steps timed so far.
pub struct Phases {
    device: Device,
    last: Instant,
    times: Vec<(&'static str, Vec<f64>)>,
}

/// A phase's median over the timed steps.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseMedian {
    pub phase: &'static str,
    pub median_ms: f64,
}

impl Phases {
    pub fn new(device: &Device) -> Phases {
        Phases {
            device: device.clone(),
            last: Instant::now(),
            times: Vec::new(),
        }
    }

    /// Starts a step: what the device still runs is waited for first.
    pub fn start(&mut self) -> candle_core::Result<()> {
        self.device.synchronize()?;
        self.last = Instant::now();
        Ok(())
    }

    /// Ends `phase`: waits for the device, and charges the time since the last mark.
    pub fn mark(&mut self, phase: &'static str) -> candle_core::Result<()> {
        self.device.synchronize()?;
        let now = Instant::now();
        let seconds = (now - self.last).as_secs_f64();
        self.last = now;
        match self.times.iter_mut().find(|(name, _)| *name == phase) {
            Some((_, times)) => times.push(seconds),
            None => self.times.push((phase, vec![seconds])),
        }
        Ok(())
    }

    /// Each phase's median, in the order the phases first ran.
    pub fn medians(&self) -> Vec<PhaseMedian> {
        self.times
            .iter()
            .map(|(phase, times)| {
                let mut sorted = times.clone();
                sorted.sort_by(f64::total_cmp);
                PhaseMedian {
                    phase,
                    median_ms: sorted[sorted.len() / 2] * 1e3,
                }
            })
            .collect()
    }

    /// Forgets the times so far (after warm-up steps).
    pub fn clear(&mut self) {
        self.times.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_phase_gets_the_time_since_the_last_mark_in_first_run_order() {
        let mut phases = Phases::new(&Device::Cpu);
        for _ in 0..3 {
            phases.start().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(2));
            phases.mark("slow").unwrap();
            phases.mark("fast").unwrap();
        }
        let medians = phases.medians();
        let names: Vec<_> = medians.iter().map(|m| m.phase).collect();
        assert_eq!(names, ["slow", "fast"]);
        assert!(medians[0].median_ms >= 2.0, "{medians:?}");
        assert!(medians[1].median_ms < medians[0].median_ms, "{medians:?}");
        phases.clear();
        assert!(phases.medians().is_empty());
    }
}
