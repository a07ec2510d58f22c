//! Instrumentation overhead: two trainers of the same preset and seed, one
//! instrumented (telemetry computed, transferred and turned into a step record, as
//! when reporting) and one not, stepped alternately in one process so that both see
//! the same machine load; medians of the per-step times and their ratio.
//!
//! Run: `cargo bench -p gradflow-trainer --bench overhead [-- PRESET STEPS]`
//! (default `small 60`).

use std::time::Instant;

use candle_core::{DType, Device};
use gradflow_trainer::model::HybridModel;
use gradflow_trainer::model::config::Preset;
use gradflow_trainer::train::{TrainOptions, Trainer};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn trainer(preset: &Preset, instrument: bool) -> Trainer {
    let model = HybridModel::random(preset, DType::F32, &Device::Cpu, 0).unwrap();
    let options = TrainOptions {
        instrument,
        ..TrainOptions::new(DType::F32, DType::F32)
    };
    Trainer::new(model, options, &Device::Cpu).unwrap()
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let preset = Preset::named(args.first().map_or("small", String::as_str)).unwrap();
    let steps: u64 = args.get(1).map_or(60, |s| s.parse().unwrap());
    let mut on = trainer(&preset, true);
    let mut off = trainer(&preset, false);
    for step in 0..3 {
        on.step(step).unwrap();
        off.step(step).unwrap();
    }
    let (mut t_on, mut t_off) = (Vec::new(), Vec::new());
    for step in 3..3 + steps {
        // Alternate which goes first, so neither always runs on a warmer cache.
        let order = if step % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for instrumented in order {
            let start = Instant::now();
            let output = if instrumented {
                on.step(step)
            } else {
                off.step(step)
            }
            .unwrap();
            if instrumented {
                // Building the record is part of the cost; serialising it is the reporter's.
                assert!(output.record.is_some());
                t_on.push(start.elapsed().as_secs_f64());
            } else {
                t_off.push(start.elapsed().as_secs_f64());
            }
        }
    }
    let (m_on, m_off) = (median(t_on), median(t_off));
    println!(
        "preset {}: {} params, {steps} steps each, interleaved, medians",
        preset.name,
        on.model.store.len()
    );
    println!("  instrumented : {:.2} ms a step", m_on * 1e3);
    println!("  --no-instrument: {:.2} ms a step", m_off * 1e3);
    println!("  overhead {:+.2}%", (m_on / m_off - 1.0) * 100.0);
}
