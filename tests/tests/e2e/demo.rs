//! `gradflow-server demo`, as the README's quickstart runs it: it prints the
//! dashboard's address, trains every scenario with the real trainer beside it, the
//! runs end up diagnosed, and Ctrl-C stops everything with a clean exit.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use gradflow_e2e::{binary, wait_for_exit};
use gradflow_trainer::scenario::SCENARIOS;

use serde_json::Value;

#[test]
fn demo_trains_every_scenario_and_stops_on_ctrl_c() {
    // As few steps as show every scenario's alerts. (The demo's default 300 steps,
    // where a healthy run's gradient norms rise around step 150, are
    // `false_alarms.rs`'s: it trains every scenario 320 steps.)
    let steps = SCENARIOS
        .iter()
        .map(|s| s.steps_to_show_alerts())
        .max()
        .unwrap()
        .to_string();
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(binary("gradflow-server"))
        .args(["--listen", "127.0.0.1:0", "--db"])
        .arg(dir.path().join("demo.db"))
        .args(["demo", "--steps", &steps, "--step-delay-ms", "0"])
        .env("RUST_LOG", "gradflow_server=warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let first = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    let base = first
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no dashboard address in {first:?}"))
        .trim_end_matches('/')
        .to_owned();
    let mut lines = vec![first];
    while !lines.last().unwrap().contains("every scenario ran") {
        lines.push(
            rx.recv_timeout(Duration::from_secs(120))
                .unwrap_or_else(|_| panic!("the demo stalled:\n{}", lines.join("\n"))),
        );
    }
    let get = |path: &str| -> Value {
        let text = Command::new("curl")
            .args(["-sf", &format!("{base}{path}")])
            .output()
            .unwrap()
            .stdout;
        serde_json::from_slice(&text).unwrap()
    };
    let runs = get("/api/v1/runs");
    let runs = runs["runs"].as_array().unwrap();
    // Healthy, then every scenario of the trainer's table, each once.
    let mut trained: Vec<&str> = runs
        .iter()
        .map(|run| run["run_id"].as_str().unwrap().rsplit_once('-').unwrap().0)
        .collect();
    trained.sort_unstable();
    let mut table = gradflow_trainer::scenario::names();
    table.sort_unstable();
    assert_eq!(trained, table, "{runs:?}");
    for run in runs {
        let run_id = run["run_id"].as_str().unwrap();
        assert_eq!(run["status"], "finished", "{run}");
        // Each demo run raises exactly its scenario's alerts (the README's table),
        // the healthy ones none, and nothing louder than info besides.
        let (scenario, _) = run_id.rsplit_once('-').unwrap();
        let expected = gradflow_trainer::scenario::find(scenario).unwrap().alerts;
        let alerts = get(&format!("/api/v1/runs/{run_id}/alerts"));
        let loud: Vec<&Value> = alerts["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["severity"] != "info")
            .collect();
        let kinds: BTreeSet<&str> = loud.iter().map(|a| a["kind"].as_str().unwrap()).collect();
        let expected: BTreeSet<&str> = expected.iter().copied().collect();
        assert_eq!(
            kinds,
            expected,
            "{run_id} raised:\n{}",
            loud.iter()
                .map(|a| format!(
                    "{} {} on {} from step {}: {}",
                    a["severity"], a["kind"], a["subject"], a["first_step"], a["detail"]
                ))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    // Ctrl-C.
    Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    let status = wait_for_exit(&mut child, Duration::from_secs(15), "the demo");
    assert!(status.success(), "{status}");
}
