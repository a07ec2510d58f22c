//! The chart endpoints through a real server: every chart is SVG with its title,
//! axis labels and legend; alert episodes are shaded and labelled; PNG starts with
//! the PNG signature; unknown runs and charts are 404, bad parameters 400.

use crate::common::TestApp;
use serde_json::{Value, json};

/// A run whose qwen group gets no gradient for 60 steps: grad_stuck_zero opens.
async fn cut_run(app: &TestApp) {
    app.register(
        "cut",
        &json!({"params": [
        {"name": "qwen.layers.0.input_layernorm.weight", "role": "norm", "dtype": "bf16"},
        {"name": "agent.head.weight"}], "optimizer": {"name": "adamw", "lr": 3e-4}}),
    )
    .await;
    let steps: Vec<Value> = (0..60)
        .map(|s| json!({"step": s, "loss": 2.0 - s as f64 * 0.01, "lr": 3e-4,
            "modules": [{"module": "qwen.layers.0.input_layernorm", "grad_norm": null, "hook_hits": 0},
                        {"module": "agent.head", "grad_norm": 0.5, "hook_hits": 1}],
            "params": [{"name": "qwen.layers.0.input_layernorm.weight", "grad_norm": 0.01, "update_norm": 0.0, "drift": 0.0, "mean": 1.0}],
            "scaler": {"scale": 65536.0, "found_inf": s == 7, "step_skipped": s == 7}}))
        .collect();
    assert_eq!(
        app.post_steps("cut", &Value::Array(steps)).await.status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_chart_is_svg_with_title_axes_and_legend() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("gradflow_server=error")
        .try_init();
    let app = TestApp::spawn().await;
    cut_run(&app).await;
    for (chart, must_contain) in [
        (
            "grad-flow",
            vec![
                "Gradient flow",
                "no gradient: backward never reached",
                "exactly 0",
                "NaN / Inf",
                "step",
                "[qwen]",
            ],
        ),
        (
            "group-grad-norms",
            vec![
                "Gradient norm by group",
                "shaded: grad_stuck_zero: qwen",
                "step",
                "qwen",
                "agent",
            ],
        ),
        (
            "norm-drift",
            vec![
                "Norm weights",
                "smallest change bf16 can make just below 1.0",
                "optimizer step",
            ],
        ),
        ("scaler", vec!["Loss scale", "found_inf", "step"]),
        (
            "loss",
            vec!["Loss and learning rate", "learning rate", "loss"],
        ),
        ("gpu", vec!["Nothing reported for this chart"]),
    ] {
        let response = app
            .client
            .get(app.url(&format!("/api/v1/runs/cut/charts/{chart}.svg?width=600")))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{chart}");
        assert_eq!(response.headers()["content-type"], "image/svg+xml");
        let svg = response.text().await.unwrap();
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{chart}"
        );
        for text in must_contain {
            assert!(svg.contains(text), "{chart} lacks {text:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn png_charts_and_the_errors() {
    let app = TestApp::spawn().await;
    cut_run(&app).await;
    let response = app
        .client
        .get(app.url("/api/v1/runs/cut/charts/grad-flow.png"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "image/png");
    let bytes = response.bytes().await.unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    for (path, status) in [
        ("/api/v1/runs/ghost/charts/loss.svg", 404),
        ("/api/v1/runs/cut/charts/histogram.svg", 404),
        ("/api/v1/runs/cut/charts/loss.jpg", 404),
        ("/api/v1/runs/cut/charts/loss.svg?width=10", 400),
        ("/api/v1/runs/cut/charts/loss.svg?height=99999", 400),
        (
            "/api/v1/runs/cut/charts/loss.svg?from_step=9&to_step=3",
            400,
        ),
        ("/api/v1/runs/cut/charts/loss.svg?colour=red", 400),
    ] {
        let (got, body) = app.get_json(path).await;
        assert_eq!(got, status, "{path}: {body}");
    }
}

/// A run shaped like a Hugging Face causal LM as the Python client reports it:
/// groups `model.embed_tokens`, `model.layers`, `model.norm`, `lm_head`, norm
/// weights with drift and update norm, a constant lr. In bf16 at lr 1e-5 the norm
/// weights are frozen (every update rounds away).
pub(crate) async fn hf_run(app: &TestApp, run_id: &str, dtype: &str) {
    let mut modules = vec![(
        "model.embed_tokens".to_owned(),
        "model.embed_tokens",
        "embedding",
    )];
    for layer in 0..2 {
        modules.push((
            format!("model.layers.{layer}.input_layernorm"),
            "model.layers",
            "norm",
        ));
        for proj in [
            "self_attn.q_proj",
            "self_attn.o_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ] {
            modules.push((
                format!("model.layers.{layer}.{proj}"),
                "model.layers",
                "linear",
            ));
        }
    }
    modules.push(("model.norm".to_owned(), "model.norm", "norm"));
    modules.push(("lm_head".to_owned(), "lm_head", "linear"));
    let lr = if dtype == "bf16" { 1e-5 } else { 1e-3 };
    let params: Vec<Value> = modules
        .iter()
        .map(|(m, g, role)| json!({"name": format!("{m}.weight"), "module": m, "group": g, "role": role, "dtype": dtype}))
        .collect();
    let response = app
        .register(
            run_id,
            &json!({"precision": {"param_dtype": dtype}, "optimizer": {"name": "adamw", "lr": lr}, "params": params}),
        )
        .await;
    assert!(response.status().is_success(), "{}", response.status());
    let frozen = dtype == "bf16";
    let steps: Vec<Value> = (0..80u64)
        .map(|s| {
            json!({"step": s, "loss": 4.0 - s as f64 * 0.01, "lr": lr,
            "modules": modules.iter().enumerate().map(|(i, (m, _, _))| json!({"module": m, "grad_norm": 0.02 * (1.0 + i as f64 / 10.0), "hook_hits": 1})).collect::<Vec<_>>(),
            "params": modules.iter().filter(|(_, _, role)| *role == "norm").map(|(m, _, _)| json!({
                "name": format!("{m}.weight"), "grad_norm": 3e-3, "mean": 1.0,
                "update_norm": if frozen { 0.0 } else { lr },
                "drift": if frozen { 0.0 } else { lr * (s as f64 + 1.0).sqrt() }})).collect::<Vec<_>>()})
        })
        .collect();
    assert_eq!(
        app.post_steps(run_id, &Value::Array(steps)).await.status(),
        200
    );
}

/// A text element of an SVG chart: where plotters put it, and what it says.
#[derive(Debug)]
struct SvgText {
    x: f64,
    y: f64,
    font_px: f64,
    text: String,
}

fn number_attr(element: &str, name: &str) -> f64 {
    let start = element.find(&format!(" {name}=\"")).expect(name) + name.len() + 3;
    let end = start + element[start..].find('"').unwrap();
    element[start..end].parse().unwrap()
}

fn texts(svg: &str) -> Vec<SvgText> {
    svg.split("<text")
        .skip(1)
        .map(|element| {
            let (tag, rest) = element.split_once('>').unwrap();
            SvgText {
                x: number_attr(tag, "x"),
                y: number_attr(tag, "y"),
                font_px: number_attr(tag, "font-size"),
                text: rest.split("</text>").next().unwrap().trim().to_owned(),
            }
        })
        .collect()
}

/// The points of each `<polyline>` drawn in `stroke`.
fn polylines(svg: &str, stroke: &str) -> Vec<Vec<(f64, f64)>> {
    svg.split("<polyline")
        .skip(1)
        .filter(|e| e.contains(&format!("stroke=\"{stroke}\"")))
        .map(|e| {
            let start = e.find("points=\"").unwrap() + 8;
            e[start..]
                .split('"')
                .next()
                .unwrap()
                .split_whitespace()
                .map(|p| {
                    let (x, y) = p.split_once(',').unwrap();
                    (x.parse().unwrap(), y.parse().unwrap())
                })
                .collect()
        })
        .collect()
}

async fn svg(app: &TestApp, path: &str) -> String {
    let response = app.client.get(app.url(path)).send().await.unwrap();
    assert_eq!(response.status(), 200, "{path}");
    response.text().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hf_model_s_group_labels_keep_clear_of_its_module_labels() {
    let app = TestApp::spawn().await;
    hf_run(&app, "hf", "f32").await;
    let svg = svg(&app, "/api/v1/runs/hf/charts/grad-flow.svg?width=1200").await;
    let texts = texts(&svg);
    let groups: Vec<&SvgText> = texts.iter().filter(|t| t.text.starts_with('[')).collect();
    let names: Vec<&str> = groups.iter().map(|t| t.text.as_str()).collect();
    assert_eq!(
        names,
        [
            "[model.embed_tokens]",
            "[model.layers]",
            "[model.norm]",
            "[lm_head]"
        ]
    );
    // Bold DejaVu Sans is wider than 0.55 em a character: every group label ends
    // left of every module label.
    let group_end = groups
        .iter()
        .map(|t| t.x + t.text.chars().count() as f64 * 0.55 * t.font_px)
        .fold(0.0, f64::max);
    for module in [
        "0.self_attn.q_proj",
        "1.mlp.down_proj",
        "model.norm",
        "lm_head",
    ] {
        let label = texts
            .iter()
            .find(|t| t.text == module)
            .unwrap_or_else(|| panic!("no row label {module}"));
        assert!(
            label.x > group_end,
            "{module} at x {} under the group labels ending at {group_end}",
            label.x
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lr_axis_labels_each_tick_once() {
    let app = TestApp::spawn().await;
    hf_run(&app, "f32", "f32").await;
    hf_run(&app, "bf16", "bf16").await;
    for run in ["f32", "bf16"] {
        let svg = svg(
            &app,
            &format!("/api/v1/runs/{run}/charts/loss.svg?width=600"),
        )
        .await;
        // The right axis's labels: numbers right of the plot.
        let ticks: Vec<String> = texts(&svg)
            .into_iter()
            .filter(|t| t.x > 500.0 && t.text.parse::<f64>().is_ok())
            .map(|t| t.text)
            .collect();
        assert!(ticks.len() >= 3, "{run}: {ticks:?}");
        let unique: std::collections::BTreeSet<&String> = ticks.iter().collect();
        assert_eq!(
            unique.len(),
            ticks.len(),
            "{run}: a tick label repeats: {ticks:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_bf16_norm_chart_shows_the_lr_under_the_smallest_change_and_every_zero() {
    let app = TestApp::spawn().await;
    hf_run(&app, "bf16", "bf16").await;
    let svg = svg(
        &app,
        "/api/v1/runs/bf16/charts/norm-drift.svg?width=600&height=520",
    )
    .await;
    let texts = texts(&svg);
    let floor = texts
        .iter()
        .find(|t| t.text == "0" && t.x < 83.0)
        .expect("the 0 tick of the log axis");
    let top = texts
        .iter()
        .find(|t| t.text.starts_with("Norm weights"))
        .expect("the title");
    // The dashed references: black the smallest change, grey the lr below it.
    let level = |stroke: &str| {
        let dashes = polylines(&svg, stroke);
        let ys: Vec<f64> = dashes
            .iter()
            .filter(|d| d.len() == 2 && d[0].1 == d[1].1 && d[1].0 - d[0].0 == 6.0)
            .map(|d| d[0].1)
            .collect();
        assert!(ys.len() > 10, "{stroke}: no dashed line");
        ys[0]
    };
    let (smallest, lr) = (level("#000000"), level("#787878"));
    assert!(
        top.y < smallest && smallest < lr && lr < floor.y,
        "title {}, smallest change {smallest}, lr {lr}, floor {}",
        top.y,
        floor.y
    );
    // The episodes' labels are not struck through by either line.
    for label in texts
        .iter()
        .filter(|t| t.text.starts_with("norm_weight_frozen:"))
    {
        for line in [smallest, lr] {
            assert!(
                line < label.y - 5.0 || line > label.y + label.font_px + 2.0,
                "{:?} at y {} crossed by a line at {line}",
                label.text,
                label.y
            );
        }
    }
    // Four lines at 0 (drift and update of two groups), each seen on its own.
    let zero_levels: std::collections::BTreeSet<i64> = ["#1F77B4", "#FF7F0E", "#2CA02C", "#D62728"]
        .iter()
        .flat_map(|stroke| polylines(&svg, stroke))
        .filter(|l| l.len() > 2)
        .map(|l| l[0].1 as i64)
        .collect();
    assert_eq!(zero_levels.len(), 4, "{zero_levels:?}");
    // The legend is under the plot: no line point under its box.
    let legend = svg
        .split('<')
        .find(|e| e.starts_with("rect") && e.contains("opacity=\"0.85\""))
        .expect("the legend's box");
    let legend_top = number_attr(legend, "y");
    for line in polylines(&svg, "#1F77B4").iter().filter(|l| l.len() > 2) {
        assert!(
            line.iter().all(|(_, y)| *y < legend_top),
            "a line under the legend"
        );
    }
}

/// A run whose second attention layer's logits climb past QK-Clip's τ while the
/// first stays low (attention_logit_growth opens on the second), with an Adam
/// update per module and an MoE layer's loads.
async fn logit_growth_run(app: &TestApp) {
    let registration = json!({"params": [
        {"name": "layers.0.attn.weight"}, {"name": "layers.1.attn.weight"}],
        "signals": {"attention": 1, "adam": 1, "moe": 1}});
    assert_eq!(app.register("logits", &registration).await.status(), 201);
    let steps: Vec<Value> = (0..30)
        .map(|s| {
            let grown = 2.0 * 1.3f64.powi(s);
            json!({"step": s, "loss": 2.0,
            "modules": [
                {"module": "layers.0.attn", "grad_norm": 0.5, "attn_max_logit": 4.0,
                 "adam": {"updated": 64, "below_eps": 0.0, "update_rms": 0.5, "update_absmax": 1.0}},
                {"module": "layers.1.attn", "grad_norm": 0.5, "attn_max_logit": grown,
                 "adam": {"updated": 64, "below_eps": 0.0, "update_rms": 0.25, "update_absmax": 1.0}}],
            "moe": [{"module": "layers.0.mlp.gate", "tokens_per_expert": [12, 2, 1, 1]}]})
        })
        .collect();
    assert_eq!(
        app.post_steps("logits", &Value::Array(steps))
            .await
            .status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_signal_charts_draw_a_line_per_module_and_stress_the_alerts_layer() {
    let app = TestApp::spawn().await;
    logit_growth_run(&app).await;
    let (_, alerts) = app.get_json("/api/v1/alerts?run_id=logits").await;
    let kinds: Vec<(&str, &str)> = alerts["alerts"]
        .as_array()
        .expect("alerts")
        .iter()
        .map(|a| (a["kind"].as_str().unwrap(), a["subject"].as_str().unwrap()))
        .collect();
    assert!(
        kinds.contains(&("attention_logit_growth", "layers.1.attn")),
        "{kinds:?}"
    );
    for (chart, must_contain, must_not) in [
        (
            "attention-logits",
            vec![
                "Largest attention logit by module",
                "100: QK-Clip τ, warning",
                "1000: critical",
                "shaded: attention_logit_growth: layers.1.attn",
                "layers.0.attn",
                "layers.1.attn (attention_logit_growth)",
            ],
            "layers.0.attn (",
        ),
        (
            "adam-updates",
            vec![
                "Adam update RMS over the lr by module",
                "layers.0.attn",
                "layers.1.attn",
            ],
            "(adam_update_spike)",
        ),
        (
            "moe-loads",
            vec![
                "Busiest expert",
                "layers.0.mlp.gate",
                "half the tokens on one expert",
            ],
            "shaded:",
        ),
    ] {
        let svg = text(
            &app,
            &format!("/api/v1/runs/logits/charts/{chart}.svg?width=700"),
        )
        .await;
        for text in must_contain {
            assert!(svg.contains(text), "{chart} lacks {text:?}");
        }
        assert!(!svg.contains(must_not), "{chart} has {must_not:?}");
    }
    let logits = text(&app, "/api/v1/runs/logits/charts/attention-logits.svg").await;
    assert!(
        logits.contains("stroke-width=\"4\""),
        "the alert's layer is drawn thicker"
    );

    // The run page shows the charts of the signals a run reported, and only those.
    let shown = text(&app, "/runs/logits").await;
    for id in [
        "chart-attention-logits",
        "chart-adam-updates",
        "chart-moe-loads",
    ] {
        assert!(shown.contains(id), "the run page lacks {id}");
    }
    cut_run(&app).await;
    let plain = text(&app, "/runs/cut").await;
    assert!(plain.contains("chart-grad-flow"));
    assert!(!plain.contains("chart-attention-logits"));
}

/// The body of a GET that must answer 200.
async fn text(app: &TestApp, path: &str) -> String {
    let response = app.client.get(app.url(path)).send().await.unwrap();
    assert_eq!(response.status(), 200, "{path}");
    response.text().await.unwrap()
}
