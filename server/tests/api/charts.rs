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
