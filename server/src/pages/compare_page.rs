//! `GET /compare?run=a&run=b&metric=&subject=&from_step=&to_step=`: two to eight runs
//! side by side, to see whether a change to the training code fixed what the run
//! before it showed. The runs with their status and open alerts; a GET form for
//! the metric and its subject (the union of the runs' groups, modules and norm
//! weights); the comparison chart, a line per run. A run that never reported the
//! subject is named as such on the page and in the chart's legend.

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::Response;
use maud::{Markup, html};

use super::layout::{self, thousands};
use super::runs_page::severity_counts;
use super::{PageError, page_response};
use crate::charts::compare::{self, CompareMetric, ComparedRun, Subjects};
use crate::routes::charts::{CompareQuery, compared_runs};
use crate::state::AppState;
use crate::store::now_seconds;

/// The comparison chart's width on the page: the full width, like the heatmap.
const CHART_WIDTH: u32 = 1200;

pub async fn show_comparison(
    State(state): State<AppState>,
    RawQuery(query): RawQuery,
) -> Result<Response, PageError> {
    let query = CompareQuery::parse(
        query.as_deref(),
        &["run", "metric", "subject", "from_step", "to_step"],
    )?;
    let runs = compared_runs(&state.store, &query.runs).await?;
    let subjects = Subjects::of(&state.store, &runs).await?;
    let metric = query.metric.unwrap_or(CompareMetric::Loss);
    // The subject drawn: the one asked for when the metric has it, else the
    // metric's first (a form switched from one metric to another still carries
    // the old metric's subject), said in a note.
    let (subject, note) = match metric.subject_noun() {
        None => (None, None),
        Some(noun) => match &query.subject {
            Some(asked) if subjects.offers(metric, asked) => (Some(asked.clone()), None),
            asked => {
                let first = subjects.of_metric(metric).next().map(str::to_owned);
                let note = match (asked, &first) {
                    (_, None) => Some(format!("None of these runs has a {noun} to compare.")),
                    (Some(asked), Some(first)) => Some(format!(
                        "None of these runs has a {noun} named “{asked}”: showing {first}."
                    )),
                    (None, Some(_)) => None,
                };
                (first, note)
            }
        },
    };
    let missing = match (metric, &subject) {
        (CompareMetric::Loss, _) => compare::missing(&state.store, &runs, metric, "").await?,
        (_, Some(subject)) => compare::missing(&state.store, &runs, metric, subject).await?,
        (_, None) => Vec::new(),
    };
    let counts = state.store.open_alert_counts(None).await?;
    let view = CompareView {
        runs: &runs,
        subjects: &subjects,
        metric,
        // The form keeps the subject chosen last, also while the loss is shown.
        selected: subject.as_deref().or(query.subject.as_deref()),
        subject: subject.as_deref(),
        missing: &missing,
        from: query.from_step,
        to: query.to_step,
    };
    let names: Vec<&str> = runs.iter().map(|r| r.id.as_str()).collect();
    let title = format!("Compare {}", names.join(", "));
    let now = now_seconds();
    let body = html! {
        nav.breadcrumb aria-label="Breadcrumb" { a href="/" { "Runs" } " › " span { "Compare" } }
        h1 { "Compare runs" }
        section #compared-runs aria-labelledby="compared-heading" {
            h2 #compared-heading { "Runs (" (runs.len()) ")" }
            table.runs {
                caption.visually-hidden { "The runs compared, in the chart's order" }
                thead {
                    tr {
                        th scope="col" { "Run" }
                        th scope="col" { "Status" }
                        th scope="col" .num { "Steps" }
                        th scope="col" { "Open alerts" }
                        th scope="col" { "In this chart" }
                    }
                }
                tbody {
                    @for run in &runs {
                        @let stored = &run.stored;
                        @let status = stored.status(now);
                        tr data-run-id=(run.id) {
                            th scope="row" {
                                a href={"/runs/" (run.id)} { (stored.registration.name.as_deref().unwrap_or(run.id.as_str())) }
                                @if stored.registration.name.is_some() { br; span.run-id { (run.id) } }
                            }
                            td { span class={"status status-" (status.as_str())} { (status.as_str()) } }
                            td.num {
                                @match (stored.first_step, stored.last_step) {
                                    (Some(first), Some(last)) => { (thousands(first)) "–" (thousands(last)) },
                                    _ => span.muted { "no steps yet" },
                                }
                            }
                            td { (severity_counts(&counts.get(run.id.as_str()).copied().unwrap_or_default())) }
                            td {
                                @if missing.iter().any(|m| m == run.id.as_str()) {
                                    span.flag.not-reported { "not reported" }
                                } @else {
                                    "shown"
                                }
                            }
                        }
                    }
                }
            }
        }
        (view.form())
        (view.chart(note.as_deref()))
    };
    Ok(page_response(
        StatusCode::OK,
        layout::page(&title, Some(("compare", None)), body),
    ))
}

struct CompareView<'a> {
    runs: &'a [ComparedRun],
    subjects: &'a Subjects,
    metric: CompareMetric,
    /// The subject drawn, `None` for the loss.
    subject: Option<&'a str>,
    /// The subject the form shows as chosen.
    selected: Option<&'a str>,
    /// Runs that never reported what is drawn.
    missing: &'a [String],
    from: Option<u64>,
    to: Option<u64>,
}

impl CompareView<'_> {
    /// The metric, its subject and the step range: a plain GET form, so the
    /// comparison lives in the URL.
    fn form(&self) -> Markup {
        let metrics = [
            (CompareMetric::Loss, "Loss"),
            (
                CompareMetric::GradNorm,
                "Gradient norm of a group or module",
            ),
            (CompareMetric::Drift, "Drift of a norm weight"),
            (CompareMetric::Metric, "One of your own metrics"),
        ];
        let groups = [
            (
                "Groups (gradient norm)",
                CompareMetric::GradNorm,
                &self.subjects.groups,
            ),
            (
                "Modules (gradient norm)",
                CompareMetric::GradNorm,
                &self.subjects.modules,
            ),
            (
                "Norm weights (drift)",
                CompareMetric::Drift,
                &self.subjects.norm_weights,
            ),
            (
                "Your metrics",
                CompareMetric::Metric,
                &self.subjects.metrics,
            ),
        ];
        let any_subject = groups.iter().any(|(_, _, list)| !list.is_empty());
        html! {
            section #compare-choice aria-labelledby="choice-heading" {
                h2 #choice-heading { "What to compare" }
                form #compare-form .range method="get" action="/compare" {
                    @for run in self.runs {
                        input type="hidden" name="run" value=(run.id);
                    }
                    label {
                        "Metric "
                        select name="metric" {
                            @for (metric, label) in metrics {
                                option value=(metric.as_str()) selected[metric == self.metric] { (label) }
                            }
                        }
                    }
                    @if any_subject {
                        label {
                            "Subject "
                            select name="subject" {
                                @for (label, metric, list) in groups {
                                    @if !list.is_empty() {
                                        optgroup label=(label) data-metric=(metric.as_str()) {
                                            @for subject in list.iter() {
                                                option value=(subject) selected[self.selected == Some(subject.as_str())] { (subject) }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                    label { "From step " input type="number" name="from_step" min="0" step="1" inputmode="numeric" value=[self.from] placeholder="first"; }
                    label { "To step " input type="number" name="to_step" min="0" step="1" inputmode="numeric" value=[self.to] placeholder="last"; }
                    button type="submit" { "Compare" }
                }
            }
        }
    }

    /// The chart's address, with every choice in it.
    fn chart_src(&self, extension: &str) -> String {
        let mut pairs: Vec<(&str, String)> = self
            .runs
            .iter()
            .map(|r| ("run", r.id.as_str().to_owned()))
            .collect();
        pairs.push(("metric", self.metric.as_str().to_owned()));
        if let Some(subject) = self.subject {
            pairs.push(("subject", subject.to_owned()));
        }
        if let Some(from) = self.from {
            pairs.push(("from_step", from.to_string()));
        }
        if let Some(to) = self.to {
            pairs.push(("to_step", to.to_string()));
        }
        pairs.push(("width", CHART_WIDTH.to_string()));
        let query = serde_urlencoded::to_string(&pairs).expect("string pairs always encode");
        format!("/api/v1/charts/compare.{extension}?{query}")
    }

    fn chart(&self, note: Option<&str>) -> Markup {
        let what = match (self.metric, self.subject) {
            (CompareMetric::Loss, _) => "the loss".to_owned(),
            (CompareMetric::GradNorm, Some(s)) => format!("the gradient norm of {s}"),
            (CompareMetric::Drift, Some(s)) => format!("the drift of {s}"),
            (CompareMetric::Metric, Some(s)) => s.to_owned(),
            (_, None) => String::new(),
        };
        let drawable = self.subject.is_some() || self.metric == CompareMetric::Loss;
        let nobody = self.missing.len() == self.runs.len();
        html! {
            section #charts aria-labelledby="charts-heading" {
                h2 #charts-heading { "Chart" }
                @if let Some(note) = note {
                    p.note #compare-note { (note) }
                }
                @if !self.missing.is_empty() && drawable {
                    p #compare-missing .sev-warning {
                        "Not reported by " (self.missing.join(", ")) ": "
                        @if nobody { "none of these runs has reported " (what) "." }
                        @else { "their legend entries say so and they draw no line." }
                    }
                }
                @if drawable && !nobody {
                    figure.chart.wide {
                        img #chart-compare src=(self.chart_src("svg")) width=(CHART_WIDTH)
                            alt={"Comparison of " (what) " across " (self.runs.len()) " runs, one line per run over steps"};
                        figcaption {
                            "One line per run, on a shared step axis: " (what) "."
                            @if !matches!(self.metric, CompareMetric::Loss | CompareMetric::Metric) {
                                " Log axis; 0 (or, for a gradient, none at all) sits on the floor."
                            }
                        }
                        a.chart-link href=(self.chart_src("png")) { "PNG" }
                    }
                }
            }
        }
    }
}
