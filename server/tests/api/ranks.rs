//! Multi-rank runs (v1.4) through a real server: every rank posts its own records,
//! the server combines a step once every rank's record has arrived (or it can wait
//! no longer), the detectors judge the combined steps, and each rank's records stay
//! readable on their own.

use std::time::{Duration, Instant};

use crate::common::{TestApp, error_of};
use serde_json::{Value, json};

/// Two groups, every parameter with a shape: `shared.proj` replicated (DDP), the
/// `sharded` group's module laid out across the ranks (FSDP).
fn registration(world_size: u32, rank: u32) -> Value {
    json!({
        "world_size": world_size, "rank": rank, "host": format!("node-{rank}"),
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "params": [
            {"name": "shared.proj.weight", "shape": [8, 8]},
            {"name": "shared.norm.weight", "role": "norm", "shape": [8]},
            {"name": "sharded.mlp.weight", "shape": [16, 8], "layout": "sharded"},
            {"name": "sharded.norm.weight", "role": "norm", "shape": [8], "layout": "sharded"}
        ]
    })
}

/// Rank `rank`'s record of `step`: the replicated module's norm is the same on every
/// rank (after the all-reduce), the sharded one's is this rank's part.
fn record(step: u64, rank: u32, world_size: u32) -> Value {
    let part = 2.0 + rank as f64;
    json!({
        "step": step, "rank": rank, "loss": 3.0 - step as f64 * 0.001 + rank as f64 * 0.01,
        "step_time": 0.1,
        "modules": [
            {"module": "shared.proj", "grad_norm": 0.5, "hook_hits": 1, "numel": 64},
            {"module": "shared.norm", "grad_norm": 0.25, "hook_hits": 1, "numel": 8},
            {"module": "sharded.mlp", "grad_sumsq": part * part, "hook_hits": 1,
             "numel": 128 / world_size as u64, "nonfinite": 0},
            {"module": "sharded.norm", "grad_sumsq": 0.01, "hook_hits": 1,
             "numel": 8 / world_size as u64}
        ],
        "params": [
            {"name": "shared.norm.weight", "grad_norm": 0.25, "update_norm": 1e-3,
             "drift": step as f64 * 1e-4, "mean": 1.0},
            {"name": "sharded.norm.weight", "grad_norm": 0.1, "update_norm": 1e-3,
             "drift": step as f64 * 1e-4 * (rank + 1) as f64, "mean": 1.0 + rank as f64,
             "numel": 8 / world_size as u64}
        ]
    })
}

async fn post(app: &TestApp, run: &str, records: Vec<Value>) -> Value {
    let response = app.post_steps(run, &Value::Array(records)).await;
    let status = response.status();
    let body: Value = response.json().await.unwrap();
    assert_eq!(status, 200, "{body}");
    body
}

async fn register_all(app: &TestApp, run: &str, world_size: u32) {
    for rank in 0..world_size {
        let response = app.register(run, &registration(world_size, rank)).await;
        let status = response.status().as_u16();
        assert!(
            status == 201 || status == 200,
            "rank {rank}: {status} {}",
            response.text().await.unwrap()
        );
    }
}

async fn alerts(app: &TestApp, run: &str) -> Vec<Value> {
    let (status, body) = app.get_json(&format!("/api/v1/runs/{run}/alerts")).await;
    assert_eq!(status, 200, "{body}");
    body["alerts"].as_array().unwrap().clone()
}

fn kinds(alerts: &[Value]) -> Vec<(String, String)> {
    alerts
        .iter()
        .filter(|a| a["severity"] != "info")
        .map(|a| {
            (
                a["kind"].as_str().unwrap().to_owned(),
                a["subject"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[tokio::test]
async fn every_rank_registers_and_the_combined_step_adds_up_the_shards() {
    let app = TestApp::spawn().await;
    register_all(&app, "ddp", 2).await;
    // Rank 0 runs ahead; nothing is combined until rank 1 sends the same steps.
    let answer = post(&app, "ddp", (0..5).map(|s| record(s, 0, 2)).collect()).await;
    assert_eq!(answer["accepted"], 5);
    assert_eq!(answer["last_step"], 4, "rank 0's own last step");
    let (_, run) = app.get_json("/api/v1/runs/ddp").await;
    assert_eq!(run["step_count"], 0, "{run}");
    post(&app, "ddp", (0..3).map(|s| record(s, 1, 2)).collect()).await;
    let (_, run) = app.get_json("/api/v1/runs/ddp").await;
    assert_eq!(run["step_count"], 3);
    assert_eq!(run["last_step"], 2);
    assert_eq!(
        (run["world_size"].as_u64(), run["rank"].as_u64()),
        (Some(2), Some(0))
    );

    // Sharded: sqrt(2² + 3²); replicated: the same on both ranks.
    let sharded = app
        .points("ddp", "metric=grad_norm&subject=sharded.mlp")
        .await;
    assert_eq!(sharded.len(), 3);
    let expected = (4.0f64 + 9.0).sqrt();
    for (_, value) in &sharded {
        assert!((value.as_f64().unwrap() - expected).abs() < 1e-6, "{value}");
    }
    let replicated = app
        .points("ddp", "metric=grad_norm&subject=shared.proj")
        .await;
    assert!(replicated.iter().all(|(_, v)| v.as_f64() == Some(0.5)));
    // The group's norm comes from the combined modules.
    let group = app.points("ddp", "metric=grad_norm&subject=sharded").await;
    let expected_group = (13.0f64 + 0.02).sqrt();
    assert!(
        (group[0].1.as_f64().unwrap() - expected_group).abs() < 1e-5,
        "{group:?}"
    );
    // The loss is the ranks' mean; a sharded weight's mean is weighted, its drift the
    // largest.
    let loss = app.points("ddp", "metric=loss").await;
    assert!((loss[1].1.as_f64().unwrap() - (3.0 - 0.001 + 0.005)).abs() < 1e-6);
    let mean = app
        .points("ddp", "metric=param_mean&subject=sharded.norm.weight")
        .await;
    assert!((mean[0].1.as_f64().unwrap() - 1.5).abs() < 1e-6, "{mean:?}");
    let drift = app
        .points("ddp", "metric=drift&subject=sharded.norm.weight")
        .await;
    assert!(
        (drift[2].1.as_f64().unwrap() - 4e-4).abs() < 1e-9,
        "{drift:?}"
    );

    // Each rank's own records, as it sent them.
    let own = app
        .points("ddp", "metric=grad_norm&subject=sharded.mlp&rank=1")
        .await;
    assert_eq!(own.len(), 3);
    assert!(own.iter().all(|(_, v)| v.as_f64() == Some(3.0)));
    let ahead = app.points("ddp", "metric=loss&rank=0").await;
    assert_eq!(
        ahead.len(),
        5,
        "rank 0's records are stored before they combine"
    );
    let response = app
        .client
        .get(app.url("/api/v1/runs/ddp/series?metric=loss&rank=2"))
        .send()
        .await
        .unwrap();
    let (status, error) = error_of(response).await;
    assert_eq!((status, error["path"].as_str()), (400, Some("rank")));

    // Resent records are duplicates of their rank.
    let answer = post(&app, "ddp", (0..5).map(|s| record(s, 0, 2)).collect()).await;
    assert_eq!(
        (answer["accepted"].as_u64(), answer["duplicates"].as_u64()),
        (Some(0), Some(5))
    );
    assert!(kinds(&alerts(&app, "ddp").await).is_empty());
}

#[tokio::test]
async fn records_of_a_multi_rank_run_must_name_their_rank() {
    let app = TestApp::spawn().await;
    register_all(&app, "r", 2).await;
    for (body, path) in [
        (json!([{"step": 0, "loss": 1.0}]), "steps[0].rank"),
        (
            json!([{"step": 0, "rank": 2, "loss": 1.0}]),
            "steps[0].rank",
        ),
    ] {
        let response = app.post_steps("r", &body).await;
        let (status, error) = error_of(response).await;
        assert_eq!(status, 400, "{error}");
        assert_eq!(error["path"], path, "{error}");
    }
    // A different body is still a conflict; only who sent it may differ.
    let mut other = registration(2, 1);
    other["world_size"] = json!(4);
    let response = app.register("r", &other).await;
    let (status, error) = error_of(response).await;
    assert_eq!((status, error["path"].as_str()), (409, Some("world_size")));
}

#[tokio::test]
async fn healthy_ranks_raise_nothing() {
    let app = TestApp::spawn().await;
    register_all(&app, "h", 4).await;
    for first in (0..200).step_by(25) {
        for rank in 0..4 {
            let records = (first..first + 25)
                .map(|s| {
                    let mut r = record(s, rank, 4);
                    // Noisy step times, as real ranks have.
                    r["step_time"] = json!(0.1 + 0.02 * ((s * 7 + rank as u64) % 5) as f64);
                    r
                })
                .collect();
            post(&app, "h", records).await;
        }
    }
    let (_, run) = app.get_json("/api/v1/runs/h").await;
    assert_eq!(run["step_count"], 200);
    assert_eq!(
        kinds(&alerts(&app, "h").await),
        Vec::<(String, String)>::new()
    );
}

#[tokio::test]
async fn a_rank_that_stops_reporting_is_named_once_the_others_move_on() {
    let app = TestApp::spawn().await;
    register_all(&app, "gone", 2).await;
    post(&app, "gone", (0..10).map(|s| record(s, 1, 2)).collect()).await;
    post(&app, "gone", (0..300).map(|s| record(s, 0, 2)).collect()).await;
    let alerts = alerts(&app, "gone").await;
    let missing: Vec<&Value> = alerts
        .iter()
        .filter(|a| a["kind"] == "rank_missing")
        .collect();
    assert_eq!(missing.len(), 1, "{alerts:?}");
    assert_eq!(missing[0]["subject"], "rank 1");
    assert_eq!(missing[0]["opened_step"], 10);
    assert_eq!(missing[0]["evidence"]["last_step"], 9);
    // Steps more than 256 behind the front completed without rank 1.
    let (_, run) = app.get_json("/api/v1/runs/gone").await;
    assert_eq!(run["last_step"], 299 - 257);
}

#[tokio::test]
async fn steps_waiting_for_a_silent_rank_complete_after_the_timeout() {
    let app = TestApp::spawn_with(|c| c.rank_timeout_secs = 0.5).await;
    register_all(&app, "t", 2).await;
    post(&app, "t", (0..6).map(|s| record(s, 0, 2)).collect()).await;
    post(&app, "t", (0..4).map(|s| record(s, 1, 2)).collect()).await;
    // Nothing more arrives: the server completes steps 4 and 5 by itself.
    let started = Instant::now();
    loop {
        let (_, run) = app.get_json("/api/v1/runs/t").await;
        if run["last_step"] == 5 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "{run}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let kinds = kinds(&alerts(&app, "t").await);
    assert_eq!(kinds, [("rank_missing".to_owned(), "rank 1".to_owned())]);
}

#[tokio::test]
async fn a_nan_on_one_rank_is_named_where_it_began() {
    let app = TestApp::spawn().await;
    register_all(&app, "nan", 2).await;
    let run = |rank: u32| -> Vec<Value> {
        (0..40)
            .map(|s| {
                let mut r = record(s, rank, 2);
                if rank == 1 && s == 12 {
                    r["loss"] = json!("NaN");
                    r["modules"][2]["grad_sumsq"] = json!("NaN");
                    r["modules"][2]["nonfinite"] = json!(3);
                }
                r
            })
            .collect()
    };
    post(&app, "nan", run(0)).await;
    post(&app, "nan", run(1)).await;
    let alerts = alerts(&app, "nan").await;
    let rank: Vec<&Value> = alerts
        .iter()
        .filter(|a| a["kind"] == "rank_nonfinite")
        .collect();
    assert_eq!(rank.len(), 1, "{alerts:?}");
    assert_eq!(rank[0]["subject"], "rank 1");
    assert_eq!(rank[0]["opened_step"], 12);
    assert_eq!(rank[0]["resolved_step"], 13);
    // The combined run saw it too.
    assert!(alerts.iter().any(|a| a["kind"] == "loss_nonfinite"));
    assert!(
        alerts
            .iter()
            .any(|a| a["kind"] == "grad_nonfinite" && a["subject"] == "sharded")
    );
}

#[tokio::test]
async fn a_straggling_rank_is_named_with_its_step_times() {
    let app = TestApp::spawn().await;
    register_all(&app, "slow", 2).await;
    for rank in 0..2 {
        let records = (0..30)
            .map(|s| {
                let mut r = record(s, rank, 2);
                r["step_time"] = json!(if rank == 1 { 0.35 } else { 0.1 });
                r
            })
            .collect();
        post(&app, "slow", records).await;
    }
    let alerts = alerts(&app, "slow").await;
    let slow: Vec<&Value> = alerts
        .iter()
        .filter(|a| a["kind"] == "rank_straggler")
        .collect();
    assert_eq!(slow.len(), 1, "{alerts:?}");
    assert_eq!(slow[0]["subject"], "rank 1");
    assert_eq!(slow[0]["opened_step"], 9);
    assert!((slow[0]["evidence"]["step_time_ms"].as_f64().unwrap() - 350.0).abs() < 1e-3);
    assert_eq!(kinds(&alerts).len(), 1, "{alerts:?}");
}

#[tokio::test]
async fn a_desynchronised_replica_is_caught() {
    let app = TestApp::spawn().await;
    register_all(&app, "desync", 2).await;
    for rank in 0..2 {
        let records = (0..10)
            .map(|s| {
                let mut r = record(s, rank, 2);
                if rank == 1 && s >= 4 {
                    // Rank 1 skipped the all-reduce: its replicated gradient is its own.
                    r["modules"][0]["grad_norm"] = json!(0.61);
                }
                r
            })
            .collect();
        post(&app, "desync", records).await;
    }
    let alerts = alerts(&app, "desync").await;
    let desync: Vec<&Value> = alerts
        .iter()
        .filter(|a| a["kind"] == "replica_divergence")
        .collect();
    assert_eq!(desync.len(), 1, "{alerts:?}");
    assert_eq!(desync[0]["first_step"], 4);
    assert_eq!(desync[0]["opened_step"], 6);
    let subjects = &desync[0]["evidence"]["subjects"];
    assert_eq!(subjects[0]["subject"], "shared.proj", "{subjects}");
    assert_eq!(subjects[0]["max_rank"], 1);
}

#[tokio::test]
async fn a_shard_read_as_the_whole_tensor_is_caught() {
    let app = TestApp::spawn().await;
    // A client that registers every parameter as a whole tensor, then reports each
    // rank's local shard.
    let registration = json!({"world_size": 2, "params": [
        {"name": "model.layers.0.mlp.weight", "shape": [16, 8]},
        {"name": "model.layers.1.mlp.weight", "shape": [16, 8]}
    ]});
    for rank in 0..2 {
        let mut body = registration.clone();
        body["rank"] = json!(rank);
        assert!(app.register("shard", &body).await.status().is_success());
    }
    for rank in 0..2u32 {
        let records = (0..3)
            .map(|s| {
                json!({"step": s, "rank": rank, "loss": 1.0, "modules": [
                    {"module": "model.layers.0.mlp", "grad_norm": 0.5 + rank as f64, "hook_hits": 1, "numel": 64},
                    {"module": "model.layers.1.mlp", "grad_norm": 0.7, "hook_hits": 1, "numel": 64}
                ]})
            })
            .collect();
        post(&app, "shard", records).await;
    }
    let alerts = alerts(&app, "shard").await;
    let shard: Vec<&Value> = alerts
        .iter()
        .filter(|a| a["kind"] == "shard_reported_as_global")
        .collect();
    assert_eq!(shard.len(), 1, "{alerts:?}");
    assert_eq!(shard[0]["subject"], "model");
    assert_eq!(shard[0]["evidence"]["count"], 2);
    assert_eq!(shard[0]["evidence"]["modules"][0]["registered_numel"], 128);
}

#[tokio::test]
async fn a_restarted_server_completes_the_steps_it_was_waiting_for() {
    let app = TestApp::spawn().await;
    register_all(&app, "restart", 2).await;
    post(&app, "restart", (0..8).map(|s| record(s, 0, 2)).collect()).await;
    post(&app, "restart", (0..3).map(|s| record(s, 1, 2)).collect()).await;
    // Steps 3–7 wait for rank 1 when the server stops; the next one reads them back.
    let app = app.restart().await;
    post(&app, "restart", (3..8).map(|s| record(s, 1, 2)).collect()).await;
    let (_, run) = app.get_json("/api/v1/runs/restart").await;
    assert_eq!(
        (run["step_count"].as_u64(), run["last_step"].as_u64()),
        (Some(8), Some(7))
    );
    let sharded = app
        .points("restart", "metric=grad_norm&subject=sharded.mlp")
        .await;
    assert_eq!(sharded.len(), 8);
    for (_, value) in &sharded {
        assert!((value.as_f64().unwrap() - 13f64.sqrt()).abs() < 1e-6);
    }
    assert!(kinds(&alerts(&app, "restart").await).is_empty());
}
