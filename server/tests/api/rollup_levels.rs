//! The 1,024-step rollup level: a reduced read of a long range uses it and keeps
//! spikes and NaNs; a run registered before the level existed keeps reading the two
//! levels it had, even where it went on after the upgrade (its 1,024-step buckets
//! there start part-way).

use gradflow_server::store::DatabaseUrl;
use serde_json::{Value, json};
use sqlx::Connection;

use crate::common::TestApp;

fn losses(steps: std::ops::Range<u64>, spike: u64, nan: u64) -> Value {
    steps
        .map(|s| {
            let loss = match s {
                s if s == spike => json!(1000.0),
                s if s == nan => json!("NaN"),
                _ => json!(2.0 + ((s * 7919) % 100) as f64 / 1000.0),
            };
            json!({"step": s, "loss": loss})
        })
        .collect()
}

/// Runs `statements` on the test server's database (stopped or running).
async fn execute(app: &TestApp, statements: &[&str]) {
    match &app.database {
        DatabaseUrl::Sqlite(_) => {
            let url = format!("sqlite://{}", app.db.display());
            let mut conn = sqlx::SqliteConnection::connect(&url).await.unwrap();
            for statement in statements {
                sqlx::query(statement).execute(&mut conn).await.unwrap();
            }
        }
        DatabaseUrl::Postgres(url) => {
            let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
            for statement in statements {
                sqlx::query(statement).execute(&mut conn).await.unwrap();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_read_uses_the_1024_step_level_and_keeps_spikes_and_nans() {
    let app = TestApp::spawn().await;
    app.register("long", &json!({"params": []})).await;
    const SPIKE: u64 = 150_001;
    const NAN: u64 = 37_777;
    for start in (0..200_000).step_by(25_000) {
        let response = app
            .post_steps("long", &losses(start..start + 25_000, SPIKE, NAN))
            .await;
        assert_eq!(response.status(), 200);
    }
    // 200,000 steps in 50 output buckets of 4,000 steps: read from 1,024-step
    // buckets (the 4,096-step ones are wider than an output bucket).
    for query in [
        "metric=loss&max_points=100",
        "metric=loss&from_step=1001&to_step=199990&max_points=100",
    ] {
        let (_, body) = app
            .get_json(&format!("/api/v1/runs/long/series?{query}"))
            .await;
        assert_eq!(body["downsampled"], true, "{query}");
        let points = body["points"].as_array().unwrap();
        assert!(points.len() <= 100, "{query}: {}", points.len());
        assert!(points.contains(&json!([SPIKE, 1000])), "{query}: the spike");
        assert!(points.contains(&json!([NAN, "NaN"])), "{query}: the NaN");
        let steps: Vec<u64> = points.iter().map(|p| p[0].as_u64().unwrap()).collect();
        assert!(steps.windows(2).all(|w| w[0] < w[1]), "{query}: in order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_from_before_the_1024_step_level_reads_the_two_levels_it_had() {
    let mut app = TestApp::spawn().await;
    app.register("old", &json!({"params": []})).await;
    // The spike lies in the 1,024-step bucket 2048..=3071, which the upgrade cuts.
    const SPIKE: u64 = 2_500;
    let response = app
        .post_steps("old", &losses(0..3_000, SPIKE, u64::MAX))
        .await;
    assert_eq!(response.status(), 200);
    // What a server before the level left: no 1,024-step buckets, and a run the
    // upgrade's migration marked as having the two levels.
    app.stop().await;
    execute(
        &app,
        &[
            "DELETE FROM rollups WHERE width = 1024",
            "UPDATE runs SET rollup_widths = '64,4096'",
        ],
    )
    .await;
    let app = app.restart().await;
    let response = app
        .post_steps("old", &losses(3_000..6_000, u64::MAX, u64::MAX))
        .await;
    assert_eq!(response.status(), 200);
    // 6,000 steps in 2 output buckets of 3,000: wide enough for the 1,024-step
    // level, whose bucket 2048..=3071 holds only 3000..=3071 of this run.
    let (_, body) = app
        .get_json("/api/v1/runs/old/series?metric=loss&max_points=4")
        .await;
    assert_eq!(body["downsampled"], true);
    let points = body["points"].as_array().unwrap();
    assert!(
        points.contains(&json!([SPIKE, 1000])),
        "the spike before the upgrade is read from the 64-step level: {points:?}"
    );
}
