//! What each chart shows, gathered from the store (its rollups, through series reads)
//! and the run's alerts. No drawing here.

use gradflow_protocol::{Dtype, RunId, RunRegistration};

use crate::store::{Store, StoreResult, StoredRun};
use gradflow_core::detect::precision::{describe_magnitude, smallest_change};
use gradflow_core::detect::{AlertKind, sci};
use gradflow_core::model::cell::{Cell, widen_for_display};
use gradflow_core::model::series_kind::SeriesKind;
use gradflow_core::series::Buckets;

use super::reads::{bands, read, read_with};
use super::shapes::{Axis, ChartData, FlowCell, GradFlow, LegendPlace, Line, LineChart, Window};
use super::{ChartKind, signals, user_metrics};

/// The run's step range, clipped to what was asked.
pub fn window(stored: &StoredRun, from: Option<u64>, to: Option<u64>, points: usize) -> Window {
    let first = stored.first_step.unwrap_or(0);
    let last = stored.last_step.unwrap_or(first);
    let from = from.unwrap_or(first).max(first).min(last);
    let to = to.unwrap_or(last).min(last).max(from);
    Window { from, to, points }
}

/// What `kind` shows of `stored` (read once by the caller) over `window`.
pub async fn gather(
    store: &Store,
    run: &RunId,
    stored: &StoredRun,
    kind: ChartKind,
    window: Window,
) -> StoreResult<ChartData> {
    let title_run = run.as_str();
    Ok(match kind {
        ChartKind::GradFlow => ChartData::GradFlow(grad_flow(store, run, stored, window).await?),
        ChartKind::GroupGradNorms => {
            let mut lines = Vec::new();
            for group in store.subjects(run, SeriesKind::GroupGradNorm).await? {
                lines.push(
                    read_with(store, run, SeriesKind::GroupGradNorm, &group, window, true).await?,
                );
            }
            ChartData::Lines(LineChart {
                title: format!("Gradient norm by group — {title_run}"),
                from: window.from,
                to: window.to,
                primary: Axis {
                    label: "gradient L2 norm (log; 0 or no gradient at the floor)".into(),
                    log: true,
                    lines,
                },
                secondary: None,
                bands: bands(store, run, AlertKind::GradStuckZero, window).await?,
                markers: Vec::new(),
                references: Vec::new(),
                notes: Vec::new(),
                legend: LegendPlace::Below,
            })
        }
        ChartKind::NormDrift => norm_drift(store, run, stored, window).await?,
        ChartKind::Metrics => ChartData::Panels(user_metrics::gather(store, run, window).await?),
        ChartKind::AttentionLogits | ChartKind::AdamUpdates | ChartKind::MoeLoads => {
            let chart = signals::gather(store, run, kind, window).await?;
            ChartData::Lines(chart.expect("a per-layer signal chart"))
        }
        ChartKind::Scaler => {
            let scale = read(store, run, SeriesKind::ScalerScale, "", window).await?;
            let found_inf = read(store, run, SeriesKind::FoundInf, "", window).await?;
            let skipped = read(store, run, SeriesKind::StepSkipped, "", window).await?;
            let on = |line: &Line| {
                line.points
                    .iter()
                    .filter(|(_, v)| *v > 0.5)
                    .map(|(s, _)| *s)
                    .collect::<Vec<_>>()
            };
            ChartData::Lines(LineChart {
                title: format!("Loss scale — {title_run}"),
                from: window.from,
                to: window.to,
                primary: Axis {
                    label: "loss scale (log)".into(),
                    log: true,
                    lines: vec![Line {
                        label: "scale".into(),
                        ..scale
                    }],
                },
                secondary: None,
                bands: bands(store, run, AlertKind::ScalerOverflowStreak, window).await?,
                markers: vec![
                    ("found_inf".into(), on(&found_inf)),
                    ("step skipped".into(), on(&skipped)),
                ],
                references: Vec::new(),
                notes: Vec::new(),
                legend: LegendPlace::Inside,
            })
        }
        ChartKind::Loss => {
            let loss = read(store, run, SeriesKind::Loss, "", window).await?;
            let lr = read(store, run, SeriesKind::Lr, "", window).await?;
            ChartData::Lines(LineChart {
                title: format!("Loss and learning rate — {title_run}"),
                from: window.from,
                to: window.to,
                primary: Axis {
                    label: "loss".into(),
                    log: false,
                    lines: vec![Line {
                        label: "loss".into(),
                        ..loss
                    }],
                },
                secondary: Some(Axis {
                    label: "learning rate".into(),
                    log: false,
                    lines: vec![Line {
                        label: "lr".into(),
                        ..lr
                    }],
                }),
                bands: bands(store, run, AlertKind::LossNonfinite, window).await?,
                markers: Vec::new(),
                references: Vec::new(),
                notes: Vec::new(),
                legend: LegendPlace::Inside,
            })
        }
        ChartKind::Gpu => {
            let mut memory = Vec::new();
            let mut utilisation = Vec::new();
            for device in store.subjects(run, SeriesKind::GpuMemoryUsedBytes).await? {
                let mut line =
                    read(store, run, SeriesKind::GpuMemoryUsedBytes, &device, window).await?;
                for point in &mut line.points {
                    point.1 /= 1024f64.powi(3);
                }
                line.label = format!("GPU {device} memory");
                memory.push(line);
            }
            for device in store.subjects(run, SeriesKind::GpuUtilizationPct).await? {
                let mut line =
                    read(store, run, SeriesKind::GpuUtilizationPct, &device, window).await?;
                line.label = format!("GPU {device} utilisation");
                utilisation.push(line);
            }
            ChartData::Lines(LineChart {
                title: format!("GPU memory and utilisation — {title_run}"),
                from: window.from,
                to: window.to,
                primary: Axis {
                    label: "memory used (GiB)".into(),
                    log: false,
                    lines: memory,
                },
                secondary: Some(Axis {
                    label: "utilisation (%)".into(),
                    log: false,
                    lines: utilisation,
                }),
                bands: Vec::new(),
                markers: Vec::new(),
                references: Vec::new(),
                notes: Vec::new(),
                legend: LegendPlace::Inside,
            })
        }
    })
}

async fn grad_flow(
    store: &Store,
    run: &RunId,
    stored: &StoredRun,
    window: Window,
) -> StoreResult<GradFlow> {
    let registered_group = |module: &str| {
        stored
            .registration
            .params
            .iter()
            .find(|p| p.module_name() == module)
            .map(|p| p.group_name().to_owned())
            .unwrap_or_else(|| gradflow_protocol::default_group(module).to_owned())
    };
    let columns = flow_columns(store, run, window).await?;
    let series = store
        .series_of_every_subject(run, SeriesKind::ModuleGradNorm, columns)
        .await?;
    let mut rows = Vec::with_capacity(series.len());
    let mut cells = Vec::with_capacity(series.len());
    for (module, points) in series {
        let mut row = vec![FlowCell::Absent; columns.count];
        for (step, cell) in points {
            let Some(slot) = columns.index(step).and_then(|c| row.get_mut(c)) else {
                continue;
            };
            let new = match cell {
                Cell::Absent => continue,
                Cell::Null => FlowCell::NotReached,
                Cell::Value(v) if !v.is_finite() => FlowCell::NonFinite,
                Cell::Value(0.0) => FlowCell::Zero,
                Cell::Value(v) => FlowCell::Norm(widen_for_display(v)),
            };
            // What a person must see wins: non-finite, then the largest norm, then a
            // zero, then "never reached".
            *slot = match (*slot, new) {
                (FlowCell::NonFinite, _) | (_, FlowCell::NonFinite) => FlowCell::NonFinite,
                (FlowCell::Norm(a), FlowCell::Norm(b)) => FlowCell::Norm(a.max(b)),
                (FlowCell::Norm(a), _) | (_, FlowCell::Norm(a)) => FlowCell::Norm(a),
                (FlowCell::Zero, _) | (_, FlowCell::Zero) => FlowCell::Zero,
                (_, new) => new,
            };
        }
        rows.push((registered_group(&module), module));
        cells.push(row);
    }
    // Model order within each group, groups in order of first appearance.
    let mut order: Vec<usize> = (0..rows.len()).collect();
    let group_rank = |g: &str| rows.iter().position(|(group, _)| group == g).unwrap_or(0);
    order.sort_by_key(|&i| (group_rank(&rows[i].0), i));
    Ok(GradFlow {
        title: format!("Gradient flow — {}", run.as_str()),
        from: window.from,
        to: window.to,
        steps_per_column: columns.width,
        modules: order
            .iter()
            .map(|&i| (rows[i].1.clone(), rows[i].0.clone()))
            .collect(),
        cells: order.iter().map(|&i| cells[i].clone()).collect(),
    })
}

/// The heatmap's columns over `window`: the downsampler's own buckets, so that each
/// column gets the points of its steps and no other's (columns cut apart from the
/// buckets once left a measured column with no point: a white seam, read as "not
/// measured"). At most `window.points` of them, and no more than the run's steps
/// stored there: a run reporting every k-th step gets columns k steps wide, each
/// holding a report, not empty columns between reports.
async fn flow_columns(store: &Store, run: &RunId, window: Window) -> StoreResult<Buckets> {
    let wanted = window.points.max(1) as u64;
    let stored = store
        .steps_stored_in(run, window.from, window.to, wanted)
        .await?;
    Ok(Buckets::new(
        window.from,
        window.to,
        stored.clamp(1, wanted) as usize,
    ))
}

/// Whether updates of weights of `dtype` round away at sizes a chart shows: its
/// smallest change is drawn as a reference line.
fn rounds_visibly(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::Bf16 | Dtype::F16)
}

/// The dtype whose smallest change the norm-weight chart draws for `registration`
/// (its first norm weight in bf16 or f16), and whether it draws the optimizer's
/// step (≈ lr) beside it; `None` when its norm weights are all in a wider dtype.
/// The line needs the weights' mean too, which a client may not send.
pub fn norm_reference(registration: &RunRegistration) -> Option<(Dtype, bool)> {
    let run_dtype = registration.precision.as_ref().and_then(|p| p.param_dtype);
    let dtype = registration
        .params
        .iter()
        .filter(|p| p.role() == gradflow_protocol::Role::Norm)
        .filter_map(|p| p.dtype.or(run_dtype))
        .find(|d| rounds_visibly(*d))?;
    let lr = registration.optimizer.as_ref().and_then(|o| o.lr).is_some();
    Some((dtype, lr))
}

async fn norm_drift(
    store: &Store,
    run: &RunId,
    stored: &StoredRun,
    window: Window,
) -> StoreResult<ChartData> {
    let run_dtype = stored
        .registration
        .precision
        .as_ref()
        .and_then(|p| p.param_dtype);
    let mut groups: Vec<(String, Line, Line)> = Vec::new();
    let mut references: Vec<(f64, String)> = Vec::new();
    let columns = window.points.max(1);
    let span = window.to - window.from + 1;
    for param in stored
        .registration
        .params
        .iter()
        .filter(|p| p.role() == gradflow_protocol::Role::Norm)
    {
        let drift = read(store, run, SeriesKind::Drift, &param.name, window).await?;
        let update = read(store, run, SeriesKind::UpdateNorm, &param.name, window).await?;
        if drift.points.is_empty() && update.points.is_empty() {
            continue;
        }
        let group = param.group_name().to_owned();
        let entry = match groups.iter().position(|(g, _, _)| *g == group) {
            Some(i) => &mut groups[i],
            None => {
                groups.push((group.clone(), Line::default(), Line::default()));
                groups.last_mut().expect("pushed")
            }
        };
        merge_max(&mut entry.1, &drift, window.from, span, columns);
        merge_max(&mut entry.2, &update, window.from, span, columns);
        if references.is_empty()
            && let Some(dtype) = param.dtype.or(run_dtype)
            && rounds_visibly(dtype)
        {
            let mean = read(store, run, SeriesKind::ParamMean, &param.name, window).await?;
            if let Some(&(_, m)) = mean.points.last()
                && let Some(smallest) = smallest_change(m, dtype)
            {
                references.push((
                    smallest,
                    format!(
                        "smallest change {} can make {} ({})",
                        dtype.as_str(),
                        describe_magnitude(m),
                        sci(smallest)
                    ),
                ));
                // Against it, what one optimizer step moves an element by (≈ lr for
                // Adam-family optimizers).
                if let Some(lr) = stored.registration.optimizer.as_ref().and_then(|o| o.lr) {
                    references.push((lr.get(), format!("optimizer step ≈ lr ({})", sci(lr.get()))));
                }
            }
        }
    }
    let mut lines = Vec::new();
    for (group, mut drift, mut update) in groups {
        drift.label = format!("{group} drift (max)");
        update.label = format!("{group} update norm (max)");
        lines.push(drift);
        lines.push(update);
    }
    Ok(ChartData::Lines(LineChart {
        title: format!("Norm weights: drift and update — {}", run.as_str()),
        from: window.from,
        to: window.to,
        primary: Axis {
            label: "per group, largest over its norm weights (log; 0 at the floor)".into(),
            log: true,
            lines,
        },
        secondary: None,
        bands: bands(store, run, AlertKind::NormWeightFrozen, window).await?,
        markers: Vec::new(),
        references,
        notes: Vec::new(),
        legend: LegendPlace::Below,
    }))
}

/// Folds `line` into `into`, keeping per pixel column the largest value (at its step).
fn merge_max(into: &mut Line, line: &Line, from: u64, span: u64, columns: usize) {
    let column = |step: u64| ((step - from) as u128 * columns as u128 / span as u128) as u64;
    let mut by_column: std::collections::BTreeMap<u64, (u64, f64)> = into
        .points
        .iter()
        .map(|&(s, v)| (column(s), (s, v)))
        .collect();
    for &(step, value) in &line.points {
        by_column
            .entry(column(step))
            .and_modify(|e| {
                if value > e.1 {
                    *e = (step, value);
                }
            })
            .or_insert((step, value));
    }
    into.points = by_column.into_values().collect();
    into.nonfinite.extend(&line.nonfinite);
}
