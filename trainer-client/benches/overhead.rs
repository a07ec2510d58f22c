//! Instrumentation overhead of a training step (`gradflow_trainer::overhead`).
//!
//! Run: `cargo bench -p gradflow-trainer --bench overhead [-- PRESET STEPS]`
//! (default `small 60`). `gradflow-bench overhead` measures the same instrumented
//! and uninstrumented pair; this adds a third trainer, instrumented without the
//! attention statistics, to show what those cost apart.

use candle_core::Device;
use gradflow_trainer::model::config::Preset;
use gradflow_trainer::overhead;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    // SAFETY: the first thing the program does; no other thread runs yet.
    unsafe { gradflow_trainer::threads::settle_thread_count() };
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let preset = Preset::named(args.first().map_or("small", String::as_str))?;
    let steps: u64 = args.get(1).map_or(Ok(60), |s| s.parse())?;
    let o = overhead::measure_attention(&preset, steps, &Device::Cpu)?;
    println!(
        "preset {}: {} params, {} steps each, interleaved, medians",
        o.preset, o.params, o.steps
    );
    for (mode, ms) in [
        ("instrumented", o.instrumented_ms),
        ("instrumented, no attention stats", o.without_attention_ms),
        ("--no-instrument", o.uninstrumented_ms),
    ] {
        println!("  {mode:<32}: {ms:.2} ms a step");
    }
    let extra = o.instrumented_ms - o.uninstrumented_ms;
    println!(
        "  overhead {:+.3} ms a step, {:+.2}%",
        extra,
        extra / o.uninstrumented_ms * 100.0
    );
    println!(
        "  attention statistics {:+.3} ms a step, {:.0}% of the overhead",
        o.attention_ms(),
        o.share_of_overhead()
    );
    Ok(())
}
