//! The durability promise of docs/PROTOCOL.md: "once 200 is returned the batch is durable:
//! a server killed right after it loses none of it". Clients stream into the real
//! binary, it is killed with SIGKILL mid-stream, restarted on the same file, and
//! every acknowledged step must be there exactly once.

use std::collections::BTreeSet;
use std::time::Duration;

use gradflow_e2e::{ServerProcess, stored_loss_steps};
use reqwest::Client;
use serde_json::{Value, json};

fn batch(first: u64, len: u64) -> Value {
    Value::Array(
        (first..first + len)
            .map(|s| {
                json!({"step": s, "loss": s as f64,
                       "modules": [{"module": "qwen.layers.0.mlp", "grad_norm": 0.5, "hook_hits": 1},
                                   {"module": "agent.head", "grad_norm": 1.0, "hook_hits": 1}]})
            })
            .collect(),
    )
}

/// Streams batches of 10 steps until the server stops answering; returns the steps
/// of every batch that was acknowledged with 200.
async fn stream_until_refused(
    client: Client,
    base: String,
    run: String,
    start: u64,
) -> BTreeSet<u64> {
    let mut acknowledged = BTreeSet::new();
    let mut next = start;
    loop {
        let response = client
            .post(format!("{base}/api/v1/runs/{run}/steps"))
            .json(&batch(next, 10))
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        match response {
            Ok(r) if r.status() == 200 => {
                acknowledged.extend(next..next + 10);
                next += 10;
            }
            Ok(r) => panic!("unexpected status {}", r.status()),
            Err(_) => return acknowledged,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_loses_no_acknowledged_step() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gradflow.db");
    let client = Client::new();
    let runs = ["a", "b"];
    let mut acknowledged: Vec<BTreeSet<u64>> = vec![BTreeSet::new(); runs.len()];

    for (round, kill_after_ms) in [40u64, 150, 5].into_iter().enumerate() {
        let server = ServerProcess::start(&db, &[]);
        for run in runs {
            let response = client
                .put(server.url(&format!("/api/v1/runs/{run}")))
                .json(&json!({"params": []}))
                .send()
                .await
                .unwrap();
            assert!(response.status() == 201 || response.status() == 200);
        }
        let streams: Vec<_> = runs
            .iter()
            .zip(&acknowledged)
            .map(|(run, acked)| {
                let start = acked.last().map_or(0, |s| s + 1);
                tokio::spawn(stream_until_refused(
                    client.clone(),
                    server.base.clone(),
                    run.to_string(),
                    start,
                ))
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(kill_after_ms)).await;
        server.kill();
        for (stream, acked) in streams.into_iter().zip(&mut acknowledged) {
            acked.extend(stream.await.unwrap());
        }

        let server = ServerProcess::start(&db, &[]);
        for (run, acked) in runs.iter().zip(&acknowledged) {
            let stored = stored_loss_steps(&client, &server, run).await;
            let unique: BTreeSet<u64> = stored.iter().copied().collect();
            assert_eq!(
                unique.len(),
                stored.len(),
                "round {round}: run {run} has a step twice"
            );
            assert!(
                acked.is_subset(&unique),
                "round {round}: run {run} lost acknowledged steps {:?}",
                acked.difference(&unique).take(10).collect::<Vec<_>>()
            );
            // What was stored but never acknowledged (killed between commit and
            // answer) is kept: the client will resend it and it counts as duplicate.
        }
        server.kill();
    }
    assert!(
        acknowledged.iter().all(|a| a.len() >= 20),
        "the streams made progress: {:?}",
        acknowledged.iter().map(BTreeSet::len).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_and_exits_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gradflow.db");
    let client = Client::new();
    let server = ServerProcess::start(&db, &[]);
    client
        .put(server.url("/api/v1/runs/r"))
        .json(&json!({"params": []}))
        .send()
        .await
        .unwrap();
    let response = client
        .post(server.url("/api/v1/runs/r/steps"))
        .json(&batch(0, 100))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let status = server.terminate();
    assert!(status.success(), "exit status {status}");
    // A clean shutdown checkpoints the WAL into the main file.
    let wal = dir.path().join("gradflow.db-wal");
    assert!(
        !wal.exists() || std::fs::metadata(&wal).unwrap().len() == 0,
        "WAL left behind"
    );
    let server = ServerProcess::start(&db, &[]);
    assert_eq!(stored_loss_steps(&client, &server, "r").await.len(), 100);
}
