//! The metrics read by name — the series API's `metric=`, the runs comparison and the
//! per-rank charts — in one table: each name, the stored series kinds behind it, and
//! what subject it takes. Adding a metric is adding a row; the API's error texts, its
//! OpenAPI description (held to this table by a test) and the charts read it.

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

/// Every metric name the series API reads: the series kinds behind it (a group's
/// norm is derived; a name that is both a group and a module, a one-module group,
/// gives the same value either way) and whether it needs a subject. The error text
/// lists these names, and a test holds the API document's list to them.
pub const METRICS: &[Metric] = &[
    Metric {
        name: "loss",
        kinds: &[SeriesKind::Loss],
        subject: Subject::None,
    },
    Metric {
        name: "lr",
        kinds: &[SeriesKind::Lr],
        subject: Subject::Optional,
    },
    Metric {
        name: "grad_norm",
        kinds: &[SeriesKind::GroupGradNorm, SeriesKind::ModuleGradNorm],
        subject: Subject::Required("a group or module"),
    },
    Metric {
        name: "hook_hits",
        kinds: &[SeriesKind::HookHits],
        subject: Subject::Required("a module"),
    },
    Metric {
        name: "param_grad_norm",
        kinds: &[SeriesKind::ParamGradNorm],
        subject: Subject::Required("a parameter"),
    },
    Metric {
        name: "update_norm",
        kinds: &[SeriesKind::UpdateNorm],
        subject: Subject::Required("a parameter"),
    },
    Metric {
        name: "drift",
        kinds: &[SeriesKind::Drift],
        subject: Subject::Required("a parameter"),
    },
    Metric {
        name: "param_mean",
        kinds: &[SeriesKind::ParamMean],
        subject: Subject::Required("a parameter"),
    },
    Metric {
        name: "intended_update_norm",
        kinds: &[SeriesKind::IntendedUpdateNorm],
        subject: Subject::Required("a parameter"),
    },
    Metric {
        name: "intended_update_max_ulp",
        kinds: &[SeriesKind::IntendedUpdateMaxUlp],
        subject: Subject::Required("a parameter"),
    },
    Metric {
        name: "intended_nonzero",
        kinds: &[SeriesKind::IntendedNonzero],
        subject: Subject::Required("a parameter"),
    },
    Metric {
        name: "rounded_away",
        kinds: &[SeriesKind::RoundedAway],
        subject: Subject::Required("a parameter"),
    },
    Metric {
        name: "scaler_scale",
        kinds: &[SeriesKind::ScalerScale],
        subject: Subject::None,
    },
    Metric {
        name: "scaler_growth_tracker",
        kinds: &[SeriesKind::ScalerGrowthTracker],
        subject: Subject::None,
    },
    Metric {
        name: "found_inf",
        kinds: &[SeriesKind::FoundInf],
        subject: Subject::None,
    },
    Metric {
        name: "step_skipped",
        kinds: &[SeriesKind::StepSkipped],
        subject: Subject::None,
    },
    Metric {
        name: "metric",
        kinds: &[SeriesKind::Metric],
        subject: Subject::Required("a metrics name"),
    },
    Metric {
        name: "gpu_memory_used_bytes",
        kinds: &[SeriesKind::GpuMemoryUsedBytes],
        subject: Subject::Device,
    },
    Metric {
        name: "gpu_memory_total_bytes",
        kinds: &[SeriesKind::GpuMemoryTotalBytes],
        subject: Subject::Device,
    },
    Metric {
        name: "gpu_utilization_pct",
        kinds: &[SeriesKind::GpuUtilizationPct],
        subject: Subject::Device,
    },
    Metric {
        name: "gpu_temperature_c",
        kinds: &[SeriesKind::GpuTemperatureC],
        subject: Subject::Device,
    },
    Metric {
        name: "gpu_power_w",
        kinds: &[SeriesKind::GpuPowerW],
        subject: Subject::Device,
    },
    Metric {
        name: "dropped_steps",
        kinds: &[SeriesKind::DroppedSteps],
        subject: Subject::None,
    },
    Metric {
        name: "step_time",
        kinds: &[SeriesKind::StepTime],
        subject: Subject::None,
    },
    Metric {
        name: "grads_carried_over",
        kinds: &[SeriesKind::GradsCarriedOver],
        subject: Subject::None,
    },
    Metric {
        name: "local_grads_nonfinite",
        kinds: &[SeriesKind::LocalGradsNonfinite],
        subject: Subject::None,
    },
    Metric {
        name: "input_absmax",
        kinds: &[SeriesKind::InputAbsmax],
        subject: Subject::None,
    },
    Metric {
        name: "grad_nonfinite",
        kinds: &[SeriesKind::ModuleNonfinite],
        subject: Subject::Required("a module"),
    },
    Metric {
        name: "grad_numel",
        kinds: &[SeriesKind::ModuleNumel],
        subject: Subject::Required("a module"),
    },
    Metric {
        name: "param_sum",
        kinds: &[SeriesKind::ModuleParamSum],
        subject: Subject::Required("a module"),
    },
];

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
        METRICS
            .iter()
            .map(|metric| metric.name)
            .collect::<Vec<_>>()
            .join(", ")
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
    fn each_name_is_listed_once_and_reads_some_kind() {
        for metric in METRICS {
            assert_eq!(Metric::named(metric.name), Some(metric));
            assert!(!metric.kinds.is_empty(), "{}", metric.name);
        }
    }
}
