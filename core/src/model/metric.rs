//! The metrics read by name — the series API's `metric=`, the runs comparison and the
//! per-rank charts — in one table: each name, the stored series kinds behind it, and
//! what subject it takes. Adding a metric is adding a row; the API's error texts, its
//! OpenAPI document and the charts read it.

use gradflow_protocol::vocabulary;

use super::series_kind::SeriesKind;

/// Whether a metric needs a subject, and what kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subject {
    /// Run-wide: no subject.
    None,
    /// A subject is required (a module, group, parameter or metric name).
    Required(&'static str),
    /// A device index, `0` when not given.
    Device,
    /// Run-wide without one; with one, a named part (an optimizer parameter group's
    /// own lr).
    Optional,
}

vocabulary! {
    /// Every metric name the series API reads: the series kinds behind it (a group's
    /// norm is derived; a name that is both a group and a module, a one-module group,
    /// gives the same value either way) and whether it needs a subject. The error
    /// text and the API document list these names; the comparison's and the
    /// per-rank charts' metrics are some of them.
    pub enum MetricName: Reads {
        Loss = "loss" => Reads::new(&[SeriesKind::Loss], Subject::None),
        Lr = "lr" => Reads::new(&[SeriesKind::Lr], Subject::Optional),
        GradNorm = "grad_norm" => Reads::new(&[SeriesKind::GroupGradNorm, SeriesKind::ModuleGradNorm], Subject::Required("a group or module")),
        HookHits = "hook_hits" => Reads::new(&[SeriesKind::HookHits], Subject::Required("a module")),
        ParamGradNorm = "param_grad_norm" => Reads::new(&[SeriesKind::ParamGradNorm], Subject::Required("a parameter")),
        UpdateNorm = "update_norm" => Reads::new(&[SeriesKind::UpdateNorm], Subject::Required("a parameter")),
        Drift = "drift" => Reads::new(&[SeriesKind::Drift], Subject::Required("a parameter")),
        ParamMean = "param_mean" => Reads::new(&[SeriesKind::ParamMean], Subject::Required("a parameter")),
        IntendedUpdateNorm = "intended_update_norm" => Reads::new(&[SeriesKind::IntendedUpdateNorm], Subject::Required("a parameter")),
        IntendedUpdateMaxUlp = "intended_update_max_ulp" => Reads::new(&[SeriesKind::IntendedUpdateMaxUlp], Subject::Required("a parameter")),
        IntendedNonzero = "intended_nonzero" => Reads::new(&[SeriesKind::IntendedNonzero], Subject::Required("a parameter")),
        RoundedAway = "rounded_away" => Reads::new(&[SeriesKind::RoundedAway], Subject::Required("a parameter")),
        ScalerScale = "scaler_scale" => Reads::new(&[SeriesKind::ScalerScale], Subject::None),
        ScalerGrowthTracker = "scaler_growth_tracker" => Reads::new(&[SeriesKind::ScalerGrowthTracker], Subject::None),
        FoundInf = "found_inf" => Reads::new(&[SeriesKind::FoundInf], Subject::None),
        StepSkipped = "step_skipped" => Reads::new(&[SeriesKind::StepSkipped], Subject::None),
        Metric = "metric" => Reads::new(&[SeriesKind::Metric], Subject::Required("a metrics name")),
        GpuMemoryUsedBytes = "gpu_memory_used_bytes" => Reads::new(&[SeriesKind::GpuMemoryUsedBytes], Subject::Device),
        GpuMemoryTotalBytes = "gpu_memory_total_bytes" => Reads::new(&[SeriesKind::GpuMemoryTotalBytes], Subject::Device),
        GpuUtilizationPct = "gpu_utilization_pct" => Reads::new(&[SeriesKind::GpuUtilizationPct], Subject::Device),
        GpuTemperatureC = "gpu_temperature_c" => Reads::new(&[SeriesKind::GpuTemperatureC], Subject::Device),
        GpuPowerW = "gpu_power_w" => Reads::new(&[SeriesKind::GpuPowerW], Subject::Device),
        DroppedSteps = "dropped_steps" => Reads::new(&[SeriesKind::DroppedSteps], Subject::None),
        StepTime = "step_time" => Reads::new(&[SeriesKind::StepTime], Subject::None),
        GradsCarriedOver = "grads_carried_over" => Reads::new(&[SeriesKind::GradsCarriedOver], Subject::None),
        LocalGradsNonfinite = "local_grads_nonfinite" => Reads::new(&[SeriesKind::LocalGradsNonfinite], Subject::None),
        OptimizerSteps = "optimizer_steps" => Reads::new(&[SeriesKind::OptimizerSteps], Subject::None),
        InputAbsmax = "input_absmax" => Reads::new(&[SeriesKind::InputAbsmax], Subject::None),
        GradNonfinite = "grad_nonfinite" => Reads::new(&[SeriesKind::ModuleNonfinite], Subject::Required("a module")),
        GradNumel = "grad_numel" => Reads::new(&[SeriesKind::ModuleNumel], Subject::Required("a module")),
        ParamSum = "param_sum" => Reads::new(&[SeriesKind::ModuleParamSum], Subject::Required("a module")),
        AttnMaxLogit = "attn_max_logit" => Reads::new(&[SeriesKind::AttnMaxLogit], Subject::Required("an attention module")),
        AttnMinEntropy = "attn_min_entropy" => Reads::new(&[SeriesKind::AttnMinEntropy], Subject::Required("an attention module")),
        ActRms = "act_rms" => Reads::new(&[SeriesKind::ActRms], Subject::Required("a module")),
        ActAbsmax = "act_absmax" => Reads::new(&[SeriesKind::ActAbsmax], Subject::Required("a module")),
        AdamUpdated = "adam_updated" => Reads::new(&[SeriesKind::AdamUpdated], Subject::Required("a module")),
        AdamBelowEps = "adam_below_eps" => Reads::new(&[SeriesKind::AdamBelowEps], Subject::Required("a module")),
        AdamUpdateRms = "adam_update_rms" => Reads::new(&[SeriesKind::AdamUpdateRms], Subject::Required("a module")),
        AdamUpdateAbsmax = "adam_update_absmax" => Reads::new(&[SeriesKind::AdamUpdateAbsmax], Subject::Required("a module")),
        OutputLogzMean = "output_logz_mean" => Reads::new(&[SeriesKind::OutputLogzMean], Subject::None),
        OutputLogitAbsmax = "output_logit_absmax" => Reads::new(&[SeriesKind::OutputLogitAbsmax], Subject::None),
        MoeExpertTokens = "moe_expert_tokens" => Reads::new(&[SeriesKind::MoeExpertTokens], Subject::Required("an MoE layer and expert, `layer/3`")),
        MoeRouterZ = "moe_router_z" => Reads::new(&[SeriesKind::MoeRouterZ], Subject::Required("an MoE layer")),
        MoeTopShare = "moe_top_share" => Reads::new(&[SeriesKind::MoeTopShare], Subject::Required("an MoE layer")),
        MoeMaxVio = "moe_max_vio" => Reads::new(&[SeriesKind::MoeMaxVio], Subject::Required("an MoE layer")),
        MoeIdleExperts = "moe_idle_experts" => Reads::new(&[SeriesKind::MoeIdleExperts], Subject::Required("an MoE layer")),
        MicroLoss = "micro_loss" => Reads::new(&[SeriesKind::MicroLoss], Subject::Required("a micro-batch index")),
        RepeatedTokenShare = "repeated_token_share" => Reads::new(&[SeriesKind::RepeatedTokenShare], Subject::None),
        OutputLogitMean = "output_logit_mean" => Reads::new(&[SeriesKind::OutputLogitMean], Subject::None),
    }
}

vocabulary! {
    /// The names of a step record's `metrics` that docs/PROTOCOL.md gives a meaning:
    /// a client sends them for the detectors to read. They are not the user's own
    /// numbers, which the dashboard charts and compares by name.
    pub enum DetectorMetric {
        /// The model's training flag at the client's step, 1 or 0 (`model_in_eval_mode`).
        ModelTraining = "model_training",
        /// On a step of several backward passes, how many after the first found the
        /// gradient reset (`accumulation_reset`).
        GradsResetBetweenBackwards = "grads_reset_between_backwards",
        /// The `max_norm` of a norm clip of all the gradients that ran after the
        /// client read them, before the optimizer step (`grad_explosion`).
        GradClipMaxNorm = "grad_clip_max_norm",
    }
}

/// Whether `name`, a name of a step record's `metrics`, is the user's own: a name the
/// protocol does not reserve for the detectors.
pub fn is_users_metric(name: &str) -> bool {
    DetectorMetric::parse(name).is_none()
}

/// What a metric name reads: the series kinds behind it, in the order they are
/// tried (a group's norm first: a one-module group gives the same value either
/// way), and what subject it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reads {
    pub kinds: &'static [SeriesKind],
    pub subject: Subject,
}

impl Reads {
    const fn new(kinds: &'static [SeriesKind], subject: Subject) -> Reads {
        Reads { kinds, subject }
    }
}

/// Every metric of the table, with its name.
pub static METRICS: [Metric; MetricName::COUNT] = {
    let mut metrics = [Metric {
        name: "",
        kinds: &[],
        subject: Subject::None,
    }; MetricName::COUNT];
    let mut i = 0;
    while i < MetricName::COUNT {
        let name = MetricName::ALL[i];
        let reads = name.properties();
        metrics[i] = Metric {
            name: name.as_str(),
            kinds: reads.kinds,
            subject: reads.subject,
        };
        i += 1;
    }
    metrics
};

/// One metric name and what it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metric {
    pub name: &'static str,
    /// The series kinds behind it, in the order they are tried (a group's norm
    /// first: a one-module group gives the same value either way).
    pub kinds: &'static [SeriesKind],
    pub subject: Subject,
}

impl Metric {
    /// The metric of this name.
    pub fn named(name: &str) -> Option<&'static Metric> {
        METRICS.iter().find(|metric| metric.name == name)
    }

    /// Every name, comma-separated, for error texts.
    pub fn names() -> String {
        MetricName::names()
    }

    /// What a subject of this metric is, as an error text says it (`None`: it takes
    /// no named subject).
    pub fn subject_noun(&self) -> Option<&'static str> {
        match self.subject {
            Subject::Required(what) => Some(what),
            Subject::Optional => Some("a parameter group"),
            Subject::None | Subject::Device => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_detectors_names_are_not_the_users() {
        assert!(!is_users_metric("model_training"));
        assert!(!is_users_metric("grads_reset_between_backwards"));
        assert!(!is_users_metric("grad_clip_max_norm"));
        assert!(is_users_metric("reward"));
    }

    #[test]
    fn each_name_is_listed_once_and_reads_some_kind() {
        for metric in &METRICS {
            assert_eq!(Metric::named(metric.name), Some(metric));
            assert!(!metric.kinds.is_empty(), "{}", metric.name);
        }
    }
}
