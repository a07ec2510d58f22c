//! Deleting runs gives their space back, and `--retain-days` deletes idle runs: on a
//! real file (or a real PostgreSQL database), through the real server. The bytes are
//! SQLite's: PostgreSQL keeps a deleted run's pages for reuse (autovacuum), so there
//! only what is deleted and what is kept is checked.

use std::time::{Duration, Instant};

use crate::common::{TestApp, registration};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use sqlx::Connection;

/// `count` steps of 200 modules with noisy norms (so they compress as real
/// telemetry does, not to nothing), sent in batches of 250.
async fn fill(app: &TestApp, run: &str, count: u64) {
    app.register(run, &registration()).await;
    let mut rng = StdRng::seed_from_u64(0x9e37_79b9_7f4a_7c15 ^ run.len() as u64);
    let mut noise = move || rng.gen_range(0.0..1.0);
    for first in (0..count).step_by(250) {
        let batch: Vec<Value> = (first..(first + 250).min(count))
            .map(|s| {
                let modules: Vec<Value> = (0..200)
                    .map(|m| json!({"module": format!("qwen.layers.{m}.mlp"), "grad_norm": noise(), "hook_hits": 1}))
                    .collect();
                json!({"step": s, "loss": noise(), "modules": modules})
            })
            .collect();
        let response = app.post_steps(run, &Value::Array(batch)).await;
        assert_eq!(response.status(), 200);
    }
}

/// Bytes of the SQLite database and its write-ahead log (`None` on PostgreSQL).
fn bytes_on_disk(app: &TestApp) -> Option<u64> {
    if app.on_postgres() {
        return None;
    }
    let wal = app.db.with_extension("db-wal");
    Some(
        std::fs::metadata(&app.db).unwrap().len()
            + std::fs::metadata(wal).map(|m| m.len()).unwrap_or(0),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_run_gives_its_space_back() {
    let app = TestApp::spawn().await;
    fill(&app, "kept", 2_000).await;
    fill(&app, "deleted", 2_000).await;
    // A clean restart folds the log into the file: what the two runs take.
    let app = app.restart().await;
    let before = bytes_on_disk(&app);

    let response = app
        .client
        .delete(app.url("/api/v1/runs/deleted"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    if let (Some(before), Some(after)) = (before, bytes_on_disk(&app)) {
        eprintln!(
            "two runs of 2,000 steps × 200 modules: {before} bytes; after deleting one: {after} bytes"
        );
        assert!(
            (after as f64) < 0.6 * before as f64,
            "deleting half the data left {after} of {before} bytes"
        );
    }
    assert_eq!(app.get_json("/api/v1/runs/deleted").await.0, 404);
    assert_eq!(app.get_json("/api/v1/runs/kept").await.0, 200);
    assert_eq!(
        app.points("kept", "metric=loss").await.len(),
        2_000,
        "the other run is whole"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retain_days_deletes_idle_runs_and_frees_their_space() {
    let app = TestApp::spawn().await;
    fill(&app, "old", 2_000).await;
    fill(&app, "recent", 200).await;
    app.register("old-and-empty", &registration()).await;
    let mut app = app.restart().await;
    app.stop().await;
    // Ten days pass for two of the runs.
    let ten_days_ago = gradflow_server::store::now_seconds() - 10.0 * 86_400.0;
    let backdate = "UPDATE runs SET created_at = $1, \
         last_seen = CASE WHEN last_seen IS NULL THEN NULL ELSE $1 END \
         WHERE run_id IN ('old', 'old-and-empty')";
    match &app.database {
        gradflow_server::store::DatabaseUrl::Sqlite(path) => {
            let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
                .await
                .unwrap();
            sqlx::query(backdate)
                .bind(ten_days_ago)
                .execute(&mut conn)
                .await
                .unwrap();
            conn.close().await.unwrap();
        }
        gradflow_server::store::DatabaseUrl::Postgres(url) => {
            let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
            sqlx::query(backdate)
                .bind(ten_days_ago)
                .execute(&mut conn)
                .await
                .unwrap();
            conn.close().await.unwrap();
        }
    }
    let before = bytes_on_disk(&app);

    let app = app.restart_with(|c| c.retain_days = Some(7)).await;
    // Retention deletes the runs, then vacuums and checkpoints: wait for all of it,
    // since a loaded machine may see the first deletion before the rest.
    let started = Instant::now();
    loop {
        let old = app.get_json("/api/v1/runs/old").await.0;
        let empty = app.get_json("/api/v1/runs/old-and-empty").await.0;
        let after = bytes_on_disk(&app);
        let freed = match (before, after) {
            (Some(before), Some(after)) => (after as f64) < 0.3 * before as f64,
            _ => true,
        };
        if old == 404 && empty == 404 && freed {
            eprintln!("retention: {before:?} bytes before, {after:?} after");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "after 20 s: `old` answers {old}, `old-and-empty` {empty}, and the database \
             holds {after:?} of {before:?} bytes"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(app.get_json("/api/v1/runs/recent").await.0, 200);
    assert_eq!(app.points("recent", "metric=loss").await.len(), 200);
}

/// With several servers on one PostgreSQL database, a database-wide chore
/// (retention) runs on one at a time: while one store holds the chore's lock,
/// another store on the same database is told someone else is doing it, and can
/// take it once the first is done. On SQLite (one server) the work always runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_wide_chore_runs_on_one_server_at_a_time() {
    use gradflow_server::store::{Store, StoreConfig, SyncMode};

    let app = TestApp::spawn().await;
    let config = StoreConfig {
        database: app.database.clone(),
        sync: SyncMode::Normal,
    };
    let first = Store::open(&config).await.unwrap();
    let second = Store::open(&config).await.unwrap();
    first.wait_ready().await.unwrap();
    second.wait_ready().await.unwrap();

    let (held_tx, held_rx) = tokio::sync::oneshot::channel::<()>();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let holder = tokio::spawn(async move {
        let ran = first
            .exclusively("retention", async || {
                held_tx.send(()).unwrap();
                release_rx.await.unwrap();
                Ok(1)
            })
            .await
            .unwrap();
        (first, ran)
    });
    held_rx.await.unwrap();
    let meanwhile = second
        .exclusively("retention", async || Ok(2))
        .await
        .unwrap();
    // Another name is another chore: not held back.
    let other = second
        .exclusively("another chore", async || Ok(3))
        .await
        .unwrap();
    release_tx.send(()).unwrap();
    let (_first, ran) = holder.await.unwrap();
    let after = second
        .exclusively("retention", async || Ok(4))
        .await
        .unwrap();

    assert_eq!(ran, Some(1));
    assert_eq!(other, Some(3));
    assert_eq!(after, Some(4), "the lock is released when the work ends");
    if app.on_postgres() {
        assert_eq!(
            meanwhile, None,
            "a second server must not run a chore another runs"
        );
    } else {
        assert_eq!(meanwhile, Some(2), "SQLite has one server: the work runs");
    }
}
