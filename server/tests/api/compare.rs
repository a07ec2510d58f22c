//! Comparing runs through a real server: the runs page leads to `/compare`, which
//! lists the runs and the subjects they offer; the comparison chart draws one line
//! per run on a shared step axis and names a run that never reported the subject;
//! bad input is a JSON error (the chart) or a page (the dashboard) saying what was
//! wrong; the read token guards both.

use crate::common::{TestApp, error_of};
use reqwest::header;
use serde_json::{Value, json};

/// Series colours of the charts (the first three of the palette), as plotters
/// writes them in SVG.
const COLOURS: [&str; 3] = ["#1F77B4", "#FF7F0E", "#2CA02C"];

/// Three runs: `before` (the qwen tower detached: no gradient, steps 0–59),
/// `after` (the fix: a gradient, steps 100–159) and `other` (no qwen at all,
/// steps 0–29).
async fn three_runs(app: &TestApp) {
    let params = json!([
        {"name": "qwen.layers.0.input_layernorm.weight", "role": "norm", "dtype": "f32"},
        {"name": "qwen.layers.0.self_attn.q_proj.weight", "dtype": "f32"},
        {"name": "agent.head.weight", "dtype": "f32"}]);
    for (run, name) in [("before", "detached prompt"), ("after", "fixed prompt")] {
        let status = app
            .register(run, &json!({"name": name, "params": params}))
            .await
            .status();
        assert_eq!(status, 201);
    }
    let status = app
        .register(
            "other",
            &json!({"params": [{"name": "agent.head.weight", "dtype": "f32"}]}),
        )
        .await
        .status();
    assert_eq!(status, 201);
    let record = |step: u64, qwen: Value| {
        json!({"step": step, "loss": 3.0 - step as f64 * 0.01,
            "modules": [{"module": "qwen.layers.0.self_attn", "grad_norm": qwen, "hook_hits": 1},
                        {"module": "agent.head", "grad_norm": 0.5, "hook_hits": 1}],
            "params": [{"name": "qwen.layers.0.input_layernorm.weight", "drift": step as f64 * 1e-4}]})
    };
    let before: Vec<Value> = (0..60).map(|s| record(s, Value::Null)).collect();
    let after: Vec<Value> = (100..160)
        .map(|s| record(s, json!(0.2 + s as f64 * 0.001)))
        .collect();
    let other: Vec<Value> = (0..30)
        .map(|s| json!({"step": s, "loss": 2.0, "modules": [{"module": "agent.head", "grad_norm": 0.4}]}))
        .collect();
    for (run, steps) in [("before", before), ("after", after), ("other", other)] {
        let status = app.post_steps(run, &Value::Array(steps)).await.status();
        assert_eq!(status, 200, "{run}");
    }
}

async fn get_text(app: &TestApp, path: &str) -> (u16, String, String) {
    let response = app.client.get(app.url(path)).send().await.unwrap();
    let status = response.status().as_u16();
    let content_type = response.headers()[header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .to_owned();
    (status, content_type, response.text().await.unwrap())
}

/// The value of attribute `name` in the element text `element`.
fn attr<'a>(element: &'a str, name: &str) -> Option<&'a str> {
    let start = element.find(&format!(" {name}=\""))? + name.len() + 3;
    let end = start + element[start..].find('"')?;
    Some(&element[start..end])
}

/// The plotted lines of an SVG: (stroke colour, points), legend samples (two
/// points) left out.
fn lines(svg: &str) -> Vec<(String, Vec<(f64, f64)>)> {
    svg.split('<')
        .filter(|e| e.starts_with("polyline"))
        .filter_map(|e| {
            let points: Vec<(f64, f64)> = attr(e, "points")?
                .split_whitespace()
                .map(|p| {
                    let (x, y) = p.split_once(',').expect("x,y");
                    (x.parse().unwrap(), y.parse().unwrap())
                })
                .collect();
            (points.len() > 2).then(|| (attr(e, "stroke").unwrap_or_default().to_owned(), points))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runs_page_leads_to_a_comparison_of_the_runs_ticked() {
    let app = TestApp::spawn().await;
    three_runs(&app).await;
    let (status, _, html) = get_text(&app, "/").await;
    assert_eq!(status, 200);
    // A plain GET form to /compare, a checkbox per run.
    assert!(
        html.contains(r#"<form id="compare-runs" method="get" action="/compare">"#),
        "{html}"
    );
    for run in ["before", "after", "other"] {
        assert!(
            html.contains(&format!(
                r#"<input type="checkbox" name="run" value="{run}""#
            )),
            "no checkbox for {run}: {html}"
        );
    }
    assert!(html.contains("Compare selected runs"));

    // What the form sends: the runs ticked, nothing else.
    let (status, _, html) = get_text(&app, "/compare?run=before&run=after&run=other").await;
    assert_eq!(status, 200, "{html}");
    for run in ["before", "after", "other"] {
        assert!(html.contains(&format!(r#"data-run-id="{run}""#)), "{run}");
        assert!(html.contains(&format!(
            r#"<input type="hidden" name="run" value="{run}">"#
        )));
    }
    assert!(html.contains("detached prompt") && html.contains("fixed prompt"));
    // The loss by default; every run has one.
    assert!(
        html.contains(r#"<option value="loss" selected>Loss</option>"#),
        "{html}"
    );
    assert!(
        html.contains(
            r#"src="/api/v1/charts/compare.svg?run=before&amp;run=after&amp;run=other&amp;metric=loss&amp;width=1200""#
        ),
        "{html}"
    );
    assert!(!html.contains("Not reported by"));
    // The subjects offered: the union of the runs' groups, modules and norm
    // weights, each under its metric.
    for (label, subjects) in [
        ("Groups (gradient norm)", vec!["qwen", "agent"]),
        (
            "Modules (gradient norm)",
            vec![
                "qwen.layers.0.self_attn",
                "agent.head",
                "qwen.layers.0.input_layernorm",
            ],
        ),
        (
            "Norm weights (drift)",
            vec!["qwen.layers.0.input_layernorm.weight"],
        ),
    ] {
        let start = html
            .find(&format!(r#"<optgroup label="{label}""#))
            .unwrap_or_else(|| panic!("no {label}: {html}"));
        let group = &html[start..start + html[start..].find("</optgroup>").unwrap()];
        for subject in subjects {
            assert!(
                group.contains(&format!(r#"<option value="{subject}">"#)),
                "{label} lacks {subject}: {group}"
            );
        }
    }

    // A module's gradient norm: the run without that module is named as such.
    let (status, _, html) = get_text(
        &app,
        "/compare?run=before&run=after&run=other&metric=grad_norm&subject=qwen.layers.0.self_attn",
    )
    .await;
    assert_eq!(status, 200, "{html}");
    assert!(html.contains(r#"<option value="grad_norm" selected>"#));
    assert!(html.contains(r#"<option value="qwen.layers.0.self_attn" selected>"#));
    assert!(
        html.contains("metric=grad_norm&amp;subject=qwen.layers.0.self_attn&amp;width=1200"),
        "{html}"
    );
    assert!(html.contains("Not reported by other"), "{html}");
    let row = &html[html.find(r#"data-run-id="other""#).unwrap()..];
    let row = &row[..row.find("</tr>").unwrap()];
    assert!(row.contains("not reported"), "{row}");

    // A subject switched to a metric that lacks it: the metric's first, said so.
    let (status, _, html) = get_text(
        &app,
        "/compare?run=before&run=after&metric=drift&subject=agent.head&to_step=120",
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        html.contains("None of these runs has a norm weight named “agent.head”: showing qwen.layers.0.input_layernorm.weight."),
        "{html}"
    );
    assert!(html.contains("subject=qwen.layers.0.input_layernorm.weight&amp;to_step=120"));
    assert!(html.contains(r#"name="to_step" min="0" step="1" inputmode="numeric" value="120""#));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_comparison_chart_has_a_line_per_run_on_one_step_axis() {
    let app = TestApp::spawn().await;
    three_runs(&app).await;
    let (status, content_type, svg) = get_text(
        &app,
        "/api/v1/charts/compare.svg?run=before&run=after&run=other&metric=grad_norm&subject=qwen.layers.0.self_attn&width=1200",
    )
    .await;
    assert_eq!(status, 200, "{svg}");
    assert_eq!(content_type, "image/svg+xml");
    assert!(svg.contains("Gradient norm of qwen.layers.0.self_attn — 3 runs"));
    // The legend names every run, the one without the module as such.
    for label in [">\nbefore\n<", ">\nafter\n<", ">\nother: not reported\n<"] {
        assert!(svg.contains(label), "the legend lacks {label:?}");
    }
    let drawn = lines(&svg);
    let line = |colour: &str| {
        drawn
            .iter()
            .find(|(c, _)| c == colour)
            .map(|(_, p)| p.clone())
            .unwrap_or_else(|| panic!("no line in {colour}: {drawn:?}"))
    };
    let before = line(COLOURS[0]);
    let after = line(COLOURS[1]);
    assert!(
        !drawn.iter().any(|(c, _)| c == COLOURS[2]),
        "a line for the run that never reported the module"
    );
    assert_eq!(drawn.len(), 2, "one line per run that reported it");
    // One step axis: `before` (steps 0–59) ends left of where `after` (100–159)
    // starts, and their spans are about as wide.
    let span = |p: &[(f64, f64)]| (p[0].0, p[p.len() - 1].0);
    let (b0, b1) = span(&before);
    let (a0, a1) = span(&after);
    assert!(b1 < a0, "before ends at x {b1}, after starts at x {a0}");
    assert!(
        ((b1 - b0) - (a1 - a0)).abs() < 5.0,
        "{b0}–{b1} vs {a0}–{a1}"
    );
    // The detached run sits flat on the floor, below every point of the fix
    // (SVG y grows downwards).
    let floor = before[0].1;
    assert!(before.iter().all(|p| p.1 == floor), "{before:?}");
    assert!(after.iter().all(|p| p.1 < floor - 20.0), "{after:?}");

    // The loss of two runs; PNG too.
    let (status, _, svg) = get_text(&app, "/api/v1/charts/compare.svg?run=after&run=other").await;
    assert_eq!(status, 200);
    assert!(svg.contains("Loss — 2 runs"));
    assert_eq!(lines(&svg).len(), 2);
    let response = app
        .client
        .get(app.url(
            "/api/v1/charts/compare.png?run=before&run=after&metric=drift&subject=qwen.layers.0.input_layernorm.weight",
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()[header::CONTENT_TYPE], "image/png");
    assert_eq!(&response.bytes().await.unwrap()[..8], b"\x89PNG\r\n\x1a\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_comparison_says_what_was_wrong() {
    let app = TestApp::spawn().await;
    three_runs(&app).await;
    let nine: String = (0..9).map(|i| format!("run=r{i}&")).collect();
    let chart = "/api/v1/charts/compare.svg";
    for (query, status, code, says) in [
        ("run=before", 400, "invalid_query", "at least 2 runs, got 1"),
        ("", 400, "invalid_query", "at least 2 runs, got 0"),
        (
            nine.as_str(),
            400,
            "invalid_query",
            "at most 8 runs can be compared at once, got 9",
        ),
        (
            "run=before&run=before",
            400,
            "invalid_query",
            "run \"before\" is named twice",
        ),
        (
            "run=before&run=bad%20id",
            400,
            "invalid_query",
            "run \"bad id\"",
        ),
        (
            "run=before&run=ghost",
            404,
            "run_not_found",
            "run \"ghost\" is not registered",
        ),
        (
            "run=before&run=after&metric=accuracy",
            400,
            "invalid_query",
            "unknown metric \"accuracy\": one of loss, grad_norm, drift",
        ),
        (
            "run=before&run=after&metric=grad_norm",
            400,
            "invalid_query",
            "metric \"grad_norm\" needs a subject: a group or module",
        ),
        (
            "run=before&run=after&metric=loss&subject=agent",
            400,
            "invalid_query",
            "metric \"loss\" is run-wide and takes no subject",
        ),
        (
            "run=before&run=after&metric=drift&subject=agent.head",
            404,
            "unknown_subject",
            "none of these runs has reported a norm weight named \"agent.head\"",
        ),
        (
            "run=before&run=after&width=10",
            400,
            "invalid_query",
            "width must lie between 300 and 4000 pixels, got 10",
        ),
        (
            "run=before&run=after&height=tall",
            400,
            "invalid_query",
            "height must be a whole number of pixels, got \"tall\"",
        ),
        (
            "run=before&run=after&from_step=9&to_step=3",
            400,
            "invalid_query",
            "from_step 9 is after to_step 3",
        ),
        (
            "run=before&run=after&colour=red",
            400,
            "invalid_query",
            "unknown query parameter \"colour\"",
        ),
    ] {
        let response = app
            .client
            .get(app.url(&format!("{chart}?{query}")))
            .send()
            .await
            .unwrap();
        let (got, error) = error_of(response).await;
        assert_eq!(got, status, "{query}: {error}");
        assert_eq!(error["code"], code, "{query}: {error}");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains(says), "{query}: {message}");
    }
    let (status, error) = app
        .get_json("/api/v1/charts/compare.jpg?run=before&run=after")
        .await;
    assert_eq!(status, 404);
    assert_eq!(error["error"]["code"], "unknown_chart");

    // The page answers the same mistakes as pages.
    for (query, status, says) in [
        (
            "run=before",
            400,
            "a comparison needs at least 2 runs, got 1",
        ),
        (
            "run=before&run=ghost",
            404,
            "run &quot;ghost&quot; is not registered",
        ),
        (
            "run=before&run=after&metric=accuracy",
            400,
            "unknown metric &quot;accuracy&quot;",
        ),
        (
            "run=before&run=after&width=900",
            400,
            "unknown query parameter &quot;width&quot;",
        ),
    ] {
        let (got, content_type, html) = get_text(&app, &format!("/compare?{query}")).await;
        assert_eq!(got, status, "{query}: {html}");
        assert!(content_type.starts_with("text/html"), "{query}");
        assert!(html.contains(says), "{query}: {html}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_token_guards_the_comparison() {
    let app = TestApp::spawn_with(|c| c.read_token = Some("r34d".into())).await;
    three_runs(&app).await;
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let chart = app.url("/api/v1/charts/compare.svg?run=before&run=after");
    let (status, error) = error_of(client.get(&chart).send().await.unwrap()).await;
    assert_eq!(status, 401);
    assert_eq!(error["code"], "unauthorized");
    let ok = client.get(&chart).bearer_auth("r34d").send().await.unwrap();
    assert_eq!(ok.status(), 200);
    // The page sends a browser to log in, and back.
    let page = client
        .get(app.url("/compare?run=before&run=after"))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 303);
    assert_eq!(
        page.headers()[header::LOCATION],
        "/login?next=%2Fcompare%3Frun%3Dbefore%26run%3Dafter"
    );
}
