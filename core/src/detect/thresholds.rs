//! The thresholds the detectors count against: the server's, with a run's own
//! overrides, and whether detection runs at all.

use serde::{Deserialize, Serialize};

/// The server-wide thresholds, in consecutive reported steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Thresholds {
    pub stuck_zero_steps: u32,
    pub frozen_norm_steps: u32,
    pub overflow_streak_steps: u32,
}

impl Default for Thresholds {
    /// docs/PROTOCOL.md's defaults.
    fn default() -> Self {
        Thresholds {
            stuck_zero_steps: 50,
            frozen_norm_steps: 20,
            overflow_streak_steps: 10,
        }
    }
}

impl Thresholds {
    /// These thresholds with a run's own overrides applied.
    pub fn with_overrides(self, overrides: Option<&gradflow_protocol::DetectorOverrides>) -> Self {
        let Some(o) = overrides else { return self };
        Thresholds {
            stuck_zero_steps: o.stuck_zero_steps.unwrap_or(self.stuck_zero_steps),
            frozen_norm_steps: o.frozen_norm_steps.unwrap_or(self.frozen_norm_steps),
            overflow_streak_steps: o
                .overflow_streak_steps
                .unwrap_or(self.overflow_streak_steps),
        }
    }
}

/// Whether the detectors run, and with which server-wide thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Detection {
    pub enabled: bool,
    pub thresholds: Thresholds,
}

impl Default for Detection {
    fn default() -> Self {
        Detection {
            enabled: true,
            thresholds: Thresholds::default(),
        }
    }
}
