//! The reporter's body encoding, against a real gradflow server on its own SQLite
//! file: JSON by default, CBOR when told; and against a server older than protocol
//! v1.6, JSON after its `415`. The older server is the real one behind a front that
//! answers `415 unsupported_media_type` to `application/cbor`, as a v1.5 server does,
//! and passes everything else through; the front also notes each `Content-Type` it saw.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use clap::Parser;
use gradflow_protocol::{Float, RunRegistration, StepRecord};
use gradflow_server::config::ServerConfig;
use gradflow_server::startup::Application;
use gradflow_trainer::reporter::{Reporter, ReporterConfig};
use serde_json::Value;
use tokio::runtime::Runtime;

#[derive(Clone)]
struct Front {
    target: String,
    refuses_cbor: bool,
    seen: Arc<Mutex<Vec<String>>>,
    client: reqwest::Client,
}

async fn pass(State(front): State<Front>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    if parts.uri.path().ends_with("/steps") {
        front.seen.lock().unwrap().push(content_type.clone());
    }
    if front.refuses_cbor && content_type == "application/cbor" {
        let error = serde_json::json!({"error": {"code": "unsupported_media_type",
            "message": "Content-Type \"application/cbor\" is not accepted here: send Content-Type: application/json or application/x-ndjson"}});
        return (StatusCode::UNSUPPORTED_MEDIA_TYPE, axum::Json(error)).into_response();
    }
    forward(&front, parts.method, &parts.uri, &parts.headers, body).await
}

async fn forward(
    front: &Front,
    method: Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
) -> Response {
    let mut request = front
        .client
        .request(method, format!("{}{uri}", front.target))
        .body(body);
    for name in [header::CONTENT_TYPE, header::CONTENT_ENCODING] {
        if let Some(value) = headers.get(&name) {
            request = request.header(name, value.as_bytes());
        }
    }
    let answer = request.send().await.unwrap();
    let status = StatusCode::from_u16(answer.status().as_u16()).unwrap();
    (status, answer.bytes().await.unwrap()).into_response()
}

/// A real server and a front on its own port; returns (the front's base URL, the
/// server's base URL, what the front saw).
fn start(
    runtime: &Runtime,
    db: &std::path::Path,
    refuses_cbor: bool,
) -> (String, String, Arc<Mutex<Vec<String>>>) {
    let config = ServerConfig::try_parse_from([
        "gradflow-server",
        "--listen",
        "127.0.0.1:0",
        "--db",
        db.to_str().unwrap(),
        "--sync",
        "normal",
    ])
    .unwrap();
    let app = runtime.block_on(Application::build(&config)).unwrap();
    let server = format!("http://{}", app.address());
    runtime.spawn(app.run_until(std::future::pending()));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let front = Front {
        target: server.clone(),
        refuses_cbor,
        seen: seen.clone(),
        client: reqwest::Client::new(),
    };
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let router = axum::Router::new().fallback(pass).with_state(front);
    runtime.spawn(async move { axum::serve(listener, router).await });
    (base, server, seen)
}

/// Streams steps 0..20 (step 7's loss NaN) through `base`, and says what the server
/// stored of the loss: (step, value) pairs as its API writes them.
fn stream(base: &str, server: &str, cbor: bool, spool: std::path::PathBuf) -> Vec<Value> {
    let mut config = ReporterConfig::new(base, "bodies");
    config.batch_size = 5;
    config.batch_interval = Duration::from_millis(50);
    config.spool_path = spool;
    config.cbor = cbor;
    let registration: RunRegistration =
        serde_json::from_value(serde_json::json!({"params": []})).unwrap();
    let reporter = Reporter::start(config, registration).unwrap();
    for step in 0..20 {
        let loss = if step == 7 {
            f64::NAN
        } else {
            1.0 / (step + 1) as f64
        };
        reporter.report(StepRecord {
            step,
            loss: Some(Float(loss)),
            ..Default::default()
        });
    }
    let summary = reporter.finish(Duration::from_secs(20));
    assert!(summary.complete(), "{summary:?}");
    assert_eq!(summary.delivered, 20, "{summary:?}");
    let url = format!("{server}/api/v1/runs/bodies/series?metric=loss");
    let body: Value = reqwest::blocking::get(url).unwrap().json().unwrap();
    body["points"].as_array().unwrap().clone()
}

#[test]
fn json_by_default_cbor_when_told_and_json_again_when_the_server_is_older() {
    assert!(
        !ReporterConfig::new("http://127.0.0.1:1", "r").cbor,
        "JSON by default"
    );
    let runtime = Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut stored = Vec::new();
    for (name, refuses_cbor, cbor, expected) in [
        ("current", false, true, &["application/cbor"][..]),
        ("told", false, false, &["application/json"][..]),
        (
            "older",
            true,
            true,
            &["application/cbor", "application/json"][..],
        ),
    ] {
        let (base, server, seen) = start(
            &runtime,
            &dir.path().join(format!("{name}.db")),
            refuses_cbor,
        );
        stored.push(stream(
            &base,
            &server,
            cbor,
            dir.path().join(format!("{name}.spool")),
        ));
        let mut kinds = seen.lock().unwrap().clone();
        kinds.dedup();
        assert_eq!(
            kinds, expected,
            "{name}: the step batches' Content-Types in order"
        );
    }
    assert_eq!(stored[0].len(), 20);
    assert_eq!(stored[0][7][1], "NaN", "{:?}", stored[0][7]);
    assert_eq!(stored[0], stored[1]);
    assert_eq!(stored[0], stored[2]);
}
