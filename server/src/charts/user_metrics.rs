//! The run's own numbers: the names of a step record's `metrics` that the user sent
//! (a reward, a discriminator's accuracy, an episode's length), a panel each. The
//! names the detectors read (`model_training`, …) are the client's, not the user's,
//! and are left out.

use gradflow_protocol::RunId;

use crate::store::{Store, StoreResult};
use gradflow_core::model::cell::Cell;
use gradflow_core::model::metric::is_users_metric;
use gradflow_core::model::series_kind::SeriesKind;
use gradflow_core::series::Buckets;

use super::panels::grid;
use super::shapes::{Axis, LegendPlace, LineChart, Panels, Window, line_of};

/// The most panels one chart draws: fifteen rows of three at the run page's width,
/// within the tallest chart. The page's table lists every name.
pub const MAX_PANELS: usize = 45;

/// The run's own metric names, in order of first appearance.
pub async fn names(store: &Store, run: &RunId) -> StoreResult<Vec<String>> {
    let mut names = store.subjects(run, SeriesKind::Metric).await?;
    names.retain(|name| is_users_metric(name));
    Ok(names)
}

/// A panel per metric of the run over `window` (at most [`MAX_PANELS`]), read in one
/// pass for all of them; `window.points` is for the chart's whole width, shared by
/// the panels side by side.
pub async fn gather(store: &Store, run: &RunId, window: Window) -> StoreResult<Panels> {
    let count = names(store, run).await?.len().min(MAX_PANELS);
    let (columns, _) = grid(count, window.points as u32);
    // Two points (a bucket's extremes) per couple of pixels of a panel.
    let buckets = Buckets::new(window.from, window.to, (window.points / columns / 4).max(1));
    let series: Vec<(String, Vec<(u64, Cell)>)> = store
        .series_of_every_subject(run, SeriesKind::Metric, buckets)
        .await?
        .into_iter()
        .filter(|(name, _)| is_users_metric(name))
        .collect();
    let total = series.len();
    let panels: Vec<LineChart> = series
        .into_iter()
        .take(MAX_PANELS)
        .map(|(name, points)| panel(name, points, window))
        .collect();
    let title = if total > panels.len() {
        format!(
            "Your metrics — {}: the first {} of {total}",
            run.as_str(),
            panels.len()
        )
    } else {
        format!("Your metrics — {}", run.as_str())
    };
    Ok(Panels {
        title,
        from: window.from,
        to: window.to,
        panels,
    })
}

/// One metric's panel: its name for a title, its values on a linear axis of their
/// own (a reward and an accuracy share no scale), no legend.
fn panel(name: String, points: Vec<(u64, Cell)>, window: Window) -> LineChart {
    LineChart {
        from: window.from,
        to: window.to,
        primary: Axis {
            label: String::new(),
            log: false,
            lines: vec![line_of(&name, points, false)],
        },
        title: name,
        secondary: None,
        bands: Vec::new(),
        markers: Vec::new(),
        references: Vec::new(),
        notes: Vec::new(),
        legend: LegendPlace::None,
    }
}
