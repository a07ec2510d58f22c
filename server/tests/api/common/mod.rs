//! A real server on `127.0.0.1:0` with its own database — a temporary SQLite file,
//! or with `GRADFLOW_TEST_BACKEND=postgres` a fresh PostgreSQL database — and the
//! real migrations, and a client to talk to it.

#![allow(dead_code)] // each test binary uses its own part of the helpers

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use gradflow_e2e::postgres::{Backend, Postgres, test_backend};
use gradflow_server::config::ServerConfig;
use gradflow_server::startup::Application;
use gradflow_server::store::{DatabaseUrl, SyncMode};
use reqwest::{Client, Response};
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub struct TestApp {
    pub base: String,
    pub client: Client,
    /// The SQLite file (unused with PostgreSQL).
    pub db: PathBuf,
    /// The database the server runs on.
    pub database: DatabaseUrl,
    /// The PostgreSQL server holding `database`, kept alive while the test runs.
    pub postgres: Option<Arc<Postgres>>,
    dir: tempfile::TempDir,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

/// A test server's configuration: the server's own flags and defaults, as a user
/// would start it, on port 0 and `db`, with `--sync normal` (tests need no fsync per
/// commit). Tests change fields of it; a new flag needs no edit here.
pub fn config(db: PathBuf) -> ServerConfig {
    let db = db.to_str().expect("a UTF-8 temporary path").to_owned();
    ServerConfig::try_parse_from([
        "gradflow-server",
        "--listen",
        "127.0.0.1:0",
        "--db",
        &db,
        "--sync",
        "normal",
    ])
    .expect("the test server's flags parse")
}

impl TestApp {
    pub async fn spawn() -> TestApp {
        Self::spawn_with(|_| {}).await
    }

    /// Starts a server; `adjust` may change its configuration (the database path
    /// is a fresh temporary file).
    pub async fn spawn_with(adjust: impl FnOnce(&mut ServerConfig)) -> TestApp {
        let dir = tempfile::tempdir().expect("temporary directory");
        let db = dir.path().join("gradflow.db");
        let mut config = config(db.clone());
        let postgres = match test_backend() {
            Backend::Sqlite => None,
            Backend::Postgres => {
                let postgres = Postgres::shared()
                    .expect("GRADFLOW_TEST_BACKEND=postgres, but no PostgreSQL could be had");
                config.database = Some(postgres.create_database().await);
                Some(postgres)
            }
        };
        adjust(&mut config);
        Self::start(config, dir, postgres).await
    }

    /// Whether this test runs on PostgreSQL.
    pub fn on_postgres(&self) -> bool {
        self.database.is_postgres()
    }

    async fn start(
        config: ServerConfig,
        dir: tempfile::TempDir,
        postgres: Option<Arc<Postgres>>,
    ) -> TestApp {
        let app = Application::build(&config).await.expect("server builds");
        let database = config.database_url().expect("a valid database URL");
        if database.is_postgres() {
            tokio::time::timeout(std::time::Duration::from_secs(60), app.wait_ready())
                .await
                .expect("the PostgreSQL database is ready within a minute");
        }
        let base = format!("http://{}", app.address());
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(app.run_until(async {
            let _ = rx.await;
        }));
        TestApp {
            base,
            client: Client::new(),
            db: config.db,
            database,
            postgres,
            dir,
            shutdown: Some(tx),
            task: Some(task),
        }
    }

    /// Stops the server gracefully and starts a new one on the same database file.
    pub async fn restart(self) -> TestApp {
        self.restart_with(|_| {}).await
    }

    /// Like [`TestApp::restart`], with `adjust` applied to the new configuration.
    pub async fn restart_with(mut self, adjust: impl FnOnce(&mut ServerConfig)) -> TestApp {
        self.stop().await;
        let mut config = config(self.db.clone());
        if self.database.is_postgres() {
            if let DatabaseUrl::Postgres(url) = &self.database {
                config.database = Some(url.clone());
            }
        }
        adjust(&mut config);
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap());
        Self::start(config, dir, self.postgres.take()).await
    }

    pub async fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.await
                .expect("server task")
                .expect("server ran cleanly");
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn register(&self, run_id: &str, body: &Value) -> Response {
        self.client
            .put(self.url(&format!("/api/v1/runs/{run_id}")))
            .json(body)
            .send()
            .await
            .expect("request")
    }

    pub async fn post_steps(&self, run_id: &str, steps: &Value) -> Response {
        self.client
            .post(self.url(&format!("/api/v1/runs/{run_id}/steps")))
            .json(steps)
            .send()
            .await
            .expect("request")
    }

    pub async fn post_raw(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<reqwest::Body>,
    ) -> Response {
        let mut request = self.client.post(self.url(path)).body(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.send().await.expect("request")
    }

    pub async fn get_json(&self, path: &str) -> (u16, Value) {
        let response = self
            .client
            .get(self.url(path))
            .send()
            .await
            .expect("request");
        let status = response.status().as_u16();
        (status, response.json().await.expect("JSON body"))
    }

    /// The points of a series, as `[step, value]` pairs.
    pub async fn points(&self, run_id: &str, query: &str) -> Vec<(u64, Value)> {
        let (status, body) = self
            .get_json(&format!("/api/v1/runs/{run_id}/series?{query}"))
            .await;
        assert_eq!(status, 200, "{body}");
        body["points"]
            .as_array()
            .expect("points")
            .iter()
            .map(|p| (p[0].as_u64().expect("step"), p[1].clone()))
            .collect()
    }
}

/// A registration with one norm parameter per group.
pub fn registration() -> Value {
    json!({
        "name": "test run",
        "precision": {"param_dtype": "f32"},
        "optimizer": {"name": "adamw", "lr": 3e-4},
        "params": [
            {"name": "qwen.layers.0.input_layernorm.weight", "role": "norm", "dtype": "f32", "shape": [8]},
            {"name": "agent.norm.weight", "role": "norm", "dtype": "f32", "shape": [8]}
        ]
    })
}

/// A healthy step record.
pub fn step(step: u64) -> Value {
    json!({
        "step": step,
        "loss": 4.0 - step as f64 * 0.001,
        "lr": 3e-4,
        "modules": [
            {"module": "qwen.layers.0.self_attn", "grad_norm": 0.5, "hook_hits": 1},
            {"module": "agent.head", "grad_norm": 1.5, "hook_hits": 1}
        ],
        "params": [
            {"name": "qwen.layers.0.input_layernorm.weight", "grad_norm": 0.003, "update_norm": 1e-4, "drift": 1e-3, "mean": 1.0}
        ]
    })
}

pub fn steps(range: std::ops::Range<u64>) -> Value {
    Value::Array(range.map(step).collect())
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

pub async fn error_of(response: Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let body: Value = response.json().await.expect("error bodies are JSON");
    assert!(
        body["error"]["code"].is_string(),
        "error body shape: {body}"
    );
    assert!(
        body["error"]["message"].is_string(),
        "error body shape: {body}"
    );
    (status, body["error"].clone())
}

/// A store and its ingest service on the test's database (SQLite or PostgreSQL, as
/// for [`TestApp`]), without HTTP.
pub struct TestStore {
    pub store: std::sync::Arc<gradflow_server::store::Store>,
    pub ingest: gradflow_server::ingest::Ingest,
    _dir: tempfile::TempDir,
    _postgres: Option<Arc<Postgres>>,
}

impl TestStore {
    pub async fn open(detection: gradflow_core::detect::Detection) -> TestStore {
        use gradflow_server::store::{Store, StoreConfig};
        let dir = tempfile::tempdir().expect("temporary directory");
        let (database, postgres) = match test_backend() {
            Backend::Sqlite => (DatabaseUrl::Sqlite(dir.path().join("g.db")), None),
            Backend::Postgres => {
                let postgres = Postgres::shared().expect("no PostgreSQL could be had");
                let url = postgres.create_database().await;
                (DatabaseUrl::Postgres(url), Some(postgres))
            }
        };
        let store = Arc::new(
            // Every commit synced, as a server runs by default.
            Store::open(&StoreConfig {
                database,
                sync: SyncMode::Full,
            })
            .await
            .expect("the store opens"),
        );
        store.wait_ready().await.expect("the database is ready");
        let ingest = gradflow_server::ingest::Ingest::standalone(store.clone(), detection);
        TestStore {
            store,
            ingest,
            _dir: dir,
            _postgres: postgres,
        }
    }
}
