//! The comparison of runs: one metric of two or more runs, one line per run on a
//! shared step axis, so a change to the training code shows beside the run before
//! it. The metric and subject are named as the series API names them: `loss`, a
//! group's or module's `grad_norm`, a norm weight's `drift`, one of the user's own
//! `metrics` (a reward, a discriminator's accuracy) by its name. A run that never
//! reported the subject keeps its legend entry, marked as such.

use std::collections::HashSet;

use gradflow_protocol::{Role, RunId};

use crate::store::{SeriesRequest, Store, StoreResult, StoredRun};
use gradflow_core::model::metric::{Metric, MetricName, is_users_metric};
use gradflow_core::model::series_kind::SeriesKind;

use super::shapes::{Axis, LegendPlace, LineChart, Window, line_of};

/// The fewest runs a comparison takes.
pub const MIN_RUNS: usize = 2;
/// The most: beyond eight lines a chart stops being readable (and the palette
/// starts repeating at ten).
pub const MAX_RUNS: usize = 8;

gradflow_protocol::vocabulary! {
    /// What can be compared: metrics of the series API's table, by its names.
    pub enum CompareMetric {
        Loss = MetricName::Loss.as_str(),
        GradNorm = MetricName::GradNorm.as_str(),
        Drift = MetricName::Drift.as_str(),
        Metric = MetricName::Metric.as_str(),
    }
}

impl CompareMetric {
    /// What its subject is, or `None` for a run-wide metric.
    pub fn subject_noun(self) -> Option<&'static str> {
        match self {
            CompareMetric::Loss => None,
            CompareMetric::GradNorm => Some("group or module"),
            CompareMetric::Drift => Some("norm weight"),
            CompareMetric::Metric => Some("metric of your own"),
        }
    }

    /// The columns that hold it, in the order the series API tries them (a group's
    /// norm first: a one-module group gives the same value either way).
    /// The series API's table (`gradflow_core::model::metric`) says which.
    fn kinds(self) -> &'static [SeriesKind] {
        Metric::named(self.as_str()).map_or(&[], |metric| metric.kinds)
    }
}

/// A run taking part in a comparison.
#[derive(Debug, Clone)]
pub struct ComparedRun {
    pub id: RunId,
    pub stored: StoredRun,
}

/// What the compared runs offer as subjects: the union of their registrations and
/// of what they reported, each list in order of first appearance (model order).
#[derive(Debug, Default)]
pub struct Subjects {
    pub groups: Vec<String>,
    pub modules: Vec<String>,
    pub norm_weights: Vec<String>,
    /// The user's own `metrics` names (not those the client sends for the detectors).
    pub metrics: Vec<String>,
}

impl Subjects {
    pub async fn of(store: &Store, runs: &[ComparedRun]) -> StoreResult<Subjects> {
        let mut groups = Union::default();
        let mut modules = Union::default();
        let mut norm_weights = Union::default();
        let mut metrics = Union::default();
        for run in runs {
            for param in &run.stored.registration.params {
                groups.add(param.group_name());
                modules.add(param.module_name());
                if param.role() == Role::Norm {
                    norm_weights.add(&param.name);
                }
            }
            for (kind, union) in [
                (SeriesKind::GroupGradNorm, &mut groups),
                (SeriesKind::ModuleGradNorm, &mut modules),
                (SeriesKind::Drift, &mut norm_weights),
                (SeriesKind::Metric, &mut metrics),
            ] {
                for subject in store.subjects(&run.id, kind).await? {
                    if kind != SeriesKind::Metric || is_users_metric(&subject) {
                        union.add(&subject);
                    }
                }
            }
        }
        Ok(Subjects {
            groups: groups.list,
            modules: modules.list,
            norm_weights: norm_weights.list,
            metrics: metrics.list,
        })
    }

    /// Whether `subject` is one of `metric`'s subjects.
    pub fn offers(&self, metric: CompareMetric, subject: &str) -> bool {
        self.of_metric(metric).any(|s| s == subject)
    }

    /// `metric`'s subjects: groups then modules, the norm weights, or the user's
    /// metrics.
    pub fn of_metric(&self, metric: CompareMetric) -> impl Iterator<Item = &str> {
        let lists: [&[String]; 2] = match metric {
            CompareMetric::Loss => [&[], &[]],
            CompareMetric::GradNorm => [&self.groups, &self.modules],
            CompareMetric::Drift => [&self.norm_weights, &[]],
            CompareMetric::Metric => [&self.metrics, &[]],
        };
        lists.into_iter().flatten().map(String::as_str)
    }
}

#[derive(Default)]
struct Union {
    seen: HashSet<String>,
    list: Vec<String>,
}

impl Union {
    fn add(&mut self, item: &str) {
        if self.seen.insert(item.to_owned()) {
            self.list.push(item.to_owned());
        }
    }
}

/// The runs (ids) that have never reported `metric` of `subject`.
pub async fn missing(
    store: &Store,
    runs: &[ComparedRun],
    metric: CompareMetric,
    subject: &str,
) -> StoreResult<Vec<String>> {
    let mut missing = Vec::new();
    for run in runs {
        let mut reported = false;
        for kind in metric.kinds() {
            if store
                .subjects(&run.id, *kind)
                .await?
                .iter()
                .any(|s| s == subject)
            {
                reported = true;
                break;
            }
        }
        if !reported {
            missing.push(run.id.as_str().to_owned());
        }
    }
    Ok(missing)
}

/// The steps every compared run covers between them (the first step of the
/// earliest to the last of the latest), clipped to what was asked.
pub fn window(runs: &[ComparedRun], from: Option<u64>, to: Option<u64>, points: usize) -> Window {
    let first = runs.iter().filter_map(|r| r.stored.first_step).min();
    let last = runs.iter().filter_map(|r| r.stored.last_step).max();
    let first = first.unwrap_or(0);
    let last = last.unwrap_or(first);
    let from = from.unwrap_or(first).max(first).min(last);
    let to = to.unwrap_or(last).min(last).max(from);
    Window { from, to, points }
}

/// One line per run of `metric` (of `subject`, `""` for the loss) over `window`, in
/// the order of `runs`. A run that never reported it keeps its place (and colour)
/// in the legend, labelled "not reported".
pub async fn gather(
    store: &Store,
    runs: &[ComparedRun],
    metric: CompareMetric,
    subject: &str,
    window: Window,
) -> StoreResult<LineChart> {
    let mut lines = Vec::with_capacity(runs.len());
    for run in runs {
        let data = store
            .series(
                &run.id,
                &SeriesRequest {
                    candidates: metric
                        .kinds()
                        .iter()
                        .map(|k| (*k, subject.to_owned()))
                        .collect(),
                    from: window.from,
                    to: window.to,
                    max_points: Some(window.points.max(2)),
                    stream: crate::store::RUN_STREAM,
                },
            )
            .await?;
        let label = match data.kind {
            Some(_) => run.id.as_str().to_owned(),
            None => format!("{}: not reported", run.id),
        };
        // A module backward never reached sits on the floor, like a zero: the
        // comparison must show a cut graph, not hide it.
        let null_as_zero = metric == CompareMetric::GradNorm;
        lines.push(line_of(&label, data.points, null_as_zero));
    }
    let (title, axis, log) = match metric {
        CompareMetric::Loss => ("Loss".to_owned(), "loss".to_owned(), false),
        CompareMetric::GradNorm => (
            format!("Gradient norm of {subject}"),
            "gradient L2 norm (log; 0 or no gradient at the floor)".to_owned(),
            true,
        ),
        CompareMetric::Drift => (
            format!("Drift of {subject}"),
            "largest change since registration (log; 0 at the floor)".to_owned(),
            true,
        ),
        // The user's own number, on a linear axis: a reward or an accuracy may be
        // negative or 0, and its scale is the user's.
        CompareMetric::Metric => (subject.to_owned(), subject.to_owned(), false),
    };
    Ok(LineChart {
        title: format!("{title} — {} runs", runs.len()),
        from: window.from,
        to: window.to,
        primary: Axis {
            label: axis,
            log,
            lines,
        },
        secondary: None,
        bands: Vec::new(),
        markers: Vec::new(),
        references: Vec::new(),
        notes: Vec::new(),
        legend: LegendPlace::Inside,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_compared_metric_is_a_series_api_metric() {
        for metric in CompareMetric::ALL {
            assert!(!metric.kinds().is_empty(), "{}", metric.as_str());
        }
    }
}
