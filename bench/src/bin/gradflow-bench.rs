//! gradflow-bench: every figure of BENCHMARKS.md from one command. Each measurement
//! starts what it needs (a release `gradflow-server` on a fresh temporary database,
//! the trainer binary, bare SQLite), compares side by side in one run, and writes
//! `results.json`, `report.md` (the tables, each figure beside its target) and the
//! scaling plots into `--out`.
//!
//! `cargo build --release --bins && ./target/release/gradflow-bench` (all of it,
//! ~10 minutes on 2 cores); `--quick` runs every part at smoke sizes.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use candle_core::Device;
use clap::{Parser, ValueEnum};
use gradflow_bench::harness::alarms::FalseAlarms;
use gradflow_bench::harness::report::{self, IngestReport, IngestRound, Report};
use gradflow_bench::harness::{Machine, baseline, ingest, latency, plot, queries, scaling};
use gradflow_trainer::model::config::Preset;
use gradflow_trainer::overhead;

// The trainer binary's allocator, so the overhead measured is the trainer's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Part {
    All,
    Ingest,
    Queries,
    Overhead,
    Latency,
    Scaling,
    Mlflow,
    /// Redraw the scaling plots from `--out`/results.json, measuring nothing.
    Plots,
}

#[derive(Debug, Parser)]
#[command(name = "gradflow-bench", version, about)]
struct Args {
    /// What to measure.
    #[arg(value_enum, default_value = "all")]
    part: Part,
    /// Smoke sizes: every part runs, in seconds; the figures mean nothing.
    #[arg(long)]
    quick: bool,
    /// Where results.json, report.md and the plots go.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
    /// Rounds of the ingest comparison (default 5, 1 with --quick).
    #[arg(long)]
    rounds: Option<usize>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let wants = |part: Part| args.part == part || args.part == Part::All;
    let quick = args.quick;
    if args.part == Part::Plots {
        return redraw_plots(&args.out);
    }
    let mut report = Report {
        machine: Some(Machine::this()),
        quick,
        ..Report::default()
    };

    if wants(Part::Ingest) {
        let steps = if quick { 100 } else { 5_000 };
        let rounds = args.rounds.unwrap_or(if quick { 1 } else { 5 });
        report.ingest = Some(ingest_rounds(steps, rounds).await?);
    }
    if wants(Part::Queries) {
        let spec = if quick {
            queries::QuerySpec {
                long_steps: 2_000,
                long_modules: 50,
                runs: 20,
                repeats: 3,
            }
        } else {
            queries::QuerySpec {
                long_steps: 100_000,
                long_modules: 200,
                runs: 1_000,
                repeats: 21,
            }
        };
        eprintln!(
            "gradflow-bench: queries ({} runs, the long one {} steps × {} modules)",
            spec.runs, spec.long_steps, spec.long_modules
        );
        report.queries = Some(queries::run(&spec).await?);
    }
    if wants(Part::Overhead) {
        let (preset, steps) = if quick { ("tiny", 4) } else { ("small", 120) };
        eprintln!("gradflow-bench: trainer overhead ({preset}, {steps} steps each)");
        let preset = Preset::named(preset)?;
        report.overhead = Some(
            tokio::task::spawn_blocking(move || overhead::measure(&preset, steps, &Device::Cpu))
                .await??,
        );
    }
    if wants(Part::Latency) {
        // The healthy scenarios beside the failures: long enough for the rise of
        // the tiny model's gradient norms around step 150.
        let healthy = if quick {
            latency::HealthyRuns {
                seeds: vec![0],
                steps: 200,
            }
        } else {
            latency::HealthyRuns {
                seeds: vec![0, 1, 2],
                steps: 1_000,
            }
        };
        eprintln!(
            "gradflow-bench: detection latency (every failure scenario of the trainer), \
            and its healthy scenarios at {} seeds × {} steps",
            healthy.seeds.len(),
            healthy.steps
        );
        let (detections, alarms) = latency::run(&healthy).await?;
        report.latency = Some(detections);
        report.latency_alarms = Some(alarms);
    }
    if wants(Part::Scaling) {
        let sweeps = scaling_sweeps(quick).await?;
        write_plots(&sweeps, &args.out)?;
        report.scaling = Some(sweeps);
    }
    if wants(Part::Mlflow) {
        report.mlflow = mlflow_reference(quick)?;
    }

    let alarms = report::gather_alarms(&report);
    if !alarms.is_empty() {
        report.false_alarms = Some(FalseAlarms::of(alarms));
    }

    let json = args.out.join("results.json");
    std::fs::write(&json, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let markdown = report.markdown();
    std::fs::write(args.out.join("report.md"), &markdown)?;
    println!("{markdown}");
    eprintln!("gradflow-bench: wrote {} and report.md", json.display());
    Ok(())
}

fn write_plots(sweeps: &[scaling::Sweep], out: &Path) -> anyhow::Result<()> {
    for sweep in sweeps {
        let file = out.join(format!("scaling-{}.svg", sweep.slug));
        std::fs::write(&file, plot::sweep_svg(sweep)?)
            .with_context(|| format!("writing {}", file.display()))?;
    }
    Ok(())
}

fn redraw_plots(out: &Path) -> anyhow::Result<()> {
    let path = out.join("results.json");
    let text = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let results: serde_json::Value =
        serde_json::from_slice(&text).with_context(|| format!("parsing {}", path.display()))?;
    let sweeps: Vec<scaling::Sweep> = serde_json::from_value(results["scaling"].clone())
        .with_context(|| format!("{} has no scaling results", path.display()))?;
    write_plots(&sweeps, out)?;
    eprintln!(
        "gradflow-bench: redrew {} plots in {}",
        sweeps.len(),
        out.display()
    );
    Ok(())
}

async fn ingest_rounds(steps: u64, rounds: usize) -> anyhow::Result<IngestReport> {
    let on = ingest::IngestSpec::target(steps);
    let off = ingest::IngestSpec {
        server_args: vec!["--disable-detectors".into()],
        ..on.clone()
    };
    let mut done = Vec::new();
    for round in 0..rounds {
        eprintln!("gradflow-bench: ingest round {}/{rounds}", round + 1);
        // Alternate the order so that no contender always runs on a warmer machine.
        let (detectors_on, detectors_off) = if round % 2 == 0 {
            let a = ingest::http(&on).await?;
            (a, ingest::http(&off).await?)
        } else {
            let b = ingest::http(&off).await?;
            (ingest::http(&on).await?, b)
        };
        let shape = on.shape;
        let baseline =
            tokio::task::spawn_blocking(move || baseline::bare_sqlite(on.clients, steps, shape))
                .await??;
        done.push(IngestRound {
            detectors_on,
            detectors_off,
            baseline,
        });
    }
    Ok(IngestReport {
        clients: on.clients,
        steps_per_client: steps,
        modules: on.shape.modules,
        norm_params: on.shape.norm_params,
        batch_steps: on.batch_steps,
        rounds: done,
    })
}

async fn scaling_sweeps(quick: bool) -> anyhow::Result<Vec<scaling::Sweep>> {
    eprintln!("gradflow-bench: scaling with modules per step");
    let modules = if quick {
        scaling::modules(&[50, 200], 50).await?
    } else {
        scaling::modules(&[50, 100, 250, 500, 1_000], 2_000).await?
    };
    eprintln!("gradflow-bench: scaling with concurrent runs");
    let runs = if quick {
        scaling::runs(&[1, 4], 200).await?
    } else {
        scaling::runs(&[1, 2, 4, 8, 16, 32], 8_000).await?
    };
    eprintln!("gradflow-bench: scaling with run length");
    let length = if quick {
        scaling::length(&[1_000, 5_000], 20).await?
    } else {
        scaling::length(&[10_000, 100_000, 1_000_000], 50).await?
    };
    Ok(vec![modules, runs, length])
}

/// MLflow's figures for the same shape, through `scripts/mlflow_reference.py`, when
/// a Python with MLflow is found (`GRADFLOW_MLFLOW_PYTHON`, else `python3`).
fn mlflow_reference(quick: bool) -> anyhow::Result<Option<serde_json::Value>> {
    let python = std::env::var("GRADFLOW_MLFLOW_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let has_mlflow = Command::new(&python)
        .args(["-c", "import mlflow"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_mlflow {
        eprintln!(
            "gradflow-bench: MLflow is not installed for {python}: its reference figures are skipped"
        );
        return Ok(None);
    }
    eprintln!("gradflow-bench: MLflow reference");
    let steps = if quick { "5" } else { "50" };
    let output = Command::new(&python)
        .args(["scripts/mlflow_reference.py", steps])
        .output()
        .context("running scripts/mlflow_reference.py")?;
    anyhow::ensure!(
        output.status.success(),
        "mlflow_reference.py: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(Some(
        serde_json::from_slice(&output.stdout).context("mlflow_reference.py's JSON")?,
    ))
}
