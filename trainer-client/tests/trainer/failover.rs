//! The reporter's order through several servers, against real gradflow servers on
//! their own SQLite files: the first server first; when it stops answering, the
//! next; after the last, the first again. Each server's own database says where
//! every step went.

use std::path::Path;
use std::time::{Duration, Instant};

use clap::Parser;
use gradflow_protocol::{Float, RunRegistration, StepRecord};
use gradflow_server::config::ServerConfig;
use gradflow_server::startup::Application;
use gradflow_trainer::reporter::{Reporter, ReporterConfig};
use serde_json::Value;
use tokio::runtime::Runtime;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const RUN: &str = "rotation";

/// A gradflow server serving on `runtime` until stopped.
struct Server {
    base: String,
    shutdown: oneshot::Sender<()>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Server {
    fn start(runtime: &Runtime, db: &Path, listen: &str) -> Server {
        let config = ServerConfig::try_parse_from([
            "gradflow-server",
            "--listen",
            listen,
            "--db",
            db.to_str().unwrap(),
            "--sync",
            "normal",
        ])
        .unwrap();
        let app = runtime
            .block_on(Application::build(&config))
            .expect("the server starts");
        let base = format!("http://{}", app.address());
        let (shutdown, stop) = oneshot::channel();
        let task = runtime.spawn(app.run_until(async {
            let _ = stop.await;
        }));
        Server {
            base,
            shutdown,
            task,
        }
    }

    /// Stops serving; its address refuses connections from then on.
    fn stop(self, runtime: &Runtime) {
        let _ = self.shutdown.send(());
        runtime
            .block_on(self.task)
            .unwrap()
            .expect("the server stops cleanly");
    }

    /// The steps of the run this server stored, in order; none when it does not
    /// know the run.
    fn steps(&self) -> Vec<u64> {
        let url = format!("{}/api/v1/runs/{RUN}/series?metric=loss", self.base);
        let response = reqwest::blocking::get(&url).unwrap();
        if response.status() == 404 {
            return Vec::new();
        }
        let body: Value = response.json().unwrap();
        body["points"]
            .as_array()
            .unwrap_or_else(|| panic!("no points in {body}"))
            .iter()
            .map(|p| p[0].as_u64().unwrap())
            .collect()
    }

    /// Waits until this server has stored `expected`.
    fn wait_for(&self, expected: &[u64]) {
        let started = Instant::now();
        loop {
            let steps = self.steps();
            if steps == expected {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{} holds {steps:?}, not {expected:?}",
                self.base
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn record(step: u64) -> StepRecord {
    StepRecord {
        step,
        loss: Some(Float(1.0 / (step + 1) as f64)),
        ..Default::default()
    }
}

fn report(reporter: &Reporter, steps: std::ops::Range<u64>) {
    for step in steps {
        reporter.report(record(step));
    }
}

#[test]
fn the_first_server_first_then_the_next_then_the_first_again() {
    let runtime = Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (db_a, db_b) = (dir.path().join("a.db"), dir.path().join("b.db"));
    let a = Server::start(&runtime, &db_a, "127.0.0.1:0");
    let b = Server::start(&runtime, &db_b, "127.0.0.1:0");
    let address_a = a.base.trim_start_matches("http://").to_owned();

    let mut config = ReporterConfig::new(&a.base, RUN);
    config.servers.push(b.base.clone());
    config.batch_size = 5;
    config.batch_interval = Duration::from_millis(50);
    config.request_timeout = Duration::from_secs(5);
    config.spool_path = dir.path().join("spool.ndjson");
    let registration: RunRegistration =
        serde_json::from_value(serde_json::json!({"params": []})).unwrap();
    let reporter = Reporter::start(config, registration).unwrap();

    // Both answer: every step goes to the first.
    report(&reporter, 0..10);
    a.wait_for(&(0..10).collect::<Vec<_>>());
    assert_eq!(b.steps(), [] as [u64; 0], "B was not spoken to");

    // The first stops answering: the next takes the run (registering it, since B's
    // database has never seen it).
    a.stop(&runtime);
    report(&reporter, 10..20);
    b.wait_for(&(10..20).collect::<Vec<_>>());

    // The last stops answering and the first is back: after the last, the first.
    b.stop(&runtime);
    let a = Server::start(&runtime, &db_a, &address_a);
    report(&reporter, 20..30);
    let summary = reporter.finish(Duration::from_secs(20));
    assert!(summary.complete(), "{summary:?}");
    assert_eq!(
        (summary.delivered, summary.duplicates),
        (30, 0),
        "{summary:?}"
    );
    assert_eq!(
        a.steps(),
        (0..10).chain(20..30).collect::<Vec<_>>(),
        "A holds the first and the last steps"
    );
    a.stop(&runtime);
}
