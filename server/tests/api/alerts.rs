//! Diagnosis through the real HTTP API: a scenario for every alert kind, the filters of
//! the alerts endpoints, `open_alerts`, the restart rule, and an SSE listener that
//! hears the alert the moment a scenario crosses its threshold.

use std::time::Duration;

use crate::common::TestApp;
use serde_json::{Value, json};

/// A hybrid model: qwen (4 modules, 2 norm weights) feeding an agent (2 modules).
fn hybrid(precision: Value, optimizer: Value) -> Value {
    json!({
        "name": "qwen-agent",
        "precision": precision,
        "optimizer": optimizer,
        "params": [
            {"name": "qwen.embed_tokens.weight", "role": "embedding"},
            {"name": "qwen.layers.0.input_layernorm.weight", "role": "norm", "shape": [64]},
            {"name": "qwen.layers.0.self_attn.q_proj.weight", "role": "linear"},
            {"name": "qwen.norm.weight", "role": "norm", "shape": [64]},
            {"name": "agent.encoder.weight", "role": "linear"},
            {"name": "agent.head.weight", "role": "linear"}
        ]
    })
}

fn healthy_registration() -> Value {
    hybrid(
        json!({"param_dtype": "f32", "loss_scaler": "none"}),
        json!({"name": "adamw", "lr": 3e-4, "weight_decay": 0.01}),
    )
}

/// One step of the hybrid model. `qwen`: the Qwen modules' (grad_norm, hook_hits).
fn step(step: u64, qwen: (Value, u32), norm_update: f64) -> Value {
    let (grad, hooks) = qwen;
    json!({
        "step": step, "loss": 2.0, "lr": 3e-4,
        "modules": [
            {"module": "qwen.embed_tokens", "grad_norm": grad, "hook_hits": hooks},
            {"module": "qwen.layers.0.input_layernorm", "grad_norm": grad, "hook_hits": hooks},
            {"module": "qwen.layers.0.self_attn.q_proj", "grad_norm": grad, "hook_hits": hooks},
            {"module": "qwen.norm", "grad_norm": grad, "hook_hits": hooks},
            {"module": "agent.encoder", "grad_norm": 0.8, "hook_hits": 1},
            {"module": "agent.head", "grad_norm": 1.1, "hook_hits": 1}
        ],
        "params": [
            {"name": "qwen.layers.0.input_layernorm.weight", "grad_norm": 3.1e-3, "update_norm": norm_update, "drift": 0.0, "mean": 1.0},
            {"name": "qwen.norm.weight", "grad_norm": 2.0e-3, "update_norm": norm_update, "drift": 0.0, "mean": 1.0}
        ]
    })
}

fn healthy(s: u64) -> Value {
    step(s, (json!(0.02), 1), 1e-4)
}

fn detached(s: u64) -> Value {
    step(s, (Value::Null, 0), 1e-4)
}

/// The alerts a query returns. First-step hints (info, on the second step of many
/// runs here, tested on their own) are left out unless the query asks for them.
async fn alerts(app: &TestApp, query: &str) -> Vec<Value> {
    let (status, body) = app.get_json(&format!("/api/v1/alerts?{query}")).await;
    assert_eq!(status, 200, "{body}");
    let all = body["alerts"].as_array().unwrap().clone();
    if query.contains("first_step_hint") || query.contains("severity=info") {
        return all;
    }
    all.into_iter()
        .filter(|a| a["kind"] != "first_step_hint")
        .collect()
}

async fn stream(app: &TestApp, run: &str, records: Vec<Value>) {
    for chunk in records.chunks(25) {
        let response = app.post_steps(run, &Value::Array(chunk.to_vec())).await;
        assert_eq!(response.status(), 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_run_raises_nothing() {
    let app = TestApp::spawn().await;
    assert_eq!(
        app.register("ok", &healthy_registration()).await.status(),
        201
    );
    // Qwen zero at step 0 only, as in the original log, then healthy.
    let mut records = vec![detached(0)];
    records.extend((1..200).map(healthy));
    stream(&app, "ok", records).await;
    assert!(alerts(&app, "run_id=ok").await.is_empty());
    // Prompt caching: Qwen back-propagated every 10th step only.
    app.register("cached", &healthy_registration()).await;
    stream(
        &app,
        "cached",
        (0..200)
            .map(|s| if s % 10 == 0 { healthy(s) } else { detached(s) })
            .collect(),
    )
    .await;
    assert!(alerts(&app, "run_id=cached").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detached_prompt_opens_grad_stuck_zero_on_the_50th_step_and_resolves() {
    let app = TestApp::spawn().await;
    app.register("cut", &healthy_registration()).await;
    stream(&app, "cut", (0..49).map(detached).collect()).await;
    assert!(
        alerts(&app, "run_id=cut").await.is_empty(),
        "not on the 49th zero step"
    );
    // Only the first-step hint so far: info, from step 1, naming Qwen's modules.
    let early = alerts(&app, "run_id=cut&kind=first_step_hint").await;
    assert_eq!(early.len(), 1, "{early:?}");
    assert_eq!(
        (
            &early[0]["kind"],
            &early[0]["severity"],
            &early[0]["opened_step"]
        ),
        (&json!("first_step_hint"), &json!("info"), &json!(1))
    );
    assert_eq!(
        early[0]["evidence"]["no_gradient"],
        json!([
            "qwen.embed_tokens",
            "qwen.layers.0.input_layernorm",
            "qwen.layers.0.self_attn.q_proj",
            "qwen.norm"
        ])
    );
    stream(&app, "cut", vec![detached(49)]).await;
    let open = alerts(&app, "run_id=cut&status=open").await;
    assert_eq!(
        open.len(),
        1,
        "one alert on the group, not one per module: {open:?}"
    );
    let alert = &open[0];
    assert_eq!(alert["kind"], "grad_stuck_zero");
    assert_eq!(alert["subject"], "qwen");
    assert_eq!(alert["severity"], "critical");
    assert_eq!(alert["first_step"], 0);
    assert_eq!(alert["opened_step"], 49);
    assert_eq!(alert["evidence"]["cause"], "backward_not_reached");
    assert!(
        alert["detail"].as_str().unwrap().contains("hook"),
        "{alert}"
    );
    assert!(alert["fix"].as_str().unwrap().contains("detach"), "{alert}");

    stream(&app, "cut", (50..60).map(detached).collect()).await;
    let (_, run) = app.get_json("/api/v1/runs/cut").await;
    assert_eq!(
        run["open_alerts"],
        json!({"critical": 1, "warning": 0, "info": 0})
    );
    assert_eq!(
        alerts(&app, "run_id=cut&kind=grad_stuck_zero").await[0]["last_step"],
        59
    );

    // Healthy again from step 60: the alert resolves once the cut has stayed away
    // for the kind's hold (20 steps), at the first step without it.
    stream(&app, "cut", (60..79).map(healthy).collect()).await;
    assert_eq!(alerts(&app, "run_id=cut&status=open").await.len(), 1);
    stream(&app, "cut", (79..85).map(healthy).collect()).await;
    // The hint ended when grad_stuck_zero confirmed it, on step 49.
    let hint = alerts(&app, "run_id=cut&kind=first_step_hint").await;
    assert_eq!(hint[0]["resolved_step"], 49);
    let resolved = alerts(&app, "run_id=cut&status=resolved&kind=grad_stuck_zero").await;
    assert_eq!(resolved.len(), 1);
    assert_eq!(resolved[0]["resolved_step"], 60);
    assert_eq!(resolved[0]["last_step"], 59);
    assert_eq!(resolved[0]["status"], "resolved");
    let (_, run) = app.get_json("/api/v1/runs/cut").await;
    assert_eq!(run["open_alerts"]["critical"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bf16_norm_weights_that_never_move_are_diagnosed_as_rounding() {
    let app = TestApp::spawn().await;
    let registration = hybrid(
        json!({"param_dtype": "bf16", "compute_dtype": "bf16", "loss_scaler": "none"}),
        json!({"name": "AdamW", "lr": 3e-4, "weight_decay": 0.01}),
    );
    app.register("bf16", &registration).await;
    stream(
        &app,
        "bf16",
        (0..19).map(|s| step(s, (json!(0.02), 1), 0.0)).collect(),
    )
    .await;
    assert!(alerts(&app, "run_id=bf16").await.is_empty());
    stream(&app, "bf16", vec![step(19, (json!(0.02), 1), 0.0)]).await;
    let open = alerts(&app, "run_id=bf16&kind=norm_weight_frozen").await;
    assert_eq!(open.len(), 1, "{open:?}");
    let alert = &open[0];
    assert_eq!(alert["subject"], "qwen");
    assert_eq!(alert["opened_step"], 19);
    assert_eq!(alert["evidence"]["cause"], "low_precision_underflow");
    let detail = alert["detail"].as_str().unwrap();
    assert!(
        detail.contains("1.95e-3, the smallest change bf16 can make just below 1.0"),
        "{detail}"
    );

    // The same story at lr 0.05 is not rounding.
    let registration = hybrid(
        json!({"param_dtype": "bf16"}),
        json!({"name": "AdamW", "lr": 0.05}),
    );
    app.register("bf16-high-lr", &registration).await;
    let records = (0..20)
        .map(|s| {
            let mut r = step(s, (json!(0.02), 1), 0.0);
            r["lr"] = json!(0.05);
            r
        })
        .collect();
    stream(&app, "bf16-high-lr", records).await;
    let open = alerts(&app, "run_id=bf16-high-lr").await;
    assert_eq!(open[0]["evidence"]["cause"], "unknown", "{open:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_checks_fire_before_the_first_step() {
    let app = TestApp::spawn().await;
    let mut registration = hybrid(
        json!({"param_dtype": "bf16", "loss_scaler": "dynamic"}),
        json!({"name": "adamw", "lr": 3e-4}),
    );
    registration["params"][4]["in_optimizer"] = json!(false);
    assert_eq!(app.register("scaler", &registration).await.status(), 201);
    let found = alerts(&app, "run_id=scaler").await;
    let kinds: Vec<&str> = found.iter().map(|a| a["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["scaler_bf16_incompatible", "param_not_in_optimizer"],
        "{found:?}"
    );
    assert_eq!(found[0]["first_step"], Value::Null);
    assert!(
        found[0]["detail"]
            .as_str()
            .unwrap()
            .contains("not implemented for 'BFloat16'")
    );
    assert_eq!(found[1]["subject"], "agent");

    let mut lora = healthy_registration();
    lora["params"][2]["dtype"] = json!("bf16");
    app.register("lora", &lora).await;
    let found = alerts(&app, "run_id=lora").await;
    assert_eq!(found.len(), 1);
    assert_eq!(found[0]["kind"], "dtype_mismatch");
    assert_eq!(found[0]["severity"], "warning");
    // Registering the same body again opens nothing new.
    assert_eq!(app.register("lora", &lora).await.status(), 200);
    assert_eq!(alerts(&app, "run_id=lora").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overflow_streaks_nan_gradients_and_nan_losses() {
    let app = TestApp::spawn().await;
    app.register(
        "fp16",
        &hybrid(
            json!({"param_dtype": "f32", "compute_dtype": "f16", "loss_scaler": "dynamic"}),
            json!({"name": "adamw", "lr": 3e-4}),
        ),
    )
    .await;
    let mut scale = 65536.0;
    // Steps after the streak, for the hold (20 steps) that ends the episode.
    let records: Vec<Value> = (0..32)
        .map(|s| {
            let mut r = healthy(s);
            let inf = (2..12).contains(&s);
            if inf {
                scale /= 2.0;
                r["modules"][0]["grad_norm"] = json!("Infinity");
            }
            r["scaler"] =
                json!({"scale": scale, "growth_tracker": 0, "found_inf": inf, "step_skipped": inf});
            r
        })
        .collect();
    stream(&app, "fp16", records).await;
    let found = alerts(&app, "run_id=fp16").await;
    assert_eq!(
        found.len(),
        1,
        "infinite gradients the scaler caught are not grad_nonfinite: {found:?}"
    );
    assert_eq!(found[0]["kind"], "scaler_overflow_streak");
    assert_eq!(
        (
            found[0]["first_step"].clone(),
            found[0]["opened_step"].clone()
        ),
        (json!(2), json!(11))
    );
    assert_eq!(found[0]["resolved_step"], 12);

    app.register("nan", &healthy_registration()).await;
    let mut records: Vec<Value> = (0..25).map(healthy).collect();
    records[3]["modules"][5]["grad_norm"] = json!("NaN");
    records[4]["loss"] = json!("NaN");
    stream(&app, "nan", records).await;
    let found = alerts(&app, "run_id=nan").await;
    let summary: Vec<(String, String, i64, Option<i64>)> = found
        .iter()
        .map(|a| {
            (
                a["kind"].as_str().unwrap().to_owned(),
                a["subject"].as_str().unwrap().to_owned(),
                a["opened_step"].as_i64().unwrap(),
                a["resolved_step"].as_i64(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("grad_nonfinite".into(), "agent".into(), 3, Some(4)),
            ("loss_nonfinite".into(), "loss".into(), 4, Some(5)),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alert_filters_and_their_errors() {
    let app = TestApp::spawn().await;
    app.register("cut", &healthy_registration()).await;
    stream(&app, "cut", (0..50).map(detached).collect()).await;
    app.register(
        "scaler",
        &hybrid(
            json!({"param_dtype": "bf16", "loss_scaler": "static"}),
            json!({}),
        ),
    )
    .await;
    // A finite loss after the first, for the hold (20 steps) that ends the episode.
    let mut nan: Vec<Value> = (0..21).map(healthy).collect();
    nan[0]["loss"] = json!("Infinity");
    app.register("nan", &healthy_registration()).await;
    stream(&app, "nan", nan).await;

    let all = alerts(&app, "").await;
    assert_eq!(all.len(), 3);
    // Oldest first_step first: the registration alert (no step) leads.
    let order: Vec<&str> = all.iter().map(|a| a["kind"].as_str().unwrap()).collect();
    assert_eq!(
        order,
        [
            "scaler_bf16_incompatible",
            "grad_stuck_zero",
            "loss_nonfinite"
        ]
    );
    assert_eq!(alerts(&app, "status=open").await.len(), 2);
    assert_eq!(alerts(&app, "status=resolved").await.len(), 1);
    assert_eq!(alerts(&app, "status=all").await.len(), 3);
    assert_eq!(alerts(&app, "kind=grad_stuck_zero").await.len(), 1);
    assert_eq!(alerts(&app, "severity=critical&status=open").await.len(), 2);
    // The cut run's first-step hint, resolved when grad_stuck_zero confirmed it.
    assert_eq!(alerts(&app, "severity=info").await.len(), 1);
    assert_eq!(alerts(&app, "run_id=scaler").await.len(), 1);
    let (status, body) = app.get_json("/api/v1/runs/cut/alerts?status=open").await;
    assert_eq!(status, 200);
    assert_eq!(body["alerts"][0]["kind"], "grad_stuck_zero");
    assert_eq!(body["alerts"][0]["run_id"], "cut");

    for (path, status, field) in [
        ("/api/v1/alerts?status=closed", 400, "status"),
        ("/api/v1/alerts?kind=grad_zero", 400, "kind"),
        ("/api/v1/alerts?severity=high", 400, "severity"),
        ("/api/v1/alerts?run_id=a/b", 400, "run_id"),
        ("/api/v1/alerts?run_id=ghost", 404, ""),
        ("/api/v1/runs/ghost/alerts", 404, ""),
        ("/api/v1/alerts?colour=red", 400, ""),
    ] {
        let (got, body) = app.get_json(path).await;
        assert_eq!(got, status, "{path}: {body}");
        assert_eq!(
            body["error"]
                .get("path")
                .and_then(Value::as_str)
                .unwrap_or(""),
            field,
            "{path}"
        );
    }
    let (_, runs) = app.get_json("/api/v1/runs").await;
    let counts: Vec<(String, Value)> = runs["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["run_id"].as_str().unwrap().to_owned(),
                r["open_alerts"].clone(),
            )
        })
        .collect();
    assert!(counts.contains(&(
        "cut".into(),
        json!({"critical": 1, "warning": 0, "info": 0})
    )));
    assert!(counts.contains(&(
        "nan".into(),
        json!({"critical": 0, "warning": 0, "info": 0})
    )));

    // Deleting a run deletes its alerts.
    app.client
        .delete(app.url("/api/v1/runs/cut"))
        .send()
        .await
        .unwrap();
    assert_eq!(alerts(&app, "").await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detector_state_survives_a_restart() {
    let app = TestApp::spawn().await;
    app.register("cut", &healthy_registration()).await;
    stream(&app, "cut", (0..30).map(detached).collect()).await;
    let app = app.restart().await;
    stream(&app, "cut", (30..49).map(detached).collect()).await;
    assert!(
        alerts(&app, "run_id=cut").await.is_empty(),
        "49 zero steps are not 50"
    );
    stream(&app, "cut", vec![detached(49)]).await;
    let open = alerts(&app, "run_id=cut").await;
    assert_eq!(open.len(), 1);
    assert_eq!(
        (
            open[0]["first_step"].clone(),
            open[0]["opened_step"].clone()
        ),
        (json!(0), json!(49))
    );
    // And an open alert still resolves after another restart, one in the middle of
    // its hold included.
    let app = app.restart().await;
    stream(&app, "cut", (50..60).map(healthy).collect()).await;
    let app = app.restart().await;
    stream(&app, "cut", (60..70).map(healthy).collect()).await;
    assert_eq!(
        alerts(&app, "run_id=cut&status=resolved").await[0]["resolved_step"],
        50
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thresholds_come_from_the_server_and_the_registration() {
    let app = TestApp::spawn_with(|c| c.stuck_zero_steps = 10).await;
    app.register("server-wide", &healthy_registration()).await;
    stream(&app, "server-wide", (0..10).map(detached).collect()).await;
    assert_eq!(
        alerts(&app, "run_id=server-wide").await[0]["opened_step"],
        9
    );
    let mut registration = healthy_registration();
    registration["detectors"] = json!({"stuck_zero_steps": 3});
    app.register("per-run", &registration).await;
    stream(&app, "per-run", (0..3).map(detached).collect()).await;
    assert_eq!(alerts(&app, "run_id=per-run").await[0]["opened_step"], 2);
}

/// Reads SSE frames until one with `event: alert` arrives; returns its JSON data.
async fn next_alert_event(response: &mut reqwest::Response) -> Value {
    let mut buffer = String::new();
    loop {
        let chunk = tokio::time::timeout(Duration::from_secs(10), response.chunk())
            .await
            .expect("an event within 10 s")
            .expect("stream readable")
            .expect("stream open");
        buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = buffer.find("\n\n") {
            let frame: String = buffer.drain(..end + 2).collect();
            if frame.lines().any(|l| l == "event: alert") {
                let data: String = frame
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .collect();
                return serde_json::from_str(&data).unwrap();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sse_listener_hears_the_alert_when_the_threshold_is_crossed() {
    let app = TestApp::spawn().await;
    app.register("other", &healthy_registration()).await;
    app.register("cut", &healthy_registration()).await;
    let mut events = app
        .client
        .get(app.url("/api/v1/events?run_id=cut"))
        .send()
        .await
        .unwrap();
    assert_eq!(events.status(), 200);
    assert_eq!(events.headers()["content-type"], "text/event-stream");
    // Another run's alert is not this listener's business.
    stream(
        &app,
        "other",
        vec![{
            let mut r = healthy(0);
            r["loss"] = json!("NaN");
            r
        }],
    )
    .await;
    stream(&app, "cut", (0..50).map(detached).collect()).await;
    // The first-step hint on step 1, then the verdict on step 49, which ends the hint.
    let event = next_alert_event(&mut events).await;
    assert_eq!(
        (
            &event["action"],
            &event["alert"]["kind"],
            &event["alert"]["opened_step"]
        ),
        (&json!("opened"), &json!("first_step_hint"), &json!(1))
    );
    let event = next_alert_event(&mut events).await;
    assert_eq!(event["type"], "alert");
    assert_eq!(event["action"], "opened");
    assert_eq!(event["alert"]["run_id"], "cut");
    assert_eq!(event["alert"]["kind"], "grad_stuck_zero");
    assert_eq!(event["alert"]["opened_step"], 49);
    let event = next_alert_event(&mut events).await;
    assert_eq!(
        (&event["action"], &event["alert"]["kind"]),
        (&json!("resolved"), &json!("first_step_hint"))
    );
    // Announced once the cut has stayed away for the hold (20 steps).
    stream(&app, "cut", (50..70).map(healthy).collect()).await;
    let event = next_alert_event(&mut events).await;
    assert_eq!(event["action"], "resolved");
    assert_eq!(event["alert"]["resolved_step"], 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_not_held_up_by_event_listeners() {
    let mut app = TestApp::spawn().await;
    let _listener = app
        .client
        .get(app.url("/api/v1/events"))
        .send()
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), app.stop())
        .await
        .expect("the server stops within 10 s with a listener connected");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gradflows_own_kinds_fire_through_the_api() {
    let app = TestApp::spawn().await;

    // grad_explosion: one reading thousands of times its level in agent after a calm
    // start (a bad batch).
    app.register("spike", &healthy_registration()).await;
    let mut records: Vec<Value> = (0..51).map(healthy).collect();
    records[30]["modules"][4]["grad_norm"] = json!(5000.0);
    stream(&app, "spike", records).await;
    let found = alerts(&app, "run_id=spike").await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        (found[0]["kind"].as_str(), found[0]["subject"].as_str()),
        (Some("grad_explosion"), Some("agent"))
    );
    assert_eq!(
        (
            found[0]["opened_step"].clone(),
            found[0]["resolved_step"].clone()
        ),
        (json!(30), json!(31))
    );

    // unused_parameters: a registered head that no step reports.
    let mut registration = healthy_registration();
    registration["params"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "agent.aux_head.weight", "role": "linear"}));
    app.register("aux", &registration).await;
    stream(&app, "aux", (0..50).map(healthy).collect()).await;
    let found = alerts(&app, "run_id=aux").await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0]["kind"], "unused_parameters");
    assert_eq!(found[0]["evidence"]["modules"], json!(["agent.aux_head"]));
    assert_eq!(found[0]["opened_step"], 49);

    // grad_vanishing: six layers whose norms shrink tenfold per layer towards the input.
    let params: Vec<Value> = (0..6)
        .map(|l| json!({"name": format!("deep.layers.{l}.mlp.weight")}))
        .collect();
    app.register("deep", &json!({"params": params})).await;
    let records: Vec<Value> = (0..25)
        .map(|s| {
            let modules: Vec<Value> = (0..6)
                .map(|l| json!({"module": format!("deep.layers.{l}.mlp"), "grad_norm": 0.1f64.powi(5 - l), "hook_hits": 1}))
                .collect();
            json!({"step": s, "modules": modules})
        })
        .collect();
    stream(&app, "deep", records).await;
    let found = alerts(&app, "run_id=deep").await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0]["kind"], "grad_vanishing");
    assert_eq!(found[0]["opened_step"], 19);
    assert_eq!(
        alerts(&app, "kind=grad_vanishing").await.len(),
        1,
        "the kind filter knows the new kinds"
    );
}
