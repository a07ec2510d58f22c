//! `GET /runs/{run_id}/ranks?module=`: a multi-rank run rank by rank. The run's
//! alerts about its ranks, worded as the alerts API words them; each rank's step
//! time in one chart, a module's gradient norm as each rank computed it in another
//! (the module chosen in a GET form, so the view lives in the URL); and where each
//! rank stands (whether it reports, its last step, how far behind the most advanced
//! rank, its latest step time, its open alerts). The run page links here.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use gradflow_protocol::RunId;
use maud::{Markup, html};
use serde::Deserialize;

use super::layout::{self, thousands};
use super::run_page::alert_card;
use super::{PageError, page_response};
use crate::charts::PALETTE;
use crate::charts::ranks::{MAX_RANK_LINES, RankMetric, RankState, Ranks};
use crate::error::ApiError;
use crate::routes::charts::RANKS_CHART;
use crate::state::AppState;
use crate::store::StoredRun;
use crate::store::alerts::Alert;
use gradflow_core::model::alert::{AlertKind, AlertStatus};
use gradflow_core::model::series_kind::SeriesKind;

/// The charts' width on the page: the full width, like the heatmap.
const CHART_WIDTH: u32 = 1200;
/// The most rows the rank table shows; past it, the ranks that need a look and
/// those drawn in the charts (the API lists every rank).
const MAX_TABLE_ROWS: usize = 256;

#[derive(Debug, Default, Deserialize)]
pub struct RanksParams {
    module: Option<String>,
}

pub async fn show_ranks(
    State(state): State<AppState>,
    Path(raw_run_id): Path<String>,
    Query(params): Query<RanksParams>,
) -> Result<Response, PageError> {
    let run_id =
        RunId::parse(&raw_run_id).map_err(|m| ApiError::invalid_query(m).with_path("run_id"))?;
    let run = state.store.run(&run_id).await?;
    let ranks = Ranks::of(&state.store, &run_id, &run).await?;
    let modules = state
        .store
        .subjects(&run_id, SeriesKind::ModuleGradNorm)
        .await?;
    // The module drawn: the one asked for when the run reported it, else the first
    // (said in a note).
    let asked = params
        .module
        .as_deref()
        .map(str::trim)
        .filter(|m| !m.is_empty());
    let module = match asked {
        Some(asked) if modules.iter().any(|m| m == asked) => Some(asked.to_owned()),
        _ => modules.first().cloned(),
    };
    let note = match (asked, &module) {
        (Some(asked), Some(shown)) if asked != shown => Some(format!(
            "This run has reported no module named “{asked}”: showing {shown}."
        )),
        (Some(asked), None) => Some(format!(
            "This run has reported no module named “{asked}”, nor any other module."
        )),
        _ => None,
    };
    let view = RanksView {
        run: &run,
        ranks: &ranks,
        drawn: ranks.drawn(),
        modules: &modules,
        module: module.as_deref(),
    };
    let title = run.registration.name.as_deref().unwrap_or(&run.run_id);
    let body = html! {
        nav.breadcrumb aria-label="Breadcrumb" {
            a href="/" { "Runs" } " › " a href={"/runs/" (run.run_id)} { (title) } " › " span { "Ranks" }
        }
        h1 { (title) ": ranks" }
        (view.meta())
        (view.alerts())
        (view.charts(note.as_deref()))
        (view.table())
    };
    Ok(page_response(
        StatusCode::OK,
        layout::page(
            &format!("{title}: ranks"),
            Some(("ranks", Some(&run.run_id))),
            body,
        ),
    ))
}

struct RanksView<'a> {
    run: &'a StoredRun,
    ranks: &'a Ranks,
    /// The ranks the charts draw, in rank order (their line's colour is their place).
    drawn: Vec<u32>,
    /// The modules the run reported a gradient norm of, in model order.
    modules: &'a [String],
    /// The module whose per-rank gradient norm is drawn.
    module: Option<&'a str>,
}

/// Whether a rank needs a look: an open alert, or nothing sent.
fn needs_look(rank: &RankState) -> bool {
    !rank.open_alerts.is_empty() || rank.last_step.is_none()
}

/// A step time for a person: `95.0 ms`, `1.25 s`.
fn duration(seconds: f64) -> String {
    if seconds < 1.0 {
        format!("{:.1} ms", seconds * 1000.0)
    } else {
        format!("{seconds:.2} s")
    }
}

impl RanksView<'_> {
    /// The line under the title. Swapped in live.
    fn meta(&self) -> Markup {
        let ranks = self.ranks;
        let reporting = ranks.ranks.iter().filter(|r| r.last_step.is_some()).count();
        let open = ranks
            .alerts
            .iter()
            .filter(|a| a.status == AlertStatus::Open)
            .count();
        html! {
            dl #rank-meta .run-meta {
                div { dt { "Ranks" } dd { (thousands(u64::from(ranks.world_size))) } }
                div { dt { "Reporting" } dd { (thousands(reporting as u64)) " of " (thousands(u64::from(ranks.world_size))) } }
                div {
                    dt { "Last combined step" }
                    dd #combined-step {
                        @match ranks.last_step {
                            Some(step) => (thousands(step)),
                            None => "none yet",
                        }
                    }
                }
                @if let Some(front) = ranks.front {
                    div { dt { "Most advanced rank at step" } dd #front-step { (thousands(front)) } }
                }
                div { dt { "Open rank alerts" } dd { (open) } }
            }
            @if ranks.world_size == 1 {
                p.note #single-process { "This run is a single process: its one rank is the run itself." }
            }
        }
    }

    /// The run's alerts about its ranks, open first. Swapped in live.
    fn alerts(&self) -> Markup {
        let mut open: Vec<&Alert> = self
            .ranks
            .alerts
            .iter()
            .filter(|a| a.status == AlertStatus::Open)
            .collect();
        open.sort_by_key(|a| a.severity);
        let resolved: Vec<&Alert> = self
            .ranks
            .alerts
            .iter()
            .filter(|a| a.status != AlertStatus::Open)
            .collect();
        html! {
            section #rank-alerts aria-labelledby="rank-alerts-heading" {
                h2 #rank-alerts-heading { "Rank alerts (" (open.len()) " open)" }
                @if open.is_empty() {
                    p.ok { "No open alerts about the ranks: none is missing, straggling, non-finite alone, or out of step with its replicas." }
                } @else {
                    ol.alerts { @for alert in &open { li { (alert_card(alert)) } } }
                }
                @if !resolved.is_empty() {
                    details.resolved {
                        summary { "Resolved rank alerts (" (resolved.len()) ")" }
                        ol.alerts { @for alert in &resolved { li { (alert_card(alert)) } } }
                    }
                }
            }
        }
    }

    /// The ranks shown in the table: all of them, or past [`MAX_TABLE_ROWS`] those
    /// that need a look, those furthest behind and those drawn, in rank order.
    fn table_rows(&self) -> Vec<&RankState> {
        let all = &self.ranks.ranks;
        if all.len() <= MAX_TABLE_ROWS {
            return all.iter().collect();
        }
        let mut chosen: Vec<&RankState> = all
            .iter()
            .filter(|r| needs_look(r) || self.drawn.contains(&r.rank))
            .collect();
        let mut behind: Vec<&RankState> = all
            .iter()
            .filter(|r| !needs_look(r) && !self.drawn.contains(&r.rank) && r.behind > Some(0))
            .collect();
        behind.sort_by_key(|r| std::cmp::Reverse(r.behind));
        chosen.extend(behind);
        chosen.truncate(MAX_TABLE_ROWS);
        chosen.sort_by_key(|r| r.rank);
        chosen
    }

    /// The rank table. Its body and note are swapped in live.
    fn table(&self) -> Markup {
        let rows = self.table_rows();
        let world = self.ranks.ranks.len();
        html! {
            section #ranks aria-labelledby="ranks-heading" {
                h2 #ranks-heading { "Ranks" }
                p.muted #ranks-note {
                    "Each rank's own records: its last step, how far it is behind the most advanced rank, and the time of its own work on its latest step. "
                    @if rows.len() < world {
                        "Showing " (rows.len()) " of " (thousands(world as u64)) " ranks: those with open alerts or nothing sent, those drawn in the charts, and the furthest behind; "
                        a href={"/api/v1/runs/" (self.run.run_id) "/ranks"} { "the API lists them all" } "."
                    }
                }
                div.table-scroll {
                    table #rank-table .ranks {
                        caption.visually-hidden { "Ranks, in order" }
                        thead {
                            tr {
                                th scope="col" { "Rank" }
                                th scope="col" { "Reporting" }
                                th scope="col" .num { "Last step" }
                                th scope="col" .num { "Behind" }
                                th scope="col" .num { "Latest step time" }
                                th scope="col" { "Open alerts" }
                            }
                        }
                        tbody #rank-rows {
                            @for rank in &rows { (self.row(rank)) }
                        }
                    }
                }
            }
        }
    }

    fn row(&self, rank: &RankState) -> Markup {
        // The colour (and, past the palette, the dashes) of its lines in the charts.
        let swatch = self.drawn.iter().position(|r| *r == rank.rank).map(|line| {
            let dashed = if line >= PALETTE.len() { " dashed" } else { "" };
            format!("swatch c{}{dashed}", line % PALETTE.len())
        });
        let missing = rank
            .open_alerts
            .iter()
            .any(|a| a.kind == AlertKind::RankMissing);
        html! {
            tr class=[needs_look(rank).then_some("attention")] data-rank=(rank.rank) {
                th scope="row" {
                    @if let Some(swatch) = swatch {
                        span class=(swatch) title="its line in the charts" aria-hidden="true" {}
                    }
                    "rank " (rank.rank)
                }
                td {
                    @match (rank.last_step, missing) {
                        (None, _) => span.flag { "nothing sent" },
                        (Some(_), true) => span.flag { "stopped: the run went on without it" },
                        (Some(_), false) => "yes",
                    }
                }
                td.num {
                    @match rank.last_step {
                        Some(step) => (thousands(step)),
                        None => span.muted { "—" },
                    }
                }
                td.num {
                    @match rank.behind {
                        Some(0) => span.muted { "0" },
                        Some(behind) => (thousands(behind)),
                        None => span.muted { "—" },
                    }
                }
                td.num {
                    @match rank.step_time {
                        Some(seconds) => (duration(seconds)),
                        None => span.muted { "not reported" },
                    }
                }
                td {
                    @if rank.open_alerts.is_empty() {
                        span.muted { "none" }
                    } @else {
                        ul.alert-titles {
                            @for alert in &rank.open_alerts {
                                li class={"sev-" (alert.severity)} { code { (alert.kind) } ": " (alert.title) }
                            }
                        }
                    }
                }
            }
        }
    }

    /// A chart's address. Without an upper bound the charts end at the most advanced
    /// rank's step, so their address changes as the ranks move on and the live
    /// update loads them again.
    fn chart_src(&self, metric: RankMetric, extension: &str) -> String {
        let mut pairs: Vec<(&str, String)> = vec![("metric", metric.as_str().to_owned())];
        if metric == RankMetric::GradNorm
            && let Some(module) = self.module
        {
            pairs.push(("subject", module.to_owned()));
        }
        if let Some(to) = self.ranks.front.max(self.run.last_step) {
            pairs.push(("to_step", to.to_string()));
        }
        pairs.push(("width", CHART_WIDTH.to_string()));
        let query = serde_urlencoded::to_string(&pairs).expect("string pairs always encode");
        format!(
            "/api/v1/runs/{}/charts/{RANKS_CHART}.{extension}?{query}",
            self.run.run_id
        )
    }

    fn figure(&self, metric: RankMetric, id: &str, alt: &str, caption: Markup) -> Markup {
        html! {
            figure.chart.wide {
                img id=(id) src=(self.chart_src(metric, "svg")) width=(CHART_WIDTH) alt=(alt);
                figcaption { (caption) }
                a.chart-link href=(self.chart_src(metric, "png")) { "PNG" }
            }
        }
    }

    /// The step-time chart, the module form and the module's chart. The charts
    /// are swapped in live; the form stays as the reader left it.
    fn charts(&self, note: Option<&str>) -> Markup {
        let world = self.ranks.world_size as usize;
        let left_out = world.saturating_sub(self.drawn.len());
        html! {
            section #charts aria-labelledby="charts-heading" {
                h2 #charts-heading { "Charts" }
                @if self.ranks.front.is_none() {
                    p.muted { "The charts appear with the first step." }
                } @else {
                    @if left_out > 0 {
                        p.note #ranks-left-out {
                            "Each chart draws " (self.drawn.len()) " of the " (thousands(world as u64)) " ranks (at most " (MAX_RANK_LINES) "): those with open alerts, then the lowest numbers. Its legend names the ranks left out."
                        }
                    }
                    (self.figure(RankMetric::StepTime, "chart-ranks-step-time",
                        "Step time of each rank over steps, one line per rank, with straggler stretches shaded",
                        html! { "Step time per rank: seconds of each rank's own work per step. A rank well above the others is the one they wait for; shaded stretches are under a rank_straggler or rank_missing alert." }))
                    form #rank-module-form .range method="get" action={"/runs/" (self.run.run_id) "/ranks"} {
                        @if self.modules.is_empty() {
                            span.muted { "No module has reported a gradient norm yet." }
                        } @else {
                            label {
                                "Module "
                                select name="module" {
                                    @for module in self.modules {
                                        option value=(module) selected[self.module == Some(module.as_str())] { (module) }
                                    }
                                }
                            }
                            button type="submit" { "Show its gradient norm per rank" }
                        }
                    }
                    @if let Some(note) = note {
                        p.note #rank-module-note { (note) }
                    }
                    @if let Some(module) = self.module {
                        (self.figure(RankMetric::GradNorm, "chart-ranks-grad-norm",
                            &format!("Gradient norm of {module} as each rank computed it, over steps, one line per rank"),
                            html! { "Gradient norm of " code { (module) } " per rank (log axis): a replicated module's norm is the same on every rank after the all-reduce; a sharded module's is each rank's own shard. Shaded stretches are under a rank_nonfinite or replica_divergence alert." }))
                    }
                }
            }
        }
    }
}
