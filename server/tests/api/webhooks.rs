//! Alert notifications through real webhooks: a real HTTP receiver on 127.0.0.1
//! that refuses its first attempts, the delivery log of the API, a queue that
//! outlives a restart, per-run receivers and severities, and bad input.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{TestApp, error_of};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use serde_json::{Value, json};
use tokio::net::TcpListener;

/// A webhook receiver: answers `fail_first` attempts of each distinct body with
/// `failure`, then 200, and keeps every body it accepted.
#[derive(Clone)]
struct Receiver {
    url: String,
    accepted: Arc<Mutex<Vec<Value>>>,
    task: Arc<tokio::task::JoinHandle<()>>,
}

#[derive(Clone)]
struct ReceiverState {
    fail_first: usize,
    failure: StatusCode,
    seen: Arc<Mutex<HashMap<String, usize>>>,
    accepted: Arc<Mutex<Vec<Value>>>,
}

async fn receive(State(state): State<ReceiverState>, Json(body): Json<Value>) -> StatusCode {
    let key = body.to_string();
    let attempts = {
        let mut seen = state.seen.lock().unwrap();
        let n = seen.entry(key).or_insert(0);
        *n += 1;
        *n
    };
    if attempts <= state.fail_first {
        return state.failure;
    }
    state.accepted.lock().unwrap().push(body);
    StatusCode::OK
}

impl Receiver {
    async fn start(fail_first: usize, failure: StatusCode) -> Receiver {
        Self::start_on(
            TcpListener::bind("127.0.0.1:0").await.unwrap(),
            fail_first,
            failure,
        )
        .await
    }

    async fn start_on(listener: TcpListener, fail_first: usize, failure: StatusCode) -> Receiver {
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let accepted = Arc::new(Mutex::new(Vec::new()));
        let state = ReceiverState {
            fail_first,
            failure,
            seen: Arc::default(),
            accepted: accepted.clone(),
        };
        let app = axum::Router::new()
            .route("/hook", post(receive))
            .with_state(state);
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Receiver {
            url,
            accepted,
            task: Arc::new(task),
        }
    }

    fn accepted(&self) -> Vec<Value> {
        self.accepted.lock().unwrap().clone()
    }

    /// Waits until `n` bodies were accepted (or fails after 20 s).
    async fn wait_for(&self, n: usize) -> Vec<Value> {
        for _ in 0..400 {
            let accepted = self.accepted();
            if accepted.len() >= n {
                return accepted;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "the receiver got {} bodies, not {n}: {:?}",
            self.accepted().len(),
            self.accepted()
        );
    }
}

/// A run whose `qwen` group gets no gradient from step 1 to 5 (grad_stuck_zero
/// opens at step 5 with `stuck_zero_steps` 5), then trains (it resolves at 6, said
/// once the group has trained for the hold, 20 steps).
async fn stuck_then_healed(app: &TestApp, run_id: &str, webhooks: Value) {
    let registration = json!({
        "params": [{"name": "qwen.proj.weight"}, {"name": "agent.head.weight"}],
        "detectors": {"stuck_zero_steps": 5},
        "webhooks": webhooks,
    });
    let response = app.register(run_id, &registration).await;
    assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
    let step = |s: u64, qwen: f64| {
        json!({"step": s, "loss": 2.0, "modules": [
            {"module": "qwen.proj", "grad_norm": qwen, "hook_hits": u32::from(qwen > 0.0)},
            {"module": "agent.head", "grad_norm": 0.5, "hook_hits": 1}]})
    };
    let stuck: Vec<Value> = (1..=5).map(|s| step(s, 0.0)).collect();
    let healed: Vec<Value> = (6..=26).map(|s| step(s, 0.3)).collect();
    for batch in [stuck, healed] {
        let response = app.post_steps(run_id, &Value::Array(batch)).await;
        assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    }
}

fn of_kind<'a>(bodies: &'a [Value], kind: &str) -> Vec<&'a Value> {
    bodies
        .iter()
        .filter(|b| {
            b["alert"]["kind"] == kind || b["text"].as_str().is_some_and(|t| t.contains(kind))
        })
        .collect()
}

async fn deliveries(app: &TestApp, query: &str) -> Vec<Value> {
    let (status, body) = app
        .get_json(&format!("/api/v1/webhooks/deliveries{query}"))
        .await;
    assert_eq!(status, 200, "{body}");
    body["deliveries"].as_array().unwrap().clone()
}

#[tokio::test]
async fn alerts_reach_a_receiver_that_refuses_its_first_attempts() {
    let generic = Receiver::start(2, StatusCode::SERVICE_UNAVAILABLE).await;
    let slack = Receiver::start(2, StatusCode::SERVICE_UNAVAILABLE).await;
    let app = TestApp::spawn_with(|c| {
        c.webhooks.generic = vec![generic.url.clone()];
        c.webhooks.slack = vec![slack.url.clone()];
        c.webhooks.retry_secs = 0.05;
        c.webhooks.public_url = Some("https://gradflow.example".into());
    })
    .await;
    stuck_then_healed(&app, "r1", json!([])).await;

    // Opened, then resolved; each after two refusals.
    let bodies = generic.wait_for(2).await;
    let stuck = of_kind(&bodies, "grad_stuck_zero");
    assert_eq!(stuck.len(), 2, "{bodies:?}");
    let opened = stuck.iter().find(|b| b["event"] == "alert.opened").unwrap();
    assert_eq!(opened["alert"]["run_id"], "r1");
    assert_eq!(opened["alert"]["subject"], "qwen");
    assert_eq!(opened["alert"]["opened_step"], 5);
    assert_eq!(opened["alert"]["status"], "open");
    assert_eq!(opened["run_url"], "https://gradflow.example/runs/r1");
    let resolved = stuck
        .iter()
        .find(|b| b["event"] == "alert.resolved")
        .unwrap();
    assert_eq!(resolved["alert"]["id"], opened["alert"]["id"]);
    assert_eq!(resolved["alert"]["status"], "resolved");
    assert_eq!(resolved["alert"]["resolved_step"], 6);
    // The info hint of the first steps stays off the server's receivers (warning and
    // up by default).
    assert!(of_kind(&bodies, "first_step_hint").is_empty(), "{bodies:?}");

    let texts = slack.wait_for(2).await;
    let opened_text = texts
        .iter()
        .filter_map(|b| b["text"].as_str())
        .find(|t| t.contains("grad_stuck_zero") && !t.contains("Resolved"))
        .unwrap_or_else(|| panic!("{texts:?}"));
    assert!(
        opened_text.contains("on `qwen`, run <https://gradflow.example/runs/r1|r1> at step 5"),
        "{opened_text}"
    );
    assert!(opened_text.contains("*Fix:*"), "{opened_text}");

    // The log says what happened: three attempts each, the last answered 200.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = deliveries(&app, "?run_id=r1").await;
    assert_eq!(log.len(), 4, "{log:?}");
    for delivery in &log {
        assert_eq!(delivery["status"], "delivered", "{delivery}");
        assert_eq!(delivery["attempts"], 3, "{delivery}");
        assert_eq!(delivery["last_status"], 200, "{delivery}");
        assert!(delivery["delivered_at"].is_f64(), "{delivery}");
        assert!(delivery["next_attempt_at"].is_null(), "{delivery}");
        // The path, where webhook URLs keep their secret, is not shown.
        assert!(
            !delivery["target"].as_str().unwrap().contains("/hook"),
            "{delivery}"
        );
    }
    let mut formats: Vec<&str> = log.iter().map(|d| d["format"].as_str().unwrap()).collect();
    formats.sort();
    assert_eq!(formats, ["generic", "generic", "slack", "slack"]);
    assert_eq!(deliveries(&app, "?status=pending").await.len(), 0);
    assert_eq!(deliveries(&app, "?status=delivered&limit=1").await.len(), 1);
}

#[tokio::test]
async fn a_run_names_its_own_receivers_and_severities() {
    let server_wide = Receiver::start(0, StatusCode::OK).await;
    let runs_own = Receiver::start(0, StatusCode::OK).await;
    let app = TestApp::spawn_with(|c| {
        c.webhooks.generic = vec![server_wide.url.clone()];
        c.webhooks.retry_secs = 0.05;
    })
    .await;
    stuck_then_healed(
        &app,
        "r2",
        json!([{"url": runs_own.url, "min_severity": "info"}]),
    )
    .await;
    // Readers see where the run's notifications go, not the URL's path.
    let (_, run) = app.get_json("/api/v1/runs/r2").await;
    let shown = run["webhooks"][0]["url"].as_str().unwrap();
    assert_eq!(format!("{shown}/hook"), runs_own.url, "{run}");
    assert_eq!(run["webhooks"][0]["min_severity"], "info");
    // The run's receiver asked for info: it also gets the first-step hint.
    let own = runs_own.wait_for(4).await;
    assert_eq!(of_kind(&own, "grad_stuck_zero").len(), 2, "{own:?}");
    assert!(!of_kind(&own, "first_step_hint").is_empty(), "{own:?}");
    let wide = server_wide.wait_for(2).await;
    assert!(of_kind(&wide, "first_step_hint").is_empty(), "{wide:?}");

    // Another run without receivers of its own notifies the server's only.
    stuck_then_healed(&app, "r3", json!([])).await;
    server_wide.wait_for(4).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        runs_own
            .accepted()
            .iter()
            .all(|b| b["alert"]["run_id"] == "r2")
    );
}

#[tokio::test]
async fn a_refused_body_fails_at_once_and_an_unreachable_one_gives_up() {
    let refusing = Receiver::start(usize::MAX, StatusCode::BAD_REQUEST).await;
    // A port nothing listens on.
    let closed = {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        format!("http://{}/hook", listener.local_addr().unwrap())
    };
    let app = TestApp::spawn_with(|c| {
        c.webhooks.generic = vec![refusing.url.clone(), closed.clone()];
        c.webhooks.retry_secs = 0.02;
        c.webhooks.max_attempts = 3;
    })
    .await;
    stuck_then_healed(&app, "r4", json!([])).await;
    let mut log = Vec::new();
    for _ in 0..200 {
        log = deliveries(&app, "?run_id=r4").await;
        if log.len() == 4 && log.iter().all(|d| d["status"] == "failed") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(log.len(), 4, "{log:?}");
    for delivery in &log {
        assert_eq!(delivery["status"], "failed", "{delivery}");
        let error = delivery["last_error"].as_str().unwrap();
        if delivery["last_status"] == 400 {
            assert_eq!(delivery["attempts"], 1, "{delivery}");
            assert!(
                error.contains("400 Bad Request") && error.contains("not retried"),
                "{error}"
            );
        } else {
            assert!(delivery["last_status"].is_null(), "{delivery}");
            assert_eq!(delivery["attempts"], 3, "{delivery}");
            assert!(
                error.contains("gave up after 3 attempts") && error.contains("cannot connect"),
                "{error}"
            );
        }
    }
    assert!(refusing.accepted().is_empty());
}

#[tokio::test]
async fn the_queue_outlives_a_restart() {
    // Reserve a port, then leave it closed while the alert opens.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    drop(listener);
    let url = format!("http://{address}/hook");
    let app = TestApp::spawn_with(|c| {
        c.webhooks.generic = vec![url.clone()];
        c.webhooks.retry_secs = 0.05;
    })
    .await;
    stuck_then_healed(&app, "r5", json!([])).await;
    let mut pending = Vec::new();
    for _ in 0..100 {
        pending = deliveries(&app, "?status=pending").await;
        if pending.len() == 2 && pending.iter().all(|d| d["attempts"].as_i64() >= Some(1)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(pending.len(), 2, "{pending:?}");
    assert!(
        pending[0]["last_error"]
            .as_str()
            .unwrap()
            .contains("cannot connect")
    );
    assert!(pending[0]["next_attempt_at"].is_f64());

    let app = app
        .restart_with(|c| {
            c.webhooks.generic = vec![url.clone()];
            c.webhooks.retry_secs = 0.05;
        })
        .await;
    let receiver =
        Receiver::start_on(TcpListener::bind(address).await.unwrap(), 0, StatusCode::OK).await;
    let bodies = receiver.wait_for(2).await;
    let mut events: Vec<&str> = bodies
        .iter()
        .map(|b| b["event"].as_str().unwrap())
        .collect();
    events.sort();
    assert_eq!(events, ["alert.opened", "alert.resolved"]);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = deliveries(&app, "?run_id=r5").await;
    assert!(log.iter().all(|d| d["status"] == "delivered"), "{log:?}");
    receiver.task.abort();
}

#[tokio::test]
async fn bad_webhooks_and_queries_are_refused_and_store_nothing() {
    let app = TestApp::spawn().await;
    let response = app
        .register(
            "bad",
            &json!({"params": [], "webhooks": [{"url": "file:///etc/passwd"}]}),
        )
        .await;
    let (status, error) = error_of(response).await;
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["path"], "webhooks[0].url", "{error}");
    let (status, _) = app.get_json("/api/v1/runs/bad").await;
    assert_eq!(status, 404);

    for (query, path) in [
        ("?status=sent", "status"),
        ("?limit=0", "limit"),
        ("?limit=1001", "limit"),
        ("?run_id=a/b", "run_id"),
    ] {
        let (status, body) = app
            .get_json(&format!("/api/v1/webhooks/deliveries{query}"))
            .await;
        assert_eq!(status, 400, "{query}: {body}");
        assert_eq!(body["error"]["path"], path, "{query}: {body}");
    }
    let (status, body) = app
        .get_json("/api/v1/webhooks/deliveries?run_id=nope")
        .await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = app.get_json("/api/v1/webhooks/deliveries").await;
    assert_eq!((status, body), (200, json!({"deliveries": []})));
}

/// A loss that flaps around `loss_divergence`'s bar, its gradients with it: 4× its
/// level with gradients 20× on six steps, back on the next fourteen, eight times
/// over, as a run at the edge of stability does. Each return within the hold
/// continues the one episode (and doubles its hold, up to 1,000 steps), so the
/// receiver hears one opening and, once the loss has stayed below for the hold, one
/// resolve.
#[tokio::test]
async fn a_flapping_condition_is_one_alert_said_once_each_way() {
    let receiver = Receiver::start(0, StatusCode::OK).await;
    let app = TestApp::spawn_with(|c| {
        c.webhooks.generic = vec![receiver.url.clone()];
        c.webhooks.retry_secs = 0.05;
    })
    .await;
    let registration = json!({"params": [{"name": "generator.proj.weight"}]});
    assert_eq!(app.register("gan", &registration).await.status(), 201);
    // Steps 0–24 set the level (loss 1, gradient norm 1); cycle c is high on steps
    // 25 + 20c to 30 + 20c, back on the next fourteen. The condition holds from the
    // fifth high step of a cycle until the median of the last five is back under
    // the bar: on steps 29 + 20c to 32 + 20c. The last cycle's absence begins at
    // step 173; the hold has reached 1,000 steps by then.
    let high = |step: u64| step < 180 && step.checked_sub(25).is_some_and(|s| s % 20 < 6);
    let record = |step: u64| {
        let (loss, grad) = if high(step) { (4.0, 20.0) } else { (1.0, 1.0) };
        json!({
            "step": step,
            "loss": loss,
            "modules": [{"module": "generator.proj", "grad_norm": grad}]
        })
    };
    let records: Vec<Value> = (0..1176).map(record).collect();
    for batch in records.chunks(250) {
        let response = app.post_steps("gan", &Value::Array(batch.to_vec())).await;
        assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    }

    let (_, body) = app.get_json("/api/v1/runs/gan/alerts").await;
    let alerts = body["alerts"].as_array().unwrap();
    assert_eq!(alerts.len(), 1, "one episode: {alerts:?}");
    let alert = &alerts[0];
    assert_eq!(alert["kind"], "loss_divergence");
    assert_eq!(
        (
            &alert["first_step"],
            &alert["opened_step"],
            &alert["last_step"],
            &alert["resolved_step"],
            &alert["status"]
        ),
        (
            &json!(29),
            &json!(30),
            &json!(172),
            &json!(173),
            &json!("resolved")
        )
    );
    receiver.wait_for(2).await;
    // Nothing more comes.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let bodies: Vec<Value> = receiver
        .accepted()
        .into_iter()
        .filter(|b| b["alert"]["kind"] == "loss_divergence")
        .collect();
    let events: Vec<&str> = bodies
        .iter()
        .map(|b| b["event"].as_str().unwrap())
        .collect();
    assert_eq!(events, ["alert.opened", "alert.resolved"], "{bodies:?}");
    assert!(bodies.iter().all(|b| b["alert"]["id"] == alert["id"]));
    assert_eq!(deliveries(&app, "?run_id=gan").await.len(), 2);
    receiver.task.abort();
}
