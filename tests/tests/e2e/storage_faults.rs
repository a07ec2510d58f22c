//! The database cannot take writes: locked by another writer, its files made
//! read-only (immutable, which holds even for root), or the disk "full" (the
//! server's file-size limit lowered below the files' size, so every write fails as
//! on a full disk). Each time the server answers `503 storage_unavailable` with
//! `Retry-After`, keeps serving reads, loses nothing it acknowledged, stores nothing
//! of the refused batch, and takes writes again, without a restart, once the
//! condition clears.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use gradflow_e2e::{ServerProcess, stored_loss_steps};
use reqwest::Client;
use serde_json::{Value, json};
use sqlx::Connection;

const RUN: &str = "r";

fn batch(steps: std::ops::Range<u64>) -> Value {
    Value::Array(
        steps
            .map(|s| {
                json!({"step": s, "loss": 1.0 / (s as f64 + 1.0),
                       "modules": [{"module": "qwen.layers.0.mlp", "grad_norm": 0.5, "hook_hits": 1},
                                   {"module": "agent.head", "grad_norm": 1.0, "hook_hits": 1}]})
            })
            .collect(),
    )
}

struct Harness {
    server: ServerProcess,
    client: Client,
    acknowledged: BTreeSet<u64>,
    next: u64,
}

impl Harness {
    async fn start(db: &Path) -> Harness {
        let server = ServerProcess::start(db, &[]);
        let client = Client::new();
        let response = client
            .put(server.url(&format!("/api/v1/runs/{RUN}")))
            .json(&json!({"params": []}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        let mut harness = Harness {
            server,
            client,
            acknowledged: BTreeSet::new(),
            next: 0,
        };
        for _ in 0..5 {
            assert_eq!(harness.post_next().await.0, 200);
        }
        harness
    }

    /// Posts the next 20 steps; returns the status and the error body, if any.
    async fn post_next(&mut self) -> (u16, Value) {
        let steps = self.next..self.next + 20;
        let response = self
            .client
            .post(self.server.url(&format!("/api/v1/runs/{RUN}/steps")))
            .json(&batch(steps.clone()))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let retry_after = response.headers().get("retry-after").cloned();
        let body: Value = response.json().await.unwrap();
        if status == 200 {
            self.acknowledged.extend(steps);
            self.next += 20;
        } else {
            assert!(retry_after.is_some(), "{status} without Retry-After");
        }
        (status, body)
    }

    /// Every acknowledged step is stored once, and nothing else (the refused
    /// batches left nothing behind).
    async fn assert_exactly_acknowledged(&self, when: &str) {
        let stored = stored_loss_steps(&self.client, &self.server, RUN).await;
        let expected: Vec<u64> = self.acknowledged.iter().copied().collect();
        assert_eq!(stored, expected, "{when}");
    }

    /// While the fault lasts: writes get 503 with a clear message, reads still work.
    async fn assert_refused(&mut self, fault: &str) {
        for _ in 0..2 {
            let (status, body) = self.post_next().await;
            assert_eq!(status, 503, "{fault}: {body}");
            assert_eq!(body["error"]["code"], "storage_unavailable", "{fault}");
            let message = body["error"]["message"].as_str().unwrap();
            assert!(
                message.contains("nothing was stored, retry later"),
                "{fault}: {message}"
            );
        }
        self.assert_exactly_acknowledged(&format!("reads during {fault}"))
            .await;
        let health = self.client.get(self.server.url("/healthz")).send().await;
        assert_eq!(health.unwrap().status(), 200, "{fault}: health");
    }

    /// After the fault: the same server takes writes again, the refused steps
    /// included (a client resends them), and nothing was lost.
    async fn assert_recovered(&mut self, fault: &str) {
        let before = self.acknowledged.len();
        for _ in 0..3 {
            let (status, body) = self.post_next().await;
            assert_eq!(status, 200, "after {fault}: {body}");
        }
        assert_eq!(self.acknowledged.len(), before + 60);
        self.assert_exactly_acknowledged(&format!("after {fault}"))
            .await;
    }

    /// Acknowledged means committed: a server started afresh on the file has it all.
    async fn assert_durable(self, db: &Path, fault: &str) {
        let Harness {
            server,
            client,
            acknowledged,
            next,
        } = self;
        assert!(server.terminate().success(), "{fault}: a clean stop");
        let restarted = Harness {
            server: ServerProcess::start(db, &[]),
            client,
            acknowledged,
            next,
        };
        restarted
            .assert_exactly_acknowledged(&format!("after {fault} and a restart"))
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_database_gets_503_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gradflow.db");
    let mut harness = Harness::start(&db).await;

    // Another process takes the write lock and keeps it past the server's busy
    // timeout (5 s).
    let mut other = sqlx::SqliteConnection::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut other)
        .await
        .unwrap();
    let started = Instant::now();
    harness.assert_refused("a locked database").await;
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "the server waited its busy timeout before giving up"
    );
    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    drop(other);
    harness.assert_recovered("a locked database").await;
    harness.assert_durable(&db, "a locked database").await;
}

/// Sets or clears the immutable attribute; cleared again when dropped, so a failing
/// test still leaves a removable temporary directory.
struct Immutable(Vec<PathBuf>);

impl Immutable {
    fn set(files: Vec<PathBuf>) -> Immutable {
        chattr("+i", &files);
        Immutable(files)
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        chattr("-i", &self.0);
    }
}

fn chattr(flag: &str, files: &[PathBuf]) {
    let status = Command::new("chattr")
        .arg(flag)
        .args(files)
        .status()
        .expect("chattr (e2fsprogs) runs");
    assert!(
        status.success(),
        "chattr {flag} failed: this test needs a filesystem with file attributes (ext4) and CAP_LINUX_IMMUTABLE"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_database_gets_503_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gradflow.db");
    let mut harness = Harness::start(&db).await;
    let wal = dir.path().join("gradflow.db-wal");
    assert!(wal.exists(), "the server writes ahead to {}", wal.display());

    let read_only = Immutable::set(vec![db.clone(), wal]);
    harness.assert_refused("a read-only database").await;
    drop(read_only);
    harness.assert_recovered("a read-only database").await;
    harness.assert_durable(&db, "a read-only database").await;
}

fn prlimit_file_size(pid: u32, soft: &str) {
    let status = Command::new("prlimit")
        .args([
            "--pid",
            &pid.to_string(),
            &format!("--fsize={soft}:unlimited"),
        ])
        .status()
        .expect("prlimit (util-linux) runs");
    assert!(status.success(), "prlimit --fsize={soft}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_gets_503_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gradflow.db");
    let mut harness = Harness::start(&db).await;

    // No write may reach past the first 4 KiB of any file: every write of the
    // database and its log fails (EFBIG, or a short write, as on a full disk).
    prlimit_file_size(harness.server.pid(), "4096");
    harness.assert_refused("a full disk").await;
    prlimit_file_size(harness.server.pid(), "unlimited");
    harness.assert_recovered("a full disk").await;
    harness.assert_durable(&db, "a full disk").await;
}
