//! A multi-rank run rank by rank. Where each rank stands ([`Ranks`]: its last step,
//! how far it is behind the most advanced rank, its latest step time, its open
//! alerts), and one metric per rank on one step axis, like the comparison of runs
//! ([`super::compare`]): each rank's own step time, or a module's gradient norm as
//! each rank computed it. A single-process run is one rank, read from the run's own
//! steps.
//!
//! A chart draws at most [`MAX_RANK_LINES`] ranks: those with open alerts first,
//! then the lowest numbers; its legend names the ranks it leaves out.

use gradflow_protocol::RunId;

use crate::store::alerts::{Alert, AlertFilter};
use crate::store::{RUN_STREAM, SeriesRequest, Store, StoreResult, StoredRun, rank_stream};
use gradflow_core::detect::AlertKind;
use gradflow_core::model::alert::AlertStatus;
use gradflow_core::model::cell::{Cell, widen_for_display};
use gradflow_core::model::metric::MetricName;
use gradflow_core::model::series_kind::SeriesKind;

use super::DEFAULT_HEIGHT;
use super::lines::LEGEND_ROW_PX;
use super::reads::bands;
use super::shapes::{Axis, Band, LegendPlace, LineChart, Window, line_of};

/// The most ranks one chart draws a line for: beyond that the lines are a tangle,
/// and the palette's ten colours have run out even dashed.
pub const MAX_RANK_LINES: usize = 16;

/// The alerts about ranks: what the per-rank view lists.
pub const RANK_ALERT_KINDS: [AlertKind; 5] = [
    AlertKind::RankMissing,
    AlertKind::RankStraggler,
    AlertKind::RankNonfinite,
    AlertKind::ReplicaDivergence,
    AlertKind::ShardReportedAsGlobal,
];

gradflow_protocol::vocabulary! {
    /// What a per-rank chart shows: metrics of the series API's table, by its names.
    pub enum RankMetric {
        /// Seconds of each rank's own work per step.
        StepTime = MetricName::StepTime.as_str(),
        /// A module's gradient norm as each rank computed it (for a sharded module, the
        /// rank's own shard).
        GradNorm = MetricName::GradNorm.as_str(),
    }
}

impl RankMetric {
    /// One of the kinds the series API's table gives its name (a test holds it so):
    /// per rank, the module's own norm.
    fn kind(self) -> SeriesKind {
        match self {
            RankMetric::StepTime => SeriesKind::StepTime,
            RankMetric::GradNorm => SeriesKind::ModuleGradNorm,
        }
    }

    /// The alerts whose episodes the chart shades.
    fn band_kinds(self) -> &'static [AlertKind] {
        match self {
            RankMetric::StepTime => &[AlertKind::RankStraggler, AlertKind::RankMissing],
            RankMetric::GradNorm => &[AlertKind::RankNonfinite, AlertKind::ReplicaDivergence],
        }
    }
}

/// Where one rank stands.
#[derive(Debug, Clone)]
pub struct RankState {
    pub rank: u32,
    /// Its last stored step; `None` while it has sent nothing.
    pub last_step: Option<u64>,
    /// Steps behind the most advanced rank; `None` while it has sent nothing.
    pub behind: Option<u64>,
    /// Its latest `step_time`, in seconds.
    pub step_time: Option<f64>,
    /// Its open alerts (subject `rank N`).
    pub open_alerts: Vec<Alert>,
}

/// Every rank of a run, and the run's alerts about its ranks.
#[derive(Debug, Clone)]
pub struct Ranks {
    pub world_size: u32,
    /// The run's last (combined) step.
    pub last_step: Option<u64>,
    /// The most advanced rank's last step.
    pub front: Option<u64>,
    /// Ranks `0..world_size`, in order.
    pub ranks: Vec<RankState>,
    /// The alerts of [`RANK_ALERT_KINDS`], open and resolved, oldest first.
    pub alerts: Vec<Alert>,
}

/// The rank an alert's subject names (`rank 3`), if it names one.
pub fn rank_of_subject(subject: &str) -> Option<u32> {
    subject.strip_prefix("rank ")?.parse().ok()
}

impl Ranks {
    /// Where every rank of `stored` stands.
    pub async fn of(store: &Store, run_id: &RunId, stored: &StoredRun) -> StoreResult<Ranks> {
        let world_size = stored.registration.world_size();
        let alerts: Vec<Alert> = store
            .alerts(&AlertFilter {
                run_id: Some(run_id.as_str().to_owned()),
                ..AlertFilter::default()
            })
            .await?
            .into_iter()
            .filter(|a| RANK_ALERT_KINDS.contains(&a.kind))
            .collect();
        // Each rank's last step and latest step time; one process is its own rank 0,
        // read from the run's steps.
        let progress: Vec<(u32, u64)> = if world_size > 1 {
            store.rank_progress(run_id).await?
        } else {
            stored.last_step.map(|s| (0, s)).into_iter().collect()
        };
        let step_times: Vec<(u32, Cell)> = if world_size > 1 {
            store
                .rank_latest(run_id, SeriesKind::StepTime, "")
                .await?
                .into_iter()
                .map(|latest| (latest.rank, latest.cell))
                .collect()
        } else {
            let latest = store.latest_values(run_id, &[SeriesKind::StepTime]).await?;
            latest
                .and_then(|l| l.get(SeriesKind::StepTime, ""))
                .map(|cell| (0, cell))
                .into_iter()
                .collect()
        };
        let front = progress.iter().map(|(_, step)| *step).max();
        let mut ranks: Vec<RankState> = (0..world_size)
            .map(|rank| RankState {
                rank,
                last_step: None,
                behind: None,
                step_time: None,
                open_alerts: Vec::new(),
            })
            .collect();
        for (rank, step) in progress {
            if let (Some(state), Some(front)) = (ranks.get_mut(rank as usize), front) {
                state.last_step = Some(step);
                state.behind = Some(front - step);
            }
        }
        for (rank, cell) in step_times {
            if let (Some(state), Cell::Value(v)) = (ranks.get_mut(rank as usize), cell)
                && v.is_finite()
            {
                state.step_time = Some(widen_for_display(v));
            }
        }
        for alert in alerts.iter().filter(|a| a.status == AlertStatus::Open) {
            if let Some(state) =
                rank_of_subject(&alert.subject).and_then(|r| ranks.get_mut(r as usize))
            {
                state.open_alerts.push(alert.clone());
            }
        }
        Ok(Ranks {
            world_size,
            last_step: stored.last_step,
            front,
            ranks,
            alerts,
        })
    }

    /// The ranks a chart draws, in rank order: all of them up to
    /// [`MAX_RANK_LINES`]; beyond, those with open alerts first, then the lowest
    /// numbers. Only alerts choose, not momentary lag or noise in step times, so a
    /// live chart keeps its ranks (and their colours) from one update to the next.
    pub fn drawn(&self) -> Vec<u32> {
        let mut drawn: Vec<u32> = self
            .ranks
            .iter()
            .filter(|r| !r.open_alerts.is_empty())
            .map(|r| r.rank)
            .take(MAX_RANK_LINES)
            .collect();
        for rank in &self.ranks {
            if drawn.len() >= MAX_RANK_LINES {
                break;
            }
            if rank.open_alerts.is_empty() {
                drawn.push(rank.rank);
            }
        }
        drawn.sort_unstable();
        drawn
    }
}

/// Rank numbers as ranges (`0–3, 7, 9–15`), at most `max_ranges` of them, then `…`.
pub fn rank_ranges(ranks: &[u32], max_ranges: usize) -> String {
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for &rank in ranks {
        match ranges.last_mut() {
            Some((_, last)) if *last + 1 == rank => *last = rank,
            _ => ranges.push((rank, rank)),
        }
    }
    let mut parts: Vec<String> = ranges
        .iter()
        .take(max_ranges)
        .map(|&(first, last)| match last - first {
            0 => first.to_string(),
            1 => format!("{first}, {last}"),
            _ => format!("{first}–{last}"),
        })
        .collect();
    if ranges.len() > max_ranges {
        parts.push("…".to_owned());
    }
    parts.join(", ")
}

/// The steps the ranks cover between them: the run's first step to the most
/// advanced rank's last (ranks run ahead of the combined steps), clipped to what
/// was asked.
pub fn window(
    stored: &StoredRun,
    ranks: &Ranks,
    from: Option<u64>,
    to: Option<u64>,
    points: usize,
) -> Window {
    let first = stored.first_step.unwrap_or(0);
    let last = ranks
        .front
        .max(stored.last_step)
        .unwrap_or(first)
        .max(first);
    let from = from.unwrap_or(first).max(first).min(last);
    let to = to.unwrap_or(last).min(last).max(from);
    Window { from, to, points }
}

/// One line per drawn rank of `metric` (of `subject`, a module, for the gradient
/// norm; `""` for the step time) over `window`, the rank alerts of the metric
/// shaded, and the ranks not drawn named in the legend.
pub async fn gather(
    store: &Store,
    run_id: &RunId,
    ranks: &Ranks,
    metric: RankMetric,
    subject: &str,
    window: Window,
) -> StoreResult<LineChart> {
    let drawn = ranks.drawn();
    let mut lines = Vec::with_capacity(drawn.len());
    for &rank in &drawn {
        let stream = if ranks.world_size > 1 {
            rank_stream(rank)
        } else {
            RUN_STREAM
        };
        let data = store
            .series(
                run_id,
                &SeriesRequest {
                    candidates: vec![(metric.kind(), subject.to_owned())],
                    from: window.from,
                    to: window.to,
                    max_points: Some(window.points.max(2)),
                    stream,
                },
            )
            .await?;
        let label = if data.points.is_empty() {
            format!("rank {rank}: not reported")
        } else {
            format!("rank {rank}")
        };
        // A module backward never reached sits on the floor, as in the other
        // gradient charts.
        lines.push(line_of(&label, data.points, metric == RankMetric::GradNorm));
    }
    let mut notes = Vec::new();
    let left_out: Vec<u32> = (0..ranks.world_size)
        .filter(|r| drawn.binary_search(r).is_err())
        .collect();
    if !left_out.is_empty() {
        notes.push(format!(
            "{} more ranks not drawn: {}",
            left_out.len(),
            rank_ranges(&left_out, 4)
        ));
    }
    let mut shaded: Vec<Band> = Vec::new();
    for kind in metric.band_kinds() {
        shaded.extend(bands(store, run_id, *kind, window).await?);
    }
    let (title, axis, log) = match metric {
        RankMetric::StepTime => (
            "Step time per rank".to_owned(),
            "seconds of the rank's own work per step".to_owned(),
            false,
        ),
        RankMetric::GradNorm => (
            format!("Gradient norm of {subject} per rank"),
            "gradient L2 norm (log; 0 or no gradient at the floor)".to_owned(),
            true,
        ),
    };
    Ok(LineChart {
        title: format!("{title} — {}", run_id.as_str()),
        from: window.from,
        to: window.to,
        primary: Axis {
            label: axis,
            log,
            lines,
        },
        secondary: None,
        bands: shaded,
        markers: Vec::new(),
        references: Vec::new(),
        notes,
        legend: LegendPlace::Right,
    })
}

/// A height that holds the chart's legend (a row per entry, beside the plot) under
/// the title and above the step axis, and never less than the other charts'.
pub fn natural_height(chart: &LineChart) -> u32 {
    let rows = super::lines::legend_entries(chart) as u32;
    // The legend box's margins take 20 pixels; the title, the chart's margins and
    // the step axis about 120.
    DEFAULT_HEIGHT.max(rows * LEGEND_ROW_PX + 20 + 120)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_metric_reads_a_kind_of_its_series_api_metric() {
        for metric in RankMetric::ALL {
            let table = gradflow_core::model::metric::Metric::named(metric.as_str())
                .expect("a series API metric");
            assert!(table.kinds.contains(&metric.kind()), "{}", metric.as_str());
        }
    }

    fn state(rank: u32, behind: u64, step_time: f64, alerts: usize) -> RankState {
        let alert = Alert {
            id: 1,
            run_id: "r".into(),
            kind: AlertKind::RankStraggler,
            severity: gradflow_protocol::AlertSeverity::Warning,
            subject: format!("rank {rank}"),
            status: AlertStatus::Open,
            first_step: Some(0),
            last_step: Some(9),
            resolved_step: None,
            opened_step: Some(9),
            title: String::new(),
            detail: String::new(),
            fix: String::new(),
            evidence: serde_json::Value::Null,
        };
        RankState {
            rank,
            last_step: Some(100 - behind),
            behind: Some(behind),
            step_time: Some(step_time),
            open_alerts: vec![alert; alerts],
        }
    }

    fn ranks(states: Vec<RankState>) -> Ranks {
        Ranks {
            world_size: states.len() as u32,
            last_step: Some(90),
            front: Some(100),
            ranks: states,
            alerts: Vec::new(),
        }
    }

    #[test]
    fn every_rank_is_drawn_up_to_the_limit() {
        let all = ranks((0..16).map(|r| state(r, 0, 0.1, 0)).collect());
        assert_eq!(all.drawn(), (0..16).collect::<Vec<_>>());
    }

    #[test]
    fn beyond_the_limit_the_ranks_with_open_alerts_are_drawn() {
        let mut states: Vec<RankState> = (0..64).map(|r| state(r, 0, 0.1, 0)).collect();
        states[40] = state(40, 0, 0.1, 1);
        states[63] = state(63, 0, 0.1, 2);
        // Lag and slowness alone do not choose: they change with every batch.
        states[50] = state(50, 30, 0.9, 0);
        let drawn = ranks(states).drawn();
        assert_eq!(drawn.len(), MAX_RANK_LINES);
        let mut expected: Vec<u32> = (0..14).collect();
        expected.extend([40, 63]);
        assert_eq!(drawn, expected);
    }

    #[test]
    fn rank_ranges_read_compactly() {
        assert_eq!(rank_ranges(&[16, 17, 18, 19], 4), "16–19");
        assert_eq!(rank_ranges(&[1, 2, 5, 7, 8, 9], 4), "1, 2, 5, 7–9");
        assert_eq!(rank_ranges(&[0, 2, 4, 6, 8, 10], 4), "0, 2, 4, 6, …");
        assert_eq!(rank_ranges(&[], 4), "");
    }

    #[test]
    fn subjects_name_their_rank() {
        assert_eq!(rank_of_subject("rank 12"), Some(12));
        assert_eq!(rank_of_subject("run"), None);
        assert_eq!(rank_of_subject("rank x"), None);
    }
}
