//! Multi-rank runs (v1.5): a rank that closes (`POST .../finish?rank=N`) completes at
//! once the steps that waited only for it, and a NaN spread to every rank within its
//! step is traced to the ranks whose own loss was not finite.

use crate::common::TestApp;
use serde_json::{Value, json};

fn registration(rank: u32) -> Value {
    json!({
        "world_size": 2, "rank": rank, "host": format!("node-{rank}"),
        "params": [{"name": "shared.proj.weight", "shape": [8, 8]}]
    })
}

fn record(step: u64, rank: u32) -> Value {
    json!({
        "step": step, "rank": rank, "loss": 3.0 - step as f64 * 0.001, "step_time": 0.1,
        "modules": [{"module": "shared.proj", "grad_norm": 0.5, "hook_hits": 1, "numel": 64}]
    })
}

async fn post(app: &TestApp, run: &str, records: Vec<Value>) {
    let response = app.post_steps(run, &Value::Array(records)).await;
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
}

async fn register(app: &TestApp, run: &str) {
    for rank in 0..2 {
        let response = app.register(run, &registration(rank)).await;
        assert!(response.status().is_success());
    }
}

async fn finish(app: &TestApp, run: &str, query: &str) -> (u16, Value) {
    let response = app
        .post_raw(&format!("/api/v1/runs/{run}/finish{query}"), &[], "")
        .await;
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

async fn alerts_of(app: &TestApp, run: &str, kind: &str) -> Vec<Value> {
    let (_, body) = app.get_json(&format!("/api/v1/runs/{run}/alerts")).await;
    body["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["kind"] == kind)
        .cloned()
        .collect()
}

async fn last_step(app: &TestApp, run: &str) -> Value {
    app.get_json(&format!("/api/v1/runs/{run}")).await.1["last_step"].clone()
}

#[tokio::test]
async fn a_closed_rank_s_missing_steps_complete_at_once() {
    // The default rank timeout (60 s): nothing here waits for it.
    let app = TestApp::spawn().await;
    register(&app, "closes").await;
    post(&app, "closes", (0..6).map(|s| record(s, 1)).collect()).await;
    post(&app, "closes", (0..10).map(|s| record(s, 0)).collect()).await;
    assert_eq!(last_step(&app, "closes").await, 5);
    // Rank 0 closing does not complete steps rank 1 has not sent: it may still.
    let (status, _) = finish(&app, "closes", "?rank=0").await;
    assert_eq!(status, 200);
    assert_eq!(last_step(&app, "closes").await, 5);
    let (status, run) = finish(&app, "closes", "?rank=1").await;
    assert_eq!(status, 200, "{run}");
    assert_eq!(run["last_step"], 9, "{run}");
    assert_eq!(run["status"], "finished", "{run}");
    let missing = alerts_of(&app, "closes", "rank_missing").await;
    assert_eq!(missing.len(), 1, "{missing:?}");
    assert_eq!(missing[0]["subject"], "rank 1");
    assert_eq!(missing[0]["opened_step"], 6);
    assert_eq!(missing[0]["evidence"]["last_step"], 5);
    assert_eq!(missing[0]["evidence"]["closed"], true);
    // Rank 0's records that arrive after rank 1 closed complete as they arrive...
    post(&app, "closes", (10..12).map(|s| record(s, 0)).collect()).await;
    assert_eq!(last_step(&app, "closes").await, 11);
    // ...until rank 1 sends again (a resumed job): then its steps are waited for.
    post(&app, "closes", (12..14).map(|s| record(s, 1)).collect()).await;
    post(&app, "closes", (12..16).map(|s| record(s, 0)).collect()).await;
    assert_eq!(last_step(&app, "closes").await, 13);
}

#[tokio::test]
async fn once_every_rank_closed_every_waiting_step_completes() {
    let app = TestApp::spawn().await;
    register(&app, "all").await;
    post(&app, "all", (0..6).map(|s| record(s, 0)).collect()).await;
    post(&app, "all", (0..3).map(|s| record(s, 1)).collect()).await;
    // A finish naming no rank (a v1.4 client, from each rank as it is done) keeps
    // its meaning: the steps still wait for their ranks.
    let (status, run) = finish(&app, "all", "").await;
    assert_eq!(status, 200, "{run}");
    assert_eq!(run["last_step"], 2, "{run}");
    finish(&app, "all", "?rank=1").await;
    let (_, run) = finish(&app, "all", "?rank=0").await;
    assert_eq!(run["last_step"], 5, "{run}");
    let missing = alerts_of(&app, "all", "rank_missing").await;
    assert_eq!(missing.len(), 1, "{missing:?}");
    assert_eq!(missing[0]["subject"], "rank 1");
}

#[tokio::test]
async fn a_finish_names_a_rank_of_the_run() {
    let app = TestApp::spawn().await;
    register(&app, "bad").await;
    let (status, body) = finish(&app, "bad", "?rank=2").await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = finish(&app, "bad", "?rank=x").await;
    assert_eq!(status, 400, "{body}");
    // A run of one process takes a rank and ignores it.
    let response = app
        .register(
            "single",
            &json!({"params": [{"name": "a.weight", "shape": [2]}]}),
        )
        .await;
    assert!(response.status().is_success());
    let (status, body) = finish(&app, "single", "?rank=0").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "finished");
}

#[tokio::test]
async fn a_nan_spread_to_every_rank_is_traced_to_the_rank_whose_loss_is_not_finite() {
    let app = TestApp::spawn().await;
    register(&app, "spread").await;
    for rank in 0..2 {
        let records = (0..8)
            .map(|s| {
                let mut r = record(s, rank);
                if s >= 4 {
                    r["modules"][0]["grad_norm"] = json!("NaN");
                }
                if s >= 5 || (s == 4 && rank == 1) {
                    r["loss"] = json!("NaN");
                }
                r
            })
            .collect();
        post(&app, "spread", records).await;
    }
    let alerts = alerts_of(&app, "spread", "rank_nonfinite").await;
    assert_eq!(alerts.len(), 1, "{alerts:?}");
    assert_eq!(alerts[0]["subject"], "rank 1");
    assert_eq!(alerts[0]["opened_step"], 4);
    assert_eq!(alerts[0]["evidence"]["origin"], "loss");
    assert_eq!(alerts[0]["evidence"]["spread_to"], json!([0]));
}
