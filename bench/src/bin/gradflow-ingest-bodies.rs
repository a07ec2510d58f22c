//! gradflow-ingest-bodies: the ingest target's comparison by body encoding, on its
//! own: 4 concurrent runs of the realistic trace to a release `gradflow-server` on a
//! fresh SQLite file, sent as JSON and as CBOR (protocol v1.6), beside bare SQLite,
//! side by side in each round (the order alternating), medians over rounds.
//!
//! `cargo build --release -p gradflow-server -p gradflow-bench --bins &&
//! ./target/release/gradflow-ingest-bodies --rounds 5`

use clap::Parser;
use gradflow_bench::harness::{baseline, ingest};
use gradflow_bench::stats::median;
use gradflow_bench::workload::{Shape, Trace};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
struct Args {
    /// Rounds; each runs every contender once.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Steps each of the 4 runs streams.
    #[arg(long, default_value_t = 5_000)]
    steps: u64,
    /// Where to write every round's figures as JSON.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

#[derive(Debug, serde::Serialize)]
struct Round {
    bare_sqlite: f64,
    json: f64,
    cbor: f64,
    json_batch_p50_ms: f64,
    cbor_batch_p50_ms: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let spec = |body| ingest::IngestSpec {
        trace: Trace::Realistic,
        server_args: Vec::new(),
        body,
        ..ingest::IngestSpec::target(args.steps)
    };
    let (json, cbor) = (spec(ingest::BodyType::Json), spec(ingest::BodyType::Cbor));
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        eprintln!(
            "gradflow-ingest-bodies: round {}/{}",
            round + 1,
            args.rounds
        );
        let (j, c) = if round % 2 == 0 {
            let j = ingest::http(&json).await?;
            (j, ingest::http(&cbor).await?)
        } else {
            let c = ingest::http(&cbor).await?;
            (ingest::http(&json).await?, c)
        };
        let steps = args.steps;
        let bare =
            tokio::task::spawn_blocking(move || baseline::bare_sqlite(4, steps, Shape::QWEN_1_5B))
                .await??;
        let r = Round {
            bare_sqlite: bare.module_values_per_second,
            json: j.module_values_per_second,
            cbor: c.module_values_per_second,
            json_batch_p50_ms: j.batch_latency_p50_ms,
            cbor_batch_p50_ms: c.batch_latency_p50_ms,
        };
        eprintln!("{r:?}");
        rounds.push(r);
    }
    let m = |f: fn(&Round) -> f64| median(rounds.iter().map(f));
    println!("module values/s, medians of {} rounds:", rounds.len());
    println!("  bare SQLite {:>12.0}", m(|r| r.bare_sqlite));
    for (name, get) in [
        ("JSON", (|r: &Round| r.json) as fn(&Round) -> f64),
        ("CBOR", |r: &Round| r.cbor),
    ] {
        let ratios: Vec<f64> = rounds.iter().map(|r| get(r) / r.bare_sqlite).collect();
        let (lo, hi) = ratios
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        println!(
            "  {name:<11} {:>12.0}   {:.2}× bare SQLite (median of the per-round ratios; {lo:.2}–{hi:.2}×)",
            m(get),
            median(ratios.iter().copied()),
        );
    }
    println!(
        "  batch p50: JSON {:.2} ms, CBOR {:.2} ms",
        m(|r| r.json_batch_p50_ms),
        m(|r| r.cbor_batch_p50_ms)
    );
    if let Some(out) = args.out {
        std::fs::write(out, serde_json::to_vec_pretty(&rounds)?)?;
    }
    Ok(())
}
