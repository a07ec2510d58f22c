//! A database written before step blocks (one `steps` row per step) opens with every
//! step where it was: the server moves the rows into blocks at start, drops the old
//! table, and serves the same numbers.

use std::borrow::Cow;

use gradflow_core::columnar::codec;
use serde_json::json;
use sqlx::Connection;
use sqlx::migrate::Migrator;

use crate::common::TestApp;

/// The first migration that knows blocks: the database is built with the ones
/// before it, as the server that wrote it would have.
const BLOCKS_MIGRATION: i64 = 20261126000002;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_rows_of_an_older_database_move_into_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    let mut conn =
        sqlx::SqliteConnection::connect(&format!("sqlite://{}?mode=rwc", path.display()))
            .await
            .unwrap();
    let mut migrator = Migrator::new(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../migrations/sqlite"
    )))
    .await
    .unwrap();
    migrator.migrations = Cow::Owned(
        migrator
            .migrations
            .iter()
            .filter(|m| m.version < BLOCKS_MIGRATION)
            .cloned()
            .collect(),
    );
    migrator.run(&mut conn).await.unwrap();

    // A run of 150 steps (three blocks, the last one partial, with a gap), written
    // the old way: a compressed row per step over four columns.
    let registration = json!({"params": [{"name": "agent.head.weight"}]});
    sqlx::query(
        "INSERT INTO runs (id, run_id, registration, created_at, first_step, last_step, \
         last_seen, step_count) VALUES (1, 'old', $1, 1.0, 0, 149, 2.0, 148)",
    )
    .bind(registration.to_string())
    .execute(&mut conn)
    .await
    .unwrap();
    for (col, kind, subject) in [
        (0, "loss", ""),
        (1, "module_grad_norm", "agent.head"),
        (2, "hook_hits", "agent.head"),
        (3, "group_grad_norm", "agent"),
    ] {
        sqlx::query("INSERT INTO columns (run, col, kind, subject) VALUES (1, $1, $2, $3)")
            .bind(col)
            .bind(kind)
            .bind(subject)
            .execute(&mut conn)
            .await
            .unwrap();
    }
    let steps: Vec<u64> = (0..150).filter(|s| *s != 70 && *s != 71).collect();
    let loss = |s: u64| 4.0 - s as f32 / 100.0;
    let norm = |s: u64| 0.5 + (s % 7) as f32 / 10.0;
    let mut compressor = codec::compressor().unwrap();
    for &step in &steps {
        // Step 3 reports no module at all: its row is shorter than the others.
        let cells: Vec<u32> = if step == 3 {
            vec![loss(step).to_bits()]
        } else {
            vec![
                loss(step).to_bits(),
                norm(step).to_bits(),
                1.0f32.to_bits(),
                norm(step).to_bits(),
            ]
        };
        sqlx::query("INSERT INTO steps (run, step, time, vals) VALUES (1, $1, $2, $3)")
            .bind(step as i64)
            .bind(1_795_000_000.0 + step as f64)
            .bind(codec::encode(&cells, &mut compressor).unwrap())
            .execute(&mut conn)
            .await
            .unwrap();
    }
    conn.close().await.unwrap();

    let app = TestApp::spawn_with(|c| {
        c.db = path.clone();
        c.database = None;
    })
    .await;
    let losses = app.points("old", "metric=loss").await;
    assert_eq!(
        losses.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        steps,
        "every step, the gap kept"
    );
    for (step, value) in &losses {
        assert_eq!(
            value.as_f64().unwrap() as f32,
            loss(*step),
            "loss of step {step}"
        );
    }
    let norms = app
        .points("old", "metric=grad_norm&subject=agent.head")
        .await;
    assert_eq!(norms.len(), steps.len() - 1, "step 3 reported no module");
    assert!(
        norms
            .iter()
            .all(|(s, v)| v.as_f64().unwrap() as f32 == norm(*s))
    );
    let (status, run) = app.get_json("/api/v1/runs/old").await;
    assert_eq!(status, 200);
    assert_eq!(run["last_step"], 149);

    // The old table is gone and the steps live in three blocks of stream 0.
    let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let legacy: Option<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'steps'",
    )
    .fetch_optional(&mut conn)
    .await
    .unwrap();
    assert_eq!(legacy, None);
    let blocks: Vec<(i64, i64)> =
        sqlx::query_as("SELECT stream, block FROM blocks WHERE run = 1 ORDER BY block")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    assert_eq!(blocks, [(0, 0), (0, 1), (0, 2)]);
    conn.close().await.unwrap();

    // The run goes on where it was.
    let response = app
        .post_steps(
            "old",
            &json!([{"step": 150, "loss": 2.5,
                     "modules": [{"module": "agent.head", "grad_norm": 0.7, "hook_hits": 1}]}]),
        )
        .await;
    assert_eq!(response.status(), 200);
    let losses = app.points("old", "metric=loss&from_step=148").await;
    assert_eq!(
        losses.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        [148, 149, 150]
    );
}
