//! The per-layer views of the instability signals (protocol v1.8): a line per
//! module of one signal over steps, with the thresholds its verdict counts against
//! and the episodes of that verdict shaded. The module an alert names is drawn
//! thicker, so the layer where an instability began stands out among its
//! neighbours.
//!
//! - `attention-logits`: each attention module's largest pre-softmax logit
//!   (`attn_max_logit`), against `attention_logit_growth`'s warning and critical
//!   bars.
//! - `adam-updates`: each module's Adam update RMS over the lr (`adam_update_rms`),
//!   with `adam_update_spike`'s episodes.
//! - `moe-loads`: each MoE layer's busiest expert's share of the tokens
//!   (`moe_top_share`), against the half that marks a router's collapse.

use std::collections::BTreeSet;

use gradflow_core::detect::AlertKind;
use gradflow_core::detect::attention_logit_growth::{CRITICAL_LOGIT, WARN_LOGIT};
use gradflow_core::model::series_kind::SeriesKind;
use gradflow_protocol::RunId;

use super::ChartKind;
use super::reads::{alerts_of, bands, read};
use super::shapes::{Axis, LegendPlace, LineChart, Window};
use crate::store::{Store, StoreResult};

/// The share of an MoE layer's tokens its busiest expert takes that the
/// literature calls a collapse onto one expert (ST-MoE, DeepSeek-V3: with 8 or more
/// experts, one expert taking more than half the tokens).
pub const MOE_COLLAPSE_SHARE: f64 = 0.5;

/// What one per-layer chart shows.
struct Spec {
    series: SeriesKind,
    title: &'static str,
    axis: &'static str,
    log: bool,
    /// The verdict whose episodes are shaded and whose subjects are drawn thicker
    /// (none yet for the MoE loads: the chart shows the signal alone).
    alert: Option<AlertKind>,
    references: Vec<(f64, String)>,
}

fn spec(kind: ChartKind) -> Option<Spec> {
    Some(match kind {
        ChartKind::AttentionLogits => Spec {
            series: SeriesKind::AttnMaxLogit,
            title: "Largest attention logit by module",
            axis: "max pre-softmax logit q·k/√d (log)",
            log: true,
            alert: Some(AlertKind::AttentionLogitGrowth),
            references: vec![
                (WARN_LOGIT, format!("{WARN_LOGIT:.0}: QK-Clip τ, warning")),
                (CRITICAL_LOGIT, format!("{CRITICAL_LOGIT:.0}: critical")),
            ],
        },
        ChartKind::AdamUpdates => Spec {
            series: SeriesKind::AdamUpdateRms,
            title: "Adam update RMS over the lr by module",
            axis: "update RMS / lr (log)",
            log: true,
            alert: Some(AlertKind::AdamUpdateSpike),
            references: Vec::new(),
        },
        ChartKind::MoeLoads => Spec {
            series: SeriesKind::MoeTopShare,
            title: "Busiest expert's share of the tokens by MoE layer",
            axis: "top expert's share of tokens",
            log: false,
            alert: None,
            references: vec![(
                MOE_COLLAPSE_SHARE,
                "half the tokens on one expert: a collapse".into(),
            )],
        },
        _ => return None,
    })
}

/// The series each per-layer chart draws: the run page shows a chart when the run
/// reported its series.
pub fn series_of(kind: ChartKind) -> Option<SeriesKind> {
    spec(kind).map(|s| s.series)
}

/// The chart `kind` (one of this module's) of `run` over `window`; `None` for
/// another kind.
pub async fn gather(
    store: &Store,
    run: &RunId,
    kind: ChartKind,
    window: Window,
) -> StoreResult<Option<LineChart>> {
    let Some(spec) = spec(kind) else {
        return Ok(None);
    };
    let (named, shaded) = match spec.alert {
        Some(alert) => (
            alerts_of(store, run, alert)
                .await?
                .into_iter()
                .map(|a| a.subject)
                .collect(),
            bands(store, run, alert, window).await?,
        ),
        None => (BTreeSet::new(), Vec::new()),
    };
    let mut lines = Vec::new();
    for subject in store.subjects(run, spec.series).await? {
        let mut line = read(store, run, spec.series, &subject, window).await?;
        if let Some(alert) = spec.alert.filter(|_| named.contains(&subject)) {
            line.emphasis = true;
            line.label = format!("{subject} ({alert})");
        }
        lines.push(line);
    }
    Ok(Some(LineChart {
        title: format!("{} — {}", spec.title, run.as_str()),
        from: window.from,
        to: window.to,
        primary: Axis {
            label: spec.axis.into(),
            log: spec.log,
            lines,
        },
        secondary: None,
        bands: shaded,
        markers: Vec::new(),
        references: spec.references,
        notes: Vec::new(),
        legend: LegendPlace::Right,
    }))
}
