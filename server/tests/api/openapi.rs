//! The API document covers every endpoint of docs/PROTOCOL.md (and the extensions), and
//! real responses of a real server validate against the schemas it gives for them.

use crate::common::{TestApp, registration, steps};
use serde_json::{Value, json};

/// Every request of docs/PROTOCOL.md, plus what this server adds.
const ENDPOINTS: &[(&str, &str)] = &[
    ("put", "/api/v1/runs/{run_id}"),
    ("post", "/api/v1/runs/{run_id}/steps"),
    ("get", "/healthz"),
    ("get", "/api/v1/runs"),
    ("get", "/api/v1/runs/{run_id}"),
    ("get", "/api/v1/alerts"),
    ("get", "/api/v1/runs/{run_id}/alerts"),
    ("get", "/api/v1/runs/{run_id}/series"),
    ("get", "/api/v1/runs/{run_id}/charts/{file}"),
    ("get", "/api/v1/events"),
    ("delete", "/api/v1/runs/{run_id}"),
    // Extensions.
    ("post", "/api/v1/runs/{run_id}/finish"),
    ("get", "/metrics"),
    ("get", "/api/v1/openapi.json"),
    ("get", "/api/v1/charts/{file}"),
    ("get", "/api/v1/runs/{run_id}/ranks"),
];

struct Document(Value);

impl Document {
    /// Checks `body` against the document's schema for (`path`, `method`, `status`).
    fn check(&self, method: &str, path: &str, status: u16, body: &Value) {
        let errors = self.errors(method, path, status, body);
        assert!(
            errors.is_empty(),
            "{method} {path} {status} does not match its schema:\n{}\nbody: {body}",
            errors.join("\n")
        );
    }

    /// What is wrong with `body` under the document's schema for it.
    fn errors(&self, method: &str, path: &str, status: u16, body: &Value) -> Vec<String> {
        let mut response = &self.0["paths"][path][method]["responses"][status.to_string()];
        // A shared response is a reference to components.responses.
        if let Some(reference) = response["$ref"].as_str() {
            let name = reference
                .strip_prefix("#/components/responses/")
                .expect("a reference to a shared response");
            response = &self.0["components"]["responses"][name];
        }
        let schema = response["content"]["application/json"]["schema"].clone();
        assert!(
            !schema.is_null(),
            "no JSON schema for {method} {path} {status}"
        );
        let root = json!({"components": self.0["components"], "allOf": [schema]});
        let validator = jsonschema::validator_for(&root).expect("a valid schema");
        validator
            .iter_errors(body)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_covers_the_protocol_and_real_responses_match_it() {
    let app = TestApp::spawn().await;
    let (status, document) = app.get_json("/api/v1/openapi.json").await;
    assert_eq!(status, 200);
    assert!(document["openapi"].as_str().unwrap().starts_with("3."));
    for (method, path) in ENDPOINTS {
        assert!(
            document["paths"][path][method].is_object(),
            "{method} {path} is not in the document"
        );
    }
    let doc = Document(document);
    // The schemas are strict enough to catch a wrong shape.
    for wrong in [
        json!({"runs": [{"run_id": 5}]}),
        json!({"runs": {}}),
        json!({}),
    ] {
        assert!(
            !doc.errors("get", "/api/v1/runs", 200, &wrong).is_empty(),
            "{wrong}"
        );
    }
    let client = reqwest::Client::new();

    let (status, body) = app.get_json("/healthz").await;
    doc.check("get", "/healthz", status, &body);

    let response = app.register("run-a", &registration()).await;
    assert_eq!(response.status(), 201);
    doc.check(
        "put",
        "/api/v1/runs/{run_id}",
        201,
        &response.json().await.unwrap(),
    );
    let response = app.register("run-a", &registration()).await;
    doc.check(
        "put",
        "/api/v1/runs/{run_id}",
        200,
        &response.json().await.unwrap(),
    );
    let response = app.register("run-a", &json!({"params": []})).await;
    assert_eq!(response.status(), 409);
    doc.check(
        "put",
        "/api/v1/runs/{run_id}",
        409,
        &response.json().await.unwrap(),
    );
    // A scaler over bf16: an alert with evidence, opened at registration.
    app.register(
        "run-b",
        &json!({"precision": {"param_dtype": "bf16", "loss_scaler": "dynamic"},
                "params": [{"name": "qwen.norm.weight", "role": "norm"}]}),
    )
    .await;

    let response = app.post_steps("run-a", &steps(0..5)).await;
    assert_eq!(response.status(), 200);
    doc.check(
        "post",
        "/api/v1/runs/{run_id}/steps",
        200,
        &response.json().await.unwrap(),
    );
    let response = app.post_steps("run-a", &json!([{"step": "x"}])).await;
    assert_eq!(response.status(), 400);
    doc.check(
        "post",
        "/api/v1/runs/{run_id}/steps",
        400,
        &response.json().await.unwrap(),
    );
    let response = app.post_steps("nope", &steps(0..1)).await;
    assert_eq!(response.status(), 404);
    doc.check(
        "post",
        "/api/v1/runs/{run_id}/steps",
        404,
        &response.json().await.unwrap(),
    );

    for path in ["/api/v1/runs/run-a", "/api/v1/runs/run-b"] {
        let (status, body) = app.get_json(path).await;
        doc.check("get", "/api/v1/runs/{run_id}", status, &body);
    }
    let (status, body) = app.get_json("/api/v1/runs").await;
    doc.check("get", "/api/v1/runs", status, &body);
    let (status, body) = app.get_json("/api/v1/alerts").await;
    assert!(!body["alerts"].as_array().unwrap().is_empty());
    doc.check("get", "/api/v1/alerts", status, &body);
    let (status, body) = app.get_json("/api/v1/runs/run-b/alerts?status=open").await;
    doc.check("get", "/api/v1/runs/{run_id}/alerts", status, &body);
    for query in [
        "metric=loss",
        "metric=grad_norm&subject=qwen&max_points=2",
        "metric=hook_hits&subject=agent.head",
    ] {
        let (status, body) = app
            .get_json(&format!("/api/v1/runs/run-a/series?{query}"))
            .await;
        doc.check("get", "/api/v1/runs/{run_id}/series", status, &body);
    }
    // Where each rank stands: a single process, and two ranks of which one has
    // sent nothing (its fields null).
    for rank in 0..2 {
        let body = json!({"world_size": 2, "rank": rank, "params": []});
        assert!(app.register("ddp", &body).await.status().is_success());
    }
    let records = json!([{"step": 0, "rank": 0, "loss": 1.0, "step_time": 0.1}]);
    assert_eq!(app.post_steps("ddp", &records).await.status(), 200);
    for run in ["run-a", "ddp", "ghost"] {
        let (status, body) = app.get_json(&format!("/api/v1/runs/{run}/ranks")).await;
        doc.check("get", "/api/v1/runs/{run_id}/ranks", status, &body);
    }
    let (_, ranks) = app.get_json("/api/v1/runs/ddp/ranks").await;
    assert!(ranks["ranks"][1]["last_step"].is_null(), "{ranks}");
    let (status, body) = app.get_json("/api/v1/runs/run-a/series?metric=bogus").await;
    doc.check("get", "/api/v1/runs/{run_id}/series", status, &body);
    for query in ["run=run-a", "run=run-a&run=ghost"] {
        let (status, body) = app
            .get_json(&format!("/api/v1/charts/compare.svg?{query}"))
            .await;
        assert!(status == 400 || status == 404, "{query}: {status}");
        doc.check("get", "/api/v1/charts/{file}", status, &body);
    }
    let response = client
        .post(app.url("/api/v1/runs/run-a/finish"))
        .send()
        .await
        .unwrap();
    doc.check(
        "post",
        "/api/v1/runs/{run_id}/finish",
        200,
        &response.json().await.unwrap(),
    );
    let response = client
        .delete(app.url("/api/v1/runs/run-a"))
        .send()
        .await
        .unwrap();
    doc.check(
        "delete",
        "/api/v1/runs/{run_id}",
        200,
        &response.json().await.unwrap(),
    );
    let (status, body) = app.get_json("/api/v1/runs/run-a").await;
    doc.check("get", "/api/v1/runs/{run_id}", status, &body);
}
