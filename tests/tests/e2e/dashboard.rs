//! The dashboard in a real headless Chromium: the real server, runs streamed by the
//! real trainer binary (`detached-prompt` and `bf16-frozen-norms`), then
//! `tests/browser/dashboard.mjs` (playwright-core driving Debian's Chromium) opens
//! `/` and each run's page, checks the alert text word for word against the API, the
//! charts (each one's text laid out without overlap at the size the page asks for),
//! sorting, filtering, the step range in the URL, the comparison of two runs, a
//! live update, two runs shaped like a Hugging Face model (f32 and bf16: the heatmap's
//! group and module labels apart, each lr tick once, the norm chart's legend under
//! its plot, its bf16 lr line inside it, its caption per dtype), and the per-rank page of a multi-rank run it makes over HTTP (four
//! synthetic ranks, one straggling: the table, both charts, the alert, a module
//! picked, a live update, a narrow screen), and fails on any console error.
//! Screenshots land in `test-artifacts/dashboard/`.
//!
//! A second test, `tests/browser/own_numbers.mjs`, checks the user's own metrics on
//! the run page and in the comparison, and the heatmap of short runs pixel by pixel.
//!
//! Needs `chromium` and `npm ci --prefix tests/browser` (`.ci/run` does both).

use std::path::{Path, PathBuf};
use std::process::Command;

use gradflow_e2e::{ServerProcess, binary};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the workspace root")
        .to_path_buf()
}

fn chromium() -> PathBuf {
    let path = std::env::var_os("CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    assert!(
        path.exists(),
        "{} not found: install Debian's chromium (apt-get install chromium), or set CHROMIUM",
        path.display()
    );
    path
}

/// Runs `script` of `tests/browser` against the server at `base` with `env`, and
/// fails unless it passes and ends with `done`; its screenshots land in `artifacts`.
fn run_browser_script(
    script: &str,
    base: &str,
    env: &[(&str, &str)],
    artifacts: &Path,
    done: &str,
) {
    let browser_tests = workspace_root().join("tests/browser");
    assert!(
        browser_tests.join("node_modules/playwright-core").exists(),
        "playwright-core is not installed: run `npm ci --prefix tests/browser`"
    );
    let output = Command::new("node")
        .arg(script)
        .current_dir(&browser_tests)
        .env("GRADFLOW_BASE", base)
        .env("GRADFLOW_ARTIFACTS", artifacts)
        .env("CHROMIUM", chromium())
        .envs(env.iter().copied())
        .output()
        .expect("node runs (Node.js 18 or newer)");
    let log = format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "the browser test failed\n{log}");
    assert!(log.contains(done), "{log}");
}

#[test]
fn dashboard_shows_the_diagnosis_and_updates_live() {
    let root = workspace_root();
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("gradflow.db"), &["--sync", "normal"]);
    let runs = ["detached-prompt", "bf16-frozen-norms"];
    for scenario in runs {
        let output = Command::new(binary("gradflow-trainer"))
            .args(["--server", &server.base, "--scenario", scenario])
            .args(["--run-id", scenario, "--steps", "120", "--quiet"])
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{scenario}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let artifacts = root.join("test-artifacts/dashboard");
    run_browser_script(
        "dashboard.mjs",
        &server.base,
        &[("GRADFLOW_RUNS", &runs.join(","))],
        &artifacts,
        "dashboard ok",
    );
    for shot in [
        "runs.png",
        "run-detached-prompt.png",
        "run-bf16-frozen-norms.png",
        "run-detached-prompt-live.png",
        "run-bf16-frozen-norms-chart-norm-drift.png",
        "run-hf-f32.png",
        "run-hf-bf16-chart-grad-flow.png",
        "run-hf-bf16-chart-norm-drift.png",
        "compare-loss.png",
        "compare-grad-norm.png",
        "compare-grad-norm-chart-compare.png",
        "ranks.png",
        "ranks-chart-ranks-step-time.png",
        "ranks-module.png",
        "ranks-module-chart-ranks-grad-norm.png",
        "ranks-live.png",
        "ranks-narrow.png",
    ] {
        let bytes = std::fs::read(artifacts.join(shot)).unwrap();
        assert!(
            bytes.starts_with(b"\x89PNG"),
            "{shot} is not a PNG screenshot"
        );
    }
}

/// The user's own metrics, a panel each on the run page and one at a time in the
/// comparison; the heatmap of runs of a few hundred steps with no seam in a row
/// where every step was measured.
#[test]
fn dashboard_shows_the_users_own_numbers_and_unbroken_heatmaps() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("gradflow.db"), &["--sync", "normal"]);
    let artifacts = workspace_root().join("test-artifacts/dashboard");
    run_browser_script(
        "own_numbers.mjs",
        &server.base,
        &[],
        &artifacts,
        "own numbers ok",
    );
    for shot in [
        "run-gan-a.png",
        "run-gan-a-chart-metrics.png",
        "compare-own-metric.png",
        "run-short-dense-1000-chart-grad-flow.png",
    ] {
        let bytes = std::fs::read(artifacts.join(shot)).unwrap();
        assert!(
            bytes.starts_with(b"\x89PNG"),
            "{shot} is not a PNG screenshot"
        );
    }
}
