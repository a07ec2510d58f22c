//! The store reads every chart shares: a series as a line, an alert kind's episodes
//! as shaded bands. Below `data` and `signals`, which gather whole charts from them.

use gradflow_core::detect::AlertKind;
use gradflow_core::model::series_kind::SeriesKind;
use gradflow_protocol::RunId;

use super::shapes::{Band, Line, Window, line_of};
use crate::store::alerts::{Alert, AlertFilter};
use crate::store::{SeriesRequest, Store, StoreResult};

pub async fn read(
    store: &Store,
    run: &RunId,
    kind: SeriesKind,
    subject: &str,
    window: Window,
) -> StoreResult<Line> {
    read_with(store, run, kind, subject, window, false).await
}

/// Reads a line; with `null_as_zero`, "reported without a gradient" is drawn as 0
/// (on a log axis: the floor), so a cut-off group shows as a line along the bottom
/// instead of vanishing.
pub async fn read_with(
    store: &Store,
    run: &RunId,
    kind: SeriesKind,
    subject: &str,
    window: Window,
    null_as_zero: bool,
) -> StoreResult<Line> {
    let data = store
        .series(
            run,
            &SeriesRequest {
                candidates: vec![(kind, subject.to_owned())],
                from: window.from,
                to: window.to,
                max_points: Some(window.points.max(2)),
                stream: crate::store::RUN_STREAM,
            },
        )
        .await?;
    Ok(line_of(subject, data.points, null_as_zero))
}

/// `run`'s alerts of `kind`, open or resolved.
pub async fn alerts_of(store: &Store, run: &RunId, kind: AlertKind) -> StoreResult<Vec<Alert>> {
    store
        .alerts(&AlertFilter {
            run_id: Some(run.as_str().to_owned()),
            kind: Some(kind),
            ..AlertFilter::default()
        })
        .await
}

/// The episodes of `run`'s alerts of `kind` within `window`, each labelled with
/// its kind and subject.
pub async fn bands(
    store: &Store,
    run: &RunId,
    kind: AlertKind,
    window: Window,
) -> StoreResult<Vec<Band>> {
    Ok(alerts_of(store, run, kind)
        .await?
        .into_iter()
        .filter_map(|a| {
            let from = a.first_step.unwrap_or(0).max(0) as u64;
            let to = a
                .resolved_step
                .map(|s| (s - 1).max(0) as u64)
                .or(a.last_step.map(|s| s as u64))
                .unwrap_or(window.to);
            (to >= window.from && from <= window.to).then(|| Band {
                from: from.max(window.from),
                to: to.min(window.to),
                label: format!("{}: {}", a.kind, a.subject),
            })
        })
        .collect())
}
