//! The per-rank view of a run through a real server: `GET /api/v1/runs/{id}/ranks`
//! says where each rank stands (a lagging rank behind, a straggler with its alert, a
//! silent rank with nothing), a single process is one rank, and the `ranks` chart
//! draws a line per rank (at most sixteen, naming the rest in its legend).

use crate::common::{TestApp, error_of};
use serde_json::{Value, json};

/// Rank `rank`'s registration of a run of `world_size` ranks: a replicated module
/// and a sharded one.
fn registration(world_size: u32, rank: u32) -> Value {
    json!({
        "world_size": world_size, "rank": rank,
        "params": [
            {"name": "shared.proj.weight", "shape": [8, 8]},
            {"name": "sharded.mlp.weight", "shape": [16, 8], "layout": "sharded"}
        ]
    })
}

/// Rank `rank`'s record of `step`, its own work taking `step_time` seconds; its
/// shard of `sharded.mlp` has norm `rank + 1`.
fn record(step: u64, rank: u32, world_size: u32, step_time: f64) -> Value {
    json!({
        "step": step, "rank": rank, "loss": 2.0, "step_time": step_time,
        "modules": [
            {"module": "shared.proj", "grad_norm": 0.5, "hook_hits": 1, "numel": 64},
            {"module": "sharded.mlp", "grad_sumsq": ((rank + 1) * (rank + 1)) as f64,
             "hook_hits": 1, "numel": 128 / world_size as u64}
        ]
    })
}

/// Registers every rank of `run` and posts, for each rank, steps `0..steps[rank]`
/// taking `times[rank]` seconds each.
async fn multi_rank_run(app: &TestApp, run: &str, steps: &[u64], times: &[f64]) {
    let world_size = steps.len() as u32;
    for rank in 0..world_size {
        let status = app
            .register(run, &registration(world_size, rank))
            .await
            .status();
        assert!(status.is_success(), "rank {rank}: {status}");
    }
    for rank in 0..world_size {
        let records: Vec<Value> = (0..steps[rank as usize])
            .map(|s| record(s, rank, world_size, times[rank as usize]))
            .collect();
        if records.is_empty() {
            continue;
        }
        let status = app.post_steps(run, &Value::Array(records)).await.status();
        assert_eq!(status, 200, "rank {rank}");
    }
}

async fn ranks_of(app: &TestApp, run: &str) -> Value {
    let (status, body) = app.get_json(&format!("/api/v1/runs/{run}/ranks")).await;
    assert_eq!(status, 200, "{body}");
    body
}

#[tokio::test]
async fn a_lagging_rank_is_behind_and_a_straggler_carries_its_alert() {
    let app = TestApp::spawn().await;
    // Rank 1 straggles (its own work takes 3.5× the others'); rank 2 lags 12 steps.
    multi_rank_run(&app, "ddp", &[40, 40, 28], &[0.1, 0.35, 0.1]).await;
    let body = ranks_of(&app, "ddp").await;
    assert_eq!(body["world_size"], 3);
    assert_eq!(
        body["last_step"], 27,
        "combined up to the lagging rank: {body}"
    );
    let ranks = body["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 3);
    for (rank, (last, behind)) in [(39, 0), (39, 0), (27, 12)].into_iter().enumerate() {
        assert_eq!(ranks[rank]["rank"], rank, "{body}");
        assert_eq!(ranks[rank]["last_step"], last, "rank {rank}: {body}");
        assert_eq!(ranks[rank]["behind"], behind, "rank {rank}: {body}");
    }
    let time = |rank: usize| ranks[rank]["step_time"].as_f64().unwrap();
    assert!((time(0) - 0.1).abs() < 1e-6 && (time(1) - 0.35).abs() < 1e-6);
    // The straggler's alert, and no one else's.
    assert_eq!(ranks[1]["open_alerts"], json!(["rank_straggler"]));
    assert_eq!(ranks[0]["open_alerts"], json!([]));
    assert_eq!(ranks[2]["open_alerts"], json!([]));
    let (_, alerts) = app
        .get_json("/api/v1/runs/ddp/alerts?kind=rank_straggler&status=open")
        .await;
    assert_eq!(alerts["alerts"][0]["subject"], "rank 1");
}

#[tokio::test]
async fn a_rank_that_has_sent_nothing_is_listed_with_nothing() {
    let app = TestApp::spawn().await;
    multi_rank_run(&app, "silent", &[10, 0, 10, 0], &[0.2, 0.2, 0.2, 0.2]).await;
    let body = ranks_of(&app, "silent").await;
    assert_eq!(body["world_size"], 4);
    assert!(
        body["last_step"].is_null(),
        "no step has every rank: {body}"
    );
    let ranks = body["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4, "every rank, those silent too: {body}");
    for rank in [1, 3] {
        assert_eq!(
            ranks[rank],
            json!({"rank": rank, "last_step": null, "behind": null, "step_time": null, "open_alerts": []})
        );
    }
    assert_eq!(ranks[2]["last_step"], 9);
    assert_eq!(ranks[2]["behind"], 0);
}

#[tokio::test]
async fn a_single_process_is_one_rank_read_from_the_run() {
    let app = TestApp::spawn().await;
    assert_eq!(
        app.register("solo", &json!({"params": []})).await.status(),
        201
    );
    let body = ranks_of(&app, "solo").await;
    assert_eq!(
        body,
        json!({"world_size": 1, "last_step": null, "ranks": [
            {"rank": 0, "last_step": null, "behind": null, "step_time": null, "open_alerts": []}]})
    );
    let records: Vec<Value> = (0..5)
        .map(|s| json!({"step": s, "loss": 1.0, "step_time": 0.25 + s as f64 * 0.01}))
        .collect();
    assert_eq!(
        app.post_steps("solo", &Value::Array(records))
            .await
            .status(),
        200
    );
    let body = ranks_of(&app, "solo").await;
    assert_eq!(body["last_step"], 4);
    let rank = &body["ranks"][0];
    assert_eq!(
        (rank["last_step"].as_u64(), rank["behind"].as_u64()),
        (Some(4), Some(0))
    );
    assert!(
        (rank["step_time"].as_f64().unwrap() - 0.29).abs() < 1e-6,
        "{body}"
    );
}

#[tokio::test]
async fn an_unknown_run_has_no_ranks() {
    let app = TestApp::spawn().await;
    let response = app
        .client
        .get(app.url("/api/v1/runs/ghost/ranks"))
        .send()
        .await
        .unwrap();
    let (status, error) = error_of(response).await;
    assert_eq!(
        (status, error["code"].as_str()),
        (404, Some("run_not_found"))
    );
    let (status, _) = app.get_json("/api/v1/runs/bad%20id/ranks").await;
    assert_eq!(status, 400);
}

/// The chart's SVG.
async fn chart(app: &TestApp, path: &str) -> String {
    let response = app.client.get(app.url(path)).send().await.unwrap();
    assert_eq!(response.status(), 200, "{path}");
    assert_eq!(response.headers()["content-type"], "image/svg+xml");
    response.text().await.unwrap()
}

/// The solid lines of an SVG (legend samples and the dashes of a dashed line, a few
/// points each, left out): their stroke colours.
fn line_colours(svg: &str) -> Vec<String> {
    svg.split('<')
        .filter(|e| e.starts_with("polyline"))
        .filter(|e| {
            let start = e.find(" points=\"").unwrap() + 9;
            e[start..]
                .split('"')
                .next()
                .unwrap()
                .split_whitespace()
                .count()
                > 8
        })
        .map(|e| {
            let start = e.find(" stroke=\"").unwrap() + 9;
            e[start..].split('"').next().unwrap().to_owned()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ranks_chart_draws_a_line_per_rank() {
    let app = TestApp::spawn().await;
    multi_rank_run(&app, "ddp", &[40, 40, 28], &[0.1, 0.35, 0.1]).await;
    let svg = chart(&app, "/api/v1/runs/ddp/charts/ranks.svg?width=900").await;
    let shown = texts(&svg);
    for text in [
        "Step time per rank — ddp",
        "seconds of the rank&apos;s own work per step",
        "rank 0",
        "rank 1",
        "rank 2",
        "shaded: rank_straggler: rank 1",
        "rank_straggler: rank 1",
    ] {
        assert!(
            shown.iter().any(|t| t == text),
            "the step-time chart lacks {text:?}: {shown:?}"
        );
    }
    assert_eq!(line_colours(&svg).len(), 3, "a line per rank");
    assert!(!svg.contains("not drawn"), "every rank is drawn");

    let svg = chart(
        &app,
        "/api/v1/runs/ddp/charts/ranks.svg?metric=grad_norm&subject=sharded.mlp&width=900",
    )
    .await;
    assert!(svg.contains("Gradient norm of sharded.mlp per rank — ddp"));
    let mut colours = line_colours(&svg);
    colours.dedup();
    assert_eq!(colours.len(), 3, "each rank's own shard: {colours:?}");

    let response = app
        .client
        .get(app.url("/api/v1/runs/ddp/charts/ranks.png?metric=step_time"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["content-type"], "image/png");
    assert_eq!(&response.bytes().await.unwrap()[..8], b"\x89PNG\r\n\x1a\n");

    for (query, status, path) in [
        ("metric=loss", 400, "metric"),
        ("metric=grad_norm", 400, "subject"),
        ("metric=step_time&subject=shared.proj", 400, "subject"),
        ("metric=grad_norm&subject=nowhere", 404, "subject"),
        ("width=10", 400, "width"),
    ] {
        let response = app
            .client
            .get(app.url(&format!("/api/v1/runs/ddp/charts/ranks.svg?{query}")))
            .send()
            .await
            .unwrap();
        let (got, error) = error_of(response).await;
        assert_eq!(
            (got, error["path"].as_str()),
            (status, Some(path)),
            "{query}: {error}"
        );
    }
    // The other charts take no metric.
    let (status, _) = app
        .get_json("/api/v1/runs/ddp/charts/loss.svg?metric=step_time")
        .await;
    assert_eq!(status, 400);
    let (status, _) = app.get_json("/api/v1/runs/ghost/charts/ranks.svg").await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chart_of_many_ranks_draws_sixteen_and_names_the_rest() {
    let app = TestApp::spawn().await;
    // 20 ranks; rank 18 straggles, so it is drawn though past the first sixteen.
    let mut times = vec![0.1; 20];
    times[18] = 0.4;
    multi_rank_run(&app, "wide", &[30; 20], &times).await;
    let body = ranks_of(&app, "wide").await;
    assert_eq!(body["ranks"][18]["open_alerts"], json!(["rank_straggler"]));
    let svg = chart(&app, "/api/v1/runs/wide/charts/ranks.svg").await;
    let legend: Vec<String> = texts(&svg)
        .into_iter()
        .filter(|t| t.starts_with("rank ") && !t.contains(':'))
        .collect();
    let mut expected: Vec<String> = (0..15).map(|r| format!("rank {r}")).collect();
    expected.push("rank 18".to_owned());
    assert_eq!(legend, expected, "the first fifteen and the straggler");
    assert!(
        texts(&svg).contains(&"4 more ranks not drawn: 15–17, 19".to_owned()),
        "the legend names the ranks left out: {:?}",
        texts(&svg)
    );
    // Ten solid lines; past the palette's ten colours the lines are dashed (drawn
    // as many short segments).
    assert_eq!(line_colours(&svg).len(), 10);
    assert!(svg.matches("<polyline").count() > 100);
}

/// The text of every `<text>` element of an SVG.
fn texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|e| {
            let start = e.find('>')? + 1;
            let end = e.find("</text>")?;
            Some(e[start..end].trim().to_owned())
        })
        .collect()
}
