//! The real trainer binary against the real server: each scenario raises exactly the
//! alerts it should (a healthy run none), and a run whose server is down trains to
//! the end and delivers its spool when the server comes back.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use gradflow_e2e::{
    ServerProcess, binary, free_loopback_address, stored_loss_steps, wait_for_exit,
};
use gradflow_trainer::scenario::SCENARIOS;
use serde_json::Value;

fn trainer(args: &[&str]) -> Command {
    let mut command = Command::new(binary("gradflow-trainer"));
    command
        .args(args)
        .arg("--quiet")
        .env("RUST_LOG", "gradflow_trainer=info");
    command
}

fn text(output: &Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

async fn get(client: &reqwest::Client, url: String) -> Value {
    client.get(url).send().await.unwrap().json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_scenario_raises_exactly_its_alerts() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("gradflow.db"), &["--sync", "normal"]);
    let client = reqwest::Client::new();
    for scenario in &SCENARIOS {
        let steps = scenario.steps_to_show_alerts().to_string();
        let output = trainer(&[
            "--server",
            &server.base,
            "--scenario",
            scenario.name,
            "--run-id",
            scenario.name,
            "--steps",
            &steps,
        ])
        .output()
        .unwrap();
        if scenario.stops_at_once {
            assert!(!output.status.success(), "{}", text(&output));
            assert!(
                text(&output).contains("not implemented for 'BFloat16'"),
                "{}",
                text(&output)
            );
        } else {
            assert!(
                output.status.success(),
                "{}: {}",
                scenario.name,
                text(&output)
            );
        }
        let alerts = get(
            &client,
            server.url(&format!("/api/v1/runs/{}/alerts", scenario.name)),
        )
        .await;
        // Verdicts only: the first-step hint (info) has tests of its own.
        let mut kinds: Vec<&str> = alerts["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["severity"] != "info")
            .map(|a| a["kind"].as_str().unwrap())
            .collect();
        kinds.sort();
        kinds.dedup();
        let mut expected = scenario.alerts.to_vec();
        expected.sort();
        assert_eq!(kinds, expected, "scenario {}: {alerts}", scenario.name);
    }
    // The diagnosis of the detached prompt names the cause.
    let alerts = get(
        &client,
        server.url("/api/v1/runs/detached-prompt/alerts?kind=grad_stuck_zero"),
    )
    .await;
    assert_eq!(
        alerts["alerts"][0]["evidence"]["cause"],
        "backward_not_reached"
    );
    assert_eq!(alerts["alerts"][0]["subject"], "qwen");
    let alerts = get(
        &client,
        server.url("/api/v1/runs/bf16-frozen-norms/alerts?kind=norm_weight_frozen"),
    )
    .await;
    assert_eq!(
        alerts["alerts"][0]["evidence"]["cause"],
        "low_precision_underflow"
    );
    // And a healthy run's loss falls.
    let loss = get(
        &client,
        server.url("/api/v1/runs/healthy/series?metric=loss"),
    )
    .await;
    let points = loss["points"].as_array().unwrap();
    let mean = |p: &[Value]| p.iter().map(|x| x[1].as_f64().unwrap()).sum::<f64>() / p.len() as f64;
    assert!(
        mean(&points[points.len() - 10..]) < mean(&points[..10]),
        "{loss}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_server_is_down_trains_to_the_end_and_delivers_its_spool() {
    let dir = tempfile::tempdir().unwrap();
    let address = free_loopback_address();
    let mut child = trainer(&[
        "--server",
        &format!("http://{address}"),
        "--run-id",
        "outage",
        "--steps",
        "150",
        "--spool-dir",
        dir.path().to_str().unwrap(),
    ])
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // The server comes up while the trainer is training, or while it flushes.
    std::thread::sleep(Duration::from_millis(700));
    let server = ServerProcess::start_at(
        &dir.path().join("gradflow.db"),
        &address,
        &["--sync", "normal"],
    );
    let status = wait_for_exit(&mut child, Duration::from_secs(30), "the trainer");
    let stderr = std::io::read_to_string(child.stderr.take().unwrap()).unwrap();
    assert!(status.success(), "{stderr}");
    assert!(
        stderr.contains("unreachable"),
        "the trainer warns about the outage: {stderr}"
    );
    assert!(stderr.contains("delivered 150 steps"), "{stderr}");
    let client = reqwest::Client::new();
    assert_eq!(
        stored_loss_steps(&client, &server, "outage").await,
        (0..150).collect::<Vec<_>>(),
        "every step, in order, once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spool_no_server_ever_saw_is_imported_later() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = trainer(&[
        "--server",
        &format!("http://{}", free_loopback_address()),
        "--run-id",
        "lost",
        "--steps",
        "20",
        "--spool-dir",
        dir.path().to_str().unwrap(),
    ])
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let status = wait_for_exit(&mut child, Duration::from_secs(60), "the trainer");
    let stderr = std::io::read_to_string(child.stderr.take().unwrap()).unwrap();
    assert_eq!(status.code(), Some(2), "{stderr}");
    let spool = dir.path().join("gradflow-spool-lost.ndjson");
    assert!(
        stderr.contains(&format!("import {}", spool.display())),
        "{stderr}"
    );
    let sidecar = dir
        .path()
        .join("gradflow-spool-lost.ndjson.registration.json");
    let meta: Value = serde_json::from_slice(&std::fs::read(&sidecar).unwrap()).unwrap();
    assert_eq!(meta["run_id"], "lost");

    let db = dir.path().join("later.db");
    let import = Command::new(binary("gradflow-server"))
        .args([
            "--db",
            db.to_str().unwrap(),
            "import",
            spool.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&import.stdout);
    assert!(
        import.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&import.stderr)
    );
    assert!(
        out.contains("imported 20 step records into run lost"),
        "{out}"
    );
    let server = ServerProcess::start(&db, &[]);
    let client = reqwest::Client::new();
    let run = get(&client, server.url("/api/v1/runs/lost")).await;
    assert_eq!(run["step_count"], 20, "{run}");
    // Its client has stopped: the imported run is finished, not live.
    assert_eq!(run["status"], "finished", "{run}");
    assert_eq!(
        run["params"].as_array().unwrap().len(),
        meta["registration"]["params"].as_array().unwrap().len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measuring_the_overhead_prints_both_medians_and_sends_the_instrumented_steps() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("gradflow.db"), &["--sync", "normal"]);
    let output = trainer(&[
        "--server",
        &server.base,
        "--run-id",
        "overhead",
        "--steps",
        "6",
        "--measure-overhead",
    ])
    .output()
    .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let figures: Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    for key in ["instrumented_ms", "uninstrumented_ms"] {
        let ms = figures[key].as_f64().unwrap();
        assert!(ms > 0.0 && ms.is_finite(), "{key}: {figures}");
    }
    assert_eq!(figures["steps"], 6, "{figures}");
    assert_eq!(figures["preset"], "tiny", "{figures}");
    let extra = figures["instrumented_ms"].as_f64().unwrap()
        - figures["uninstrumented_ms"].as_f64().unwrap();
    assert!(
        (figures["extra_ms"].as_f64().unwrap() - extra).abs() < 1e-9,
        "{figures}"
    );
    assert!(
        text(&output).contains("delivered 6 steps"),
        "{}",
        text(&output)
    );
    // The measured steps of the instrumented trainer, after its 3 warm-up steps.
    let client = reqwest::Client::new();
    assert_eq!(
        stored_loss_steps(&client, &server, "overhead").await,
        (3..9).collect::<Vec<_>>()
    );
    let alerts = get(&client, server.url("/api/v1/runs/overhead/alerts")).await;
    assert_eq!(
        alerts["alerts"],
        serde_json::json!([]),
        "a healthy run: {alerts}"
    );
}

#[test]
fn the_attention_cost_steps_a_third_trainer_and_prints_its_median() {
    let measure = |extra: &[&str]| -> Value {
        let mut args = vec!["--steps", "4", "--measure-overhead", "--no-report"];
        args.extend_from_slice(extra);
        let output = trainer(&args).output().unwrap();
        assert!(output.status.success(), "{}", text(&output));
        serde_json::from_slice(&output.stdout).expect("one JSON object")
    };
    let with = measure(&["--attention-cost"]);
    let ms = with["without_attention_ms"].as_f64().unwrap_or(f64::NAN);
    assert!(ms > 0.0 && ms.is_finite(), "{with}");
    let without = measure(&[]);
    assert!(without.get("without_attention_ms").is_none(), "{without}");
}
