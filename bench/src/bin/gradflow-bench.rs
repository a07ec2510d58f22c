//! gradflow-bench: every figure of BENCHMARKS.md from one command. Each measurement
//! starts what it needs (a release `gradflow-server` on a fresh temporary database,
//! the trainer binary, bare SQLite), compares side by side in one run, and writes
//! `results.json`, `report.md` (the tables, each figure beside its target) and the
//! scaling plots into `--out`.
//!
//! `cargo build --release --bins && ./target/release/gradflow-bench` (all of it,
//! ~15 minutes on 2 cores, the ingest part ~6 of them); `--quick` runs every part at
//! smoke sizes. The ingest part measures PostgreSQL too where a throwaway cluster
//! can be started (Debian's `postgresql` binaries); without one it says so and
//! skips those rows, unless `GRADFLOW_REQUIRE_POSTGRES=1`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use candle_core::Device;
use clap::{Parser, ValueEnum};
use gradflow_bench::harness::alarms::FalseAlarms;
use gradflow_bench::harness::backend::{self, Backend};
use gradflow_bench::harness::ingest::Replicas;
use gradflow_bench::harness::report::{
    self, IngestReport, IngestRound, PostgresRound, RanksRound, Report,
};
use gradflow_bench::harness::{
    Machine, baseline, ingest, latency, long_run, plot, queries, ranks, reporting, scaling,
};
use gradflow_bench::workload::{Shape, Trace};
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
    /// A 10⁶-step run's 1,000-point series, with every rollup level and with the
    /// two of before, side by side.
    LongRun,
    /// The 64-rank run beside 4 concurrent single-rank runs and one, alone.
    Ranks,
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

fn main() -> anyhow::Result<()> {
    // As the trainer binary does, before the runtime's threads start: the overhead
    // part trains in this process.
    // SAFETY: no other thread runs yet.
    unsafe { gradflow_trainer::threads::settle_thread_count() };
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(measure(args))
}

async fn measure(args: Args) -> anyhow::Result<()> {
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
        report.ingest = Some(ingest_rounds(&IngestSizes::new(quick, args.rounds)).await?);
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
        report.overhead = Some(instrumentation_overhead(preset, steps).await?);
        if !quick {
            report.overhead_tiny = Some(instrumentation_overhead("tiny", 400).await?);
        }
        let spec = reporting::ReportingSpec {
            preset: "tiny".into(),
            steps: if quick { 20 } else { 400 },
            rounds: if quick { 1 } else { 9 },
        };
        eprintln!(
            "gradflow-bench: reporting cost (the trainer binary, {}, {} steps, against a \
             server and with --no-report, {} rounds)",
            spec.preset, spec.steps, spec.rounds
        );
        report.reporting = Some(reporting::run(&spec).await?);
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
    if wants(Part::LongRun) {
        let spec = if quick {
            long_run::LongRunSpec {
                steps: 5_000,
                modules: 20,
                rounds: 2,
            }
        } else {
            long_run::LongRunSpec {
                steps: 1_000_000,
                modules: 50,
                rounds: 9,
            }
        };
        eprintln!(
            "gradflow-bench: a long run ({} steps × {} modules), its series read with each set of rollup levels, {} rounds",
            spec.steps, spec.modules, spec.rounds
        );
        report.long_run = Some(long_run::run(&spec).await?);
    }
    if args.part == Part::Ranks {
        report.ranks = Some(rank_rounds(&IngestSizes::new(quick, args.rounds)).await?);
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

async fn instrumentation_overhead(preset: &str, steps: u64) -> anyhow::Result<overhead::Overhead> {
    eprintln!("gradflow-bench: trainer overhead ({preset}, {steps} steps each)");
    let preset = Preset::named(preset)?;
    tokio::task::spawn_blocking(move || overhead::measure(&preset, steps, &Device::Cpu)).await?
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

/// The sizes of the ingest part.
struct IngestSizes {
    /// Steps per client of the 4 single-rank clients.
    steps: u64,
    rounds: usize,
    /// The multi-rank run: ranks, steps, steps a batch, and how many batches the
    /// last rank is held behind in the skewed variant.
    world_size: u32,
    rank_steps: u64,
    rank_batch_steps: u64,
    lag_batches: usize,
}

impl IngestSizes {
    fn new(quick: bool, rounds: Option<usize>) -> IngestSizes {
        if quick {
            IngestSizes {
                steps: 100,
                rounds: rounds.unwrap_or(1),
                world_size: 64,
                rank_steps: 20,
                rank_batch_steps: 10,
                lag_batches: 2,
            }
        } else {
            IngestSizes {
                steps: 5_000,
                rounds: rounds.unwrap_or(5),
                world_size: 64,
                // ~25 s a round on 2 cores, the single-rank comparison included.
                rank_steps: 384,
                rank_batch_steps: 32,
                // Every batch: the last rank starts once the others are done, 384 steps
                // ahead, past the 256 the server waits for a rank.
                lag_batches: 12,
            }
        }
    }
}

/// What the ingest part runs in each round, set up once.
struct IngestPlan {
    shape: Shape,
    /// The server on SQLite, detectors on, the i.i.d. trace (with the series reads
    /// after it), and the same without detectors, and on the realistic trace.
    on: ingest::IngestSpec,
    off: ingest::IngestSpec,
    realistic: ingest::IngestSpec,
    /// Where a PostgreSQL cluster could be started.
    postgres: Option<PostgresPlan>,
    /// The multi-rank run, and the same with its last rank held behind.
    together: ranks::RankSpec,
    skewed: ranks::RankSpec,
    /// As many module records as the ranks post, from 4 single-rank clients, and
    /// from one.
    single_rank: ingest::IngestSpec,
    one_run: ingest::IngestSpec,
}

struct PostgresPlan {
    iid: ingest::IngestSpec,
    realistic: ingest::IngestSpec,
    by_client: ingest::IngestSpec,
    alternating: ingest::IngestSpec,
}

impl IngestPlan {
    fn new(sizes: &IngestSizes, postgres: Option<Backend>) -> IngestPlan {
        let shape = Shape::QWEN_1_5B;
        let module = shape.module_names()[17].clone();
        let reads = vec![
            (
                report::LOSS_SERIES.to_owned(),
                "/api/v1/runs/bench-0/series?metric=loss&max_points=1000".to_owned(),
            ),
            (
                report::MODULE_SERIES.to_owned(),
                format!(
                    "/api/v1/runs/bench-0/series?metric=grad_norm&subject={module}&max_points=1000"
                ),
            ),
        ];
        let on = ingest::IngestSpec {
            queries_after: reads,
            ..ingest::IngestSpec::target(sizes.steps)
        };
        let off = ingest::IngestSpec {
            server_args: vec!["--disable-detectors".into()],
            queries_after: Vec::new(),
            ..on.clone()
        };
        let realistic = ingest::IngestSpec {
            trace: Trace::Realistic,
            ..on.clone()
        };
        let postgres = postgres.map(|backend| {
            let on_postgres = |spec: &ingest::IngestSpec, replicas| ingest::IngestSpec {
                backend: backend.clone(),
                replicas,
                ..spec.clone()
            };
            let by_client = ingest::IngestSpec {
                queries_after: Vec::new(),
                ..on.clone()
            };
            PostgresPlan {
                iid: on_postgres(&on, Replicas::One),
                realistic: on_postgres(&realistic, Replicas::One),
                by_client: on_postgres(&by_client, Replicas::ByClient),
                alternating: on_postgres(&by_client, Replicas::Alternating),
            }
        });
        let together = rank_spec(sizes, shape);
        let skewed = ranks::RankSpec {
            lag_batches: sizes.lag_batches,
            ..together.clone()
        };
        let single_rank = ingest::IngestSpec {
            queries_after: Vec::new(),
            ..ingest::IngestSpec::target(
                sizes.rank_steps * u64::from(sizes.world_size) / on.clients as u64,
            )
        };
        let one_run = ingest::IngestSpec {
            clients: 1,
            ..ingest::IngestSpec::target(sizes.rank_steps * u64::from(sizes.world_size))
        };
        IngestPlan {
            shape,
            on,
            off,
            realistic,
            postgres,
            together,
            skewed,
            single_rank,
            one_run,
        }
    }
}

/// The multi-rank run of the ingest and ranks parts, every rank posting as fast as
/// it can.
fn rank_spec(sizes: &IngestSizes, shape: Shape) -> ranks::RankSpec {
    ranks::RankSpec {
        world_size: sizes.world_size,
        steps: sizes.rank_steps,
        batch_steps: sizes.rank_batch_steps,
        shape,
        lag_batches: 0,
        server_args: Vec::new(),
    }
}

async fn ingest_rounds(sizes: &IngestSizes) -> anyhow::Result<IngestReport> {
    eprintln!("gradflow-bench: starting a PostgreSQL cluster for the ingest part");
    let postgres = backend::postgres().await?.map(Backend::Postgres);
    let plan = IngestPlan::new(sizes, postgres);
    let mut done = Vec::new();
    for round in 0..sizes.rounds {
        done.push(ingest_round(&plan, sizes, round).await?);
    }
    Ok(IngestReport {
        clients: plan.on.clients,
        steps_per_client: sizes.steps,
        modules: plan.on.shape.modules,
        norm_params: plan.on.shape.norm_params,
        batch_steps: plan.on.batch_steps,
        rounds: done,
    })
}

/// One round of the ingest part: every contender of [`IngestPlan`], back to back.
async fn ingest_round(
    plan: &IngestPlan,
    sizes: &IngestSizes,
    round: usize,
) -> anyhow::Result<IngestRound> {
    let rounds = sizes.rounds;
    eprintln!("gradflow-bench: ingest round {}/{rounds}", round + 1);
    // Alternate the order so that no contender always runs on a warmer machine.
    let (detectors_on, detectors_off) = if round.is_multiple_of(2) {
        let a = ingest::http(&plan.on).await?;
        (a, ingest::http(&plan.off).await?)
    } else {
        let b = ingest::http(&plan.off).await?;
        (ingest::http(&plan.on).await?, b)
    };
    let (clients, steps, shape) = (plan.on.clients, sizes.steps, plan.shape);
    let baseline =
        tokio::task::spawn_blocking(move || baseline::bare_sqlite(clients, steps, shape)).await??;
    eprintln!(
        "gradflow-bench: ingest round {}/{rounds}: the realistic trace",
        round + 1
    );
    let realistic = ingest::http(&plan.realistic).await?;
    let postgres = match &plan.postgres {
        Some(pg) => {
            eprintln!(
                "gradflow-bench: ingest round {}/{rounds}: PostgreSQL",
                round + 1
            );
            Some(postgres_round(pg).await?)
        }
        None => None,
    };
    eprintln!(
        "gradflow-bench: ingest round {}/{rounds}: {} ranks × {} steps",
        round + 1,
        plan.together.world_size,
        plan.together.steps
    );
    let (single, multi) = single_beside_ranks(round, &plan.single_rank, &plan.together).await?;
    let alone = ingest::http(&plan.one_run)
        .await
        .context("one single-rank run")?;
    let lagging = ranks::http(&plan.skewed, &Backend::Sqlite)
        .await
        .context("the skewed ranks")?;
    Ok(IngestRound {
        detectors_on,
        detectors_off,
        baseline,
        realistic,
        postgres,
        ranks: Some(RanksRound {
            single_rank: single,
            one_run: alone,
            together: multi,
            skewed: lagging,
        }),
    })
}

async fn postgres_round(pg: &PostgresPlan) -> anyhow::Result<PostgresRound> {
    Ok(PostgresRound {
        iid: ingest::http(&pg.iid).await.context("PostgreSQL, i.i.d.")?,
        realistic: ingest::http(&pg.realistic)
            .await
            .context("PostgreSQL, realistic")?,
        replicas_by_client: ingest::http(&pg.by_client)
            .await
            .context("two replicas, clients split")?,
        replicas_alternating: ingest::http(&pg.alternating)
            .await
            .context("two replicas, batches alternating")?,
    })
}

/// Single-rank runs and the multi-rank run, in an order that alternates with the
/// round.
async fn single_beside_ranks(
    round: usize,
    single_rank: &ingest::IngestSpec,
    together: &ranks::RankSpec,
) -> anyhow::Result<(ingest::IngestResult, ranks::RankResult)> {
    Ok(if round.is_multiple_of(2) {
        let single = ingest::http(single_rank).await?;
        (single, ranks::http(together, &Backend::Sqlite).await?)
    } else {
        let multi = ranks::http(together, &Backend::Sqlite).await?;
        (ingest::http(single_rank).await?, multi)
    })
}

/// The multi-rank comparison of the ingest part alone: per round, 4 single-rank
/// runs and the 64-rank run (in alternating order), then one single-rank run of as
/// many records.
async fn rank_rounds(sizes: &IngestSizes) -> anyhow::Result<Vec<report::RanksAlone>> {
    let shape = Shape::QWEN_1_5B;
    let together = rank_spec(sizes, shape);
    let records = sizes.rank_steps * u64::from(sizes.world_size);
    let single_rank = ingest::IngestSpec {
        queries_after: Vec::new(),
        ..ingest::IngestSpec::target(records / 4)
    };
    let one_run = ingest::IngestSpec {
        clients: 1,
        queries_after: Vec::new(),
        ..ingest::IngestSpec::target(records)
    };
    let mut rounds = Vec::new();
    for round in 0..sizes.rounds {
        eprintln!(
            "gradflow-bench: ranks round {}/{}: {} ranks × {} steps beside single-rank runs",
            round + 1,
            sizes.rounds,
            together.world_size,
            together.steps
        );
        let (single, multi) = single_beside_ranks(round, &single_rank, &together).await?;
        let alone = ingest::http(&one_run).await?;
        rounds.push(report::RanksAlone {
            single_rank: single,
            one_run: alone,
            together: multi,
        });
    }
    Ok(rounds)
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
