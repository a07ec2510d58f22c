//! `GET /runs/{run_id}?from_step=&to_step=`: one run. The open alerts first, worded
//! exactly as the alerts API words them; then the charts over the chosen step range
//! (kept in the URL, so a link shows the same view); the module table; the
//! registration and config.

use std::collections::HashMap;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use gradflow_protocol::{Dtype, LossScaler, RunId, RunRegistration};
use maud::{Markup, html};
use serde::Deserialize;

use super::layout::{self, ago, number, thousands};
use super::runs_page::severity_counts;
use super::{PageError, page_response};
use crate::charts::{self, ChartKind};
use crate::error::ApiError;
use crate::routes::extract::check_step_range;
use crate::state::AppState;
use crate::store::alerts::{Alert, AlertFilter, OpenAlertCounts};
use crate::store::{LatestValues, StoredRun, now_seconds};
use gradflow_core::detect::step_range;
use gradflow_core::model::alert::AlertStatus;
use gradflow_core::model::cell::Cell;
use gradflow_core::model::series_kind::SeriesKind;

/// The step range, as the form sends it: an emptied field arrives as `""`.
#[derive(Debug, Default, Deserialize)]
pub struct RangeParams {
    from_step: Option<String>,
    to_step: Option<String>,
}

fn parse_step(field: &str, raw: Option<&str>) -> Result<Option<u64>, ApiError> {
    match raw.map(str::trim) {
        None | Some("") => Ok(None),
        Some(text) => text.parse().map(Some).map_err(|_| {
            ApiError::invalid_query(format!(
                "{field} must be a step number (a whole number, 0 or more), got {text:?}"
            ))
            .with_path(field)
        }),
    }
}

pub async fn show_run(
    State(state): State<AppState>,
    Path(raw_run_id): Path<String>,
    Query(range): Query<RangeParams>,
) -> Result<Response, PageError> {
    let run_id =
        RunId::parse(&raw_run_id).map_err(|m| ApiError::invalid_query(m).with_path("run_id"))?;
    let from = parse_step("from_step", range.from_step.as_deref())?;
    let to = parse_step("to_step", range.to_step.as_deref())?;
    check_step_range(from, to)?;
    let run = state.store.run(&run_id).await?;
    let mut alerts = state
        .store
        .alerts(&AlertFilter {
            run_id: Some(run_id.as_str().to_owned()),
            ..AlertFilter::default()
        })
        .await?;
    alerts.sort_by_key(|a| a.severity);
    let (open, resolved): (Vec<Alert>, Vec<Alert>) = alerts
        .into_iter()
        .partition(|a| a.status == AlertStatus::Open);
    let latest = state
        .store
        .latest_values(
            &run_id,
            &[
                SeriesKind::ModuleGradNorm,
                SeriesKind::HookHits,
                SeriesKind::DroppedSteps,
            ],
        )
        .await?;
    let dropped = latest
        .as_ref()
        .and_then(|l| match l.get(SeriesKind::DroppedSteps, "") {
            Some(Cell::Value(n)) if n > 0.0 => Some(n as u64),
            _ => None,
        });
    let reported = state.store.series_kinds(&run_id).await?;
    let has_scaler = reported.contains(&SeriesKind::ScalerScale)
        || run
            .registration
            .precision
            .as_ref()
            .and_then(|p| p.loss_scaler)
            .is_some_and(|s| s != LossScaler::None);
    let has_gpu = reported.contains(&SeriesKind::GpuMemoryUsedBytes)
        || reported.contains(&SeriesKind::GpuUtilizationPct);
    let own_metrics = charts::user_metrics::names(&state.store, &run_id).await?;
    let signal_charts: Vec<ChartKind> = ChartKind::ALL
        .into_iter()
        .filter(|&kind| charts::signals::series_of(kind).is_some_and(|s| reported.contains(&s)))
        .collect();
    let modules = module_rows(&run.registration, latest.as_ref());
    let view = RunView {
        run: &run,
        from,
        to,
        now: now_seconds(),
        dropped,
    };
    let title = run.registration.name.as_deref().unwrap_or(&run.run_id);
    let body = html! {
        nav.breadcrumb aria-label="Breadcrumb" { a href="/" { "Runs" } " › " span { (title) } }
        h1 { (title) }
        (view.meta(&open))
        (alerts_section(&open, &resolved))
        (view.range_form())
        (view.charts(has_scaler, has_gpu, &own_metrics, &signal_charts))
        (modules_section(&modules, latest.as_ref().map(|l| l.step)))
        (registration_section(&run))
    };
    Ok(page_response(
        StatusCode::OK,
        layout::page(title, Some(("run", Some(&run.run_id))), body),
    ))
}

/// The alt text of a per-layer signal chart.
fn signal_alt(kind: ChartKind) -> &'static str {
    match kind {
        ChartKind::AttentionLogits => {
            "The largest attention logit of each attention module over steps, on a log axis, with the warning and critical bars"
        }
        ChartKind::AdamUpdates => {
            "The RMS of each module's Adam update over the lr, over steps, on a log axis"
        }
        _ => "The share of the tokens each MoE layer's busiest expert took, over steps",
    }
}

/// The caption of a per-layer signal chart: what to look for.
fn signal_caption(kind: ChartKind) -> &'static str {
    match kind {
        ChartKind::AttentionLogits => {
            "Attention logits per module (log axis). A line climbing through the dashed bars is a layer heading for attention collapse; the module an attention_logit_growth alert names is drawn thicker."
        }
        ChartKind::AdamUpdates => {
            "Adam update RMS / lr per module (log axis). A module's jump above its own level often precedes a loss spike; the module an adam_update_spike alert names is drawn thicker, its episodes shaded."
        }
        _ => {
            "Busiest expert's share of tokens per MoE layer. A layer that stays above the dashed half has collapsed onto one expert."
        }
    }
}

/// The height on the run page of the charts whose legend goes under the plot (the
/// group norms, the norm weights), in pixels: the others' 420 and the legend.
const LEGEND_BELOW_HEIGHT: u32 = 520;

/// What the norm-weight chart draws, for its alt text: the reference lines only
/// where the weights' dtype rounds updates away at sizes the chart shows.
fn norm_drift_alt(reference: Option<(Dtype, bool)>) -> String {
    match reference {
        Some((dtype, _)) => format!(
            "Drift and update norm of the norm weights over steps, with the smallest change {} can make at their magnitude",
            dtype.as_str()
        ),
        None => "Drift and update norm of the norm weights over steps".to_owned(),
    }
}

/// The norm-weight chart's caption, which describes the dashed lines only when
/// the chart draws them (bf16 or f16 norm weights).
fn norm_drift_caption(reference: Option<(Dtype, bool)>) -> String {
    let lines = "Norm weights: how far they moved (drift) and how much each update changed them, \
                 the largest per group; lines at 0 lie along the floor, one under another.";
    match reference {
        Some((dtype, true)) => format!(
            "{lines} The black dashed line is the smallest change {dtype} can make at the weights' magnitude: \
             updates below it round away. The grey dashed line is one optimizer step (≈ lr for Adam): \
             when it lies below the black one, the weights cannot move.",
            dtype = dtype.as_str()
        ),
        Some((dtype, false)) => format!(
            "{lines} The black dashed line is the smallest change {dtype} can make at the weights' magnitude: \
             updates below it round away.",
            dtype = dtype.as_str()
        ),
        None => format!(
            "{lines} Their dtype can represent changes far smaller than these, so no rounding line is drawn."
        ),
    }
}

/// The caption of the chart of the user's own metrics: what it shows, and how many
/// when it cannot show them all.
fn own_metrics_caption(count: usize, shown: usize) -> String {
    let what = "Your own metrics, as passed to gf.step(metrics=…): a panel each, on its own scale. \
                Compare runs to see one of them side by side.";
    if shown < count {
        format!("{what} The first {shown} of {count} are drawn.")
    } else {
        what.to_owned()
    }
}

struct RunView<'a> {
    run: &'a StoredRun,
    from: Option<u64>,
    to: Option<u64>,
    now: f64,
    /// Step records the trainer dropped (its spool was full), as it last reported.
    dropped: Option<u64>,
}

impl RunView<'_> {
    /// The line under the title: id, status, progress. Swapped in live.
    fn meta(&self, open: &[Alert]) -> Markup {
        let run = self.run;
        let status = run.status(self.now);
        let mut counts = OpenAlertCounts::default();
        for alert in open {
            counts.add(alert.severity, 1);
        }
        html! {
            dl #run-meta .run-meta {
                div { dt { "Run id" } dd { code { (run.run_id) } } }
                div { dt { "Status" } dd { span class={"status status-" (status.as_str())} { (status.as_str()) } } }
                div {
                    dt { "Last step" }
                    dd #last-step {
                        @match run.last_step {
                            Some(step) => (thousands(step)),
                            None => "no steps yet",
                        }
                    }
                }
                div { dt { "Steps stored" } dd { (thousands(run.step_count)) } }
                @if run.registration.world_size() > 1 {
                    div #ranks-link {
                        dt { "Ranks" }
                        dd { a href={"/runs/" (run.run_id) "/ranks"} { (thousands(u64::from(run.registration.world_size()))) " ranks, each on its own" } }
                    }
                }
                @if let Some(dropped) = self.dropped {
                    div #dropped-steps {
                        dt { "Steps dropped by the trainer" }
                        dd.sev-warning title="Its spool filled up while the server was out of reach; those steps were never sent." { (thousands(dropped)) }
                    }
                }
                @if let Some(seen) = run.last_seen {
                    div { dt { "Last batch" } dd { (ago(self.now - seen)) } }
                }
                div { dt { "Open alerts" } dd { (severity_counts(&counts)) } }
            }
        }
    }

    /// The step range: a plain GET form, so the range lives in the URL.
    fn range_form(&self) -> Markup {
        let run = self.run;
        let hint = match (run.first_step, run.last_step) {
            (Some(first), Some(last)) => format!("This run has steps {first} to {last}."),
            _ => "This run has no steps yet.".to_owned(),
        };
        html! {
            section #range aria-labelledby="range-heading" {
                h2 #range-heading { "Step range" }
                form.range method="get" action={"/runs/" (run.run_id)} {
                    label { "From step " input type="number" name="from_step" min="0" step="1" inputmode="numeric" value=[self.from] placeholder="first"; }
                    label { "To step " input type="number" name="to_step" min="0" step="1" inputmode="numeric" value=[self.to] placeholder="last"; }
                    button type="submit" { "Show range" }
                    @if self.from.is_some() || self.to.is_some() {
                        a href={"/runs/" (run.run_id)} { "All steps" }
                    }
                    span #range-hint .muted { (hint) }
                }
            }
        }
    }

    /// The charts over the range. Without an upper bound they end at the last step
    /// stored, so their address changes as the run grows and the live update loads
    /// them again.
    fn charts(
        &self,
        has_scaler: bool,
        has_gpu: bool,
        own_metrics: &[String],
        signal_charts: &[ChartKind],
    ) -> Markup {
        let to = self.to.or(self.run.last_step);
        let src = |kind: ChartKind, width: u32| {
            let mut url = format!(
                "/api/v1/runs/{}/charts/{}.svg?width={width}",
                self.run.run_id,
                kind.as_str()
            );
            if let Some(from) = self.from {
                url.push_str(&format!("&from_step={from}"));
            }
            if let Some(to) = to {
                url.push_str(&format!("&to_step={to}"));
            }
            url
        };
        let figure = |kind: ChartKind, width: u32, class: &str, alt: &str, caption: &str| {
            let mut src = src(kind, width);
            // These charts' legends go under their plots: room for both. They
            // share a row of the grid, so they share a height.
            if matches!(kind, ChartKind::NormDrift | ChartKind::GroupGradNorms) {
                src.push_str(&format!("&height={LEGEND_BELOW_HEIGHT}"));
            }
            html! {
                figure class=(class) {
                    img id={"chart-" (kind.as_str())} src=(src) alt=(alt) width=(width) loading="lazy";
                    figcaption { (caption) }
                    a.chart-link href=(src.replace(".svg?", ".png?")) { "PNG" }
                }
            }
        };
        let reference = charts::data::norm_reference(&self.run.registration);
        let shown = own_metrics.len().min(charts::user_metrics::MAX_PANELS);
        html! {
            section #charts aria-labelledby="charts-heading" {
                h2 #charts-heading { "Charts" }
                @if self.run.last_step.is_none() {
                    p.muted { "The charts appear with the first step." }
                } @else {
                    (figure(ChartKind::GradFlow, 1200, "chart wide",
                        "Gradient-flow heatmap: the gradient norm of every module (rows, in model order, grouped by component) at every step (columns)",
                        "Gradient flow. Each row is a module, each column a stretch of steps; colour is the gradient norm on a log scale. \
                         A solid grey band is a part of the model that backward never reaches (a detached tensor or no_grad); \
                         black is a gradient of exactly 0; magenta is NaN or infinity."))
                    div.chart-grid {
                        (figure(ChartKind::GroupGradNorms, 600, "chart",
                            "Gradient norm of each group over steps, on a log axis, with stuck-at-zero stretches shaded",
                            "Gradient norm per group (log axis). Shaded stretches are under a grad_stuck_zero alert."))
                        (figure(ChartKind::NormDrift, 600, "chart",
                            &norm_drift_alt(reference),
                            &norm_drift_caption(reference)))
                        (figure(ChartKind::Loss, 600, "chart",
                            "Loss and learning rate over steps",
                            "Loss and learning rate."))
                        @if has_scaler {
                            (figure(ChartKind::Scaler, 600, "chart",
                                "Loss scale over steps on a log axis, with overflow and skipped steps marked",
                                "Loss scale (log axis); marks show steps with found_inf and skipped optimizer steps."))
                        }
                        @if has_gpu {
                            (figure(ChartKind::Gpu, 600, "chart",
                                "GPU memory and utilisation over steps",
                                "GPU memory and utilisation."))
                        }
                    }
                    @if !signal_charts.is_empty() {
                        div.chart-grid {
                            @for &kind in signal_charts {
                                (figure(kind, 600, "chart", signal_alt(kind), signal_caption(kind)))
                            }
                        }
                    }
                    @if !own_metrics.is_empty() {
                        (figure(ChartKind::Metrics, 1200, "chart wide",
                            &format!("Your own metrics over steps, a panel each: {}", own_metrics[..shown].join(", ")),
                            &own_metrics_caption(own_metrics.len(), shown)))
                    }
                }
            }
        }
    }
}

fn alerts_section(open: &[Alert], resolved: &[Alert]) -> Markup {
    html! {
        section #alerts aria-labelledby="alerts-heading" {
            h2 #alerts-heading { "Open alerts (" (open.len()) ")" }
            @if open.is_empty() {
                p.ok { "No open alerts: nothing the detectors watch for has happened in this run." }
            } @else {
                ol.alerts { @for alert in open { li { (alert_card(alert)) } } }
            }
            @if !resolved.is_empty() {
                details.resolved {
                    summary { "Resolved alerts (" (resolved.len()) ")" }
                    ol.alerts { @for alert in resolved { li { (alert_card(alert)) } } }
                }
            }
        }
    }
}

pub(super) fn alert_card(alert: &Alert) -> Markup {
    let steps = match (alert.first_step, alert.last_step) {
        (Some(first), Some(last)) => step_range(first as u64, last as u64),
        _ => "at registration, before the first step".to_owned(),
    };
    html! {
        article class={"alert sev-" (alert.severity)} data-alert-id=(alert.id) data-kind=(alert.kind) {
            header {
                span class={"badge sev-" (alert.severity)} { (alert.severity) }
                h3.alert-title { (alert.title) }
            }
            p.alert-facts {
                code { (alert.kind) } " on " code { (alert.subject) } " · " (steps)
                @if let Some(opened) = alert.opened_step { " · opened on step " (opened) }
                @if let Some(resolved) = alert.resolved_step { " · resolved on step " (resolved) }
            }
            p.alert-detail { (alert.detail) }
            @if let Some(frames) = cut_sites(&alert.evidence) {
                p.alert-where {
                    strong { "Where: " }
                    @for (i, frame) in frames.iter().enumerate() {
                        @if i > 0 { ", called from " }
                        code { (frame) }
                    }
                }
            }
            p.alert-fix { strong { "Fix: " } (alert.fix) }
        }
    }
}

/// The call sites of the graph cut an alert names (`evidence.graph_cut.stack`), the
/// user's innermost frame first.
fn cut_sites(evidence: &serde_json::Value) -> Option<Vec<String>> {
    let stack = evidence.get("graph_cut")?.get("stack")?.as_array()?;
    let frames: Vec<String> = stack
        .iter()
        .filter_map(|frame| {
            let site = serde_json::from_value::<gradflow_protocol::CallSite>(frame.clone()).ok()?;
            Some(site.to_string())
        })
        .collect();
    (!frames.is_empty()).then_some(frames)
}

/// A row of the module table: a module of the registration (or one only seen in
/// steps), with what its parameters are and its last gradient.
struct ModuleRow {
    module: String,
    group: String,
    roles: Vec<String>,
    dtypes: Vec<String>,
    params: usize,
    /// Of `params`, those registered with requires_grad (and so measured).
    trainable: usize,
    grad: Option<Cell>,
    hits: Option<Cell>,
}

fn module_rows(registration: &RunRegistration, latest: Option<&LatestValues>) -> Vec<ModuleRow> {
    let mut rows: Vec<ModuleRow> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for param in &registration.params {
        let module = param.module_name();
        let at = *index.entry(module.to_owned()).or_insert_with(|| {
            rows.push(ModuleRow {
                module: module.to_owned(),
                group: param.group_name().to_owned(),
                roles: Vec::new(),
                dtypes: Vec::new(),
                params: 0,
                trainable: 0,
                grad: None,
                hits: None,
            });
            rows.len() - 1
        });
        let row = &mut rows[at];
        row.params += 1;
        row.trainable += usize::from(param.requires_grad());
        let role = wire_name(&param.role());
        if !row.roles.contains(&role) {
            row.roles.push(role);
        }
        if let Some(dtype) = param
            .dtype
            .or(registration.precision.as_ref().and_then(|p| p.param_dtype))
        {
            let dtype = dtype.as_str().to_owned();
            if !row.dtypes.contains(&dtype) {
                row.dtypes.push(dtype);
            }
        }
    }
    if let Some(latest) = latest {
        let mut reported: Vec<&String> = latest
            .values
            .keys()
            .filter(|(kind, _)| *kind == SeriesKind::ModuleGradNorm)
            .map(|(_, subject)| subject)
            .filter(|subject| !index.contains_key(*subject))
            .collect();
        reported.sort();
        for module in reported {
            index.insert(module.clone(), rows.len());
            rows.push(ModuleRow {
                group: gradflow_protocol::default_group(module).to_owned(),
                module: module.clone(),
                roles: Vec::new(),
                dtypes: Vec::new(),
                params: 0,
                trainable: 0,
                grad: None,
                hits: None,
            });
        }
        for row in &mut rows {
            row.grad = latest.get(SeriesKind::ModuleGradNorm, &row.module);
            row.hits = latest.get(SeriesKind::HookHits, &row.module);
        }
    }
    rows
}

fn wire_name<T: serde::Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(s)) => s,
        _ => String::new(),
    }
}

fn modules_section(rows: &[ModuleRow], step: Option<u64>) -> Markup {
    html! {
        section #modules aria-labelledby="modules-heading" {
            h2 #modules-heading { "Modules (" (rows.len()) ")" }
            p.muted #modules-step {
                @match step {
                    Some(step) => { "Each module's latest reported gradient norm and hook hits (the last stored step is " (thousands(step)) ")." }
                    None => "No step stored yet.",
                }
            }
            // Shown by the script, which does the filtering.
            div.table-tools hidden {
                label { "Filter modules " input #module-filter type="search" placeholder="name, group, role or dtype" autocomplete="off"; }
                span #module-count .muted role="status" aria-live="polite" {}
            }
            div.table-scroll {
                table #module-table .modules {
                    caption.visually-hidden { "Modules, in model order" }
                    thead {
                        tr {
                            th scope="col" aria-sort="none" data-sort="order" { button type="button" { "Module" } }
                            th scope="col" aria-sort="none" data-sort="group" { button type="button" { "Group" } }
                            th scope="col" aria-sort="none" data-sort="role" { button type="button" { "Role" } }
                            th scope="col" aria-sort="none" data-sort="dtype" { button type="button" { "Dtype" } }
                            th scope="col" .num aria-sort="none" data-sort="params" { button type="button" { "Params" } }
                            th scope="col" .num aria-sort="none" data-sort="grad" { button type="button" { "Last grad norm" } }
                            th scope="col" .num aria-sort="none" data-sort="hits" { button type="button" { "Hook hits" } }
                        }
                    }
                    tbody #module-rows {
                        @for (i, row) in rows.iter().enumerate() {
                            (module_row(i, row))
                        }
                    }
                }
            }
        }
    }
}

fn module_row(order: usize, row: &ModuleRow) -> Markup {
    let hits = match row.hits {
        Some(Cell::Value(v)) if v.is_finite() => Some(v as u64),
        _ => None,
    };
    let grad_text = number(row.grad);
    // Sort keys: a number, or empty for "nothing to compare" (sorted last).
    let grad_key = match row.grad {
        Some(Cell::Value(v)) if v.is_nan() => "NaN".to_owned(),
        Some(Cell::Value(v)) => v.to_string(),
        _ => String::new(),
    };
    let state = match (row.grad, hits) {
        (Some(Cell::Value(v)), _) if !v.is_finite() => "nonfinite",
        (Some(Cell::Value(0.0)), _) => "zero",
        (Some(Cell::Null), Some(0)) => "not-reached",
        _ => "",
    };
    let roles = row.roles.join(", ");
    let dtypes = row.dtypes.join(", ");
    html! {
        tr class=(state) data-order=(order) data-module=(row.module) data-group=(row.group)
           data-role=(roles) data-dtype=(dtypes) data-params=(row.params)
           data-grad=(grad_key) data-hits=[hits] {
            th scope="row" { code { (row.module) } }
            td { (row.group) }
            td { (roles) }
            td { (dtypes) }
            td.num { (row.params) }
            td.num {
                @match (grad_text, state) {
                    (_, "not-reached") => span.flag { "no gradient: backward never reached it" },
                    (Some(text), "zero") => { (text) " " span.flag { "exactly 0" } },
                    (Some(text), _) => (text),
                    // A module with nothing to train has no gradient to measure.
                    (None, _) if row.params > 0 && row.trainable == 0 => {
                        span.muted { "frozen (requires_grad=False)" }
                    }
                    (None, _) => span.muted { "not measured" },
                }
            }
            td.num {
                @match hits {
                    Some(hits) => (hits),
                    None => span.muted { "—" },
                }
            }
        }
    }
}

fn registration_section(run: &StoredRun) -> Markup {
    let registration = &run.registration;
    let precision = registration.precision.clone().unwrap_or_default();
    let optimizer = registration.optimizer.clone().unwrap_or_default();
    let elements: u64 = registration
        .params
        .iter()
        .filter_map(|p| p.shape.as_ref())
        .map(|shape| shape.iter().product::<u64>())
        .sum();
    let json = serde_json::to_string_pretty(&registration.clone().redacted()).unwrap_or_default();
    let config = registration
        .config
        .as_ref()
        .map(|c| serde_json::to_string_pretty(c).unwrap_or_default());
    let float = |f: Option<gradflow_protocol::Float>| f.map(|f| f.0.to_string());
    html! {
        section #registration aria-labelledby="registration-heading" {
            h2 #registration-heading { "Registration" }
            dl.facts {
                div { dt { "Parameter dtype" } dd { (precision.param_dtype.map(|d| d.as_str()).unwrap_or("not given")) } }
                div { dt { "Compute dtype" } dd { (precision.compute_dtype.map(|d| d.as_str()).unwrap_or("not given")) } }
                div { dt { "Loss scaler" } dd { (precision.loss_scaler.map(|s| wire_name(&s)).unwrap_or_else(|| "not given".into())) } }
                div { dt { "Optimizer" } dd { (optimizer.name.as_deref().unwrap_or("not given")) } }
                @if let Some(lr) = float(optimizer.lr) { div { dt { "Learning rate" } dd { (lr) } } }
                @if let Some(wd) = float(optimizer.weight_decay) { div { dt { "Weight decay" } dd { (wd) } } }
                div { dt { "Parameters" } dd { (thousands(registration.params.len() as u64)) " tensors" @if elements > 0 { ", " (thousands(elements)) " elements" } } }
                @if let Some(host) = &registration.host { div { dt { "Host" } dd { (host) } } }
                @if let (Some(rank), Some(world)) = (registration.rank, registration.world_size) { div { dt { "Rank" } dd { (rank) " of " (world) } } }
            }
            @if let Some(config) = config {
                h3 { "Config" }
                pre.json { code { (config) } }
            }
            details {
                summary { "The whole registration (JSON)" }
                pre.json { code { (json) } }
            }
        }
    }
}
