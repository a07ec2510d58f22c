//! What an alert is, as the detectors open it and every layer above names it: its
//! kind, its severity, what it says when it opens, and a detector's decision.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The kinds of docs/PROTOCOL.md's alert table, then the ones gradflow adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlertKind {
    GradStuckZero,
    NormWeightFrozen,
    ScalerBf16Incompatible,
    ScalerOverflowStreak,
    GradNonfinite,
    LossNonfinite,
    DtypeMismatch,
    ParamNotInOptimizer,
    GradExplosion,
    GradVanishing,
    UnusedParameters,
    LossDivergence,
    GroupNotTraining,
    GradsNotZeroed,
    FirstStepHint,
    UpdateRoundedAway,
    RankMissing,
    RankStraggler,
    RankNonfinite,
    ReplicaDivergence,
    ShardReportedAsGlobal,
    NothingTrains,
    AccumulationReset,
    ModelInEvalMode,
    FreezeFlagIgnored,
    ModulesNotRegistered,
    TiedWeightsUntied,
    ParamsCreatedInForward,
    ClipBeforeUnscale,
    ClipAfterStep,
    SchedulerPerMicroBatch,
    ParamGroupEmpty,
}

impl AlertKind {
    pub const ALL: [AlertKind; 32] = [
        AlertKind::GradStuckZero,
        AlertKind::NormWeightFrozen,
        AlertKind::ScalerBf16Incompatible,
        AlertKind::ScalerOverflowStreak,
        AlertKind::GradNonfinite,
        AlertKind::LossNonfinite,
        AlertKind::DtypeMismatch,
        AlertKind::ParamNotInOptimizer,
        AlertKind::GradExplosion,
        AlertKind::GradVanishing,
        AlertKind::UnusedParameters,
        AlertKind::LossDivergence,
        AlertKind::GroupNotTraining,
        AlertKind::GradsNotZeroed,
        AlertKind::FirstStepHint,
        AlertKind::UpdateRoundedAway,
        AlertKind::RankMissing,
        AlertKind::RankStraggler,
        AlertKind::RankNonfinite,
        AlertKind::ReplicaDivergence,
        AlertKind::ShardReportedAsGlobal,
        AlertKind::NothingTrains,
        AlertKind::AccumulationReset,
        AlertKind::ModelInEvalMode,
        AlertKind::FreezeFlagIgnored,
        AlertKind::ModulesNotRegistered,
        AlertKind::TiedWeightsUntied,
        AlertKind::ParamsCreatedInForward,
        AlertKind::ClipBeforeUnscale,
        AlertKind::ClipAfterStep,
        AlertKind::SchedulerPerMicroBatch,
        AlertKind::ParamGroupEmpty,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            AlertKind::GradStuckZero => "grad_stuck_zero",
            AlertKind::NormWeightFrozen => "norm_weight_frozen",
            AlertKind::ScalerBf16Incompatible => "scaler_bf16_incompatible",
            AlertKind::ScalerOverflowStreak => "scaler_overflow_streak",
            AlertKind::GradNonfinite => "grad_nonfinite",
            AlertKind::LossNonfinite => "loss_nonfinite",
            AlertKind::DtypeMismatch => "dtype_mismatch",
            AlertKind::ParamNotInOptimizer => "param_not_in_optimizer",
            AlertKind::GradExplosion => "grad_explosion",
            AlertKind::GradVanishing => "grad_vanishing",
            AlertKind::UnusedParameters => "unused_parameters",
            AlertKind::LossDivergence => "loss_divergence",
            AlertKind::GroupNotTraining => "group_not_training",
            AlertKind::GradsNotZeroed => "grads_not_zeroed",
            AlertKind::FirstStepHint => "first_step_hint",
            AlertKind::UpdateRoundedAway => "update_rounded_away",
            AlertKind::RankMissing => "rank_missing",
            AlertKind::RankStraggler => "rank_straggler",
            AlertKind::RankNonfinite => "rank_nonfinite",
            AlertKind::ReplicaDivergence => "replica_divergence",
            AlertKind::ShardReportedAsGlobal => "shard_reported_as_global",
            AlertKind::NothingTrains => "nothing_trains",
            AlertKind::AccumulationReset => "accumulation_reset",
            AlertKind::ModelInEvalMode => "model_in_eval_mode",
            AlertKind::FreezeFlagIgnored => "freeze_flag_ignored",
            AlertKind::ModulesNotRegistered => "modules_not_registered",
            AlertKind::TiedWeightsUntied => "tied_weights_untied",
            AlertKind::ParamsCreatedInForward => "params_created_in_forward",
            AlertKind::ClipBeforeUnscale => "clip_before_unscale",
            AlertKind::ClipAfterStep => "clip_after_step",
            AlertKind::SchedulerPerMicroBatch => "scheduler_per_micro_batch",
            AlertKind::ParamGroupEmpty => "param_group_empty",
        }
    }

    pub fn parse(text: &str) -> Option<AlertKind> {
        AlertKind::ALL.into_iter().find(|k| k.as_str() == text)
    }
}

/// An alert's severity, most severe first: the protocol's type, the one every layer
/// uses (stored, filtered, sorted and sent as its `as_str`).
pub use gradflow_protocol::AlertSeverity as Severity;

/// Whether an alert's episode is still going on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlertStatus {
    Open,
    Resolved,
}

impl AlertStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            AlertStatus::Open => "open",
            AlertStatus::Resolved => "resolved",
        }
    }

    pub fn parse(text: &str) -> Option<AlertStatus> {
        [AlertStatus::Open, AlertStatus::Resolved]
            .into_iter()
            .find(|s| s.as_str() == text)
    }
}

impl std::fmt::Display for AlertStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Display for AlertKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A new episode: everything an alert says when it opens.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Opened {
    pub kind: AlertKind,
    pub subject: String,
    pub severity: Severity,
    /// The first step of the episode (the first of the N zero steps); `None` for
    /// registration checks.
    pub first_step: Option<u64>,
    /// The step that completed the threshold and opened the alert.
    pub step: Option<u64>,
    pub title: String,
    pub detail: String,
    pub fix: String,
    pub evidence: Value,
}

/// What a detector decided on one input.
#[derive(Debug, Clone, PartialEq)]
pub enum Transition {
    Open(Opened),
    /// The episode of `kind` on `subject` ended at `step`, the first step where the
    /// condition no longer held.
    Resolve {
        kind: AlertKind,
        subject: String,
        step: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The API serialises these enums with serde and stores and filters them by
    /// `as_str`: the two spellings must be one.
    #[test]
    fn serde_names_are_the_stored_names() {
        for kind in AlertKind::ALL {
            assert_eq!(serde_json::to_value(kind).unwrap(), kind.as_str());
            assert_eq!(AlertKind::parse(kind.as_str()), Some(kind));
        }
        for severity in Severity::ALL {
            assert_eq!(serde_json::to_value(severity).unwrap(), severity.as_str());
        }
        for status in [AlertStatus::Open, AlertStatus::Resolved] {
            assert_eq!(serde_json::to_value(status).unwrap(), status.as_str());
            assert_eq!(AlertStatus::parse(status.as_str()), Some(status));
        }
    }
}
