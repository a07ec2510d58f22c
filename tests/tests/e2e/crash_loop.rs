//! The crash loop at scale: four real trainers stream fault scenarios while the
//! server is SIGKILLed at 20 moments and restarted on the same address and file each
//! time. Afterwards every run has every step exactly once (a trainer exits 0 only
//! when the server acknowledged all it sent), and every run's alerts opened at the
//! same steps as in the same runs without kills: detector state survived each kill.
//!
//! `GRADFLOW_CRASH_KILLS` sets the number of kills (default 20).

use std::collections::BTreeSet;
use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use gradflow_e2e::{
    ServerProcess, binary, free_loopback_address, stored_loss_steps, wait_for_exit,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

const SCENARIOS: [&str; 4] = [
    "detached-prompt",
    "bf16-frozen-norms",
    "qwen-not-in-optimizer",
    "nan-gradient",
];
const STEPS: u64 = 400;

fn start_trainer(dir: &Path, address: &str, scenario: &str, delay_ms: u64) -> Child {
    let log = File::create(dir.join(format!("{scenario}.log"))).unwrap();
    Command::new(binary("gradflow-trainer"))
        .args(["--server", &format!("http://{address}")])
        .args(["--run-id", scenario, "--scenario", scenario])
        .args(["--steps", &STEPS.to_string()])
        .args(["--step-delay-ms", &delay_ms.to_string()])
        .arg("--spool-dir")
        .arg(dir)
        .arg("--quiet")
        .env("RUST_LOG", "gradflow_trainer=warn")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

/// Runs the four trainers to the end against `address`; panics with a trainer's log
/// if one does not deliver everything.
fn wait_for_trainers(dir: &Path, trainers: Vec<Child>) {
    for (mut trainer, scenario) in trainers.into_iter().zip(SCENARIOS) {
        let status = wait_for_exit(&mut trainer, Duration::from_secs(180), scenario);
        let log = std::fs::read_to_string(dir.join(format!("{scenario}.log"))).unwrap();
        assert!(status.success(), "{scenario} exited {status}:\n{log}");
    }
}

/// Each alert of a run as (kind, subject, first step, the step that opened it).
async fn alert_steps(
    client: &reqwest::Client,
    server: &ServerProcess,
    run: &str,
) -> BTreeSet<(String, String, i64, i64)> {
    let alerts: Value = client
        .get(server.url(&format!("/api/v1/runs/{run}/alerts")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    alerts["alerts"]
        .as_array()
        .unwrap_or_else(|| panic!("no alerts list: {alerts}"))
        .iter()
        .map(|a| {
            (
                a["kind"].as_str().unwrap().to_owned(),
                a["subject"].as_str().unwrap_or_default().to_owned(),
                a["first_step"].as_i64().unwrap_or(-1),
                a["opened_step"].as_i64().unwrap_or(-1),
            )
        })
        .collect()
}

/// Pauses between kills, 150–1,350 ms, from a fixed seed so a failure can be
/// replayed.
fn pauses(count: usize) -> Vec<Duration> {
    let mut rng = StdRng::seed_from_u64(0x2545_f491_4f6c_dd1d);
    (0..count)
        .map(|_| Duration::from_millis(rng.gen_range(150..1_350)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_trainers_survive_twenty_sigkills() {
    let kills: usize = std::env::var("GRADFLOW_CRASH_KILLS")
        .ok()
        .map(|n| n.parse().expect("GRADFLOW_CRASH_KILLS is a count"))
        .unwrap_or(20);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gradflow.db");
    let address = free_loopback_address();
    let client = reqwest::Client::new();

    let mut server = ServerProcess::start_at(&db, &address, &[]);
    let mut trainers: Vec<Child> = SCENARIOS
        .iter()
        .map(|s| start_trainer(dir.path(), &address, s, 60))
        .collect();
    let mut kills_while_training = 0;
    for pause in pauses(kills) {
        tokio::time::sleep(pause).await;
        server.kill();
        if trainers.iter_mut().any(|t| t.try_wait().unwrap().is_none()) {
            kills_while_training += 1;
        }
        server = ServerProcess::start_at(&db, &address, &[]);
    }
    assert_eq!(
        kills_while_training, kills,
        "every kill came while the trainers were streaming"
    );
    wait_for_trainers(dir.path(), std::mem::take(&mut trainers));
    for run in SCENARIOS {
        assert_eq!(
            stored_loss_steps(&client, &server, run).await,
            (0..STEPS).collect::<Vec<_>>(),
            "{run}: every step once, in order"
        );
    }

    // The same runs on a server that is never killed.
    let reference_dir = tempfile::tempdir().unwrap();
    let reference_address = free_loopback_address();
    let reference = ServerProcess::start_at(
        &reference_dir.path().join("gradflow.db"),
        &reference_address,
        &[],
    );
    let references = SCENARIOS
        .iter()
        .map(|s| start_trainer(reference_dir.path(), &reference_address, s, 0))
        .collect();
    wait_for_trainers(reference_dir.path(), references);
    for run in SCENARIOS {
        let expected = alert_steps(&client, &reference, run).await;
        assert!(!expected.is_empty(), "{run} raises alerts");
        assert_eq!(
            alert_steps(&client, &server, run).await,
            expected,
            "{run}: alerts opened at the same steps as without kills"
        );
    }
}
