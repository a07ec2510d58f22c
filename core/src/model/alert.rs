//! What an alert is, as the detectors open it and every layer above names it: its
//! kind, its severity, what it says when it opens, and a detector's decision.

use gradflow_protocol::{WiringKind, vocabulary};
use serde::Serialize;
use serde_json::Value;

vocabulary! {
    /// Every kind of alert, as docs/PROTOCOL.md's alert table lists them (a test holds
    /// the page's table to this one, row by row): its name, and what the table says
    /// of it. A kind a client's wiring finding raises borrows the finding's name.
    ///
    /// Adding a kind is adding a row here, a detector that opens it (one file under
    /// `detect/`, with its tests, named on one line of `detect/mod.rs`'s list) and its
    /// row in docs/PROTOCOL.md.
    pub enum AlertKind: KindSpec {
        GradStuckZero = "grad_stuck_zero" => KindSpec::new(&[Severity::Critical]),
        NormWeightFrozen = "norm_weight_frozen" => KindSpec::new(&[Severity::Critical]),
        ScalerBf16Incompatible = "scaler_bf16_incompatible" => KindSpec::new(&[Severity::Critical]),
        ScalerOverflowStreak = "scaler_overflow_streak" => KindSpec::new(&[Severity::Critical]),
        GradNonfinite = "grad_nonfinite" => KindSpec::new(&[Severity::Critical]),
        LossNonfinite = "loss_nonfinite" => KindSpec::new(&[Severity::Critical]),
        DtypeMismatch = "dtype_mismatch" => KindSpec::new(&[Severity::Warning]),
        ParamNotInOptimizer = "param_not_in_optimizer" => KindSpec::new(&[Severity::Critical]),
        GradExplosion = "grad_explosion" => KindSpec::new(&[Severity::Warning]),
        GradVanishing = "grad_vanishing" => KindSpec::new(&[Severity::Warning]),
        UnusedParameters = "unused_parameters" => KindSpec::new(&[Severity::Warning]),
        GroupNotTraining = "group_not_training" => KindSpec::new(&[Severity::Critical, Severity::Warning]),
        NothingTrains = "nothing_trains" => KindSpec::new(&[Severity::Critical]),
        AccumulationReset = "accumulation_reset" => KindSpec::new(&[Severity::Warning]),
        ModelInEvalMode = "model_in_eval_mode" => KindSpec::new(&[Severity::Warning, Severity::Info]),
        FreezeFlagIgnored = WiringKind::FreezeFlagIgnored.as_str() => KindSpec::new(&[Severity::Warning]),
        ModulesNotRegistered = WiringKind::ModulesNotRegistered.as_str() => KindSpec::new(&[Severity::Critical]),
        TiedWeightsUntied = WiringKind::TiedWeightsUntied.as_str() => KindSpec::new(&[Severity::Warning]),
        ParamsCreatedInForward = WiringKind::ParamsCreatedInForward.as_str() => KindSpec::new(&[Severity::Critical]),
        ClipBeforeUnscale = WiringKind::ClipBeforeUnscale.as_str() => KindSpec::new(&[Severity::Critical]),
        ClipAfterStep = WiringKind::ClipAfterStep.as_str() => KindSpec::new(&[Severity::Warning]),
        SchedulerPerMicroBatch = WiringKind::SchedulerPerMicroBatch.as_str() => KindSpec::new(&[Severity::Warning]),
        PlateauModeMismatch = WiringKind::PlateauModeMismatch.as_str() => KindSpec::new(&[Severity::Warning]),
        ParamGroupEmpty = WiringKind::ParamGroupEmpty.as_str() => KindSpec::new(&[Severity::Warning]),
        TensorsNotRegistered = WiringKind::TensorsNotRegistered.as_str() => KindSpec::new(&[Severity::Critical]),
        FrozenWeightsStepped = WiringKind::FrozenWeightsStepped.as_str() => KindSpec::new(&[Severity::Warning]),
        LossBroadcasts = WiringKind::LossBroadcasts.as_str() => KindSpec::new(&[Severity::Critical]),
        GradsNotZeroed = "grads_not_zeroed" => KindSpec::new(&[Severity::Warning]),
        OptimizerStepsPerReport = "optimizer_steps_per_report" => KindSpec::new(&[Severity::Warning, Severity::Info]),
        OptimizerNotStepped = "optimizer_not_stepped" => KindSpec::new(&[Severity::Critical]),
        LrVanished = "lr_vanished" => KindSpec::new(&[Severity::Warning]),
        UpdateRoundedAway = "update_rounded_away" => KindSpec::new(&[Severity::Critical, Severity::Warning]),
        FirstStepHint = "first_step_hint" => KindSpec::new(&[Severity::Info]).ends_at_once(),
        LossDivergence = "loss_divergence" => KindSpec::new(&[Severity::Warning]),
        LossSpike = "loss_spike" => KindSpec::new(&[Severity::Warning]),
        LossScaleCollapse = "loss_scale_collapse" => KindSpec::new(&[Severity::Critical, Severity::Warning]),
        AttentionLogitGrowth = "attention_logit_growth" => KindSpec::new(&[Severity::Critical, Severity::Warning]),
        AdamEpsDominated = "adam_eps_dominated" => KindSpec::new(&[Severity::Warning, Severity::Info]),
        AdamUpdateSpike = "adam_update_spike" => KindSpec::new(&[Severity::Warning]),
        AdamSecondMomentStale = "adam_second_moment_stale" => KindSpec::new(&[Severity::Info]),
        MoeRouterCollapse = "moe_router_collapse" => KindSpec::new(&[Severity::Critical]),
        MoeLoadImbalance = "moe_load_imbalance" => KindSpec::new(&[Severity::Warning]),
        ActivationNormGrowth = "activation_norm_growth" => KindSpec::new(&[Severity::Info]),
        OutputLogitDrift = "output_logit_drift" => KindSpec::new(&[Severity::Warning]),
        RankMissing = "rank_missing" => KindSpec::new(&[Severity::Critical]),
        RankStraggler = "rank_straggler" => KindSpec::new(&[Severity::Warning]),
        RankNonfinite = "rank_nonfinite" => KindSpec::new(&[Severity::Critical]),
        ReplicaDivergence = "replica_divergence" => KindSpec::new(&[Severity::Critical]),
        ShardReportedAsGlobal = "shard_reported_as_global" => KindSpec::new(&[Severity::Critical]),
    }
}

/// What the alert table says of a kind beyond its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KindSpec {
    /// The severities its alerts may have (the table's last column; a detector
    /// opening another is a bug its tests catch).
    pub severities: &'static [Severity],
    /// Step numbers its condition must stay away before an open episode ends
    /// (`detect::episode`): a return within them is the same episode.
    pub hold: u64,
}

/// The hold of a kind whose table row says nothing else: long enough that a
/// condition flapping around its threshold (a loss a few steps above its bar, a few
/// below) is one episode, short enough that one that has ended says so soon. As
/// short as the shortest streak threshold (`frozen_norm_steps`, 20), so that two
/// faults the thresholds tell apart are two alerts.
pub const HOLD_STEPS: u64 = 20;

impl KindSpec {
    const fn new(severities: &'static [Severity]) -> KindSpec {
        KindSpec {
            severities,
            hold: HOLD_STEPS,
        }
    }

    /// An episode that ends on the first report without its condition (a hint that
    /// a later verdict replaces).
    const fn ends_at_once(self) -> KindSpec {
        KindSpec { hold: 0, ..self }
    }
}

impl From<WiringKind> for AlertKind {
    /// The alert a client's wiring finding raises: the kind of the same name.
    fn from(finding: WiringKind) -> AlertKind {
        AlertKind::parse(finding.as_str()).expect("every wiring kind is an alert kind")
    }
}

/// An alert's severity, most severe first: the protocol's type, the one every layer
/// uses (stored, filtered, sorted and sent as its `as_str`).
pub use gradflow_protocol::AlertSeverity as Severity;

vocabulary! {
    /// Whether an alert's episode is still going on.
    pub enum AlertStatus {
        Open = "open",
        Resolved = "resolved",
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
    /// condition no longer held; `last_step` is the last step it held on.
    Resolve {
        kind: AlertKind,
        subject: String,
        step: u64,
        last_step: Option<u64>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wiring_finding_raises_the_alert_kind_of_its_name() {
        for finding in WiringKind::ALL {
            assert_eq!(AlertKind::from(finding).as_str(), finding.as_str());
        }
    }

    #[test]
    fn names_are_unique_and_every_kind_has_a_severity() {
        let mut names = AlertKind::NAMES.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), AlertKind::COUNT);
        for kind in AlertKind::ALL {
            assert!(!kind.properties().severities.is_empty(), "{kind}");
        }
    }
}
