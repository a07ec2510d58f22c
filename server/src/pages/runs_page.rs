//! `GET /`: every run, the unhealthy ones first, each with its status, last step and
//! the titles of its open alerts, so a glance says which runs need a look and why.

use std::collections::HashMap;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use maud::{Markup, html};

use super::layout::{self, ago, thousands};
use super::{PageError, page_response};
use crate::charts::compare::{MAX_RUNS, MIN_RUNS};
use crate::state::AppState;
use crate::store::alerts::{Alert, AlertFilter, OpenAlertCounts};
use crate::store::{RunSummary, now_seconds};

/// Open alert titles shown per run; the rest are counted.
const TITLES_SHOWN: usize = 3;

pub async fn show_runs(State(state): State<AppState>) -> Result<Response, PageError> {
    let runs = state.store.runs().await?;
    let counts = state.store.open_alert_counts(None).await?;
    let open = state
        .store
        .alerts(&AlertFilter {
            open: Some(true),
            ..AlertFilter::default()
        })
        .await?;
    let mut open_by_run: HashMap<&str, Vec<&Alert>> = HashMap::new();
    for alert in &open {
        open_by_run.entry(&alert.run_id).or_default().push(alert);
    }
    for alerts in open_by_run.values_mut() {
        alerts.sort_by_key(|a| a.severity);
    }
    // Runs arrive newest first; the sort is stable, so within a severity they stay so.
    let mut runs: Vec<(RunSummary, OpenAlertCounts)> = runs
        .into_iter()
        .map(|run| {
            let count = counts.get(&run.run_id).copied().unwrap_or_default();
            (run, count)
        })
        .collect();
    runs.sort_by_key(|(_, c)| worst(c));
    let now = now_seconds();
    let unhealthy = runs.iter().filter(|(_, c)| c.critical > 0).count();
    // With two runs or more, each can be ticked for a comparison.
    let pickable = runs.len() >= MIN_RUNS;

    let body = html! {
        h1 { "Runs" }
        section #runs-summary aria-label="Summary" {
            @if runs.is_empty() {
                p { "No runs yet. Start the server's demo, or a trainer:" }
                pre { code { "cargo run --release -p gradflow-trainer -- --scenario detached-prompt --run-id cut" } }
            } @else {
                p.summary {
                    (runs.len()) @if runs.len() == 1 { " run" } @else { " runs" }
                    ", "
                    @if unhealthy == 0 {
                        "none with critical alerts."
                    } @else {
                        strong.sev-critical { (unhealthy) " with critical alerts" }
                        ", listed first."
                    }
                }
            }
        }
        @if !runs.is_empty() {
            // Checkboxes in a plain GET form: ticking runs and submitting opens
            // `/compare?run=a&run=b`, with or without the script.
            form #compare-runs method="get" action="/compare" {
                // Always there (hidden below two runs), so the live update can show it.
                p #compare-hint .compare-hint hidden[!pickable] {
                    "Tick " (MIN_RUNS) " to " (MAX_RUNS) " runs to compare them in one chart. "
                    button type="submit" { "Compare selected runs" }
                }
                table #runs-table .runs {
                    caption.visually-hidden { "Runs, unhealthy first" }
                    thead {
                        tr {
                            @if pickable { th scope="col" { span.visually-hidden { "Compare" } } }
                            th scope="col" { "Run" }
                            th scope="col" { "Status" }
                            th scope="col" .num { "Last step" }
                            th scope="col" { "Open alerts" }
                            th scope="col" { "What is wrong" }
                        }
                    }
                    tbody {
                        @for (run, count) in &runs {
                            (run_row(run, count, open_by_run.get(run.run_id.as_str()), now, pickable))
                        }
                    }
                }
            }
        }
    };
    Ok(page_response(
        StatusCode::OK,
        layout::page("Runs", Some(("runs", None)), body),
    ))
}

fn run_row(
    run: &RunSummary,
    count: &OpenAlertCounts,
    open: Option<&Vec<&Alert>>,
    now: f64,
    pickable: bool,
) -> Markup {
    let status = run.status(now);
    let href = format!("/runs/{}", run.run_id);
    let open = open.map(Vec::as_slice).unwrap_or_default();
    html! {
        tr data-run-id=(run.run_id) {
            @if pickable {
                td.pick {
                    input type="checkbox" name="run" value=(run.run_id)
                        aria-label={"Compare " (run.name.as_deref().unwrap_or(&run.run_id))};
                }
            }
            th scope="row" {
                a href=(href) { (run.name.as_deref().unwrap_or(&run.run_id)) }
                @if run.name.is_some() { br; span.run-id { (run.run_id) } }
            }
            td {
                span class={"status status-" (status.as_str())} { (status.as_str()) }
                @if let Some(seen) = run.last_seen {
                    br; span.muted { "last batch " (ago(now - seen)) }
                }
            }
            td.num {
                @match run.last_step {
                    Some(step) => (thousands(step as u64)),
                    None => span.muted { "no steps yet" },
                }
            }
            td { (severity_counts(count)) }
            td {
                @if open.is_empty() {
                    span.muted { "nothing detected" }
                } @else {
                    ul.alert-titles {
                        @for alert in open.iter().take(TITLES_SHOWN) {
                            li class={"sev-" (alert.severity)} {
                                span.visually-hidden { (alert.severity) ": " }
                                (alert.title)
                            }
                        }
                        @if open.len() > TITLES_SHOWN {
                            li.muted { "and " (open.len() - TITLES_SHOWN) " more" }
                        }
                    }
                }
            }
        }
    }
}

/// Open alerts by severity, critical first; "none" when there are none.
pub(super) fn severity_counts(count: &OpenAlertCounts) -> Markup {
    let parts = [
        ("critical", count.critical),
        ("warning", count.warning),
        ("info", count.info),
    ];
    html! {
        @if parts.iter().all(|(_, n)| *n == 0) {
            span.muted { "none" }
        } @else {
            span.counts {
                @for (severity, n) in parts {
                    @if n > 0 {
                        span class={"badge sev-" (severity)} { (n) " " (severity) }
                        " "
                    }
                }
            }
        }
    }
}

fn worst(count: &OpenAlertCounts) -> u8 {
    if count.critical > 0 {
        0
    } else if count.warning > 0 {
        1
    } else if count.info > 0 {
        2
    } else {
        3
    }
}
