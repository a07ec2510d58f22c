//! A trainer given two servers keeps its run whole when the first dies: server A
//! is killed with SIGKILL mid-run, a standby B comes up on A's database file at
//! its own address, and the real trainer binary, started with `--server A,B`,
//! finishes through B. Every step A had stored is still there, every other step
//! reached B, none twice, and the trainer says it delivered everything.

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use gradflow_e2e::{
    ServerProcess, count_after, free_loopback_address, start_logged_trainer, stored_loss_steps,
    trainer_log, wait_for_exit,
};
use serde_json::Value;

const RUN: &str = "failover";
const STEPS: u64 = 150;

fn start_trainer(dir: &Path, servers: &str) -> Child {
    let steps = STEPS.to_string();
    start_logged_trainer(
        dir,
        servers,
        RUN,
        &["--steps", &steps, "--step-delay-ms", "40"],
    )
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
            trainer_log(dir.path(), RUN)
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
    let log = trainer_log(dir.path(), RUN);
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
