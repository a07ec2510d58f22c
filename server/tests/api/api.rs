//! The HTTP API of docs/PROTOCOL.md, through a real server on `127.0.0.1:0` with its own
//! SQLite file: registration, ingestion in every accepted form, duplicates, atomic
//! batches, every error status, non-finite values, series reads and deletion.

use crate::common::{TestApp, error_of, gzip, registration, step, steps};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_ok() {
    let app = TestApp::spawn().await;
    assert_eq!(
        app.get_json("/healthz").await,
        (200, json!({"status": "ok"}))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_is_created_then_idempotent_then_conflicting() {
    let app = TestApp::spawn().await;
    let body = registration();
    let first = app.register("r1", &body).await;
    assert_eq!(first.status(), 201);
    let created: Value = first.json().await.unwrap();
    assert_eq!(created["run_id"], "r1");
    // The protocol's defaults are written out.
    assert_eq!(created["params"][0]["group"], "qwen");
    assert_eq!(
        created["params"][0]["module"],
        "qwen.layers.0.input_layernorm"
    );

    // The same registration again, even spelled differently, is 200 and changes nothing.
    let mut respelled = body.clone();
    respelled["optimizer"]["lr"] = json!(0.0003);
    let again = app.register("r1", &respelled).await;
    assert_eq!(again.status(), 200);
    let again: Value = again.json().await.unwrap();
    assert_eq!(again["created_at"], created["created_at"]);

    let mut different = body.clone();
    different["params"][1]["dtype"] = json!("bf16");
    let (status, error) = error_of(app.register("r1", &different).await).await;
    assert_eq!(status, 409);
    assert_eq!(error["code"], "conflict");
    assert_eq!(error["path"], "params[1].dtype");

    let (status, stored) = app.get_json("/api/v1/runs/r1").await;
    assert_eq!(status, 200);
    assert_eq!(
        stored["params"][1]["dtype"], "f32",
        "a rejected registration changes nothing"
    );
    assert_eq!(stored["name"], "test run");
    assert_eq!(stored["last_step"], Value::Null);
    assert_eq!(
        stored["open_alerts"],
        json!({"critical": 0, "warning": 0, "info": 0})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_run_ids_are_rejected() {
    let app = TestApp::spawn().await;
    for run_id in [
        "has%20space",
        "semi%3Bcolon",
        "a%2Fb",
        "%27%3B--",
        &"x".repeat(129),
    ] {
        let (status, error) = error_of(app.register(run_id, &registration()).await).await;
        assert_eq!(status, 400, "{run_id}");
        assert_eq!(error["code"], "invalid_run_id", "{run_id}");
        assert_eq!(error["path"], "run_id");
    }
    let (_, runs) = app.get_json("/api/v1/runs").await;
    assert_eq!(runs["runs"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_registrations_name_the_field_and_store_nothing() {
    let app = TestApp::spawn().await;
    let cases = [
        (json!({"name": "no params"}), ""),
        (
            json!({"params": [{"name": "w", "dtype": "float32"}]}),
            "params[0].dtype",
        ),
        (
            json!({"params": [{"name": "w", "role": "normalization"}]}),
            "params[0].role",
        ),
        (
            json!({"params": [], "precision": {"loss_scaler": "amp"}}),
            "precision.loss_scaler",
        ),
        (
            json!({"params": [], "started_at": "last tuesday"}),
            "started_at",
        ),
    ];
    for (body, path) in cases {
        let (status, error) = error_of(app.register("r1", &body).await).await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(error["code"], "invalid_body");
        assert_eq!(
            error.get("path").and_then(Value::as_str).unwrap_or(""),
            path,
            "{body}"
        );
    }
    let (status, _) = app.get_json("/api/v1/runs/r1").await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_ndjson_and_gzip_bodies_are_all_ingested() {
    let app = TestApp::spawn().await;
    assert_eq!(app.register("r1", &registration()).await.status(), 201);

    let response = app.post_steps("r1", &steps(0..3)).await;
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.json::<Value>().await.unwrap(),
        json!({"accepted": 3, "duplicates": 0, "last_step": 2})
    );

    let ndjson: String = (3..5).map(|s| format!("{}\n", step(s))).collect();
    let response = app
        .post_raw(
            "/api/v1/runs/r1/steps",
            &[("content-type", "application/x-ndjson")],
            ndjson,
        )
        .await;
    assert_eq!(response.json::<Value>().await.unwrap()["accepted"], 2);

    let body = serde_json::to_vec(&steps(5..8)).unwrap();
    let response = app
        .post_raw(
            "/api/v1/runs/r1/steps",
            &[
                ("content-type", "application/json"),
                ("content-encoding", "gzip"),
            ],
            gzip(&body),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.json::<Value>().await.unwrap()["accepted"], 3);

    let ndjson: String = (8..10).map(|s| format!("{}\n", step(s))).collect();
    let response = app
        .post_raw(
            "/api/v1/runs/r1/steps",
            &[
                ("content-type", "application/x-ndjson"),
                ("content-encoding", "gzip"),
            ],
            gzip(ndjson.as_bytes()),
        )
        .await;
    assert_eq!(response.json::<Value>().await.unwrap()["last_step"], 9);

    let loss = app.points("r1", "metric=loss").await;
    assert_eq!(loss.len(), 10);
    assert_eq!(loss[7], (7, json!(3.993)));
    let (_, run) = app.get_json("/api/v1/runs/r1").await;
    assert_eq!(
        (run["first_step"].clone(), run["last_step"].clone()),
        (json!(0), json!(9))
    );
    assert_eq!(run["step_count"], 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resent_batches_are_counted_as_duplicates_and_stored_once() {
    let app = TestApp::spawn().await;
    app.register("r1", &registration()).await;
    assert_eq!(app.post_steps("r1", &steps(0..5)).await.status(), 200);

    let resent = app.post_steps("r1", &steps(0..5)).await;
    assert_eq!(
        resent.json::<Value>().await.unwrap(),
        json!({"accepted": 0, "duplicates": 5, "last_step": 4})
    );
    // A batch that overlaps the end: the old part is ignored, the new part stored.
    let overlapping = app.post_steps("r1", &steps(3..8)).await;
    assert_eq!(
        overlapping.json::<Value>().await.unwrap(),
        json!({"accepted": 3, "duplicates": 2, "last_step": 7})
    );
    let steps: Vec<u64> = app
        .points("r1", "metric=loss")
        .await
        .iter()
        .map(|p| p.0)
        .collect();
    assert_eq!(steps, (0..8).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_below_the_last_stored_that_were_never_stored_are_refused_as_late() {
    // Two writers of one run, interleaved: the second moved the run past steps the
    // first had not sent yet. Those are refused and counted apart from duplicates.
    let app = TestApp::spawn().await;
    app.register("r1", &registration()).await;
    assert_eq!(app.post_steps("r1", &steps(0..5)).await.status(), 200);
    assert_eq!(app.post_steps("r1", &steps(10..15)).await.status(), 200);

    let late = app.post_steps("r1", &steps(5..10)).await;
    assert_eq!(late.status(), 200);
    assert_eq!(
        late.json::<Value>().await.unwrap(),
        json!({"accepted": 0, "duplicates": 0, "late": 5, "last_step": 14})
    );
    // Stored steps sent again stay plain duplicates (no `late` field), a mixed batch
    // is split between the two, and the new part of an overlapping batch is stored.
    let resent = app.post_steps("r1", &steps(0..5)).await;
    assert_eq!(
        resent.json::<Value>().await.unwrap(),
        json!({"accepted": 0, "duplicates": 5, "last_step": 14})
    );
    let mixed = app
        .post_steps(
            "r1",
            &json!([step(3), step(8), step(12), step(70), step(71)]),
        )
        .await;
    assert_eq!(
        mixed.json::<Value>().await.unwrap(),
        json!({"accepted": 2, "duplicates": 2, "late": 1, "last_step": 71})
    );
    // Nothing late was stored: the series holds exactly what was acknowledged.
    let stored: Vec<u64> = app
        .points("r1", "metric=loss")
        .await
        .iter()
        .map(|p| p.0)
        .collect();
    let expected: Vec<u64> = (0..5).chain(10..15).chain([70, 71]).collect();
    assert_eq!(stored, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_one_bad_record_is_rejected_whole() {
    let app = TestApp::spawn().await;
    app.register("r1", &registration()).await;
    app.post_steps("r1", &steps(0..2)).await;

    let mut batch = steps(2..6);
    batch[2]["modules"][1]["grad_norm"] = json!("nan");
    let (status, error) = error_of(app.post_steps("r1", &batch).await).await;
    assert_eq!(status, 400);
    assert_eq!(error["code"], "invalid_body");
    assert_eq!(error["path"], "steps[2].modules[1].grad_norm");
    assert!(
        error["message"].as_str().unwrap().contains("\"NaN\""),
        "{error}"
    );

    // A parameter the registration does not have.
    let mut batch = steps(2..6);
    batch[3]["params"][0]["name"] = json!("qwen.layers.9.mlp.weight");
    let (status, error) = error_of(app.post_steps("r1", &batch).await).await;
    assert_eq!(status, 400);
    assert_eq!(error["path"], "steps[3].params[0].name");

    // Nothing of either batch is there, and the run's progress did not move.
    assert_eq!(app.points("r1", "metric=loss").await.len(), 2);
    let (_, run) = app.get_json("/api/v1/runs/r1").await;
    assert_eq!(run["last_step"], 1);
    // Not even the columns a rejected batch would have added.
    let (status, _) = app
        .get_json("/api/v1/runs/r1/series?metric=grad_norm&subject=qwen.layers.9.mlp")
        .await;
    assert_eq!(status, 404);
    // And the same steps, corrected, go in.
    assert_eq!(app.post_steps("r1", &steps(2..6)).await.status(), 200);
    assert_eq!(app.points("r1", "metric=loss").await.len(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_steps_go_backwards_is_invalid() {
    let app = TestApp::spawn().await;
    app.register("r1", &registration()).await;
    let batch = json!([step(5), step(6), step(4)]);
    let (status, error) = error_of(app.post_steps("r1", &batch).await).await;
    assert_eq!(status, 400);
    assert_eq!(error["path"], "steps[2].step");
    let batch = json!([step(5), step(5)]);
    let (status, error) = error_of(app.post_steps("r1", &batch).await).await;
    assert_eq!(
        (status, error["path"].clone()),
        (400, json!("steps[1].step"))
    );
    assert!(app.points("r1", "metric=loss").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_error_status_of_the_transport_section() {
    let app = TestApp::spawn_with(|c| c.max_body_bytes = 64 * 1024).await;
    app.register("r1", &registration()).await;
    let steps_path = "/api/v1/runs/r1/steps";
    let json_ct = ("content-type", "application/json");

    // 400: malformed JSON.
    let (status, error) =
        error_of(app.post_raw(steps_path, &[json_ct], "[{\"step\": 1").await).await;
    assert_eq!(
        (status, error["code"].as_str()),
        (400, Some("invalid_body"))
    );

    // 404: unknown run, for writes and reads.
    let (status, error) = error_of(app.post_steps("ghost", &steps(0..1)).await).await;
    assert_eq!(
        (status, error["code"].as_str()),
        (404, Some("run_not_found"))
    );
    for path in [
        "/api/v1/runs/ghost",
        "/api/v1/runs/ghost/series?metric=loss",
    ] {
        let (status, body) = app.get_json(path).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (404, Some("run_not_found")),
            "{path}"
        );
    }
    let response = app
        .client
        .delete(app.url("/api/v1/runs/ghost"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);

    // 413: a body over the limit, and a small gzip body that inflates past it.
    let big = serde_json::to_vec(&steps(0..1000)).unwrap();
    assert!(big.len() > 64 * 1024);
    let (status, error) = error_of(app.post_raw(steps_path, &[json_ct], big.clone()).await).await;
    assert_eq!(
        (status, error["code"].as_str()),
        (413, Some("body_too_large"))
    );
    let bomb = gzip(&vec![b' '; 10 * 1024 * 1024]);
    assert!(bomb.len() < 64 * 1024);
    let (status, error) = error_of(
        app.post_raw(steps_path, &[json_ct, ("content-encoding", "gzip")], bomb)
            .await,
    )
    .await;
    assert_eq!(
        (status, error["code"].as_str()),
        (413, Some("body_too_large"))
    );

    // 400: a body that says gzip but is not.
    let (status, error) = error_of(
        app.post_raw(steps_path, &[json_ct, ("content-encoding", "gzip")], "[]")
            .await,
    )
    .await;
    assert_eq!(
        (status, error["code"].as_str()),
        (400, Some("invalid_gzip"))
    );

    // 415: content types and encodings the protocol does not name.
    for headers in [
        vec![("content-type", "text/plain")],
        vec![],
        vec![json_ct, ("content-encoding", "br")],
    ] {
        let (status, _) = error_of(app.post_raw(steps_path, &headers, "[]").await).await;
        assert_eq!(status, 415, "{headers:?}");
    }
    let response = app
        .client
        .put(app.url("/api/v1/runs/r2"))
        .header("content-type", "application/x-ndjson")
        .body(registration().to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 415, "registration takes JSON only");

    // 409 is covered by the registration test; 405 and unknown routes answer JSON too.
    let response = app
        .client
        .patch(app.url("/api/v1/runs/r1"))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(response).await.0, 405);
    assert_eq!(app.get_json("/api/v2/runs").await.0, 404);

    // After all that, nothing was stored and the server is healthy.
    assert!(app.points("r1", "metric=loss").await.is_empty());
    assert_eq!(app.get_json("/healthz").await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ingest_token_guards_every_write_and_only_writes() {
    let app = TestApp::spawn_with(|c| c.ingest_token = Some("s3cret".into())).await;
    let (status, error) = error_of(app.register("r1", &registration()).await).await;
    assert_eq!(
        (status, error["code"].as_str()),
        (401, Some("unauthorized"))
    );
    let wrong = app
        .client
        .put(app.url("/api/v1/runs/r1"))
        .bearer_auth("guess")
        .json(&registration())
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    assert_eq!(wrong.headers()["www-authenticate"], "Bearer");
    assert_eq!(
        app.get_json("/api/v1/runs/r1").await.0,
        404,
        "nothing was stored"
    );

    let ok = app
        .client
        .put(app.url("/api/v1/runs/r1"))
        .bearer_auth("s3cret")
        .json(&registration())
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 201);
    let (status, _) = error_of(app.post_steps("r1", &steps(0..1)).await).await;
    assert_eq!(status, 401);
    let response = app
        .client
        .delete(app.url("/api/v1/runs/r1"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    // Reads stay open.
    assert_eq!(app.get_json("/api/v1/runs/r1").await.0, 200);
    assert_eq!(app.get_json("/api/v1/runs").await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_finite_values_round_trip_as_strings() {
    let app = TestApp::spawn().await;
    app.register("r1", &registration()).await;
    let batch = json!([
        {"step": 0, "loss": "NaN", "modules": [{"module": "qwen.a", "grad_norm": "Infinity", "hook_hits": 1}],
         "metrics": {"reward": "-Infinity"}},
        {"step": 1, "loss": 1.5, "modules": [{"module": "qwen.a", "grad_norm": null, "hook_hits": 0}],
         "metrics": {"reward": null}},
        {"step": 2, "loss": "Infinity", "modules": [{"module": "qwen.a", "grad_norm": 0.0, "hook_hits": 1}]}
    ]);
    assert_eq!(app.post_steps("r1", &batch).await.status(), 200);
    assert_eq!(
        app.points("r1", "metric=loss").await,
        vec![(0, json!("NaN")), (1, json!(1.5)), (2, json!("Infinity"))]
    );
    // null (reported, no gradient) is different from 0 and from absent.
    assert_eq!(
        app.points("r1", "metric=grad_norm&subject=qwen.a").await,
        vec![(0, json!("Infinity")), (1, Value::Null), (2, json!(0))]
    );
    assert_eq!(
        app.points("r1", "metric=metric&subject=reward").await,
        vec![(0, json!("-Infinity")), (1, Value::Null)]
    );
    // Group norms are derived: an infinite module norm makes the group's infinite.
    assert_eq!(
        app.points("r1", "metric=grad_norm&subject=qwen").await,
        vec![(0, json!("Infinity")), (1, Value::Null), (2, json!(0))]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_series_metric_reads_back_what_was_sent() {
    let app = TestApp::spawn().await;
    app.register("r1", &registration()).await;
    let record = json!({
        "step": 3, "loss": 2.25, "lr": 1e-4,
        "modules": [{"module": "qwen.a", "grad_norm": 3.0, "hook_hits": 2},
                    {"module": "qwen.b", "grad_norm": 4.0, "hook_hits": 1}],
        "params": [{"name": "agent.norm.weight", "grad_norm": 0.25, "update_norm": 0.0, "drift": 0.5, "mean": 1.0}],
        "scaler": {"scale": 65536.0, "growth_tracker": 3, "found_inf": true, "step_skipped": true},
        "gpu": [{"index": 0, "memory_used_bytes": 21474836480u64, "utilization_pct": 87, "temperature_c": 61, "power_w": 412.5}],
        "metrics": {"accuracy": 0.75}
    });
    assert_eq!(app.post_steps("r1", &json!([record])).await.status(), 200);
    let cases = [
        ("metric=loss", json!(2.25)),
        ("metric=lr", json!(0.0001)),
        ("metric=grad_norm&subject=qwen", json!(5)),
        ("metric=grad_norm&subject=qwen.a", json!(3)),
        ("metric=hook_hits&subject=qwen.a", json!(2)),
        (
            "metric=param_grad_norm&subject=agent.norm.weight",
            json!(0.25),
        ),
        ("metric=update_norm&subject=agent.norm.weight", json!(0)),
        ("metric=drift&subject=agent.norm.weight", json!(0.5)),
        ("metric=param_mean&subject=agent.norm.weight", json!(1)),
        ("metric=scaler_scale", json!(65536)),
        ("metric=scaler_growth_tracker", json!(3)),
        ("metric=found_inf", json!(1)),
        ("metric=step_skipped", json!(1)),
        ("metric=metric&subject=accuracy", json!(0.75)),
        ("metric=gpu_memory_used_bytes", json!(21474836480u64)),
        ("metric=gpu_utilization_pct&subject=0", json!(87)),
        ("metric=gpu_temperature_c", json!(61)),
        ("metric=gpu_power_w", json!(412.5)),
    ];
    for (query, value) in cases {
        assert_eq!(app.points("r1", query).await, vec![(3, value)], "{query}");
    }
    // A run-wide metric nobody reported is empty; a named subject nobody reported is 404.
    assert!(
        app.points("r1", "metric=metric&subject=accuracy&from_step=4")
            .await
            .is_empty()
    );
    let bad = [
        ("metric=nope", 400, "metric"),
        ("metric=loss&subject=x", 400, "subject"),
        ("metric=grad_norm", 400, "subject"),
        ("metric=grad_norm&subject=ghost", 404, "subject"),
        ("metric=gpu_power_w&subject=first", 400, "subject"),
        ("metric=loss&from_step=5&to_step=4", 400, "from_step"),
        ("metric=loss&max_points=1", 400, "max_points"),
        ("metric=loss&bogus=1", 400, ""),
    ];
    for (query, status, path) in bad {
        let (got, body) = app
            .get_json(&format!("/api/v1/runs/r1/series?{query}"))
            .await;
        assert_eq!(got, status, "{query}: {body}");
        assert_eq!(
            body["error"]
                .get("path")
                .and_then(Value::as_str)
                .unwrap_or(""),
            path,
            "{query}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn downsampling_keeps_a_single_step_spike_and_nan() {
    let app = TestApp::spawn().await;
    app.register("long", &json!({"params": []})).await;
    const STEPS: u64 = 100_000;
    const SPIKE: u64 = 61_234;
    const NAN: u64 = 87_001;
    for start in (0..STEPS).step_by(20_000) {
        let batch: Vec<Value> = (start..start + 20_000)
            .map(|s| {
                let loss = match s {
                    SPIKE => json!(1000.0),
                    NAN => json!("NaN"),
                    _ => json!(2.0 + ((s * 7919) % 100) as f64 / 1000.0),
                };
                json!({"step": s, "loss": loss})
            })
            .collect();
        let response = app.post_steps("long", &Value::Array(batch)).await;
        assert_eq!(response.status(), 200);
    }

    let (_, body) = app
        .get_json("/api/v1/runs/long/series?metric=loss&max_points=1000")
        .await;
    assert_eq!(body["downsampled"], true);
    let points = body["points"].as_array().unwrap();
    assert!(
        points.len() <= 1000 && points.len() >= 900,
        "{} points",
        points.len()
    );
    assert!(points.contains(&json!([SPIKE, 1000])), "the spike survives");
    assert!(points.contains(&json!([NAN, "NaN"])), "the NaN survives");
    let steps: Vec<u64> = points.iter().map(|p| p[0].as_u64().unwrap()).collect();
    assert!(
        steps.windows(2).all(|w| w[0] < w[1]),
        "points are in step order"
    );

    // A window holding no more points than asked for comes back whole.
    let window = app
        .points(
            "long",
            "metric=loss&from_step=61000&to_step=61499&max_points=500",
        )
        .await;
    assert_eq!(window.len(), 500);
    assert!(window.contains(&(SPIKE, json!(1000))));
    // A ragged window that is downsampled still finds the spike through rollups and raw edges.
    let (_, body) = app
        .get_json(
            "/api/v1/runs/long/series?metric=loss&from_step=1003&to_step=99990&max_points=200",
        )
        .await;
    let points = body["points"].as_array().unwrap();
    assert!(points.len() <= 200);
    assert!(points.contains(&json!([SPIKE, 1000])));
    assert!(points.contains(&json!([NAN, "NaN"])));
    assert!(
        points
            .iter()
            .all(|p| (1003..=99_990).contains(&p[0].as_u64().unwrap()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_added_mid_run_read_as_absent_before_they_appear() {
    let app = TestApp::spawn().await;
    app.register("r1", &registration()).await;
    // 70 steps so the new module lands in a rollup bucket that already exists.
    app.post_steps("r1", &steps(0..70)).await;
    let batch: Vec<Value> = (70..200)
        .map(|s| {
            let mut record = step(s);
            record["modules"]
                .as_array_mut()
                .unwrap()
                .push(json!({"module": "agent.late", "grad_norm": s as f64, "hook_hits": 1}));
            record
        })
        .collect();
    app.post_steps("r1", &Value::Array(batch)).await;
    let late = app
        .points("r1", "metric=grad_norm&subject=agent.late")
        .await;
    assert_eq!(late.first(), Some(&(70, json!(70))));
    assert_eq!(late.len(), 130);
    let (_, body) = app
        .get_json("/api/v1/runs/r1/series?metric=grad_norm&subject=agent.late&max_points=10")
        .await;
    let points = body["points"].as_array().unwrap();
    assert!(points.len() <= 10 && !points.is_empty());
    assert_eq!(points[0][0], 70);
    assert!(points.contains(&json!([199, 199])));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_list_shows_progress_newest_first() {
    let app = TestApp::spawn().await;
    app.register("older", &registration()).await;
    app.register("newer", &json!({"name": "second", "params": []}))
        .await;
    app.post_steps("older", &steps(0..4)).await;
    let (status, body) = app.get_json("/api/v1/runs").await;
    assert_eq!(status, 200);
    let runs = body["runs"].as_array().unwrap();
    let ids: Vec<&str> = runs.iter().map(|r| r["run_id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["newer", "older"]);
    assert_eq!(runs[1]["last_step"], 3);
    assert!(runs[1]["last_seen"].is_string());
    assert_eq!(runs[0]["last_step"], Value::Null);
    assert_eq!(runs[0]["name"], "second");
    assert_eq!(
        runs[0]["open_alerts"],
        json!({"critical": 0, "warning": 0, "info": 0})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_removes_the_run_and_everything_of_it() {
    let app = TestApp::spawn().await;
    app.register("r1", &registration()).await;
    app.register("keep", &registration()).await;
    app.post_steps("r1", &steps(0..100)).await;
    app.post_steps("keep", &steps(0..3)).await;
    let response = app
        .client
        .delete(app.url("/api/v1/runs/r1"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.json::<Value>().await.unwrap(),
        json!({"run_id": "r1", "deleted": true, "steps_deleted": 100})
    );
    assert_eq!(app.get_json("/api/v1/runs/r1").await.0, 404);
    assert_eq!(
        app.get_json("/api/v1/runs/r1/series?metric=loss").await.0,
        404
    );
    // The other run is untouched, and the deleted id can be registered afresh.
    assert_eq!(app.points("keep", "metric=loss").await.len(), 3);
    assert_eq!(
        app.register("r1", &json!({"params": []})).await.status(),
        201
    );
    assert_eq!(
        app.post_steps("r1", &json!([{"step": 0, "loss": 1}]))
            .await
            .status(),
        200
    );
    assert_eq!(app.points("r1", "metric=loss").await, vec![(0, json!(1))]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_continues_where_it_stopped() {
    let app = TestApp::spawn().await;
    app.register("r1", &registration()).await;
    app.post_steps("r1", &steps(0..50)).await;
    let app = app.restart().await;
    // Duplicate detection and column positions come back from the file.
    let resent = app.post_steps("r1", &steps(40..60)).await;
    assert_eq!(
        resent.json::<Value>().await.unwrap(),
        json!({"accepted": 10, "duplicates": 10, "last_step": 59})
    );
    let norms = app
        .points("r1", "metric=grad_norm&subject=agent.head")
        .await;
    assert_eq!(norms.len(), 60);
    assert!(norms.iter().all(|(_, v)| *v == json!(1.5)));
    assert_eq!(app.register("r1", &registration()).await.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn series_export_as_csv() {
    let app = TestApp::spawn().await;
    app.register("csv", &registration()).await;
    let batch = json!([
        {"step": 0, "loss": 2.5, "modules": [{"module": "qwen.layers.0.self_attn", "grad_norm": null, "hook_hits": 0}]},
        {"step": 1, "loss": "NaN", "modules": [{"module": "qwen.layers.0.self_attn", "grad_norm": 0.0, "hook_hits": 1}]},
        {"step": 2, "loss": "-Infinity", "modules": [{"module": "qwen.layers.0.self_attn", "grad_norm": 1.5e-5, "hook_hits": 1}]}
    ]);
    assert_eq!(app.post_steps("csv", &batch).await.status(), 200);
    let client = reqwest::Client::new();
    let get = |query: &str, accept: Option<&str>| {
        let mut request = client.get(app.url(&format!("/api/v1/runs/csv/series?{query}")));
        if let Some(accept) = accept {
            request = request.header("Accept", accept);
        }
        request.send()
    };
    for (query, accept) in [
        ("metric=loss&format=csv", None),
        ("metric=loss", Some("text/csv")),
    ] {
        let response = get(query, accept).await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(
            response.headers()["content-type"],
            "text/csv; charset=utf-8"
        );
        assert_eq!(
            response.text().await.unwrap(),
            "step,value\n0,2.5\n1,NaN\n2,-Infinity\n"
        );
    }
    // A measured null is an empty value; a zero stays 0.
    let response = get(
        "metric=grad_norm&subject=qwen.layers.0.self_attn&format=csv",
        None,
    )
    .await
    .unwrap();
    assert_eq!(
        response.text().await.unwrap(),
        "step,value\n0,\n1,0\n2,0.000015\n"
    );
    // JSON stays the default, also for browsers' Accept lists.
    let response = get("metric=loss", Some("text/html,application/json;q=0.9,*/*"))
        .await
        .unwrap();
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json")
    );
    let (status, body) = error_of(get("metric=loss&format=xml", None).await.unwrap()).await;
    assert_eq!(status, 400);
    assert_eq!(body["path"], "format", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_happened() {
    let app = TestApp::spawn().await;
    app.register("m", &registration()).await;
    assert_eq!(app.post_steps("m", &steps(0..3)).await.status(), 200);
    // A duplicate batch stores nothing.
    assert_eq!(app.post_steps("m", &steps(0..3)).await.status(), 200);
    let bad = app
        .post_raw(
            "/api/v1/runs/m/steps",
            &[("Content-Type", "application/json")],
            "[{",
        )
        .await;
    assert_eq!(bad.status(), 400);
    // A loss scaler over bf16 opens a critical alert at registration.
    app.register(
        "scaled",
        &json!({"precision": {"param_dtype": "bf16", "loss_scaler": "dynamic"},
                "params": [{"name": "qwen.norm.weight", "role": "norm"}]}),
    )
    .await;

    let response = reqwest::get(app.url("/metrics")).await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    let text = response.text().await.unwrap();
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
            .parse()
            .unwrap()
    };
    assert_eq!(value("gradflow_ingested_steps_total"), 3.0);
    // Each step: loss, lr, 2 modules x (grad, hits), 1 param x 4, 2 derived group norms.
    assert_eq!(value("gradflow_ingested_values_total"), 3.0 * 12.0);
    assert_eq!(value("gradflow_ingest_batch_duration_seconds_count"), 2.0);
    assert_eq!(
        value(r#"gradflow_rejected_requests_total{reason="invalid_body"}"#),
        1.0
    );
    assert_eq!(
        value(r#"gradflow_open_alerts{kind="scaler_bf16_incompatible",severity="critical"}"#),
        1.0
    );
    assert_eq!(value("gradflow_runs"), 2.0);
    assert!(value("gradflow_database_size_bytes") > 4096.0);
    assert!(text.ends_with("# EOF\n"));
}

/// Sends the head of a steps request and part of its body, then stalls.
async fn stalled_upload(app: &TestApp) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let address = app.url("").trim_start_matches("http://").to_owned();
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream
        .write_all(
            b"POST /api/v1/runs/slow/steps HTTP/1.1\r\nHost: test\r\n\
              Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n[{\"step\": 0",
        )
        .await
        .unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_trickles_its_body_gets_408_and_stores_nothing() {
    use tokio::io::AsyncReadExt;
    let app = TestApp::spawn_with(|c| c.request_timeout_secs = 1).await;
    app.register("slow", &registration()).await;
    let started = std::time::Instant::now();
    let mut stream = stalled_upload(&app).await;
    let mut answer = vec![0; 4096];
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), stream.read(&mut answer))
        .await
        .expect("an answer before the client gives up")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    let (_, run) = app.get_json("/api/v1/runs/slow").await;
    assert_eq!(run["step_count"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_the_cap_get_503_at_once() {
    let app = TestApp::spawn_with(|c| {
        c.max_concurrent_requests = 1;
        c.request_timeout_secs = 30;
    })
    .await;
    app.register("slow", &registration()).await;
    let stalled = stalled_upload(&app).await;
    // Give the server a moment to start handling the stalled request.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let response = reqwest::get(app.url("/api/v1/runs")).await.unwrap();
    assert_eq!(response.status(), 503);
    assert!(response.headers().contains_key("retry-after"));
    let (_, body) = error_of(response).await;
    assert_eq!(body["code"], "overloaded");
    assert!(body["message"].as_str().unwrap().contains("1 at once"));
    // The stalled client goes away: its permit is back.
    drop(stalled);
    let mut status = 0;
    for _ in 0..50 {
        status = reqwest::get(app.url("/healthz"))
            .await
            .unwrap()
            .status()
            .as_u16();
        if status == 200 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(status, 200);
}

/// The steps of a run whose step 3 has a NaN gradient and step 4 a NaN loss: two
/// alerts that open and resolve.
/// Steps 0–24, a NaN gradient on 3 and a NaN loss on 4 (each episode ends once the
/// NaN has stayed away for the hold, 20 steps).
fn steps_with_nans() -> Value {
    let mut records = steps(0..25);
    records[3]["modules"][1]["grad_norm"] = json!("NaN");
    records[4]["loss"] = json!("NaN");
    records
}

/// What a run holds: its view, its alerts and its loss and grad-norm series.
async fn what_is_stored(app: &TestApp, run_id: &str) -> Value {
    let (_, mut run) = app.get_json(&format!("/api/v1/runs/{run_id}")).await;
    for volatile in ["run_id", "created_at", "last_seen"] {
        run.as_object_mut().unwrap().remove(volatile);
    }
    let (_, alerts) = app
        .get_json(&format!("/api/v1/alerts?run_id={run_id}"))
        .await;
    let alerts: Vec<Value> = alerts["alerts"]
        .as_array()
        .expect("alerts")
        .iter()
        .map(|a| {
            json!([
                a["kind"],
                a["subject"],
                a["opened_step"],
                a["resolved_step"]
            ])
        })
        .collect();
    let loss = app.points(run_id, "metric=loss").await;
    let grads = app
        .points(run_id, "metric=grad_norm&subject=agent.head")
        .await;
    json!({"run": run, "alerts": alerts, "loss": format!("{loss:?}"), "grads": format!("{grads:?}")})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cbor_bodies_are_stored_and_judged_as_their_json() {
    const CBOR: (&str, &str) = ("content-type", "application/cbor");
    let app = TestApp::spawn().await;
    assert_eq!(app.register("json", &registration()).await.status(), 201);
    let response = app
        .client
        .put(app.url("/api/v1/runs/cbor"))
        .header(CBOR.0, CBOR.1)
        .body(gradflow_protocol::to_cbor(&registration()))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);

    let records = steps_with_nans();
    let from_json = app.post_steps("json", &records).await;
    assert_eq!(from_json.status(), 200);
    let from_cbor = app
        .post_raw(
            "/api/v1/runs/cbor/steps",
            &[CBOR],
            gradflow_protocol::to_cbor(&records),
        )
        .await;
    assert_eq!(from_cbor.status(), 200);
    assert_eq!(
        from_cbor.json::<Value>().await.unwrap(),
        from_json.json::<Value>().await.unwrap()
    );
    let stored = what_is_stored(&app, "cbor").await;
    assert_eq!(stored, what_is_stored(&app, "json").await);
    assert_eq!(
        stored["alerts"],
        json!([
            ["grad_nonfinite", "agent", 3, 4],
            ["loss_nonfinite", "loss", 4, 5]
        ]),
        "{stored}"
    );

    // gzip-compressed CBOR, and the batch typed as the trainer sends it.
    let typed: Vec<gradflow_protocol::StepRecord> = serde_json::from_value(steps(25..27)).unwrap();
    let response = app
        .post_raw(
            "/api/v1/runs/cbor/steps",
            &[CBOR, ("content-encoding", "gzip")],
            gzip(&gradflow_protocol::to_cbor(&typed)),
        )
        .await;
    assert_eq!(
        response.json::<Value>().await.unwrap(),
        json!({"accepted": 2, "duplicates": 0, "last_step": 26})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_cbor_body_is_a_400_that_stores_nothing() {
    let app = TestApp::spawn().await;
    assert_eq!(app.register("r1", &registration()).await.status(), 201);
    assert_eq!(app.post_steps("r1", &steps(0..2)).await.status(), 200);
    let before = what_is_stored(&app, "r1").await;
    let whole = gradflow_protocol::to_cbor(&steps(2..5));
    let mut bad_field = steps(2..5);
    bad_field[1]["modules"][0]["grad_norm"] = json!(-1.0);
    let cases: Vec<(&str, Vec<u8>, &str, &str)> = vec![
        (
            "cut short",
            whole[..whole.len() / 2].to_vec(),
            "steps",
            "ends before",
        ),
        (
            "JSON sent as CBOR",
            steps(2..5).to_string().into_bytes(),
            "steps",
            "",
        ),
        (
            "a bad field",
            gradflow_protocol::to_cbor(&bad_field),
            "steps[1].modules[0].grad_norm",
            "cannot be negative",
        ),
        (
            "not one item",
            [whole.clone(), whole.clone()].concat(),
            "steps",
            "trailing",
        ),
    ];
    for (what, body, path, mentions) in cases {
        let (status, error) = error_of(
            app.post_raw(
                "/api/v1/runs/r1/steps",
                &[("content-type", "application/cbor")],
                body,
            )
            .await,
        )
        .await;
        assert_eq!(
            (status, error["code"].as_str()),
            (400, Some("invalid_body")),
            "{what}: {error}"
        );
        // A body cut short names where it stopped (`steps[1].modules[1].module`).
        assert!(
            error["path"].as_str().unwrap().starts_with(path),
            "{what}: {error}"
        );
        assert!(
            error["message"].as_str().unwrap().contains(mentions),
            "{what}: {error}"
        );
    }
    assert_eq!(what_is_stored(&app, "r1").await, before);

    // A media type the protocol does not name is a 415 that names the ones it does.
    let (status, error) = error_of(
        app.post_raw(
            "/api/v1/runs/r1/steps",
            &[("content-type", "application/msgpack")],
            whole,
        )
        .await,
    )
    .await;
    assert_eq!(
        (status, error["code"].as_str()),
        (415, Some("unsupported_media_type"))
    );
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("application/cbor"),
        "{error}"
    );
    assert_eq!(what_is_stored(&app, "r1").await, before);
}
