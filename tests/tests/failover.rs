//! A trainer given two servers keeps its run whole when the first dies: server A
//! is killed with SIGKILL mid-run, a standby B comes up on A's database file at
//! its own address, and the real trainer binary, started with `--server A,B`,
//! finishes through B. Every step A had stored is still there, every other step
//! reached B, none twice, and the trainer says it delivered everything.

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gradflow_e2e::{
    ServerProcess, binary, free_loopback_address, stored_loss_steps, wait_for_exit,
};
use serde_json::Value;

const RUN: &str = "failover";
const STEPS: u64 = 150;

/// The trainer's log goes to a file, not a pipe, so it can never block on it.
fn start_trainer(dir: &Path, servers: &str) -> Child {
    let log = File::create(dir.join("trainer.log")).unwrap();
    Command::new(binary("gradflow-trainer"))
        .args(["--server", servers, "--run-id", RUN])
        .args(["--steps", &STEPS.to_string(), "--step-delay-ms", "40"])
        .arg("--spool-dir")
        .arg(dir)
        .arg("--quiet")
        .env("RUST_LOG", "gradflow_trainer=info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

fn trainer_log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("trainer.log")).unwrap()
}

async fn run_info(client: &reqwest::Client, server: &ServerProcess) -> Option<Value> {
    let response = client
        .get(server.url(&format!("/api/v1/runs/{RUN}")))
        .send()
        .await
        .ok()?;
    if response.status() != 200 {
        return None;
    }
    response.json().await.ok()
}

/// The count the trainer's exit line gives after `label` ("delivered 140 steps",
/// "(10 already there)").
fn count_after(log: &str, label: &str) -> u64 {
    log.rsplit_once(label)
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count after {label:?} in the trainer's log:\n{log}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_on_the_first_server_s_database_takes_over_mid_run() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gradflow.db");
    let (address_a, address_b) = (free_loopback_address(), free_loopback_address());
    let a = ServerProcess::start_at(&db, &address_a, &[]);
    let mut trainer = start_trainer(
        dir.path(),
        &format!("http://{address_a},http://{address_b}"),
    );

    // A has stored part of the run when it dies.
    let client = reqwest::Client::new();
    let started = Instant::now();
    while run_info(&client, &a)
        .await
        .and_then(|run| run["step_count"].as_u64())
        .is_none_or(|n| n < 20)
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "A stored nothing within a minute:\n{}",
            trainer_log(dir.path())
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stored_by_a = stored_loss_steps(&client, &a, RUN).await;
    a.kill();
    assert!(
        trainer.try_wait().unwrap().is_none(),
        "the trainer was still training when A died"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let b = ServerProcess::start_at(&db, &address_b, &[]);

    let status = wait_for_exit(&mut trainer, Duration::from_secs(120), "the trainer");
    let log = trainer_log(dir.path());
    assert!(status.success(), "{log}");
    let steps = stored_loss_steps(&client, &b, RUN).await;
    assert!(
        stored_by_a.iter().all(|s| steps.contains(s)),
        "B serves every step A stored ({stored_by_a:?}): {steps:?}"
    );
    assert_eq!(
        steps,
        (0..STEPS).collect::<Vec<_>>(),
        "every step, in order, once"
    );
    let run = run_info(&client, &b).await.expect("B knows the run");
    assert_eq!(run["step_count"], STEPS, "{run}");
    assert_eq!(run["status"], "finished", "B was told the run ended: {run}");

    // Everything delivered: what A stored without answering counts as already there.
    assert!(!log.contains("NOT delivered"), "{log}");
    let delivered = count_after(&log, "delivered ");
    let duplicates = count_after(&log, "steps (");
    assert_eq!(delivered + duplicates, STEPS, "{log}");
    assert!(
        log.contains(&format!("now reporting to http://{address_b}")),
        "the trainer says where it moved: {log}"
    );
}
