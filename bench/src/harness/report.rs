//! Everything one harness run measured, as JSON (`results.json`) and as the
//! Markdown tables BENCHMARKS.md quotes (`report.md`), each figure beside its target.

use std::fmt::Write;

use gradflow_trainer::overhead::Overhead;
use serde::Serialize;

use super::Machine;
use super::alarms::{FalseAlarms, WorkloadAlarms};
use super::baseline::BaselineResult;
use super::ingest::IngestResult;
use super::latency::Detection;
use super::long_run::LongRunResult;
use super::queries::{QueryResult, QueryTiming};
use super::ranks::RankResult;
use super::reporting::ReportingCost;
use super::scaling::Sweep;
use crate::stats::median;
use crate::workload::Shape;

/// One round of the ingest comparison: every contender, run back to back.
#[derive(Debug, Clone, Serialize)]
pub struct IngestRound {
    /// The server on SQLite, i.i.d. trace, detectors on.
    pub detectors_on: IngestResult,
    pub detectors_off: IngestResult,
    pub baseline: BaselineResult,
    /// The server on SQLite, detectors on, the realistic trace.
    pub realistic: IngestResult,
    /// The same on PostgreSQL, when a PostgreSQL could be started.
    pub postgres: Option<PostgresRound>,
    /// A 64-rank run beside single-rank runs of as many records.
    pub ranks: Option<RanksRound>,
}

/// The server with detectors on a fresh PostgreSQL database for each.
#[derive(Debug, Clone, Serialize)]
pub struct PostgresRound {
    pub iid: IngestResult,
    pub realistic: IngestResult,
    /// Two servers on one database, clients 0 and 2 on one, 1 and 3 on the other.
    pub replicas_by_client: IngestResult,
    /// Two servers on one database, each run's batches alternating between them.
    pub replicas_alternating: IngestResult,
}

/// A multi-rank run, sharded, on SQLite, and single-rank runs posting as many module
/// records.
#[derive(Debug, Clone, Serialize)]
pub struct RanksRound {
    pub single_rank: IngestResult,
    /// One single-rank run posting as many module records from one client: one
    /// run's batches take turns, as a multi-rank run's do.
    pub one_run: IngestResult,
    /// Every rank posting as fast as it can.
    pub together: RankResult,
    /// The last rank held more than 256 steps behind the others.
    pub skewed: RankResult,
}

/// A round of the `ranks` part: [`RanksRound`] without the skewed run.
#[derive(Debug, Clone, Serialize)]
pub struct RanksAlone {
    pub single_rank: IngestResult,
    pub one_run: IngestResult,
    pub together: RankResult,
}

#[derive(Debug, Clone, Serialize)]
pub struct IngestReport {
    pub clients: usize,
    pub steps_per_client: u64,
    pub modules: usize,
    pub norm_params: usize,
    pub batch_steps: u64,
    pub rounds: Vec<IngestRound>,
}

impl IngestReport {
    pub fn median_rate(&self, pick: impl Fn(&IngestRound) -> f64) -> f64 {
        median(self.rounds.iter().map(pick))
    }

    /// The median over the rounds that have `pick`'s figure (NaN if none has).
    fn median_of(&self, pick: impl Fn(&IngestRound) -> Option<f64>) -> f64 {
        median(self.rounds.iter().filter_map(pick))
    }
}

/// The median time of the read named `name` after an ingest.
fn query_ms(result: &IngestResult, name: &str) -> Option<f64> {
    result
        .queries
        .iter()
        .find(|q: &&QueryTiming| q.name == name)
        .map(|q| q.median_ms)
}

/// The series reads timed after the ingest part's measurements.
pub const LOSS_SERIES: &str = "series: loss, 1,000 points";
pub const MODULE_SERIES: &str = "series: a module's grad_norm, 1,000 points";

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / (1u64 << 20) as f64)
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub machine: Option<Machine>,
    pub quick: bool,
    pub ingest: Option<IngestReport>,
    pub queries: Option<QueryResult>,
    /// Instrumentation at `small` (`tiny` at `--quick`).
    pub overhead: Option<Overhead>,
    /// Instrumentation at `tiny`, where a step is short enough for fixed costs to show.
    pub overhead_tiny: Option<Overhead>,
    /// The trainer binary reporting to a server against `--no-report`.
    pub reporting: Option<ReportingCost>,
    pub latency: Option<Vec<Detection>>,
    /// What the latency part's runs raised, healthy scenarios included, labelled.
    #[serde(skip)]
    pub latency_alarms: Option<Vec<WorkloadAlarms>>,
    pub scaling: Option<Vec<Sweep>>,
    /// A 10⁶-step run's series reads, with every rollup level and with two.
    pub long_run: Option<LongRunResult>,
    /// The `ranks` part: the 64-rank run beside single-rank runs, round by round.
    pub ranks: Option<Vec<RanksAlone>>,
    /// What every workload above raised, labelled; false alarms on the healthy ones.
    pub false_alarms: Option<FalseAlarms>,
    /// `scripts/mlflow_reference.py`'s figures, when MLflow is installed.
    pub mlflow: Option<serde_json::Value>,
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "**not met**" }
}

fn thousands(x: f64) -> String {
    let digits = format!("{:.0}", x);
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

impl Report {
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        if let Some(m) = &self.machine {
            machine_line(&mut md, m, self.quick);
        }
        if let Some(ingest) = &self.ingest {
            self.ingest_tables(&mut md, ingest);
        }
        if let Some(q) = &self.queries {
            queries_table(&mut md, q);
        }
        if self.overhead.is_some() || self.overhead_tiny.is_some() {
            overhead_table(&mut md, self.overhead.iter().chain(&self.overhead_tiny));
        }
        if let Some(r) = &self.reporting {
            reporting_table(&mut md, r);
        }
        if let Some(detections) = &self.latency {
            latency_table(&mut md, detections);
        }
        if let Some(alarms) = &self.false_alarms {
            false_alarm_table(&mut md, alarms);
        }
        if let Some(sweeps) = &self.scaling {
            for s in sweeps {
                scaling_table(&mut md, s);
            }
        }
        if let Some(l) = &self.long_run {
            long_run_table(&mut md, l);
        }
        if let Some(rounds) = &self.ranks {
            ranks_alone_table(&mut md, rounds);
        }
        if let Some(m) = &self.mlflow {
            let _ = writeln!(
                md,
                "### For reference: MLflow\n\n```json\n{}\n```\n",
                serde_json::to_string_pretty(m).unwrap_or_default()
            );
        }
        md
    }

    fn ingest_tables(&self, md: &mut String, ingest: &IngestReport) {
        let on = ingest.median_rate(|r| r.detectors_on.module_values_per_second);
        let off = ingest.median_rate(|r| r.detectors_off.module_values_per_second);
        let base = ingest.median_rate(|r| r.baseline.module_values_per_second);
        let base_rows = ingest.median_rate(|r| r.baseline.rows_per_second);
        let ratio = ingest.median_rate(|r| {
            r.detectors_on.module_values_per_second / r.baseline.module_values_per_second
        });
        let cost = ingest.median_rate(|r| {
            1.0 - r.detectors_on.module_values_per_second / r.detectors_off.module_values_per_second
        }) * 100.0;
        let bytes = ingest.median_rate(|r| r.detectors_on.bytes_per_module_value);
        let bytes_all = ingest.median_rate(|r| r.detectors_on.bytes_per_value);
        let base_bytes = ingest.median_rate(|r| r.baseline.bytes_per_module_value);
        let _ = writeln!(
            md,
            "### Ingest and storage\n\n{} clients × {} steps × ({} modules + {} norm weights), {} steps a batch, \
            {} rounds; in each round the server with detectors, the server without, and the bare-SQLite baseline run back \
            to back. Medians over the rounds; the ratios are medians of the per-round ratios.\n",
            ingest.clients,
            thousands(ingest.steps_per_client as f64),
            ingest.modules,
            ingest.norm_params,
            ingest.batch_steps,
            ingest.rounds.len()
        );
        let _ = writeln!(md, "| figure | value | target |\n| --- | --- | --- |");
        let _ = writeln!(
            md,
            "| ingest over HTTP, detectors on | {} module values/s | ≥ 4,000,000: {} |",
            thousands(on),
            verdict(on >= 4e6)
        );
        let _ = writeln!(
            md,
            "| bare SQLite, one row per value | {} module values/s ({} rows/s) | |",
            thousands(base),
            thousands(base_rows)
        );
        let _ = writeln!(
            md,
            "| HTTP ingest ÷ bare SQLite | {:.2}× | ≥ 3×: {} |",
            ratio,
            verdict(ratio >= 3.0)
        );
        let _ = writeln!(
            md,
            "| ingest over HTTP, detectors off | {} module values/s | |",
            thousands(off)
        );
        let _ = writeln!(
            md,
            "| detectors' cost | {:.1} % slower | ≤ 10 %: {} |",
            cost,
            verdict(cost <= 10.0)
        );
        let _ = writeln!(
            md,
            "| bytes on disk per module value | {:.2} B (bare SQLite: {:.1} B) | ≤ 4: {} |",
            bytes,
            base_bytes,
            verdict(bytes <= 4.0)
        );
        let _ = writeln!(
            md,
            "| bytes on disk per stored value ({} a step) | {:.2} B | |",
            Shape {
                modules: ingest.modules,
                norm_params: ingest.norm_params
            }
            .values_per_step(),
            bytes_all
        );
        let latency = ingest.median_rate(|r| r.detectors_on.batch_latency_p50_ms);
        let _ = writeln!(md, "| batch latency p50 | {:.1} ms | |\n", latency);
        let _ = writeln!(
            md,
            "| round | detectors on | detectors off | bare SQLite | ratio |\n| --- | --- | --- | --- | --- |"
        );
        for (i, r) in ingest.rounds.iter().enumerate() {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {:.2}× |",
                i + 1,
                thousands(r.detectors_on.module_values_per_second),
                thousands(r.detectors_off.module_values_per_second),
                thousands(r.baseline.module_values_per_second),
                r.detectors_on.module_values_per_second / r.baseline.module_values_per_second
            );
        }
        md.push('\n');
        backends_table(md, ingest);
        replicas_table(md, ingest);
        ranks_table(md, ingest);
    }
}

/// Ingest by database and trace, detectors on: medians over the rounds.
/// The line that says which machine measured, and whether at the recorded sizes.
fn machine_line(md: &mut String, m: &Machine, quick: bool) {
    let _ = writeln!(
        md,
        "Machine: {}, {} cores, {} GiB.{}\n",
        m.cpu,
        m.cores,
        m.memory_gib,
        if quick {
            " Quick (smoke) sizes: not the recorded figures."
        } else {
            ""
        }
    );
}

/// The timed reads after the queries part's runs, each beside its target.
fn queries_table(md: &mut String, q: &QueryResult) {
    let _ = writeln!(
        md,
        "### Queries\n\n{} runs ({} alerts: {} expected by construction, {} false \
        alarms; see the false-alarm table); the long run: {} \
        steps × {} modules. Median of the timed requests over HTTP, end to end.\n",
        q.runs,
        q.alerts,
        q.alarms
            .iter()
            .flat_map(|w| w.expected.values())
            .sum::<usize>(),
        q.alarms
            .iter()
            .flat_map(|w| w.unexpected.values())
            .sum::<usize>(),
        thousands(q.long_steps as f64),
        q.long_modules
    );
    let _ = writeln!(
        md,
        "| query | median | max | answer | target |\n| --- | --- | --- | --- | --- |"
    );
    for t in &q.timings {
        let target = match t.name.as_str() {
            n if n.starts_with("series") => Some(20.0),
            "grad-flow chart (SVG)" => Some(300.0),
            "runs list" | "alerts, every run" => Some(50.0),
            _ => None,
        };
        let target = target.map_or_else(String::new, |ms| {
            format!("≤ {ms} ms: {}", verdict(t.median_ms <= ms))
        });
        let _ = writeln!(
            md,
            "| {} | {:.1} ms | {:.1} ms | {} B | {} |",
            t.name,
            t.median_ms,
            t.max_ms,
            thousands(t.response_bytes as f64),
            target
        );
    }
    md.push('\n');
}

/// The trainer's instrumentation overhead, one row per preset measured.
fn overhead_table<'a>(md: &mut String, overheads: impl Iterator<Item = &'a Overhead>) {
    let _ = writeln!(
        md,
        "### Trainer overhead\n\nInstrumentation, in one process: median step times of an instrumented and an \
        uninstrumented trainer stepped alternately.\n\n\
        | preset | device | parameter tensors | steps | instrumented | `--no-instrument` | overhead | target |\n\
        | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    for o in overheads {
        // The target is the `small` preset's; at `tiny` fixed costs dominate.
        let target = if o.preset == "small" {
            format!("≤ 3 %: {}", verdict(o.percent() <= 3.0))
        } else {
            String::new()
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.3} ms | {:.3} ms | {:+.3} ms, {:+.2} % | {} |",
            o.preset,
            o.device,
            thousands(o.params as f64),
            o.steps,
            o.instrumented_ms,
            o.uninstrumented_ms,
            o.extra_ms(),
            o.percent(),
            target
        );
    }
    md.push('\n');
}

/// How many steps after its fault each scenario's alert opened.
fn latency_table(md: &mut String, detections: &[Detection]) {
    let _ = writeln!(
        md,
        "### Detection latency\n\nThe fault's first step is read back from the stored telemetry where it shows \
        there directly (`telemetry`), and taken from where the scenario injects it otherwise \
        (`construction`).\n\n| scenario | alert | subject | fault from step | threshold | earliest allowed | opened on | late by |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    for d in detections {
        let step = |s: Option<u64>| s.map_or_else(|| "registration".to_owned(), |s| s.to_string());
        let late = d.steps_late.map_or_else(
            || "0 (at registration)".to_owned(),
            |l| format!("{l} steps"),
        );
        let _ = writeln!(
            md,
            "| {} | `{}` | {} | {} | {} | {} | {} | {} |",
            d.scenario,
            d.kind,
            d.subject,
            match d.fault_step {
                Some(s) => format!("{s} ({})", d.fault_step_from),
                None => step(None),
            },
            d.threshold_steps,
            step(d.earliest_step),
            step(d.opened_step),
            late
        );
    }
    md.push('\n');
}

/// One scaling sweep: ingest rate, bytes and read times along its axis.
fn scaling_table(md: &mut String, s: &Sweep) {
    let _ = writeln!(md, "### Scaling: {}\n\n{}.\n", s.axis, s.method);
    let names: Vec<&str> = s
        .points
        .first()
        .map(|p| p.queries.iter().map(|q| q.name.as_str()).collect())
        .unwrap_or_default();
    let _ = write!(
        md,
        "| {} | M module values/s | B per module value | batch p50 |",
        s.axis
    );
    for n in &names {
        let _ = write!(md, " {n} |");
    }
    let _ = write!(md, "\n| --- | --- | --- | --- |");
    md.push_str(&" --- |".repeat(names.len()));
    md.push('\n');
    for p in &s.points {
        let _ = write!(
            md,
            "| {} | {:.2} | {} | {} |",
            thousands(p.x as f64),
            p.module_values_per_second / 1e6,
            p.bytes_per_module_value
                .map_or("".into(), |b| format!("{b:.2}")),
            p.batch_latency_p50_ms
                .map_or("".into(), |l| format!("{l:.1} ms"))
        );
        for q in &p.queries {
            let _ = write!(md, " {:.1} ms |", q.median_ms);
        }
        md.push('\n');
    }
    md.push('\n');
}
fn backends_table(md: &mut String, ingest: &IngestReport) {
    let postgres = ingest.rounds.iter().any(|r| r.postgres.is_some());
    let _ = writeln!(
        md,
        "### Ingest by database and trace\n\nThe server with detectors on, {} clients × {} steps as above, on \
        the i.i.d. trace (every norm drawn independently: the worst case for storage) and on the realistic \
        one (smooth, noisy series, as a real run's); on SQLite and{} on PostgreSQL (a throwaway cluster on the \
        same machine, fsync and `synchronous_commit` on; a fresh database each). Bytes: SQLite's file and WAL; \
        PostgreSQL's tables in `public` with their TOAST and indexes (`pg_total_relation_size`), not its WAL. \
        The series reads: 1,000 points of client 0's run after the ingest, the median of the timed requests. \
        Medians over the rounds.\n\n\
        | database | trace | values/s | module values/s | B per module norm | B per value | series p50: loss / a module | batch p50 |\n\
        | --- | --- | --- | --- | --- | --- | --- | --- |",
        ingest.clients,
        thousands(ingest.steps_per_client as f64),
        if postgres {
            ""
        } else {
            " (not measured here: no PostgreSQL)"
        },
    );
    type Pick = fn(&IngestRound) -> Option<&IngestResult>;
    let rows: [Pick; 4] = [
        |r| Some(&r.detectors_on),
        |r| Some(&r.realistic),
        |r| r.postgres.as_ref().map(|p| &p.iid),
        |r| r.postgres.as_ref().map(|p| &p.realistic),
    ];
    for pick in rows {
        let Some(first) = ingest.rounds.iter().find_map(pick) else {
            continue;
        };
        let of = |f: fn(&IngestResult) -> Option<f64>| ingest.median_of(|r| pick(r).and_then(f));
        let ms = |v: f64| {
            if v.is_nan() {
                "–".to_owned()
            } else {
                format!("{v:.1}")
            }
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.2} | {:.2} | {} / {} ms | {:.1} ms |",
            first.backend,
            first.trace,
            thousands(of(|r| Some(r.values_per_second))),
            thousands(of(|r| Some(r.module_values_per_second))),
            of(|r| Some(r.bytes_per_module_value)),
            of(|r| Some(r.bytes_per_value)),
            ms(of(|r| query_ms(r, LOSS_SERIES))),
            ms(of(|r| query_ms(r, MODULE_SERIES))),
            of(|r| Some(r.batch_latency_p50_ms)),
        );
    }
    md.push('\n');
}

/// One PostgreSQL database, one server or two.
fn replicas_table(md: &mut String, ingest: &IngestReport) {
    if !ingest.rounds.iter().any(|r| r.postgres.is_some()) {
        return;
    }
    let _ = writeln!(
        md,
        "### Two replicas on one PostgreSQL database\n\nThe same 4 clients (i.i.d. trace, detectors on) against \
        one server, and against two `gradflow-server` processes on one fresh database: clients 0 and 2 on \
        replica A, 1 and 3 on B; then every run's batches alternating between A and B, so that each batch \
        finds its run moved on by the other replica (the run's row lock, its state read back). Medians over the \
        rounds; the ratio is the median of the per-round ratios to one server.\n\n\
        | servers | module values/s | values/s | batch p50 | batch p99 | ÷ one server |\n\
        | --- | --- | --- | --- | --- | --- |"
    );
    type Pick = fn(&PostgresRound) -> &IngestResult;
    let rows: [(&str, Pick); 3] = [
        ("one", |p| &p.iid),
        ("two, clients split", |p| &p.replicas_by_client),
        ("two, batches alternating", |p| &p.replicas_alternating),
    ];
    for (name, pick) in rows {
        let of =
            |f: &dyn Fn(&PostgresRound) -> f64| ingest.median_of(|r| r.postgres.as_ref().map(f));
        let _ = writeln!(
            md,
            "| {name} | {} | {} | {:.1} ms | {:.1} ms | {:.2}× |",
            thousands(of(&|p| pick(p).module_values_per_second)),
            thousands(of(&|p| pick(p).values_per_second)),
            of(&|p| pick(p).batch_latency_p50_ms),
            of(&|p| pick(p).batch_latency_p99_ms),
            of(&|p| pick(p).module_values_per_second / p.iid.module_values_per_second),
        );
    }
    md.push('\n');
}

/// The multi-rank run beside single-rank runs of as many records.
fn ranks_table(md: &mut String, ingest: &IngestReport) {
    let Some(first) = ingest.rounds.iter().find_map(|r| r.ranks.as_ref()) else {
        return;
    };
    let t = &first.together;
    let _ = writeln!(
        md,
        "### A {}-rank run\n\nOne run of world size {}, every module and norm weight laid out `sharded` across \
        all ranks: {} concurrent rank clients each post their partial records (`grad_sumsq`, `numel`) of the \
        same {} steps × {} modules, {} steps a batch, to a server on SQLite with detectors on; the server \
        combines each step from every rank. A module value counts once a combined step and module; a rank's \
        module record once each. Beside it in each round, 4 single-rank runs posting as many module records \
        (4 × {} steps), and one single-rank run posting them alone: a server takes one run's batches in \
        turn (what keeps its verdicts exact), so one run, of one rank or of many, ingests on one core's \
        worth of the batch work while 4 runs use both. Skewed: rank {} holds each batch back until every other rank has sent {} steps \
        more (or all of theirs); a step waits for a rank only until another is 256 steps past it, then the server \
        completes it without that rank (`rank_missing`), so however far a rank falls behind, at most ~256 steps \
        wait for it. Memory: the server's resident set, sampled every 10 ms while the ranks post; \
        growth is the sampled peak less the resident set before the clock. Medians over the rounds; the \
        ratios are medians of the per-round ratios.\n\n\
        | run | module values/s | rank module records/s | rank records/s | ÷ single-rank, 4 runs | ÷ single-rank, 1 run | batch p50 | RSS before | peak RSS | growth |\n\
        | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        t.world_size,
        t.world_size,
        t.world_size,
        thousands(t.steps as f64),
        t.modules,
        t.batch_steps,
        thousands((t.rank_module_records / 4 / t.modules as u64) as f64),
        t.world_size - 1,
        first.skewed.lag_steps,
    );
    let of = |f: &dyn Fn(&RanksRound) -> f64| ingest.median_of(|r| r.ranks.as_ref().map(f));
    let single = of(&|k| k.single_rank.module_values_per_second);
    let _ = writeln!(
        md,
        "| single-rank, 4 runs | {} | {} | | 1.00× | | {:.1} ms | | | |",
        thousands(single),
        thousands(single),
        of(&|k| k.single_rank.batch_latency_p50_ms),
    );
    let one = of(&|k| k.one_run.module_values_per_second);
    let _ = writeln!(
        md,
        "| single-rank, 1 run | {} | {} | | {:.2}× | 1.00× | {:.1} ms | | | |",
        thousands(one),
        thousands(one),
        of(&|k| k.one_run.module_values_per_second / k.single_rank.module_values_per_second),
        of(&|k| k.one_run.batch_latency_p50_ms),
    );
    type Pick = fn(&RanksRound) -> &RankResult;
    let together: Pick = |k| &k.together;
    let skewed: Pick = |k| &k.skewed;
    for (name, pick) in [
        (format!("{} ranks", t.world_size), together),
        (
            format!(
                "{} ranks, rank {} {} steps behind",
                t.world_size,
                t.world_size - 1,
                first.skewed.lag_steps
            ),
            skewed,
        ),
    ] {
        let _ = writeln!(
            md,
            "| {name} | {} | {} | {} | {:.2}× | {:.2}× | {:.1} ms | {} | {} | {} |",
            thousands(of(&|k| pick(k).module_values_per_second)),
            thousands(of(&|k| pick(k).rank_module_records_per_second)),
            thousands(of(&|k| pick(k).rank_records_per_second)),
            of(&|k| pick(k).rank_module_records_per_second
                / k.single_rank.module_values_per_second),
            of(&|k| pick(k).rank_module_records_per_second / k.one_run.module_values_per_second),
            of(&|k| pick(k).batch_latency_p50_ms),
            mib(of(&|k| pick(k).resident_before_bytes as f64)),
            mib(of(&|k| pick(k).resident_peak_bytes as f64)),
            mib(of(&|k| {
                pick(k).resident_peak_bytes as f64 - pick(k).resident_before_bytes as f64
            })),
        );
    }
    let pending =
        of(&|k| k.skewed.resident_peak_bytes as f64 - k.together.resident_peak_bytes as f64);
    let _ = writeln!(
        md,
        "\nSteps waiting for the lagging rank cost {} of peak resident memory over the ranks in step \
        (median of the rounds' differences), with at most ~256 of them waiting however far it falls behind.\n",
        mib(pending)
    );
}

fn reporting_table(md: &mut String, r: &ReportingCost) {
    let _ = writeln!(
        md,
        "### Reporting cost\n\nThe trainer binary at `{}`, {} steps, streaming to a release server on the \
        same machine against the same command with `--no-report`, {} rounds alternating the order; \
        medians, the differences of each round's pair. The training loop's pace is the trainer's own \
        figure; the rest of a run is start-up, registration and the final flush.\n\n\
        | figure | reporting | `--no-report` | difference | target |\n| --- | --- | --- | --- | --- |",
        r.preset, r.steps, r.rounds
    );
    let _ = writeln!(
        md,
        "| a step | {:.3} ms | {:.3} ms | {:+.3} ms ({:+.1} %) | ≤ 0.2 ms: {} |",
        r.reporting_step_ms,
        r.no_report_step_ms,
        r.extra_step_ms,
        r.extra_step_ms / r.no_report_step_ms * 100.0,
        verdict(r.extra_step_ms <= 0.2)
    );
    let _ = writeln!(
        md,
        "| a run, outside the loop | | | {:+.1} ms | |",
        r.extra_per_run_ms
    );
    let _ = writeln!(
        md,
        "| the whole command | {:.3} s | {:.3} s | | |",
        r.reporting_wall_s, r.no_report_wall_s
    );
    let _ = writeln!(
        md,
        "| the server's CPU | {:.3} ms a step | | | |\n",
        r.server_cpu_ms_per_step
    );
}

/// "n × key, …", or "none".
fn counts(map: &std::collections::BTreeMap<String, usize>) -> String {
    if map.is_empty() {
        return "none".to_owned();
    }
    map.iter()
        .map(|(key, n)| format!("{n} × `{key}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn false_alarm_table(md: &mut String, alarms: &FalseAlarms) {
    let _ = writeln!(
        md,
        "### False alarms

Every alert of warning or critical severity that the workloads above raised, \
        labelled expected (the workload is built to raise it) or not. An unexpected alert on a workload \
        healthy by construction is a false alarm: **{} in {} healthy steps, {:.3} per 1,000 steps**{}.\n",
        alarms.false_alarms,
        thousands(alarms.healthy_steps as f64),
        alarms.per_1000_steps,
        if alarms.by_kind.is_empty() {
            String::new()
        } else {
            format!(
                " ({})",
                alarms
                    .by_kind
                    .iter()
                    .map(|(kind, n)| format!("{n} × `{kind}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    );
    let _ = writeln!(
        md,
        "| workload | healthy steps | expected | unexpected | false alarms per 1,000 healthy steps |\n\
        | --- | --- | --- | --- | --- |"
    );
    for w in &alarms.workloads {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} |",
            w.workload,
            thousands(w.healthy_steps as f64),
            counts(&w.expected),
            counts(&w.unexpected),
            w.false_alarms_per_1000_steps
                .map_or_else(|| "(a failure scenario)".to_owned(), |r| format!("{r:.3}"))
        );
    }
    md.push('\n');
}

/// Every workload's labelled alerts out of `report`, the ingest rounds folded into one.
pub fn gather_alarms(report: &Report) -> Vec<WorkloadAlarms> {
    let mut all = Vec::new();
    if let Some(ingest) = &report.ingest {
        // The SQLite runs of each trace, and the multi-rank ones: the PostgreSQL
        // runs send the same records again.
        type Pick = fn(&IngestRound) -> Option<WorkloadAlarms>;
        let workloads: [Pick; 4] = [
            |r| r.detectors_on.alarms.clone(),
            |r| r.realistic.alarms.clone(),
            |r| r.ranks.as_ref().map(|k| k.together.alarms.clone()),
            |r| r.ranks.as_ref().map(|k| k.skewed.alarms.clone()),
        ];
        for pick in workloads {
            let mut rounds = ingest.rounds.iter().filter_map(pick);
            if let Some(mut first) = rounds.next() {
                for round in rounds {
                    first.merge(&round);
                }
                first.workload =
                    format!("ingest, {} rounds: {}", ingest.rounds.len(), first.workload);
                all.push(first);
            }
        }
    }
    if let Some(queries) = &report.queries {
        all.extend(queries.alarms.iter().cloned());
    }
    if let Some(latency) = &report.latency_alarms {
        all.extend(latency.iter().cloned());
    }
    for sweep in report.scaling.iter().flatten() {
        all.extend(sweep.alarms.iter().map(|w| WorkloadAlarms {
            workload: format!("scaling ({}): {}", sweep.axis, w.workload),
            ..w.clone()
        }));
    }
    all
}

fn long_run_table(md: &mut String, l: &LongRunResult) {
    let _ = writeln!(
        md,
        "### A long run's series\n\nOne run of {} steps × {} modules (+ {} norm weights) \
         over HTTP, 500 steps a batch ({:.1} s, {:.2} M module values/s, {:.2} B per \
         module value); then {} rounds, each reading every series with all rollup levels \
         and with the two of before (64 and 4,096 steps).\n",
        thousands(l.steps as f64),
        l.modules,
        l.modules / 4,
        l.ingest_seconds,
        l.module_values_per_second / 1e6,
        l.bytes_per_module_value,
        l.rounds
    );
    md.push_str(
        "| read | points | all levels p50 | two levels p50 | two ÷ all (median of rounds) | ≤ 20 ms |\n\
         | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in &l.reads {
        let _ = writeln!(
            md,
            "| {} | {} | {:.1} ms | {:.1} ms | {:.1}× | {} |",
            r.name,
            r.points,
            r.all_levels_ms,
            r.two_levels_ms,
            r.speedup,
            verdict(r.all_levels_ms <= 20.0)
        );
    }
    md.push('\n');
}

fn ranks_alone_table(md: &mut String, rounds: &[RanksAlone]) {
    let Some(first) = rounds.first() else {
        return;
    };
    let _ = writeln!(
        md,
        "### {} ranks beside single-rank runs\n\n{} rounds; each: 4 concurrent \
         single-rank runs and the {}-rank run ({} steps, {} a batch) in alternating \
         order, then one single-rank run of as many module records.\n",
        first.together.world_size,
        rounds.len(),
        first.together.world_size,
        first.together.steps,
        first.together.batch_steps
    );
    md.push_str(
        "| round | 4 single-rank runs | 1 single-rank run | ranks (module records/s) | \
         ÷ 4 runs | ÷ 1 run | batch p50, ranks | server cores busy: 4 runs, 1 run, ranks |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    let mut four = Vec::new();
    let mut one = Vec::new();
    for (i, r) in rounds.iter().enumerate() {
        let multi = r.together.rank_module_records_per_second;
        four.push(multi / r.single_rank.module_values_per_second);
        one.push(multi / r.one_run.module_values_per_second);
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.2}× | {:.2}× | {:.1} ms | {:.2}, {:.2}, {:.2} |",
            i + 1,
            thousands(r.single_rank.module_values_per_second),
            thousands(r.one_run.module_values_per_second),
            thousands(multi),
            four[i],
            one[i],
            r.together.batch_latency_p50_ms,
            r.single_rank.server_cpu_seconds / r.single_rank.seconds,
            r.one_run.server_cpu_seconds / r.one_run.seconds,
            r.together.server_cpu_seconds / r.together.seconds,
        );
    }
    let _ = writeln!(
        md,
        "\nMedian ratios: **{:.2}×** 4 single-rank runs (target ≥ 0.80×: {}), {:.2}× one.\n",
        median(four.iter().copied()),
        verdict(median(four.iter().copied()) >= 0.8),
        median(one.iter().copied())
    );
}

#[cfg(test)]
mod tests {
    use super::thousands;

    #[test]
    fn groups_digits() {
        assert_eq!(thousands(1234567.4), "1,234,567");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(1000.0), "1,000");
    }
}
