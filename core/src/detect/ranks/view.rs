//! What the ranks of a multi-rank run showed at one combined step, and what the rank
//! detectors share: their thresholds, their subjects' names, a streak with the
//! values seen over it.

use serde::{Deserialize, Serialize};

use crate::detect::episode::{Alerts, Streak};
use crate::detect::wording::sci;
use crate::model::alert::AlertKind;

/// A rank is a straggler at a step when its work takes at least this many times the
/// other ranks' median...
pub const STRAGGLER_RATIO: f64 = 1.5;
/// ...and at least this many seconds more (microsecond steps are all noise).
pub const STRAGGLER_MIN_EXCESS: f64 = 0.005;
/// Step numbers running that make a straggler alert, and that end one.
pub const STRAGGLER_STEPS: u64 = 10;
/// Replicas disagree when their values differ by more than this, relative to the
/// larger magnitude: identical all-reduced gradients give identical norms, and f32
/// storage keeps them identical.
pub const DIVERGENCE_TOLERANCE: f64 = 1e-4;
/// Step numbers running with a disagreement that open `replica_divergence` (one
/// step is a coincidence worth no alert; a desynchronised replica stays so).
pub const DIVERGENCE_STEPS: u64 = 3;
/// The series name of the weights' fingerprints among the compared values.
pub const WEIGHTS_SERIES: &str = "param_sum";
/// Fingerprint readings running (steps that carried one; a client sends them every
/// few steps) on which replicas disagree that open `replica_divergence` on `weights`.
pub const WEIGHTS_READINGS: usize = 2;
/// The ranks' reported elements must add up to the registered whole within this
/// fraction for `shard_reported_as_global`.
pub const SHARD_SUM_TOLERANCE: f64 = 0.01;

/// What the ranks of a multi-rank run showed at one combined step.
#[derive(Debug, Clone, Default)]
pub struct RankView {
    pub step: u64,
    pub world_size: u32,
    /// Ranks whose record of this step arrived.
    pub reported: u32,
    /// Ranks whose record never came (the step completed without them), each with
    /// the last step it reported.
    pub missing: Vec<(u32, Option<u64>)>,
    /// Each reporting rank's `step_time`, when it sent one.
    pub step_times: Vec<(u32, f64)>,
    /// Ranks with a non-finite reading at this step (the first few), each with (up
    /// to a few of) the subjects that were not finite.
    pub nonfinite: Vec<(u32, Vec<String>)>,
    /// How many ranks had one, listed or not.
    pub nonfinite_count: u32,
    /// Replicated subjects whose ranks disagree.
    pub divergences: Vec<Divergence>,
    /// Replicated modules whose ranks each report part of the elements.
    pub shard_suspects: Vec<ShardSuspect>,
    /// Of the `missing` ranks, those that had closed (v1.5: their client said it
    /// finished), so the step was completed at once instead of waited for.
    pub closed: Vec<u32>,
    /// Reporting ranks whose own loss was not finite (computed before any
    /// all-reduce, so it says which ranks a NaN began on).
    pub loss_nonfinite: Vec<u32>,
    /// Each reporting rank's own finite loss: the combined step's is their mean, so
    /// one rank's bad batch shows here undiluted.
    pub losses: Vec<(u32, f64)>,
    /// Reporting ranks whose own gradients held a NaN or infinity before the
    /// all-reduce (v1.7 `local_grads_nonfinite`).
    pub local_grads_nonfinite: Vec<u32>,
    /// Whether a rank's loss scaler found non-finite gradients at this step (and
    /// skipped it): an overflow the scaler handles, not a NaN to trace.
    pub scaler_skipped: bool,
    /// Whether replicas' weight fingerprints were compared at this step (v1.5).
    pub fingerprinted: bool,
}

/// A replicated module's or parameter's value on which its ranks disagree.
#[derive(Debug, Clone, PartialEq)]
pub struct Divergence {
    /// The module or parameter.
    pub subject: String,
    /// The series (`grad_norm`, `update_norm`, `param_mean`, …).
    pub series: &'static str,
    /// The smallest and largest value, with a rank that had each.
    pub min: (f64, u32),
    pub max: (f64, u32),
}

impl Divergence {
    /// The spread relative to the larger magnitude.
    pub fn relative(&self) -> f64 {
        let scale = self.min.0.abs().max(self.max.0.abs());
        if scale == 0.0 {
            0.0
        } else {
            (self.max.0 - self.min.0) / scale
        }
    }
}

/// A module registered `replicated` whose ranks report parts of its elements.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardSuspect {
    pub module: String,
    pub group: String,
    /// Elements of the module's parameters as registered (their shapes).
    pub registered: u64,
    /// Elements each rank reported: the largest, and the sum over ranks.
    pub largest: u64,
    pub sum: u64,
    pub ranks: u32,
}

/// A condition's run of step numbers (its [`Streak`]) and the values seen over it,
/// for the alert's numbers.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Sampled {
    /// Stored flattened, as before it counted with [`Streak`].
    #[serde(flatten)]
    pub streak: Streak,
    /// The values seen over the run (bounded: [`MAX_SAMPLES`]).
    pub samples: Vec<(f64, f64)>,
}

impl Sampled {
    /// Folds in one step: the condition `holds` (with `sample` kept, while there is
    /// room), or not and the run starts over.
    pub fn observe(&mut self, holds: bool, step: u64, sample: (f64, f64)) {
        if !holds {
            *self = Sampled::default();
            return;
        }
        self.streak.observe(true, step);
        if self.samples.len() < MAX_SAMPLES {
            self.samples.push(sample);
        }
    }
}

/// Values kept per streak at most.
pub const MAX_SAMPLES: usize = 64;

/// The subject of a rank's alerts.
pub fn rank_subject(rank: u32) -> String {
    format!("rank {rank}")
}

/// Ends the open per-rank episodes of `kind` whose rank no longer meets the
/// condition (`still` says which ranks do).
pub fn clear_ranks_gone(alerts: &mut Alerts<'_>, kind: AlertKind, still: impl Fn(u32) -> bool) {
    let gone: Vec<String> = alerts
        .open_subjects(kind)
        .filter(|subject| {
            let rank = subject.strip_prefix("rank ").and_then(|n| n.parse().ok());
            rank.is_some_and(|rank| !still(rank))
        })
        .map(str::to_owned)
        .collect();
    let step = alerts.step();
    for subject in gone {
        alerts.clear(kind, &subject, step);
    }
}

/// "3.2 %" or "2.1e-3 %".
pub fn relative_text(relative: f64) -> String {
    let percent = relative * 100.0;
    if percent >= 0.1 {
        format!("{percent:.1} %")
    } else {
        format!("{} %", sci(percent))
    }
}
