//! Protocol v1.1 through a real server on its own SQLite file: registration
//! amendments carried by step records, per-group lr and intended-update series.

use crate::common::{TestApp, error_of};
use serde_json::{Value, json};

fn registration() -> Value {
    json!({
        "name": "late unfreeze",
        "optimizer": {"name": "adamw", "lr": 1e-3, "param_groups": [{"name": "0", "lr": 1e-3}]},
        "params": [
            {"name": "agent.head.weight", "param_group": "0"},
            {"name": "agent.norm.weight", "role": "norm", "dtype": "bf16", "param_group": "0"},
            {"name": "qwen.layers.0.mlp.up_proj.weight", "requires_grad": false, "in_optimizer": false}
        ]
    })
}

fn step(step: u64) -> Value {
    json!({"step": step, "loss": 2.0, "lrs": {"0": 1e-3},
           "modules": [{"module": "agent.head", "grad_norm": 0.3, "hook_hits": 1}]})
}

/// The amendment that unfreezes Qwen's projection into a new parameter group.
fn unfreeze(at: u64) -> Value {
    let mut record = step(at);
    record["amend"] = json!({
        "params": [{"name": "qwen.layers.0.mlp.up_proj.weight", "requires_grad": true,
                    "in_optimizer": true, "param_group": "1"}],
        "param_groups": [{"name": "1", "lr": 1e-4}]
    });
    record["lrs"]["1"] = json!(1e-4);
    record
}

fn reporting_qwen(at: u64) -> Value {
    let mut record = step(at);
    record["params"] = json!([{"name": "qwen.layers.0.mlp.up_proj.weight", "grad_norm": 0.8}]);
    record
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_amendment_takes_effect_at_its_step_and_survives_a_restart() {
    let app = TestApp::spawn().await;
    assert_eq!(app.register("r", &registration()).await.status(), 201);

    // Qwen's parameter is not trainable before step 30, so no record may report it
    // in `params` then (it is registered, so that alone is allowed) — but a
    // parameter that exists only from the amendment on is unknown before it.
    let mut early = reporting_qwen(29);
    early["params"][0]["name"] = json!("qwen.layers.0.mlp.down_proj.weight");
    let mut adds = unfreeze(30);
    adds["amend"]["params"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "qwen.layers.0.mlp.down_proj.weight", "param_group": "1"}));
    let (status, error) = error_of(app.post_steps("r", &json!([early, adds.clone()])).await).await;
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["path"], "steps[0].params[0].name");
    let (_, run) = app.get_json("/api/v1/runs/r").await;
    assert_eq!(run["step_count"], 0, "a refused batch stores nothing");

    let mut late = reporting_qwen(31);
    late["params"][0]["name"] = json!("qwen.layers.0.mlp.down_proj.weight");
    let response = app.post_steps("r", &json!([step(29), adds, late])).await;
    assert_eq!(response.status(), 200);
    let outcome: Value = response.json().await.unwrap();
    assert_eq!(
        outcome,
        json!({"accepted": 3, "duplicates": 0, "last_step": 31})
    );

    let (_, run) = app.get_json("/api/v1/runs/r").await;
    let amendments = run["amendments"].as_array().expect("amendments");
    assert_eq!(amendments.len(), 1);
    assert_eq!(amendments[0]["step"], 30);
    let params = run["params"].as_array().unwrap();
    assert_eq!(params.len(), 4, "the amendment added a parameter: {run}");
    let up = params
        .iter()
        .find(|p| p["name"] == "qwen.layers.0.mlp.up_proj.weight")
        .unwrap();
    assert_eq!(up["requires_grad"], true);
    assert_eq!(up["param_group"], "1");
    assert_eq!(
        up["group"], "qwen",
        "defaults written out as for a registration"
    );
    assert_eq!(
        run["optimizer"]["param_groups"].as_array().map(|g| g.len()),
        Some(2)
    );

    // Each group's lr reads back under its name; the run-wide lr is a separate series.
    let group_lr = app.points("r", "metric=lr&subject=1").await;
    assert_eq!(group_lr.len(), 1);
    assert_eq!(group_lr[0].0, 30);
    assert_eq!(app.points("r", "metric=lr&subject=0").await.len(), 3);
    let (status, _) = app
        .get_json("/api/v1/runs/r/series?metric=lr&subject=nope")
        .await;
    assert_eq!(status, 404);

    // The original registration is still welcome after the amendments...
    assert_eq!(app.register("r", &registration()).await.status(), 200);
    // ...and a different one is a conflict that points at amendments.
    let mut changed = registration();
    changed["params"][2]["requires_grad"] = json!(true);
    let (status, error) = error_of(app.register("r", &changed).await).await;
    assert_eq!(status, 409);
    assert_eq!(error["path"], "params[2].requires_grad");
    let message = error["message"].as_str().unwrap();
    assert!(message.contains("amendment"), "{message}");

    // A restarted server rebuilds the registration in force from the stored log.
    let app = app.restart().await;
    let mut after = reporting_qwen(32);
    after["params"][0]["name"] = json!("qwen.layers.0.mlp.down_proj.weight");
    let response = app.post_steps("r", &json!([after])).await;
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    let (_, run) = app.get_json("/api/v1/runs/r").await;
    assert_eq!(run["amendments"].as_array().map(Vec::len), Some(1));

    // A resent amendment is a duplicate like its record.
    let response = app.post_steps("r", &json!([unfreeze(30)])).await;
    let outcome: Value = response.json().await.unwrap();
    assert_eq!(outcome["duplicates"], 1);
    let (_, run) = app.get_json("/api/v1/runs/r").await;
    assert_eq!(run["amendments"].as_array().map(Vec::len), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_amendment_naming_an_unknown_parameter_group_is_refused_whole() {
    let app = TestApp::spawn().await;
    assert_eq!(app.register("r", &registration()).await.status(), 201);
    let mut bad = unfreeze(1);
    bad["amend"]["param_groups"] = json!([]);
    let (status, error) = error_of(app.post_steps("r", &json!([step(0), bad])).await).await;
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["path"], "steps[1].amend.params[0].param_group");
    let (_, run) = app.get_json("/api/v1/runs/r").await;
    assert_eq!(run["step_count"], 0);
    assert_eq!(run["amendments"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intended_updates_read_back_as_parameter_series() {
    let app = TestApp::spawn().await;
    assert_eq!(app.register("r", &registration()).await.status(), 201);
    let mut record = step(0);
    record["params"] = json!([{"name": "agent.norm.weight", "grad_norm": 3e-3, "update_norm": 0.0,
        "intended_update_norm": 4.4e-4, "intended_update_max_ulp": 0.19,
        "intended_nonzero": 896, "rounded_away": 896}]);
    assert_eq!(app.post_steps("r", &json!([record])).await.status(), 200);
    for (metric, value) in [
        ("intended_update_norm", 4.4e-4),
        ("intended_update_max_ulp", 0.19),
        ("intended_nonzero", 896.0),
        ("rounded_away", 896.0),
    ] {
        let points = app
            .points("r", &format!("metric={metric}&subject=agent.norm.weight"))
            .await;
        assert_eq!(points.len(), 1, "{metric}");
        let read = points[0].1.as_f64().unwrap();
        assert!(
            (read - value).abs() <= value * 1e-6,
            "{metric}: {read} for {value}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_unfreeze_outside_the_optimizer_is_flagged_on_its_step() {
    let app = TestApp::spawn().await;
    assert_eq!(app.register("r", &registration()).await.status(), 201);
    let mut records: Vec<Value> = (0..30).map(step).collect();
    let mut unfrozen = step(30);
    unfrozen["amend"] = json!({"params": [{"name": "qwen.layers.0.mlp.up_proj.weight",
        "requires_grad": true, "in_optimizer": false}]});
    records.push(unfrozen);
    records.extend((31..40).map(step));
    assert_eq!(
        app.post_steps("r", &Value::Array(records)).await.status(),
        200
    );
    let (_, body) = app
        .get_json("/api/v1/runs/r/alerts?kind=param_not_in_optimizer")
        .await;
    let alerts = body["alerts"].as_array().unwrap();
    assert_eq!(alerts.len(), 1, "{body}");
    assert_eq!(alerts[0]["subject"], "qwen");
    assert_eq!(alerts[0]["opened_step"], 30);
    assert_eq!(alerts[0]["evidence"]["amended_at"], 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_amendment_alone_after_the_last_step_is_stored_but_is_no_step() {
    // What a client sends at `close` when a registration change came after its last
    // step (a `requires_grad_` flip): a record with a step number, a time and the
    // amendment, and no measurement.
    let app = TestApp::spawn().await;
    assert_eq!(app.register("r", &registration()).await.status(), 201);
    let steps: Vec<Value> = (0..40).map(step).collect();
    assert_eq!(
        app.post_steps("r", &Value::Array(steps)).await.status(),
        200
    );
    let closing = json!({"step": 40, "time": 1_795_000_000.0,
        "amend": {"params": [{"name": "qwen.layers.0.mlp.up_proj.weight",
                              "requires_grad": true, "in_optimizer": false}]}});
    let response = app.post_steps("r", &json!([closing])).await;
    assert_eq!(response.status(), 200);
    let outcome: Value = response.json().await.unwrap();
    assert_eq!(
        outcome,
        json!({"accepted": 1, "duplicates": 0, "last_step": 40})
    );

    let (_, run) = app.get_json("/api/v1/runs/r").await;
    assert_eq!(run["step_count"], 40, "the amendment is not a step: {run}");
    assert_eq!(run["last_step"], 40);
    let amendments = run["amendments"].as_array().expect("amendments");
    assert_eq!(amendments.len(), 1, "{run}");
    assert_eq!(amendments[0]["step"], 40);
    let up = run["params"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "qwen.layers.0.mlp.up_proj.weight")
        .unwrap();
    assert_eq!(
        up["requires_grad"], true,
        "the amendment is in force: {run}"
    );
    // ...and judged as any amendment: trainable, outside the optimizer.
    let (_, body) = app
        .get_json("/api/v1/runs/r/alerts?kind=param_not_in_optimizer")
        .await;
    let alerts = body["alerts"].as_array().unwrap();
    assert_eq!(alerts.len(), 1, "{body}");
    assert_eq!(alerts[0]["opened_step"], 40);

    // The next measured step counts again.
    assert_eq!(app.post_steps("r", &json!([step(41)])).await.status(), 200);
    let (_, run) = app.get_json("/api/v1/runs/r").await;
    assert_eq!(run["step_count"], 41);
}
