//! The server goes away while a real trainer is training. A 60-second outage in the
//! middle of a run loses nothing: the trainer spools, and replays in order when the
//! server is back. A spool too small for the outage drops what does not fit, says
//! so on the console, and tells the server how many (`dropped_steps`).
//!
//! `GRADFLOW_OUTAGE_SECS` shortens or lengthens the outage (default 60).

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use gradflow_e2e::{
    ServerProcess, free_loopback_address, start_logged_trainer, stored_loss_steps, trainer_log,
    wait_for_exit,
};
use serde_json::Value;

/// Starts the trainer reporting to the server at `address`, its log in
/// `dir/{run}.log`.
fn start_trainer(dir: &Path, address: &str, run: &str, extra: &[&str]) -> Child {
    start_logged_trainer(dir, &format!("http://{address}"), run, extra)
}

async fn get_json(client: &reqwest::Client, server: &ServerProcess, path: &str) -> Value {
    let response = client.get(server.url(path)).send().await.unwrap();
    assert_eq!(response.status(), 200, "GET {path}");
    response.json().await.unwrap()
}

fn outage() -> Duration {
    let secs = std::env::var("GRADFLOW_OUTAGE_SECS")
        .ok()
        .map(|s| {
            s.parse()
                .expect("GRADFLOW_OUTAGE_SECS is a number of seconds")
        })
        .unwrap_or(60);
    Duration::from_secs(secs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sixty_second_outage_mid_run_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gradflow.db");
    let address = free_loopback_address();
    let outage = outage();
    let server = ServerProcess::start_at(&db, &address, &[]);
    // Paced so the run lasts the outage and 20 s more.
    let steps = 200;
    let delay_ms = (outage + Duration::from_secs(20)).as_millis() as u64 / steps;
    let mut trainer = start_trainer(
        dir.path(),
        &address,
        "long",
        &[
            "--steps",
            &steps.to_string(),
            "--step-delay-ms",
            &delay_ms.to_string(),
        ],
    );

    // The run is under way and delivering when the server dies.
    let client = reqwest::Client::new();
    let started = Instant::now();
    loop {
        let url = server.url("/api/v1/runs/long");
        if let Ok(response) = client.get(&url).send().await
            && response.status() == 200
        {
            let run: Value = response.json().await.unwrap();
            if run["step_count"].as_u64().unwrap_or(0) >= 10 {
                break;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the trainer delivered nothing within a minute:\n{}",
            trainer_log(dir.path(), "long")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server.kill();
    tokio::time::sleep(outage).await;
    assert!(
        trainer.try_wait().unwrap().is_none(),
        "the trainer was still training when the server came back"
    );
    let server = ServerProcess::start_at(&db, &address, &[]);

    let status = wait_for_exit(&mut trainer, Duration::from_secs(120), "the trainer");
    let log = trainer_log(dir.path(), "long");
    assert!(status.success(), "{log}");
    assert!(log.contains("unreachable"), "warned of the outage: {log}");
    assert!(
        log.contains("the gradflow server is back: spooled steps delivered"),
        "{log}"
    );
    assert!(!log.contains("spool is full"), "{log}");
    assert_eq!(
        stored_loss_steps(&client, &server, "long").await,
        (0..steps).collect::<Vec<_>>(),
        "every step, in order, once"
    );
    let dropped = get_json(
        &client,
        &server,
        "/api/v1/runs/long/series?metric=dropped_steps",
    )
    .await;
    assert_eq!(
        dropped["points"],
        serde_json::json!([]),
        "nothing was dropped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_spool_drops_counts_and_tells_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gradflow.db");
    let address = free_loopback_address();
    let steps = 120;
    // Room for a handful of records: the server is down for most of the run.
    let mut trainer = start_trainer(
        dir.path(),
        &address,
        "tight",
        &[
            "--steps",
            &steps.to_string(),
            "--step-delay-ms",
            "20",
            "--spool-max-bytes",
            "20000",
        ],
    );
    std::thread::sleep(Duration::from_millis(1500));
    let server = ServerProcess::start_at(&db, &address, &[]);
    let status = wait_for_exit(&mut trainer, Duration::from_secs(60), "the trainer");
    let log = trainer_log(dir.path(), "tight");
    assert_eq!(
        status.code(),
        Some(2),
        "an incomplete delivery exits 2: {log}"
    );
    assert!(
        log.contains("the spool is full (--spool-max-bytes)"),
        "{log}"
    );

    // The console says how many were dropped; the server stored the rest and knows
    // the count.
    let dropped: u64 = log
        .split("still spooled, ")
        .nth(1)
        .and_then(|rest| rest.split(" dropped").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no dropped count at exit: {log}"));
    assert!(dropped > 0, "{log}");
    let client = reqwest::Client::new();
    let stored = stored_loss_steps(&client, &server, "tight").await;
    assert_eq!(stored.len() as u64 + dropped, steps, "{log}");
    let series = get_json(
        &client,
        &server,
        "/api/v1/runs/tight/series?metric=dropped_steps",
    )
    .await;
    let last = series["points"]
        .as_array()
        .and_then(|p| p.last())
        .unwrap_or_else(|| panic!("no dropped_steps series: {series}"));
    assert_eq!(last[1].as_f64(), Some(dropped as f64), "{series}");
    let page = client
        .get(server.url("/runs/tight"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("Steps dropped by the trainer"), "{page}");
}
