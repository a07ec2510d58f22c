//! A step record resolved against its run once, for every detector: the view each
//! streaming detector's `on_step` takes.

use gradflow_protocol::{ModuleStep, StepRecord};

use super::context::{ModuleInfo, RunContext};
use super::ranks::view::RankView;

/// One step record resolved against its run once, for every detector: each
/// reported module's registration entry (a lookup by name, done once rather than
/// once per detector) and the groups' norms.
pub struct StepView<'a> {
    pub context: &'a RunContext,
    pub record: &'a StepRecord,
    /// Per entry of `record.modules`, in order: the module's entry when it has
    /// trainable parameters.
    trainable: Vec<Option<&'a ModuleInfo>>,
    /// Each group's norm, as the server derives it: the L2 norm of the norms its
    /// modules reported (modules without a gradient add nothing; a non-finite module
    /// norm makes the group's non-finite). Groups come from the registration, or
    /// from the module name's first part.
    pub group_norms: GroupMap<'a, f64>,
    /// For a multi-rank run's combined step: what its ranks showed.
    pub ranks: Option<&'a RankView>,
}

/// Values per group for one step. A run has a handful of groups, so a vector
/// searched linearly beats a tree or a hash on the per-module hot path. Iterates in
/// order of first appearance.
#[derive(Debug, Clone)]
pub struct GroupMap<'a, T>(Vec<(&'a str, T)>);

impl<T> Default for GroupMap<'_, T> {
    fn default() -> Self {
        GroupMap(Vec::new())
    }
}

impl<'a, T: Default> GroupMap<'a, T> {
    /// The value of `group`, inserted as `T::default()` if absent.
    pub fn entry(&mut self, group: &'a str) -> &mut T {
        let index = match self.0.iter().position(|(g, _)| *g == group) {
            Some(index) => index,
            None => {
                self.0.push((group, T::default()));
                self.0.len() - 1
            }
        };
        &mut self.0[index].1
    }
}

impl<'a, T> GroupMap<'a, T> {
    pub fn get(&self, group: &str) -> Option<&T> {
        self.0.iter().find(|(g, _)| *g == group).map(|(_, v)| v)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&'a str, &T)> + '_ {
        self.0.iter().map(|(g, v)| (*g, v))
    }
}

impl<'a> StepView<'a> {
    pub fn new(context: &'a RunContext, record: &'a StepRecord) -> StepView<'a> {
        let trainable: Vec<Option<&ModuleInfo>> = record
            .modules
            .iter()
            .map(|m| context.trainable_modules.get(&m.module))
            .collect();
        let mut view = StepView {
            context,
            record,
            trainable,
            group_norms: GroupMap::default(),
            ranks: None,
        };
        let mut sums: GroupMap<f64> = GroupMap::default();
        for (module, group) in view.modules_with_groups() {
            if let Some(norm) = module.grad_norm.map(|n| n.get()) {
                *sums.entry(group) += norm * norm;
            }
        }
        for (_, sum) in &mut sums.0 {
            *sum = sum.sqrt();
        }
        view.group_norms = sums;
        view
    }

    /// The same view, of a multi-rank run's combined step whose ranks showed `ranks`.
    pub fn with_ranks(self, ranks: Option<&'a RankView>) -> StepView<'a> {
        StepView { ranks, ..self }
    }

    /// The reported modules that have trainable parameters, with their entries.
    pub fn trainable_modules(&self) -> impl Iterator<Item = (&'a ModuleStep, &'a ModuleInfo)> + '_ {
        self.record
            .modules
            .iter()
            .zip(&self.trainable)
            .filter_map(|(m, info)| info.map(|i| (m, i)))
    }

    /// Every reported module with its group (registered, or its name's first part).
    pub fn modules_with_groups(&self) -> impl Iterator<Item = (&'a ModuleStep, &'a str)> + '_ {
        self.record
            .modules
            .iter()
            .zip(&self.trainable)
            .map(|(m, info)| {
                let group = info.map_or_else(
                    || gradflow_protocol::default_group(&m.module),
                    |i| i.group.as_str(),
                );
                (m, group)
            })
    }

    /// The record's entry for `module`, when it reported one.
    pub fn module(&self, module: &str) -> Option<&'a ModuleStep> {
        self.record.modules.iter().find(|m| m.module == module)
    }

    /// Whether the loss scaler reported an overflow on this step.
    pub fn found_inf(&self) -> bool {
        self.record.scaler.as_ref().and_then(|s| s.found_inf) == Some(true)
    }

    /// The step's metric `name` (one the detectors read), when measured.
    pub fn metric(&self, name: &str) -> Option<f64> {
        metric(self.record, name)
    }
}

/// `record`'s metric `name` (one the detectors read), when measured: absent and
/// `null` both mean "not measured this step".
pub fn metric(record: &StepRecord, name: &str) -> Option<f64> {
    record.metrics.get(name).copied().flatten().map(|v| v.get())
}
