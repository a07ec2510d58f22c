//! Bad input, table-driven, through a real server: each malformed request gets the
//! right 4xx, an error body that says what was wrong (and where, when there is a
//! where), nothing is stored, and the server stays healthy.

use std::io::Write;

use crate::common::{TestApp, registration, steps};
use serde_json::{Value, json};

/// One malformed request and what it must get.
struct Case {
    what: &'static str,
    method: &'static str,
    path: String,
    headers: Vec<(&'static str, &'static str)>,
    body: Vec<u8>,
    status: u16,
    code: &'static str,
    /// A piece of the message or of the path.
    mentions: &'static str,
}

const JSON: (&str, &str) = ("Content-Type", "application/json");
const NDJSON: (&str, &str) = ("Content-Type", "application/x-ndjson");
const GZIP: (&str, &str) = ("Content-Encoding", "gzip");

fn steps_case(
    what: &'static str,
    body: impl Into<Vec<u8>>,
    code: &'static str,
    mentions: &'static str,
) -> Case {
    Case {
        what,
        body: body.into(),
        code,
        mentions,
        ..post_steps()
    }
}

/// A POST of steps to the registered run; cases override what they change.
fn post_steps() -> Case {
    Case {
        what: "",
        method: "POST",
        path: "/api/v1/runs/r/steps".into(),
        headers: vec![JSON],
        body: Vec::new(),
        status: 400,
        code: "invalid_body",
        mentions: "",
    }
}

fn register_case(
    what: &'static str,
    run_id: &str,
    body: Value,
    code: &'static str,
    mentions: &'static str,
) -> Case {
    Case {
        what,
        method: "PUT",
        path: format!("/api/v1/runs/{run_id}"),
        headers: vec![JSON],
        body: body.to_string().into_bytes(),
        status: 400,
        code,
        mentions,
    }
}

fn cases() -> Vec<Case> {
    let module = |m: Value| json!([{"step": 10, "modules": [m]}]).to_string();
    let one = |record: Value| json!([record]).to_string();
    let many_modules: Vec<Value> = (0..100_001)
        .map(|i| json!({"module": format!("m.{i}"), "grad_norm": 1.0}))
        .collect();
    // Deep enough to overflow any parser that recurses without a limit, and well
    // under the body limit (2 MB). sonic-rs refused the first in time but recursed
    // to the end of the second, where a module is expected, and took the server down.
    let nested = format!("{}1{}", "[".repeat(1_000_000), "]".repeat(1_000_000));
    let deep = format!(r#"[{{"step": 10, "metrics": {{"a": {nested}}}}}]"#);
    let deep_module = format!(r#"[{{"step": 10, "modules": {nested}}}]"#);
    // 64 MiB of zeros: ~64 KiB compressed, over the 32 MiB limit once inflated.
    let bomb = {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        let zeros = vec![b' '; 1 << 20];
        for _ in 0..64 {
            encoder.write_all(&zeros).unwrap();
        }
        encoder.finish().unwrap()
    };
    let long_name = "n".repeat(2_000);
    let cases = vec![
        steps_case(
            "truncated JSON",
            r#"[{"step": 10, "loss": 1.0"#,
            "invalid_body",
            "EOF",
        ),
        steps_case("invalid JSON", "[{step: 10}]", "invalid_body", "key"),
        steps_case("empty body", "", "invalid_body", "EOF"),
        steps_case(
            "an object, not an array",
            r#"{"step": 10}"#,
            "invalid_body",
            "array",
        ),
        steps_case(
            "step as a string",
            one(json!({"step": "10"})),
            "invalid_body",
            "steps[0].step",
        ),
        steps_case(
            "negative step",
            one(json!({"step": -1})),
            "invalid_body",
            "steps[0].step",
        ),
        steps_case(
            "non-integer step",
            one(json!({"step": 10.5})),
            "invalid_body",
            "steps[0].step",
        ),
        steps_case(
            "step beyond 2^53 - 1",
            one(json!({"step": 9007199254740992u64})),
            "invalid_body",
            "steps[0].step",
        ),
        steps_case(
            "step 1e300",
            "[{\"step\": 1e300}]",
            "invalid_body",
            "steps[0].step",
        ),
        steps_case(
            "steps going backwards",
            json!([{"step": 12}, {"step": 11}]).to_string(),
            "invalid_body",
            "steps[1].step",
        ),
        steps_case(
            "the same step twice",
            json!([{"step": 12}, {"step": 12}]).to_string(),
            "invalid_body",
            "steps[1].step",
        ),
        steps_case(
            "lower-case nan",
            one(json!({"step": 10, "loss": "nan"})),
            "invalid_body",
            "steps[0].loss",
        ),
        steps_case(
            "Inf spelling",
            one(json!({"step": 10, "loss": "Inf"})),
            "invalid_body",
            "steps[0].loss",
        ),
        steps_case(
            "loss as a boolean",
            one(json!({"step": 10, "loss": true})),
            "invalid_body",
            "steps[0].loss",
        ),
        steps_case(
            "modules not a list",
            one(json!({"step": 10, "modules": {"a": 1}})),
            "invalid_body",
            "steps[0].modules",
        ),
        steps_case(
            "module without a name",
            module(json!({"grad_norm": 1.0})),
            "invalid_body",
            "steps[0].modules[0]",
        ),
        steps_case(
            "module with an empty name",
            module(json!({"module": "", "grad_norm": 1.0})),
            "invalid_body",
            "steps[0].modules[0].module",
        ),
        steps_case(
            "module name with a newline",
            module(json!({"module": "a\nb", "grad_norm": 1.0})),
            "invalid_body",
            "steps[0].modules[0].module",
        ),
        steps_case(
            "module name with a control character",
            module(json!({"module": "a\u{7}", "grad_norm": 1.0})),
            "invalid_body",
            "steps[0].modules[0].module",
        ),
        steps_case(
            "negative hook count",
            module(json!({"module": "a", "hook_hits": -1})),
            "invalid_body",
            "steps[0].modules[0].hook_hits",
        ),
        steps_case(
            "negative dropped-steps count",
            json!([{"step": 0, "dropped_steps": -3}]).to_string(),
            "invalid_body",
            "steps[0].dropped_steps",
        ),
        steps_case(
            "fractional hook count",
            module(json!({"module": "a", "hook_hits": 1.5})),
            "invalid_body",
            "steps[0].modules[0].hook_hits",
        ),
        steps_case(
            "negative gradient norm",
            module(json!({"module": "a", "grad_norm": -1.0})),
            "invalid_body",
            "steps[0].modules[0].grad_norm",
        ),
        steps_case(
            "misspelt field",
            module(json!({"module": "a", "grad_nrom": 1.0})),
            "invalid_body",
            "grad_nrom",
        ),
        steps_case(
            "100,001 modules in one record",
            json!([{"step": 10, "modules": many_modules}]).to_string(),
            "invalid_body",
            "steps[0].modules",
        ),
        steps_case(
            "1,000,000 levels of nesting",
            deep,
            "invalid_body",
            "steps[0]",
        ),
        steps_case(
            "1,000,000 levels of nesting where a module is expected",
            deep_module,
            "invalid_body",
            "steps[0].modules",
        ),
        steps_case(
            "invalid UTF-8",
            b"[{\"step\": 10, \"modules\": [{\"module\": \"\xff\xfe\"}]}]".to_vec(),
            "invalid_body",
            "steps[0].modules[0].module",
        ),
        steps_case(
            "a parameter the run did not register",
            one(json!({"step": 10, "params": [{"name": "ghost.weight", "grad_norm": 1.0}]})),
            "invalid_body",
            "ghost.weight",
        ),
        steps_case(
            "an unreadable timestamp",
            one(json!({"step": 10, "time": "yesterday"})),
            "invalid_body",
            "steps[0].time",
        ),
        steps_case(
            "a negative GPU index",
            one(json!({"step": 10, "gpu": [{"index": -1}]})),
            "invalid_body",
            "steps[0].gpu[0].index",
        ),
        steps_case(
            "a metric name with a control character",
            one(json!({"step": 10, "metrics": {"a\u{1}": 1.0}})),
            "invalid_body",
            "steps[0].metrics",
        ),
        Case {
            what: "NDJSON with a bad second line",
            headers: vec![NDJSON],
            body: b"{\"step\": 10}\n{\"step\": }\n".to_vec(),
            code: "invalid_body",
            mentions: "line 2",
            ..post_steps()
        },
        Case {
            what: "corrupt gzip",
            headers: vec![JSON, GZIP],
            body: b"\x1f\x8b\x08\x00garbage".to_vec(),
            code: "invalid_gzip",
            mentions: "gzip",
            ..post_steps()
        },
        Case {
            what: "gzip of a truncated batch",
            headers: vec![JSON, GZIP],
            body: crate::common::gzip(br#"[{"step": 10, "loss": "#),
            mentions: "EOF",
            ..post_steps()
        },
        Case {
            what: "a gzip bomb",
            headers: vec![JSON, GZIP],
            body: bomb,
            status: 413,
            code: "body_too_large",
            mentions: "bytes",
            ..post_steps()
        },
        Case {
            what: "a text/plain body",
            headers: vec![("Content-Type", "text/plain")],
            body: steps(10..11).to_string().into_bytes(),
            status: 415,
            code: "unsupported_media_type",
            mentions: "text/plain",
            ..post_steps()
        },
        Case {
            what: "brotli encoding",
            headers: vec![JSON, ("Content-Encoding", "br")],
            body: steps(10..11).to_string().into_bytes(),
            status: 415,
            code: "unsupported_encoding",
            mentions: "br",
            ..post_steps()
        },
        Case {
            what: "a body over the limit",
            body: vec![b' '; 33 * 1024 * 1024],
            status: 413,
            code: "body_too_large",
            mentions: "bytes",
            ..post_steps()
        },
        Case {
            what: "steps for a run that is not registered",
            path: "/api/v1/runs/ghost/steps".into(),
            body: steps(0..1).to_string().into_bytes(),
            status: 404,
            code: "run_not_found",
            mentions: "ghost",
            ..post_steps()
        },
        register_case(
            "a run id with a path separator",
            "a%2Fb",
            registration(),
            "invalid_run_id",
            "run_id",
        ),
        register_case(
            "a run id of SQL",
            "x'%3BDROP%20TABLE%20runs%3B--",
            registration(),
            "invalid_run_id",
            "run_id",
        ),
        register_case(
            "a run id of 129 characters",
            &"r".repeat(129),
            registration(),
            "invalid_run_id",
            "128",
        ),
        register_case(
            "a parameter name with a control character",
            "new",
            json!({"params": [{"name": "a\u{1b}[31m"}]}),
            "invalid_body",
            "params[0].name",
        ),
        register_case(
            "100,001 parameters in one registration",
            "new",
            json!({"params": (0..100_001).map(|i| json!({"name": format!("p{i}")})).collect::<Vec<_>>()}),
            "invalid_body",
            "100000",
        ),
        register_case(
            "a parameter name of 513 bytes",
            "new",
            json!({"params": [{"name": "n".repeat(513)}]}),
            "invalid_body",
            "params[0].name",
        ),
        register_case(
            "params not a list",
            "new",
            json!({"params": {"name": "a"}}),
            "invalid_body",
            "params",
        ),
        register_case(
            "the same parameter twice",
            "new",
            json!({"params": [{"name": "a.w"}, {"name": "a.w"}]}),
            "invalid_body",
            "params[1].name",
        ),
        register_case(
            "an unknown dtype",
            "new",
            json!({"params": [{"name": "a.w", "dtype": "float32x"}]}),
            "invalid_body",
            "params[0].dtype",
        ),
        register_case(
            "an unknown role",
            "new",
            json!({"params": [{"name": "a.w", "role": "weird"}]}),
            "invalid_body",
            "params[0].role",
        ),
        register_case(
            "world_size 0",
            "new",
            json!({"world_size": 0, "params": []}),
            "invalid_body",
            "world_size",
        ),
        register_case(
            "a 2,000-byte run name",
            "new",
            json!({"name": long_name, "params": []}),
            "invalid_body",
            "name",
        ),
        register_case(
            "no params at all",
            "new",
            json!({"name": "x"}),
            "invalid_body",
            "params",
        ),
    ];
    cases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_rejected_clearly_and_change_nothing() {
    let app = TestApp::spawn().await;
    assert_eq!(app.register("r", &registration()).await.status(), 201);
    assert_eq!(app.post_steps("r", &steps(0..10)).await.status(), 200);
    let (_, runs_before) = app.get_json("/api/v1/runs").await;
    let (_, loss_before) = app.get_json("/api/v1/runs/r/series?metric=loss").await;
    let client = reqwest::Client::new();
    let cases = cases();
    assert!(cases.len() >= 40, "{} cases", cases.len());
    let mut failures = Vec::new();
    for case in cases {
        let mut request = client.request(case.method.parse().unwrap(), app.url(&case.path));
        for (name, value) in &case.headers {
            request = request.header(*name, *value);
        }
        let response = request.body(case.body).send().await.unwrap();
        let status = response.status().as_u16();
        let body: Value = response
            .json()
            .await
            .unwrap_or_else(|e| panic!("{}: the error body is not JSON: {e}", case.what));
        let error = &body["error"];
        let message = error["message"].as_str().unwrap_or_default();
        let path = error["path"].as_str().unwrap_or_default();
        if status != case.status
            || error["code"] != case.code
            || message.is_empty()
            || !(message.contains(case.mentions) || path.contains(case.mentions))
        {
            failures.push(format!(
                "{}: expected {} {} mentioning {:?}, got {status} {body}",
                case.what, case.status, case.code, case.mentions
            ));
        }
        // Nothing stored, and the server still answers.
        let (health, _) = app.get_json("/healthz").await;
        assert_eq!(health, 200, "{}: the server is unhealthy", case.what);
        let (_, runs) = app.get_json("/api/v1/runs").await;
        assert_eq!(runs, runs_before, "{}: the runs changed", case.what);
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
    let (_, loss) = app.get_json("/api/v1/runs/r/series?metric=loss").await;
    assert_eq!(loss, loss_before);
}

/// A client that sends a whole over-limit body before it reads (no
/// `Expect: 100-continue`, as most clients) finishes writing and reads the `413`,
/// rather than meeting a connection closed mid-write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_limit_body_is_read_to_its_end_before_the_413() {
    let app = TestApp::spawn().await;
    assert_eq!(app.register("r", &registration()).await.status(), 201);
    let address = app.base.trim_start_matches("http://").to_string();
    let (status, body) = tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let body = vec![b' '; 33 * 1024 * 1024];
        let mut stream = std::net::TcpStream::connect(&address).unwrap();
        write!(
            stream,
            "POST /api/v1/runs/r/steps HTTP/1.1\r\nHost: {address}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n",
            body.len()
        )
        .unwrap();
        stream
            .write_all(&body)
            .expect("the server closed the connection while the body was being sent");
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        let status = answer.split(' ').nth(1).unwrap_or_default().to_string();
        let body = answer
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        (status, body)
    })
    .await
    .unwrap();
    assert_eq!(status, "413", "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "body_too_large", "{error}");
    let (_, run) = app.get_json("/api/v1/runs/r").await;
    assert_eq!(run["last_step"], Value::Null, "nothing stored: {run}");
}
