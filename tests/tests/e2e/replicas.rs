//! Two `gradflow-server` replicas on one PostgreSQL database, run as the real
//! binaries: what a client sees must not depend on which replica it reached.
//!
//! - Batches of one run alternating between the replicas, and two clients sending
//!   overlapping step ranges of one run to both at once, store the same rows and open
//!   the same alerts, at the same steps and with the same evidence, as one SQLite
//!   server fed the records in order.
//! - An event stream on one replica hears the batches, and the alerts, that the
//!   other stored.
//! - A replica killed with SIGKILL under a real trainer (`--server A,B`) costs no
//!   step and changes no verdict: the trainer finishes through the other.
//! - The database itself failing: a malformed URL stops the server at start; a
//!   database down at start, or restarted mid-run, makes the server answer `503`
//!   (and `/readyz` say so) until it is back, and a trainer loses nothing.
//!
//! Each test starts a PostgreSQL cluster of its own (Debian's `postgresql`
//! binaries), or uses `GRADFLOW_TEST_POSTGRES_URL`; the tests that stop the database
//! always start their own. Without PostgreSQL they print why and pass, unless
//! `GRADFLOW_REQUIRE_POSTGRES=1` (CI) makes that a failure.

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gradflow_e2e::postgres::{Postgres, postgres_required};
use gradflow_e2e::{
    ServerProcess, binary, count_after, start_logged_trainer, stored_loss_steps, trainer_log,
    wait_for_exit,
};
use serde_json::{Value, json};

/// Steps of the hand-made run: three whole 64-step rollup buckets and a ragged end.
const STEPS: u64 = 200;
/// Its zero-gradient streaks on `qwen`: each longer than the registration's
/// `stuck_zero_steps` (10), so each opens `grad_stuck_zero` and resolves when the
/// gradient comes back.
const CUTS: [std::ops::Range<u64>; 3] = [20..45, 70..90, 150..175];
/// Steps on which the agent's norm weight has a gradient but does not move: longer
/// than the registration's `frozen_norm_steps` (15), so `norm_weight_frozen` opens.
const FROZEN: std::ops::Range<u64> = 100..130;
/// In the concurrent split, the first client sends steps `..FIRST_END` to A, the
/// second steps `SECOND_START..` to B; they race over the steps between.
const FIRST_END: usize = 140;
const SECOND_START: usize = 60;
const QWEN_NORM: &str = "qwen.layers.0.input_layernorm.weight";
const AGENT_NORM: &str = "agent.norm.weight";

/// The series each comparison reads: the loss, a module's and a group's gradient
/// norm, both norm weights' drift; each raw and reduced.
const SERIES: [&str; 5] = [
    "metric=loss",
    "metric=grad_norm&subject=qwen.layers.0.self_attn.q_proj",
    "metric=grad_norm&subject=qwen",
    "metric=drift&subject=agent.norm.weight",
    "metric=drift&subject=qwen.layers.0.input_layernorm.weight",
];

fn registration() -> Value {
    json!({
        "name": "two replicas",
        "precision": {"param_dtype": "f32"},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "params": [
            {"name": QWEN_NORM, "role": "norm"},
            {"name": "qwen.layers.0.self_attn.q_proj.weight", "role": "linear"},
            {"name": AGENT_NORM, "role": "norm"},
            {"name": "agent.head.weight", "role": "linear"}
        ],
        "detectors": {"stuck_zero_steps": 10, "frozen_norm_steps": 15}
    })
}

/// The run's records, steps 0 to [`STEPS`] − 1: a falling loss, an agent whose norm
/// weight stops moving over [`FROZEN`], and a Qwen whose graph is cut (gradient
/// exactly 0, backward never reaching it) over [`CUTS`].
fn records() -> Vec<Value> {
    let (mut qwen_drift, mut agent_drift) = (0.0_f64, 0.0_f64);
    (0..STEPS)
        .map(|step| {
            let s = step as f64;
            let cut = CUTS.iter().any(|c| c.contains(&step));
            let (qwen_grad, hits) = if cut {
                (0.0, 0)
            } else {
                (0.05 + 0.01 * (s * 0.3).sin(), 1)
            };
            let qwen_update = if cut { 0.0 } else { 2e-4 };
            qwen_drift += qwen_update;
            let agent_update = if FROZEN.contains(&step) {
                0.0
            } else {
                1e-4 * (1.0 + 0.5 * (s * 0.2).cos())
            };
            agent_drift += agent_update;
            json!({
                "step": step,
                "loss": 3.0 * (-s / 80.0).exp() + 0.05 * (s * 0.7).sin(),
                "lr": 1e-3,
                "modules": [
                    {"module": "qwen.layers.0.input_layernorm", "grad_norm": qwen_grad * 0.1, "hook_hits": hits},
                    {"module": "qwen.layers.0.self_attn.q_proj", "grad_norm": qwen_grad, "hook_hits": hits},
                    {"module": "agent.norm", "grad_norm": 0.02, "hook_hits": 1},
                    {"module": "agent.head", "grad_norm": 0.4 + 0.1 * s.cos(), "hook_hits": 1}
                ],
                "params": [
                    {"name": QWEN_NORM, "grad_norm": qwen_grad * 0.1, "update_norm": qwen_update,
                     "drift": qwen_drift, "mean": 1.0 + qwen_drift},
                    {"name": AGENT_NORM, "grad_norm": 0.02, "update_norm": agent_update,
                     "drift": agent_drift, "mean": 1.0 - agent_drift}
                ]
            })
        })
        .collect()
}

/// The shared PostgreSQL of this test process (its own cluster, or
/// `GRADFLOW_TEST_POSTGRES_URL`); `None`, said on stderr, when there is none.
fn shared_postgres() -> Option<Arc<Postgres>> {
    Postgres::shared()
}

/// A cluster of this test's own, which it may stop and start; `None`, said on
/// stderr, when none can be started and none is required.
fn own_cluster(durable: bool) -> Option<Postgres> {
    let started = if durable {
        Postgres::start_durable()
    } else {
        Postgres::start()
    };
    match started {
        Ok(postgres) => Some(postgres),
        Err(error) if !postgres_required() => {
            eprintln!(
                "skipped: this test stops its own PostgreSQL and none can be started ({error:#})"
            );
            None
        }
        Err(error) => panic!(
            "PostgreSQL is required (GRADFLOW_REQUIRE_POSTGRES=1) but cannot be started: {error:#}"
        ),
    }
}

/// A replica on `database`, on a free loopback port.
fn replica(database: &str) -> ServerProcess {
    ServerProcess::start_on_database(database, "127.0.0.1:0", &[])
}

/// `/readyz`'s status, and its body; `None` when the server did not answer.
/// Two replicas on a fresh database of `postgres`, both ready, and a client.
async fn two_ready_replicas(
    postgres: &Postgres,
) -> (ServerProcess, ServerProcess, reqwest::Client) {
    let database = postgres.create_database().await;
    let (a, b) = (replica(&database), replica(&database));
    let client = reqwest::Client::new();
    wait_ready(&client, &a, Duration::from_secs(60)).await;
    wait_ready(&client, &b, Duration::from_secs(60)).await;
    (a, b, client)
}

async fn readiness(client: &reqwest::Client, server: &ServerProcess) -> Option<(u16, Value)> {
    let response = client
        .get(server.url("/readyz"))
        .timeout(Duration::from_secs(15))
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    Some((status, response.json().await.unwrap_or(Value::Null)))
}

/// Waits until `server` says it is ready; panics with its log after `limit`.
async fn wait_ready(client: &reqwest::Client, server: &ServerProcess, limit: Duration) {
    let started = Instant::now();
    loop {
        if let Some((200, body)) = readiness(client, server).await {
            assert_eq!(body, json!({"status": "ready"}));
            return;
        }
        assert!(
            started.elapsed() < limit,
            "{} not ready within {limit:?}:\n{}",
            server.base,
            server.logs().join("\n")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn register(client: &reqwest::Client, server: &ServerProcess, run: &str) -> u16 {
    let url = server.url(&format!("/api/v1/runs/{run}"));
    let response = client.put(&url).json(&registration()).send().await.unwrap();
    let status = response.status().as_u16();
    assert!(
        status == 200 || status == 201,
        "PUT {url}: {status} {}",
        response.text().await.unwrap_or_default()
    );
    status
}

/// What one batch came back with.
#[derive(Debug, Default, Clone, Copy)]
struct Acknowledged {
    accepted: u64,
    duplicates: u64,
    /// Steps refused as late (below the run's last stored step, never stored).
    late: u64,
    last_step: u64,
}

/// POSTs `batch` to `server`, retrying on `503` as a trainer does (the replicas may
/// refuse a batch whose run keeps moving on under it); panics on anything else.
async fn send_batch(
    client: &reqwest::Client,
    server: &ServerProcess,
    run: &str,
    batch: &[Value],
) -> Acknowledged {
    let url = server.url(&format!("/api/v1/runs/{run}/steps"));
    let started = Instant::now();
    loop {
        let response = client.post(&url).json(&batch).send().await.unwrap();
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        match status {
            200 => {
                return Acknowledged {
                    accepted: body["accepted"].as_u64().unwrap(),
                    duplicates: body["duplicates"].as_u64().unwrap(),
                    late: body["late"].as_u64().unwrap_or(0),
                    last_step: body["last_step"].as_u64().unwrap(),
                };
            }
            503 if started.elapsed() < Duration::from_secs(60) => {
                assert_eq!(body["error"]["code"], "storage_unavailable", "{body}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            _ => panic!(
                "POST {url}: {status} {body}\n--- server log ---\n{}",
                server.logs().join("\n")
            ),
        }
    }
}

async fn get_json(client: &reqwest::Client, server: &ServerProcess, path: &str) -> Value {
    let url = server.url(path);
    let response = client.get(&url).send().await.unwrap();
    let status = response.status();
    let body = response.text().await.unwrap();
    assert_eq!(status, 200, "GET {url}: {body}");
    serde_json::from_str(&body).unwrap()
}

/// What a run holds, as `server` serves it: its step range and count, every series
/// of [`SERIES`] raw and reduced to 16 points, and its alerts (every field but the
/// id, the run and the texts), sorted.
async fn run_contents(client: &reqwest::Client, server: &ServerProcess, run: &str) -> Value {
    let info = get_json(client, server, &format!("/api/v1/runs/{run}")).await;
    let mut series = serde_json::Map::new();
    for query in SERIES {
        for reduce in ["", "&max_points=16"] {
            let path = format!("/api/v1/runs/{run}/series?{query}{reduce}");
            series.insert(
                format!("{query}{reduce}"),
                get_json(client, server, &path).await,
            );
        }
    }
    let listed = get_json(client, server, &format!("/api/v1/runs/{run}/alerts")).await;
    let mut alerts: Vec<Value> = listed["alerts"]
        .as_array()
        .unwrap_or_else(|| panic!("no alerts list: {listed}"))
        .iter()
        .map(|a| {
            json!({
                "kind": a["kind"], "subject": a["subject"], "severity": a["severity"],
                "status": a["status"], "first_step": a["first_step"],
                "opened_step": a["opened_step"], "last_step": a["last_step"],
                "resolved_step": a["resolved_step"], "evidence": a["evidence"],
            })
        })
        .collect();
    alerts.sort_by_key(|a| a.to_string());
    json!({
        "first_step": info["first_step"],
        "last_step": info["last_step"],
        "step_count": info["step_count"],
        "series": series,
        "alerts": alerts,
    })
}

/// The run fed in order, batch after batch, to one SQLite server: what every
/// replicated run is compared with.
async fn sqlite_reference(client: &reqwest::Client, dir: &Path) -> (ServerProcess, Value) {
    let server = ServerProcess::start(&dir.join("reference.db"), &[]);
    register(client, &server, "reference").await;
    for batch in records().chunks(10) {
        send_batch(client, &server, "reference", batch).await;
    }
    let contents = run_contents(client, &server, "reference").await;
    (server, contents)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_split_across_two_replicas_store_what_one_sqlite_server_stores() {
    let Some(postgres) = shared_postgres() else {
        return;
    };
    let (a, b, client) = two_ready_replicas(&postgres).await;
    let dir = tempfile::tempdir().unwrap();
    let (_sqlite, expected) = sqlite_reference(&client, dir.path()).await;

    // What the reference must hold, so that the comparison compares something: each
    // cut opened and resolved at the steps its threshold sets.
    let mut stuck: Vec<(Value, Value, Value)> = expected["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["kind"] == "grad_stuck_zero" && a["subject"] == "qwen")
        .map(|a| {
            (
                a["first_step"].clone(),
                a["opened_step"].clone(),
                a["resolved_step"].clone(),
            )
        })
        .collect();
    stuck.sort_by_key(|(first, _, _)| first.as_u64());
    assert_eq!(
        stuck,
        CUTS.iter()
            .map(|c| (json!(c.start), json!(c.start + 9), json!(c.end)))
            .collect::<Vec<_>>(),
        "{expected:#}"
    );
    assert!(
        expected["alerts"].as_array().unwrap().iter().any(|a| {
            a["kind"] == "norm_weight_frozen"
                && a["subject"] == "agent"
                && (&a["first_step"], &a["opened_step"], &a["resolved_step"])
                    == (
                        &json!(FROZEN.start),
                        &json!(FROZEN.start + 14),
                        &json!(FROZEN.end),
                    )
        }),
        "{expected:#}"
    );
    assert_eq!(expected["step_count"], STEPS);
    assert_eq!(
        expected["series"]["metric=loss&max_points=16"]["downsampled"],
        true
    );

    // Registering on one replica and again on the other is the same registration.
    let records = records();
    for run in ["alternate", "concurrent"] {
        assert_eq!(register(&client, &a, run).await, 201);
        assert_eq!(register(&client, &b, run).await, 200);
    }

    // Alternately: batch after batch, each to the other replica; every batch is new.
    for (i, batch) in records.chunks(10).enumerate() {
        let server = if i % 2 == 0 { &a } else { &b };
        let ack = send_batch(&client, server, "alternate", batch).await;
        assert_eq!(
            (ack.accepted, ack.duplicates),
            (batch.len() as u64, 0),
            "batch {i}"
        );
    }

    // At once: one client sends steps 0–139 to A in batches of 7, the other steps
    // 60–199 to B in batches of 11, both as fast as they are answered. A run keeps only
    // steps past its last stored one, so a client starting at step 60 before 0–59
    // are stored would leave a gap no one fills: the second client starts once A
    // has acknowledged step 59 (a trainer that takes over from another at a
    // checkpoint does the same). Over 60–139 they race, and a batch overtaken by the
    // other client's comes back with its overtaken steps as duplicates.
    let (progress, mut progress_rx) = tokio::sync::watch::channel(None::<u64>);
    let first = async {
        let mut total = Acknowledged::default();
        for batch in records[..FIRST_END].chunks(7) {
            let ack = send_batch(&client, &a, "concurrent", batch).await;
            total.accepted += ack.accepted;
            total.duplicates += ack.duplicates;
            progress.send_replace(Some(ack.last_step));
        }
        total
    };
    let second = async {
        progress_rx
            .wait_for(|last| last.is_some_and(|l| l + 1 >= SECOND_START as u64))
            .await
            .unwrap();
        let mut total = Acknowledged::default();
        for batch in records[SECOND_START..].chunks(11) {
            let ack = send_batch(&client, &b, "concurrent", batch).await;
            total.accepted += ack.accepted;
            total.duplicates += ack.duplicates;
        }
        total
    };
    let (first, second) = tokio::join!(first, second);
    let sent_to_b = STEPS - SECOND_START as u64;
    assert_eq!(
        first.accepted + first.duplicates,
        FIRST_END as u64,
        "{first:?}"
    );
    assert_eq!(second.accepted + second.duplicates, sent_to_b, "{second:?}");
    assert_eq!(
        first.accepted + second.accepted,
        STEPS,
        "each step stored once: {first:?} {second:?}"
    );
    assert!(
        second.accepted >= STEPS - FIRST_END as u64,
        "the steps after A's range came from B: {second:?}"
    );

    for run in ["alternate", "concurrent"] {
        for server in [&a, &b] {
            assert_eq!(
                run_contents(&client, server, run).await,
                expected,
                "{run} as {} serves it, against the SQLite reference",
                server.base
            );
        }
    }
}

/// A `text/event-stream` response read event by event.
struct EventStream {
    response: reqwest::Response,
    buffer: Vec<u8>,
}

impl EventStream {
    async fn open(client: &reqwest::Client, server: &ServerProcess) -> EventStream {
        let response = client
            .get(server.url("/api/v1/events"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        EventStream {
            response,
            buffer: Vec::new(),
        }
    }

    /// The next event's name and data; keep-alive comments are skipped.
    async fn next(&mut self) -> (String, Value) {
        loop {
            if let Some(end) = self.buffer.windows(2).position(|w| w == b"\n\n") {
                let block: Vec<u8> = self.buffer.drain(..end + 2).collect();
                let block = String::from_utf8(block).expect("events are UTF-8");
                let mut name = "message".to_owned();
                let mut data = String::new();
                for line in block.lines() {
                    if let Some(value) = line.strip_prefix("event:") {
                        name = value.trim().to_owned();
                    } else if let Some(value) = line.strip_prefix("data:") {
                        data.push_str(value.trim_start());
                    }
                }
                if data.is_empty() {
                    continue;
                }
                return (
                    name,
                    serde_json::from_str(&data).expect("event data is JSON"),
                );
            }
            let chunk = self
                .response
                .chunk()
                .await
                .expect("reading the event stream")
                .expect("the event stream stays open");
            self.buffer.extend_from_slice(&chunk);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interleaved_writers_through_two_replicas_get_no_acknowledgement_for_a_step_not_stored() {
    let Some(postgres) = shared_postgres() else {
        return;
    };
    let (a, b, client) = two_ready_replicas(&postgres).await;
    register(&client, &a, "two-writers").await;
    // Two writers of one run, each with its own replica: the even batches of ten
    // steps through A, the odd ones through B, at once. Whichever gets ahead moves
    // the run past the other's next batch.
    let records = records();
    let (raced, last) = records.split_at(records.len() - 20);
    let batches: Vec<Vec<Value>> = raced.chunks(10).map(<[Value]>::to_vec).collect();
    let (mut even, odd) = tokio::join!(
        write_every_other(&client, &a, &batches, 0),
        write_every_other(&client, &b, &batches, 1)
    );
    // And once for certain: B's batch arrives after A stored the steps past it.
    let ahead = send_batch(&client, &a, "two-writers", &last[10..]).await;
    let behind = send_batch(&client, &b, "two-writers", &last[..10]).await;
    assert_eq!((ahead.accepted, ahead.late), (10, 0), "{ahead:?}");
    assert_eq!((behind.accepted, behind.late), (0, 10), "{behind:?}");
    even.accepted += ahead.accepted;
    even.late += behind.late;
    let sent = records.len() as u64;
    // Every step sent is either stored or refused as late: none is a duplicate (no
    // step was sent twice), and none is acknowledged without being stored.
    assert_eq!(even.duplicates + odd.duplicates, 0, "{even:?} {odd:?}");
    assert_eq!(
        even.accepted + odd.accepted + even.late + odd.late,
        sent,
        "{even:?} {odd:?}"
    );
    let info = get_json(&client, &b, "/api/v1/runs/two-writers").await;
    assert_eq!(
        info["step_count"].as_u64(),
        Some(even.accepted + odd.accepted),
        "{info}"
    );
}

/// Sends every other batch of `batches` (from the `parity`-th) to `server`, in order:
/// one writer of two.
async fn write_every_other(
    client: &reqwest::Client,
    server: &ServerProcess,
    batches: &[Vec<Value>],
    parity: usize,
) -> Acknowledged {
    let mut total = Acknowledged::default();
    for batch in batches.iter().skip(parity).step_by(2) {
        let answer = send_batch(client, server, "two-writers", batch).await;
        total.accepted += answer.accepted;
        total.duplicates += answer.duplicates;
        total.late += answer.late;
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_on_one_replica_hears_what_the_other_stored() {
    let Some(postgres) = shared_postgres() else {
        return;
    };
    let (a, b, client) = two_ready_replicas(&postgres).await;
    // Subscribed once the headers are in; `/readyz` said A listens to the database.
    let mut events = EventStream::open(&client, &a).await;

    // Steps 0–29 go to B: the batch of 20–29 completes the first cut's streak.
    register(&client, &b, "heard").await;
    let records = records();
    for batch in records[..30].chunks(10) {
        send_batch(&client, &b, "heard", batch).await;
    }
    let stored_by_b = get_json(&client, &b, "/api/v1/runs/heard/alerts?status=open").await;
    let opened_id = stored_by_b["alerts"][0]["id"].clone();
    assert!(opened_id.is_i64(), "B opened the alert: {stored_by_b}");

    let mut steps = Vec::new();
    let mut opened = None;
    let heard = tokio::time::timeout(Duration::from_secs(30), async {
        while steps.len() < 3 || opened.is_none() {
            let (name, data) = events.next().await;
            match name.as_str() {
                "step" => {
                    assert_eq!(data["run_id"], "heard", "{data}");
                    steps.push((data["last_step"].clone(), data["accepted"].clone()));
                }
                "alert" => {
                    assert_eq!(data["action"], "opened", "{data}");
                    assert!(opened.is_none(), "one alert opened: {data}");
                    opened = Some(data["alert"].clone());
                }
                _ => panic!("unexpected event {name}: {data}"),
            }
        }
    })
    .await;
    assert!(
        heard.is_ok(),
        "A heard {steps:?} and {opened:?} within 30 s:\nA:\n{}\nB:\n{}",
        a.logs().join("\n"),
        b.logs().join("\n")
    );
    assert_eq!(
        steps,
        [
            (json!(9), json!(10)),
            (json!(19), json!(10)),
            (json!(29), json!(10))
        ],
        "a step event for each of B's batches, in order"
    );
    let alert = opened.unwrap();
    assert_eq!(alert["id"], opened_id, "{alert}");
    assert_eq!(alert["run_id"], "heard");
    assert_eq!(alert["kind"], "grad_stuck_zero");
    assert_eq!(alert["subject"], "qwen");
    assert_eq!(alert["first_step"], 20);
    assert_eq!(alert["opened_step"], 29);
    assert_eq!(
        alert["evidence"]["cause"], "backward_not_reached",
        "{alert}"
    );
}

/// Trainer steps in the kill test: enough for detached-prompt's `grad_stuck_zero`
/// (step 49) to open after the kill.
const TRAINER_STEPS: u64 = 150;

/// The real trainer, its log in `dir/{name}.log`.
fn start_trainer(dir: &Path, name: &str, servers: &str, args: &[&str]) -> Child {
    start_logged_trainer(dir, servers, name, args)
}

/// The run's `step_count`, once the run exists.
async fn step_count(client: &reqwest::Client, server: &ServerProcess, run: &str) -> Option<u64> {
    let response = client
        .get(server.url(&format!("/api/v1/runs/{run}")))
        .send()
        .await
        .ok()?;
    if response.status() != 200 {
        return None;
    }
    response.json::<Value>().await.ok()?["step_count"].as_u64()
}

/// Waits until `run` has at least `steps` steps on `server`.
async fn wait_for_steps(
    client: &reqwest::Client,
    server: &ServerProcess,
    run: &str,
    steps: u64,
    log: impl Fn() -> String,
) {
    let started = Instant::now();
    while step_count(client, server, run)
        .await
        .is_none_or(|n| n < steps)
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{run} did not reach {steps} steps within a minute:\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A run's alerts as (kind, subject, first step, opening step), sorted.
async fn alert_steps(
    client: &reqwest::Client,
    server: &ServerProcess,
    run: &str,
) -> Vec<(String, String, i64, i64)> {
    let alerts = get_json(client, server, &format!("/api/v1/runs/{run}/alerts")).await;
    let mut steps: Vec<_> = alerts["alerts"]
        .as_array()
        .unwrap_or_else(|| panic!("no alerts list: {alerts}"))
        .iter()
        .map(|a| {
            (
                a["kind"].as_str().unwrap().to_owned(),
                a["subject"].as_str().unwrap_or_default().to_owned(),
                a["first_step"].as_i64().unwrap_or(-1),
                a["opened_step"].as_i64().unwrap_or(-1),
            )
        })
        .collect();
    steps.sort();
    steps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_finishes_through_replica_b_when_replica_a_is_killed() {
    let Some(postgres) = shared_postgres() else {
        return;
    };
    let (a, b, client) = two_ready_replicas(&postgres).await;
    let dir = tempfile::tempdir().unwrap();
    let steps = TRAINER_STEPS.to_string();
    let scenario = [
        "--scenario",
        "detached-prompt",
        "--steps",
        &steps,
        "--step-delay-ms",
    ];
    let mut trainer = start_trainer(
        dir.path(),
        "killed",
        &format!("{},{}", a.base, b.base),
        &[&scenario[..], &["60"]].concat(),
    );

    // A has stored the first of the trainer's batches (one a second), not yet the
    // step that opens the alert, when it dies: the alert opens on B, from the
    // detector state A committed.
    wait_for_steps(&client, &a, "killed", 10, || {
        trainer_log(dir.path(), "killed")
    })
    .await;
    let stored_by_a = step_count(&client, &a, "killed").await.unwrap();
    a.kill();
    assert!(
        stored_by_a < 49,
        "A stored {stored_by_a} steps before it died"
    );
    assert!(
        trainer.try_wait().unwrap().is_none(),
        "the trainer was still training when A died"
    );

    // Meanwhile, the same run on one SQLite server, for its verdicts.
    let reference = ServerProcess::start(&dir.path().join("reference.db"), &[]);
    let mut reference_trainer = start_trainer(
        dir.path(),
        "reference",
        &reference.base,
        &[&scenario[..], &["0"]].concat(),
    );

    let status = wait_for_exit(&mut trainer, Duration::from_secs(180), "the trainer");
    let log = trainer_log(dir.path(), "killed");
    assert!(status.success(), "{log}");
    assert!(!log.contains("NOT delivered"), "{log}");
    assert_eq!(
        count_after(&log, "delivered ") + count_after(&log, "steps ("),
        TRAINER_STEPS,
        "everything delivered, what A stored without answering as already there: {log}"
    );
    assert!(
        log.contains(&format!("now reporting to {}", b.base)),
        "the trainer says it moved to B: {log}"
    );
    let run = get_json(&client, &b, "/api/v1/runs/killed").await;
    assert_eq!(run["step_count"], TRAINER_STEPS, "{run}");
    assert_eq!(run["status"], "finished", "{run}");
    assert_eq!(
        stored_loss_steps(&client, &b, "killed").await,
        (0..TRAINER_STEPS).collect::<Vec<_>>(),
        "every step, in order, once"
    );

    let status = wait_for_exit(
        &mut reference_trainer,
        Duration::from_secs(180),
        "the reference trainer",
    );
    assert!(status.success(), "{}", trainer_log(dir.path(), "reference"));
    let expected = alert_steps(&client, &reference, "reference").await;
    assert!(
        expected
            .iter()
            .any(|(kind, subject, _, opened)| kind == "grad_stuck_zero"
                && subject == "qwen"
                && *opened == 49),
        "detached-prompt opens grad_stuck_zero on qwen at step 49: {expected:?}"
    );
    assert_eq!(
        alert_steps(&client, &b, "killed").await,
        expected,
        "the same verdicts at the same steps as on one server"
    );
}

/// Starts the server with `args` and waits for it to exit; its exit status and
/// what it wrote to stderr.
fn run_to_exit(
    dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> (std::process::ExitStatus, String) {
    let path = dir.join("server.log");
    let mut child = Command::new(binary("gradflow-server"))
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(File::create(&path).unwrap())
        .spawn()
        .unwrap();
    let status = wait_for_exit(&mut child, Duration::from_secs(30), "gradflow-server");
    (status, std::fs::read_to_string(&path).unwrap())
}

/// Malformed `--database` URLs, each with the phrase its refusal must contain.
const BAD_URLS: [(&str, &str); 2] = [
    (
        "postgres://gradflow:hunter2@127.0.0.1:notaport/gradflow",
        "invalid port number",
    ),
    (
        "mysql://root:hunter2@127.0.0.1/gradflow",
        "unsupported database URL scheme \"mysql\"",
    ),
];

#[test]
fn a_malformed_database_url_stops_the_server_at_start() {
    let dir = tempfile::tempdir().unwrap();
    for (url, problem) in BAD_URLS {
        for (args, env) in [
            (vec!["--database", url], vec![]),
            (vec![], vec![("GRADFLOW_DATABASE_URL", url)]),
        ] {
            let (status, stderr) = run_to_exit(dir.path(), &args, &env);
            assert!(!status.success(), "{url}: exited {status}: {stderr}");
            assert!(
                stderr.contains(problem) && stderr.contains("--database"),
                "{url}: the refusal names the flag and the problem: {stderr}"
            );
            assert!(
                !stderr.contains("listening"),
                "{url}: never served: {stderr}"
            );
        }
    }
}

#[test]
fn a_refused_database_url_never_prints_its_password() {
    let dir = tempfile::tempdir().unwrap();
    for (url, _) in BAD_URLS {
        for (args, env) in [
            (vec!["--database", url], vec![]),
            (vec![], vec![("GRADFLOW_DATABASE_URL", url)]),
        ] {
            let (status, stderr) = run_to_exit(dir.path(), &args, &env);
            assert!(!status.success(), "{url}: exited {status}: {stderr}");
            assert!(!stderr.contains("hunter2"), "{url}: {stderr}");
        }
    }
}

/// `/readyz` answers 503 `storage_unavailable` (asked until `limit`).
async fn wait_unready(client: &reqwest::Client, server: &ServerProcess, limit: Duration) {
    let started = Instant::now();
    loop {
        match readiness(client, server).await {
            Some((503, body)) => {
                assert_eq!(body["error"]["code"], "storage_unavailable", "{body}");
                return;
            }
            other => assert!(
                started.elapsed() < limit,
                "/readyz still {other:?} after {limit:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_started_before_its_database_answers_503_until_it_is_up() {
    let Some(postgres) = own_cluster(false) else {
        return;
    };
    let database = postgres.create_database().await;
    postgres.stop().unwrap();
    let server = replica(&database);
    let client = reqwest::Client::new();

    // Up, not ready: liveness yes, readiness and writes 503, saying why.
    let health = client.get(server.url("/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    wait_unready(&client, &server, Duration::from_secs(1)).await;
    let response = client
        .put(server.url("/api/v1/runs/late"))
        .json(&registration())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    assert!(response.headers().contains_key("retry-after"));
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "storage_unavailable", "{body}");
    let response = client
        .post(server.url("/api/v1/runs/late/steps"))
        .json(&records()[..5])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "storage_unavailable", "{body}");
    // Still not ready a moment later: the server keeps trying, it does not give up.
    tokio::time::sleep(Duration::from_secs(1)).await;
    wait_unready(&client, &server, Duration::from_secs(1)).await;

    postgres.restart().unwrap();
    wait_ready(&client, &server, Duration::from_secs(60)).await;
    let dir = tempfile::tempdir().unwrap();
    let mut trainer = start_trainer(
        dir.path(),
        "late",
        &server.base,
        &["--scenario", "healthy", "--steps", "40"],
    );
    let status = wait_for_exit(&mut trainer, Duration::from_secs(120), "the trainer");
    assert!(status.success(), "{}", trainer_log(dir.path(), "late"));
    assert_eq!(
        stored_loss_steps(&client, &server, "late").await,
        (0..40).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restarted_mid_run_loses_no_acknowledged_step() {
    let Some(postgres) = own_cluster(true) else {
        return;
    };
    let database = postgres.create_database().await;
    let server = replica(&database);
    let client = reqwest::Client::new();
    wait_ready(&client, &server, Duration::from_secs(60)).await;
    let dir = tempfile::tempdir().unwrap();
    // Paced to outlast the outage: a request to a server whose database is down is
    // answered 503 only after the pool's 5 s connection timeout, and the trainer
    // tries three times before it spools.
    let steps: u64 = 300;
    let mut trainer = start_trainer(
        dir.path(),
        "restarted",
        &server.base,
        &[
            "--scenario",
            "healthy",
            "--steps",
            &steps.to_string(),
            "--step-delay-ms",
            "100",
        ],
    );
    let log = || trainer_log(dir.path(), "restarted");
    wait_for_steps(&client, &server, "restarted", 20, log).await;

    postgres.stop().unwrap();
    let stopped = Instant::now();
    wait_unready(&client, &server, Duration::from_secs(20)).await;
    // Down until the trainer has had to spool.
    while !log().contains("unreachable") {
        assert!(
            stopped.elapsed() < Duration::from_secs(60),
            "the trainer never found the server unable to store: {}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        trainer.try_wait().unwrap().is_none(),
        "the trainer was still training when the database came back: {}",
        log()
    );
    postgres.restart().unwrap();
    wait_ready(&client, &server, Duration::from_secs(60)).await;

    let status = wait_for_exit(&mut trainer, Duration::from_secs(180), "the trainer");
    let log = log();
    assert!(status.success(), "{log}");
    assert!(!log.contains("NOT delivered"), "{log}");
    assert!(
        log.contains("the gradflow server is back: spooled steps delivered"),
        "{log}"
    );
    let run = get_json(&client, &server, "/api/v1/runs/restarted").await;
    assert_eq!(run["step_count"], steps, "{run}");
    assert_eq!(
        stored_loss_steps(&client, &server, "restarted").await,
        (0..steps).collect::<Vec<_>>(),
        "every step, in order, once"
    );
}
