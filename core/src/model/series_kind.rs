//! The kinds of series a run's steps carry: what a stored column holds, and what the
//! series API, the charts and the pages ask for.

/// What a column holds. The string form is stored in the `columns` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SeriesKind {
    Loss,
    Lr,
    ScalerScale,
    ScalerGrowthTracker,
    FoundInf,
    StepSkipped,
    ModuleGradNorm,
    HookHits,
    GroupGradNorm,
    ParamGradNorm,
    UpdateNorm,
    Drift,
    ParamMean,
    Metric,
    GpuMemoryUsedBytes,
    GpuMemoryTotalBytes,
    GpuUtilizationPct,
    GpuTemperatureC,
    GpuPowerW,
    DroppedSteps,
    IntendedUpdateNorm,
    IntendedUpdateMaxUlp,
    IntendedNonzero,
    RoundedAway,
    /// v1.4: a rank's own work on the step, seconds.
    StepTime,
    /// v1.4: gradient elements a rank holds of a module.
    ModuleNumel,
    /// v1.4: how many of those are NaN or infinite.
    ModuleNonfinite,
    /// v1.4: elements a rank holds of a parameter.
    ParamNumel,
    /// v1.2: whether the gradients were carried over an optimizer step (1 or 0).
    GradsCarriedOver,
    /// v1.2: the largest absolute input value of the step.
    InputAbsmax,
    /// v1.5: the sum of a module's weights a rank holds (a replica's fingerprint).
    ModuleParamSum,
    /// v1.7: whether a rank's own gradients were non-finite before the all-reduce
    /// (1 or 0).
    LocalGradsNonfinite,
}

impl SeriesKind {
    pub const ALL: [SeriesKind; 32] = [
        SeriesKind::Loss,
        SeriesKind::Lr,
        SeriesKind::ScalerScale,
        SeriesKind::ScalerGrowthTracker,
        SeriesKind::FoundInf,
        SeriesKind::StepSkipped,
        SeriesKind::ModuleGradNorm,
        SeriesKind::HookHits,
        SeriesKind::GroupGradNorm,
        SeriesKind::ParamGradNorm,
        SeriesKind::UpdateNorm,
        SeriesKind::Drift,
        SeriesKind::ParamMean,
        SeriesKind::Metric,
        SeriesKind::GpuMemoryUsedBytes,
        SeriesKind::GpuMemoryTotalBytes,
        SeriesKind::GpuUtilizationPct,
        SeriesKind::GpuTemperatureC,
        SeriesKind::GpuPowerW,
        SeriesKind::DroppedSteps,
        SeriesKind::IntendedUpdateNorm,
        SeriesKind::IntendedUpdateMaxUlp,
        SeriesKind::IntendedNonzero,
        SeriesKind::RoundedAway,
        SeriesKind::StepTime,
        SeriesKind::ModuleNumel,
        SeriesKind::ModuleNonfinite,
        SeriesKind::ParamNumel,
        SeriesKind::GradsCarriedOver,
        SeriesKind::InputAbsmax,
        SeriesKind::ModuleParamSum,
        SeriesKind::LocalGradsNonfinite,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SeriesKind::Loss => "loss",
            SeriesKind::Lr => "lr",
            SeriesKind::ScalerScale => "scaler_scale",
            SeriesKind::ScalerGrowthTracker => "scaler_growth_tracker",
            SeriesKind::FoundInf => "found_inf",
            SeriesKind::StepSkipped => "step_skipped",
            SeriesKind::ModuleGradNorm => "module_grad_norm",
            SeriesKind::HookHits => "hook_hits",
            SeriesKind::GroupGradNorm => "group_grad_norm",
            SeriesKind::ParamGradNorm => "param_grad_norm",
            SeriesKind::UpdateNorm => "update_norm",
            SeriesKind::Drift => "drift",
            SeriesKind::ParamMean => "param_mean",
            SeriesKind::Metric => "metric",
            SeriesKind::GpuMemoryUsedBytes => "gpu_memory_used_bytes",
            SeriesKind::GpuMemoryTotalBytes => "gpu_memory_total_bytes",
            SeriesKind::GpuUtilizationPct => "gpu_utilization_pct",
            SeriesKind::GpuTemperatureC => "gpu_temperature_c",
            SeriesKind::GpuPowerW => "gpu_power_w",
            SeriesKind::DroppedSteps => "dropped_steps",
            SeriesKind::IntendedUpdateNorm => "intended_update_norm",
            SeriesKind::IntendedUpdateMaxUlp => "intended_update_max_ulp",
            SeriesKind::IntendedNonzero => "intended_nonzero",
            SeriesKind::RoundedAway => "rounded_away",
            SeriesKind::StepTime => "step_time",
            SeriesKind::ModuleNumel => "module_numel",
            SeriesKind::ModuleNonfinite => "module_nonfinite",
            SeriesKind::ParamNumel => "param_numel",
            SeriesKind::GradsCarriedOver => "grads_carried_over",
            SeriesKind::InputAbsmax => "input_absmax",
            SeriesKind::ModuleParamSum => "module_param_sum",
            SeriesKind::LocalGradsNonfinite => "local_grads_nonfinite",
        }
    }

    pub fn parse(text: &str) -> Option<SeriesKind> {
        SeriesKind::ALL.into_iter().find(|k| k.as_str() == text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_through_their_names() {
        for kind in SeriesKind::ALL {
            assert_eq!(SeriesKind::parse(kind.as_str()), Some(kind));
        }
        assert_eq!(SeriesKind::parse("nope"), None);
    }

    #[test]
    fn every_kind_is_listed_in_declaration_order() {
        // `kind as usize` indexes tables of ALL's length (columns.rs).
        for (i, kind) in SeriesKind::ALL.into_iter().enumerate() {
            assert_eq!(kind as usize, i, "{kind:?}");
        }
    }
}
