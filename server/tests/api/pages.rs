//! The dashboard's pages through a real server: what a person reads is there, every
//! value a client sent is escaped, errors are pages that say what was wrong, and the
//! static route serves only its embedded files.

use crate::common::TestApp;
use serde_json::{Value, json};

async fn get_page(app: &TestApp, path: &str) -> (u16, reqwest::header::HeaderMap, String) {
    let response = reqwest::get(app.url(path)).await.unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    (status, headers, response.text().await.unwrap())
}

fn content_type(headers: &reqwest::header::HeaderMap) -> &str {
    headers["content-type"].to_str().unwrap()
}

/// A run named with markup, whose qwen group never gets a gradient.
async fn hostile_cut_run(app: &TestApp) {
    let status = app
        .register(
            "cut",
            &json!({
                "name": "<script>alert('name')</script>",
                "precision": {"param_dtype": "bf16"},
                "params": [
                    {"name": "qwen.layers.0.input_layernorm.weight", "role": "norm", "dtype": "bf16", "shape": [8]},
                    {"name": "agent.head.weight", "role": "linear", "dtype": "f32", "shape": [4, 8]}],
                "config": {"note": "</pre><img src=x onerror=alert(1)>"}}),
        )
        .await
        .status();
    assert_eq!(status, 201);
    let mut steps: Vec<Value> = (0..60)
        .map(|s| json!({"step": s, "loss": 2.0, "lr": 3e-4,
            "modules": [{"module": "qwen.layers.0.input_layernorm", "grad_norm": null, "hook_hits": 0},
                        {"module": "agent.head", "grad_norm": 0.5, "hook_hits": 1}]}))
        .collect();
    // Where the client saw the cut, from a file whose name is markup.
    steps[0]["graph_cuts"] = json!([{"module": "qwen", "kind": "no_grad", "group": "qwen",
        "stack": [{"file": "<img src=x>.py", "line": 87, "function": "encode"},
                  {"file": "train.py", "line": 112, "function": "forward"}]}]);
    assert_eq!(
        app.post_steps("cut", &Value::Array(steps)).await.status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_page_lists_runs_with_status_and_the_open_alerts() {
    let app = TestApp::spawn().await;
    let (status, _, empty) = get_page(&app, "/").await;
    assert_eq!(status, 200);
    assert!(empty.contains("No runs yet"), "{empty}");

    hostile_cut_run(&app).await;
    app.register("quiet", &json!({"params": []})).await;
    let (status, headers, html) = get_page(&app, "/").await;
    assert_eq!(status, 200);
    assert!(content_type(&headers).starts_with("text/html"));
    assert!(
        headers["content-security-policy"]
            .to_str()
            .unwrap()
            .contains("script-src 'self'")
    );
    // The run with a critical alert comes first, with the alert's title.
    let cut = html
        .find(r#"data-run-id="cut""#)
        .expect("the cut run is listed");
    let quiet = html
        .find(r#"data-run-id="quiet""#)
        .expect("the quiet run is listed");
    assert!(cut < quiet, "the unhealthy run is listed first");
    assert!(html.contains("Backward never reaches qwen"), "{html}");
    assert!(html.contains("1 critical"));
    assert!(html.contains(r#"class="status status-live""#));
    // The name is shown, as text.
    assert!(
        html.contains("&lt;script&gt;alert(&#39;name&#39;)&lt;/script&gt;")
            || html.contains("&lt;script&gt;alert('name')&lt;/script&gt;"),
        "{html}"
    );
    assert!(!html.contains("<script>alert"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_page_shows_alerts_charts_modules_and_registration_escaped() {
    let app = TestApp::spawn().await;
    hostile_cut_run(&app).await;
    let (_, alerts) = app
        .get_json("/api/v1/runs/cut/alerts?status=open&kind=grad_stuck_zero")
        .await;
    let alert = &alerts["alerts"][0];
    assert_eq!(alert["kind"], "grad_stuck_zero");

    let (status, _, html) = get_page(&app, "/runs/cut").await;
    assert_eq!(status, 200);
    // The alert, worded as the API words it (escaped for HTML).
    for field in ["title", "detail", "fix"] {
        let text = alert[field].as_str().unwrap();
        let escaped = text
            .replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
            .replace('"', "&quot;");
        assert!(
            html.contains(&escaped),
            "the page lacks the alert's {field}: {text}"
        );
    }
    // Charts over the whole run so far, the module table, the registration.
    assert!(
        html.contains(r#"src="/api/v1/runs/cut/charts/grad-flow.svg?width=1200&amp;to_step=59""#),
        "{html}"
    );
    assert!(html.contains("charts/group-grad-norms.svg"));
    assert!(
        !html.contains("charts/scaler.svg"),
        "no scaler chart without a scaler"
    );
    assert!(html.contains(r#"data-module="qwen.layers.0.input_layernorm""#));
    assert!(html.contains("no gradient: backward never reached it"));
    assert!(html.contains("5.00e-1"));
    assert!(html.contains("2 tensors, 40 elements"));
    // Where the graph was cut, as the client saw it.
    assert!(
        html.contains(
            "<strong>Where: </strong><code>&lt;img src=x&gt;.py:87 in encode</code>, called from \
             <code>train.py:112 in forward</code>"
        ),
        "{html}"
    );
    // What the client sent is text, never markup.
    assert!(!html.contains("<script>alert"));
    assert!(!html.contains("<img src=x"));
    assert!(html.contains("&lt;/pre&gt;&lt;img src=x onerror=alert(1)&gt;"));

    // A step range goes into the charts and stays in the form.
    let (status, _, ranged) = get_page(&app, "/runs/cut?from_step=10&to_step=20").await;
    assert_eq!(status, 200);
    assert!(ranged.contains("grad-flow.svg?width=1200&amp;from_step=10&amp;to_step=20"));
    assert!(
        ranged.contains(r#"name="from_step" min="0" step="1" inputmode="numeric" value="10""#),
        "{ranged}"
    );
    // An emptied form field means "no bound".
    let (status, _, _) = get_page(&app, "/runs/cut?from_step=&to_step=").await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_module_reads_frozen_not_unmeasured() {
    let app = TestApp::spawn().await;
    let registration = json!({"params": [
        {"name": "encoder.w", "requires_grad": false},
        {"name": "head.w"},
        {"name": "probe.w"}
    ]});
    assert_eq!(app.register("frozen", &registration).await.status(), 201);
    let step = json!([{"step": 0, "loss": 1.0,
        "modules": [{"module": "head", "grad_norm": 0.5, "hook_hits": 1}]}]);
    assert_eq!(app.post_steps("frozen", &step).await.status(), 200);
    let (status, _, html) = get_page(&app, "/runs/frozen").await;
    assert_eq!(status, 200);
    let row = |module: &str| {
        let at = html
            .find(&format!("data-module=\"{module}\""))
            .unwrap_or_else(|| panic!("no row for {module}: {html}"));
        html[at..at + html[at..].find("</tr>").unwrap()].to_owned()
    };
    assert!(
        row("encoder").contains("frozen (requires_grad=False)"),
        "{}",
        row("encoder")
    );
    // A trainable module that was not reported is still "not measured".
    assert!(row("probe").contains("not measured"), "{}", row("probe"));
    assert!(!row("head").contains("not measured"), "{}", row("head"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_errors_are_pages_that_say_what_was_wrong() {
    let app = TestApp::spawn().await;
    hostile_cut_run(&app).await;
    let (status, headers, html) = get_page(&app, "/runs/nope").await;
    assert_eq!(status, 404);
    assert!(content_type(&headers).starts_with("text/html"));
    assert!(
        html.contains("run &quot;nope&quot; is not registered"),
        "{html}"
    );
    let (status, _, html) = get_page(&app, "/runs/cut?from_step=ten").await;
    assert_eq!(status, 400);
    assert!(html.contains("from_step must be a step number"), "{html}");
    let (status, _, html) = get_page(&app, "/runs/cut?from_step=30&to_step=20").await;
    assert_eq!(status, 400);
    assert!(html.contains("from_step 30 is after to_step 20"), "{html}");
    let (status, _, _) = get_page(&app, "/runs/bad%20id").await;
    assert_eq!(status, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_files_are_only_the_embedded_ones() {
    let app = TestApp::spawn().await;
    let (status, headers, css) = get_page(&app, "/static/gradflow.css").await;
    assert_eq!(status, 200);
    assert!(content_type(&headers).starts_with("text/css"));
    assert!(css.contains(".alert"));
    let (status, headers, js) = get_page(&app, "/static/dashboard.js").await;
    assert_eq!(status, 200);
    assert!(content_type(&headers).starts_with("text/javascript"));
    assert!(js.contains("EventSource"));
    for path in [
        "/static/..%2F..%2FCargo.toml",
        "/static/%2e%2e%2fserver%2fsrc%2fmain.rs",
        "/static/../Cargo.toml",
        "/static/nope.js",
        "/static/",
    ] {
        let (status, _, body) = get_page(&app, path).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert!(
            !body.contains("[package]") && !body.contains("fn main"),
            "{path}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_run_says_so_until_it_sends_again() {
    let app = TestApp::spawn().await;
    hostile_cut_run(&app).await;
    let (_, run) = app.get_json("/api/v1/runs/cut").await;
    assert_eq!(run["status"], "live");
    assert!(run["finished_at"].is_null());
    let response = reqwest::Client::new()
        .post(app.url("/api/v1/runs/cut/finish"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let (_, run) = app.get_json("/api/v1/runs/cut").await;
    assert_eq!(run["status"], "finished");
    let (_, runs) = app.get_json("/api/v1/runs").await;
    assert_eq!(runs["runs"][0]["status"], "finished");
    let (_, html) = (0, get_page(&app, "/").await.2);
    assert!(html.contains(r#"class="status status-finished""#));
    // A resumed run is live again.
    let more = json!([{"step": 60, "loss": 1.0}]);
    assert_eq!(app.post_steps("cut", &more).await.status(), 200);
    let (_, run) = app.get_json("/api/v1/runs/cut").await;
    assert_eq!(run["status"], "live");
    let missing = reqwest::Client::new()
        .post(app.url("/api/v1/runs/nope/finish"))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
}

/// A two-rank run named with markup: rank 1 straggles (a `rank_straggler` alert on
/// `rank 1`), and one module's name is markup.
async fn hostile_two_rank_run(app: &TestApp) {
    for rank in 0..2 {
        let status = app
            .register(
                "ddp",
                &json!({"name": "<b>ddp</b>", "world_size": 2, "rank": rank,
                    "params": [{"name": "shared.proj.weight", "shape": [8, 8]}]}),
            )
            .await
            .status();
        assert!(status.is_success(), "rank {rank}: {status}");
    }
    for rank in 0..2u32 {
        let records: Vec<Value> = (0..30)
            .map(|s| json!({"step": s, "rank": rank, "loss": 1.0,
                "step_time": if rank == 1 { 0.35 } else { 0.1 },
                "modules": [{"module": "shared.proj", "grad_norm": 0.5, "hook_hits": 1},
                            {"module": "<img src=x onerror=alert(1)>", "grad_norm": 0.2, "hook_hits": 1}]}))
            .collect();
        assert_eq!(
            app.post_steps("ddp", &Value::Array(records)).await.status(),
            200
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_page_shows_each_rank_its_charts_and_alerts_escaped() {
    let app = TestApp::spawn().await;
    hostile_two_rank_run(&app).await;
    // The run page leads there.
    let (status, _, run_page) = get_page(&app, "/runs/ddp").await;
    assert_eq!(status, 200);
    assert!(
        run_page.contains(r#"<a href="/runs/ddp/ranks">2 ranks, each on its own</a>"#),
        "{run_page}"
    );

    let (status, headers, html) = get_page(&app, "/runs/ddp/ranks").await;
    assert_eq!(status, 200);
    assert!(content_type(&headers).starts_with("text/html"));
    assert!(
        headers["content-security-policy"]
            .to_str()
            .unwrap()
            .contains("script-src 'self'")
    );
    assert!(
        html.contains(r#"data-page="ranks" data-run-id="ddp""#),
        "{html}"
    );
    // Back to the run, under its name (as text).
    assert!(
        html.contains(r#"<a href="/runs/ddp">&lt;b&gt;ddp&lt;/b&gt;</a>"#),
        "{html}"
    );
    // A row per rank; the straggler's stands out, with its alert's title.
    let (_, alerts) = app
        .get_json("/api/v1/runs/ddp/alerts?kind=rank_straggler&status=open")
        .await;
    let alert = &alerts["alerts"][0];
    assert_eq!(alert["subject"], "rank 1");
    assert!(html.contains(r#"<tr data-rank="0">"#), "{html}");
    let row = &html[html
        .find(r#"<tr class="attention" data-rank="1">"#)
        .expect("rank 1 stands out")..];
    let row = &row[..row.find("</tr>").unwrap()];
    assert!(row.contains("350.0 ms"), "{row}");
    assert!(row.contains(alert["title"].as_str().unwrap()), "{row}");
    // The alert's card, worded as the API words it.
    assert!(html.contains(&format!(r#"data-alert-id="{}""#, alert["id"])));
    assert!(html.contains(alert["fix"].as_str().unwrap()));
    // Both charts, up to the last step, the first module chosen.
    assert!(
        html.contains(
            r#"src="/api/v1/runs/ddp/charts/ranks.svg?metric=step_time&amp;to_step=29&amp;width=1200""#
        ),
        "{html}"
    );
    assert!(html.contains(
        r#"src="/api/v1/runs/ddp/charts/ranks.svg?metric=grad_norm&amp;subject=shared.proj&amp;to_step=29&amp;width=1200""#
    ));
    // The module named with markup is offered as text, and drawn when chosen.
    assert!(html.contains(r#"<option value="&lt;img src=x onerror=alert(1)&gt;">&lt;img src=x onerror=alert(1)&gt;</option>"#), "{html}");
    assert!(!html.contains("<img src=x"));
    assert!(!html.contains("<b>ddp"));
    let (status, _, chosen) = get_page(
        &app,
        "/runs/ddp/ranks?module=%3Cimg+src%3Dx+onerror%3Dalert%281%29%3E",
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        chosen.contains("subject=%3Cimg+src%3Dx+onerror%3Dalert%281%29%3E"),
        "{chosen}"
    );
    assert!(chosen.contains(r#"<option value="&lt;img src=x onerror=alert(1)&gt;" selected>"#));
    assert!(!chosen.contains("<img src=x"));
    // A module the run never reported: said so, and the first one shown.
    let (status, _, unknown) = get_page(&app, "/runs/ddp/ranks?module=%3Cscript%3E").await;
    assert_eq!(status, 200);
    assert!(
        unknown.contains(
            "This run has reported no module named “&lt;script&gt;”: showing shared.proj."
        ),
        "{unknown}"
    );
    assert!(!unknown.contains("<script>"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_page_of_a_single_process_and_of_no_run() {
    let app = TestApp::spawn().await;
    hostile_cut_run(&app).await;
    let (_, _, run_page) = get_page(&app, "/runs/cut").await;
    assert!(
        !run_page.contains("/runs/cut/ranks"),
        "a single process has no ranks to list"
    );
    let (status, _, html) = get_page(&app, "/runs/cut/ranks").await;
    assert_eq!(status, 200);
    assert!(html.contains("This run is a single process"), "{html}");
    assert!(html.contains(r#"<tr data-rank="0">"#), "{html}");
    let (status, _, html) = get_page(&app, "/runs/ghost/ranks").await;
    assert_eq!(status, 404);
    assert!(
        html.contains("run &quot;ghost&quot; is not registered"),
        "{html}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_norm_chart_caption_names_the_dashed_lines_only_when_drawn() {
    let app = TestApp::spawn().await;
    crate::charts::hf_run(&app, "f32", "f32").await;
    crate::charts::hf_run(&app, "bf16", "bf16").await;
    let (_, _, f32_page) = get_page(&app, "/runs/f32").await;
    assert!(
        f32_page.contains("no rounding line is drawn"),
        "f32 caption"
    );
    assert!(
        !f32_page.contains("dashed"),
        "an f32 run has no dashed line"
    );
    let (_, _, bf16_page) = get_page(&app, "/runs/bf16").await;
    assert!(
        bf16_page.contains("The black dashed line is the smallest change bf16 can make"),
        "bf16 caption"
    );
    assert!(bf16_page.contains("The grey dashed line is one optimizer step"));
    assert!(bf16_page.contains("charts/norm-drift.svg?width=600"));
}
