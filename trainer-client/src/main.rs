//! The `gradflow-trainer` binary: parses flags, runs the library, reports the outcome.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use gradflow_trainer::cli::Args;
use tracing_subscriber::EnvFilter;

// glibc malloc tripled the step time of a 0.5B-shaped model: candle allocates and
// frees many mid-sized buffers per step, which mimalloc recycles far better.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // SAFETY: the first thing the program does; no other thread runs yet.
    unsafe { gradflow_trainer::threads::settle_thread_count() };
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("gradflow_trainer=info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let args = Args::parse();
    if args.check_grad_sums {
        return check_grad_sums(&args.device);
    }
    match gradflow_trainer::run::run(&args) {
        Ok(outcome) => {
            if let Some(overhead) = &outcome.overhead {
                let mut json = serde_json::to_value(overhead).expect("plain numbers and strings");
                json["percent"] = overhead.percent().into();
                json["extra_ms"] = overhead.extra_ms().into();
                println!("{json}");
                eprintln!(
                    "gradflow-trainer: instrumentation costs {:+.3} ms a step ({:+.2} %): \
                     {:.3} ms instrumented, {:.3} ms not (medians of {} steps each, {})",
                    overhead.extra_ms(),
                    overhead.percent(),
                    overhead.instrumented_ms,
                    overhead.uninstrumented_ms,
                    overhead.steps,
                    overhead.device,
                );
                if let Some(without) = overhead.without_attention_ms {
                    eprintln!(
                        "gradflow-trainer: the attention statistics cost {:+.3} ms of it \
                         ({without:.3} ms instrumented without them)",
                        overhead.instrumented_ms - without,
                    );
                }
            }
            let loss = match (outcome.first_loss, outcome.last_loss) {
                (Some(a), Some(b)) => format!("loss {a:.4} → {b:.4}"),
                _ if outcome.overhead.is_some() => "overhead measured".into(),
                _ => "no steps".into(),
            };
            let pace = outcome
                .step_ms()
                .filter(|_| outcome.overhead.is_none())
                .map(|ms| format!(" ({ms:.3} ms a step)"))
                .unwrap_or_default();
            eprintln!(
                "gradflow-trainer: run {} finished: {} steps in {:.1} s{pace}, {loss}",
                outcome.run_id, outcome.steps, outcome.seconds
            );
            match outcome.summary {
                Some(s) if s.complete() => {
                    eprintln!(
                        "gradflow-trainer: delivered {} steps ({} already there)",
                        s.delivered, s.duplicates
                    );
                    ExitCode::SUCCESS
                }
                Some(s) => {
                    eprintln!(
                        "gradflow-trainer: delivered {} steps; NOT delivered: {} still spooled, {} dropped, {} rejected, {} refused as late{}",
                        s.delivered,
                        s.undelivered,
                        s.dropped,
                        s.rejected,
                        s.late,
                        s.registration_error
                            .map(|e| format!("; registration failed: {e}"))
                            .unwrap_or_default()
                    );
                    if let Some(spool) = s.spool {
                        eprintln!(
                            "gradflow-trainer: the spooled steps are in {0}; load them later \
                             with `gradflow-server --db PATH import {0}`",
                            spool.display()
                        );
                    }
                    ExitCode::from(2)
                }
                None => ExitCode::SUCCESS,
            }
        }
        Err(error) => {
            eprintln!("gradflow-trainer: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// `--check-grad-sums`: the fused kernel against the per-tensor sums on a device.
fn check_grad_sums(device: &str) -> ExitCode {
    let checked = gradflow_trainer::run::device(device)
        .and_then(|device| Ok(gradflow_trainer::grad_sums::check_fused(&device)?));
    match checked {
        Ok(mismatches) if mismatches.is_empty() => {
            println!(
                "gradflow-trainer: fused gradient sums agree with the per-tensor sums on {device}"
            );
            ExitCode::SUCCESS
        }
        Ok(mismatches) => {
            for m in &mismatches {
                println!(
                    "mismatch: {}: per tensor {}, fused {}",
                    m.case, m.per_tensor, m.fused
                );
            }
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("gradflow-trainer: checking the gradient sums: {error:#}");
            ExitCode::FAILURE
        }
    }
}
