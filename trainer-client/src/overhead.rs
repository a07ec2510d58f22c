//! What instrumentation costs a training step: two trainers of the same preset and
//! seed, one instrumented (telemetry computed, transferred and turned into a step
//! record, as when reporting) and one not, stepped alternately in one process so that
//! both see the same machine load; medians of the per-step times. The same with a
//! third trainer, instrumented but without the attention statistics, gives those
//! statistics' own cost (`measure_attention`).
//!
//! Used by the benchmark harness (`gradflow-bench overhead`) and by
//! `cargo bench -p gradflow-trainer --bench overhead`, both of which settle candle's
//! thread count first as the trainer binary does (`threads`): without it every
//! matrix product reads /proc/cpuinfo, and the instrumentation's extra products
//! would be charged for that too.
//!
//! Sending is not measured here: the reporter's thread and the server's share of
//! the machine show only when the trainer binary runs against a real server
//! (`gradflow-bench`'s reporting part).

use std::time::Instant;

use anyhow::Context;

use candle_core::{DType, Device};
use gradflow_protocol::StepRecord;
use serde::Serialize;

use crate::model::HybridModel;
use crate::model::config::Preset;
use crate::phases::{PhaseMedian, Phases};
use crate::train::{TrainOptions, Trainer};

/// Median step times of the instrumented and the uninstrumented trainer.
#[derive(Debug, Clone, Serialize)]
pub struct Overhead {
    pub preset: String,
    pub device: String,
    pub params: usize,
    /// Measured steps of each trainer (after three warm-up steps).
    pub steps: u64,
    pub instrumented_ms: f64,
    pub uninstrumented_ms: f64,
    /// With a third trainer stepped in turn (`--attention-cost`): the instrumented
    /// trainer's median without its attention statistics.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub without_attention_ms: Option<f64>,
    /// With phases timed (`Trainer::phases` set on both): each phase's median, of
    /// the instrumented and of the uninstrumented trainer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phases_instrumented: Option<Vec<PhaseMedian>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phases_uninstrumented: Option<Vec<PhaseMedian>>,
}

impl Overhead {
    /// The instrumented step's extra time, in percent of the uninstrumented one.
    pub fn percent(&self) -> f64 {
        (self.instrumented_ms / self.uninstrumented_ms - 1.0) * 100.0
    }

    /// The instrumented step's extra time, in milliseconds.
    pub fn extra_ms(&self) -> f64 {
        self.instrumented_ms - self.uninstrumented_ms
    }
}

const WARM_UP_STEPS: u64 = 3;

/// Steps both trainers `steps` times, interleaved, and returns the medians.
pub fn measure(preset: &Preset, steps: u64, device: &Device) -> anyhow::Result<Overhead> {
    let trainer = |instrument: bool| -> anyhow::Result<Trainer> {
        let model = HybridModel::random(preset, DType::F32, device, 0)?;
        let options = TrainOptions {
            instrument,
            ..TrainOptions::new(DType::F32, DType::F32)
        };
        Trainer::new(model, options, device)
    };
    let mut on = trainer(true)?;
    let mut off = trainer(false)?;
    measure_pair(&mut on, &mut off, None, steps, device, |_, _| {})
}

/// Median step times of the instrumented trainer with and without its attention
/// statistics, and of the uninstrumented one: what the attention layers' largest
/// logit and smallest head entropy cost apart from the rest of the instrumentation.
#[derive(Debug, Clone, Serialize)]
pub struct AttentionCost {
    pub preset: String,
    pub params: usize,
    /// Measured steps of each trainer (after three warm-up steps).
    pub steps: u64,
    pub instrumented_ms: f64,
    pub without_attention_ms: f64,
    pub uninstrumented_ms: f64,
}

impl AttentionCost {
    /// The attention statistics' time a step, in milliseconds.
    pub fn attention_ms(&self) -> f64 {
        self.instrumented_ms - self.without_attention_ms
    }

    /// The attention statistics' share of the instrumentation's extra time, in percent.
    pub fn share_of_overhead(&self) -> f64 {
        self.attention_ms() / (self.instrumented_ms - self.uninstrumented_ms) * 100.0
    }
}

/// Steps three trainers of the same preset and seed `steps` times, interleaved:
/// instrumented, instrumented without attention statistics, and uninstrumented.
pub fn measure_attention(
    preset: &Preset,
    steps: u64,
    device: &Device,
) -> anyhow::Result<AttentionCost> {
    let trainer = |instrument: bool, attention_statistics: bool| -> anyhow::Result<Trainer> {
        let model = HybridModel::random(preset, DType::F32, device, 0)?;
        let options = TrainOptions {
            instrument,
            attention_statistics,
            ..TrainOptions::new(DType::F32, DType::F32)
        };
        Trainer::new(model, options, device)
    };
    let mut full = trainer(true, true)?;
    let mut without = trainer(true, false)?;
    let mut off = trainer(false, true)?;
    let overhead = measure_pair(
        &mut full,
        &mut off,
        Some(&mut without),
        steps,
        device,
        |_, _| {},
    )?;
    Ok(AttentionCost {
        preset: overhead.preset,
        params: overhead.params,
        steps,
        instrumented_ms: overhead.instrumented_ms,
        without_attention_ms: overhead
            .without_attention_ms
            .context("the third trainer was stepped")?,
        uninstrumented_ms: overhead.uninstrumented_ms,
    })
}

/// Steps two trainers built alike but for `instrument` (`on` instrumented, `off`
/// not) `steps` times, interleaved, and returns the medians. Each instrumented
/// step's record goes to `sink` inside the timed region, so a sink that hands it to
/// a reporter charges the hand-over too (the sending is the reporter thread's).
/// `without_attention`, when given, is a third trainer stepped in turn with them:
/// `on`'s options but no attention statistics, so that their own cost is the
/// difference of two medians of one run.
pub fn measure_pair(
    on: &mut Trainer,
    off: &mut Trainer,
    without_attention: Option<&mut Trainer>,
    steps: u64,
    device: &Device,
    sink: impl FnMut(u64, StepRecord),
) -> anyhow::Result<Overhead> {
    anyhow::ensure!(
        on.options.instrument && !off.options.instrument,
        "the first trainer is the instrumented one, the second is not"
    );
    let mut trainers: Vec<&mut Trainer> = vec![&mut *on, &mut *off];
    if let Some(third) = without_attention {
        anyhow::ensure!(
            third.options.instrument && !third.options.attention_statistics,
            "the third trainer is instrumented without attention statistics"
        );
        trainers.push(third);
    }
    let medians = measure_interleaved(&mut trainers, steps, device, sink)?;
    Ok(Overhead {
        preset: on.model.preset.name.to_owned(),
        device: format!("{device:?}"),
        params: on.model.store.len(),
        steps,
        instrumented_ms: medians[0],
        uninstrumented_ms: medians[1],
        without_attention_ms: medians.get(2).copied(),
        phases_instrumented: on.phases.as_ref().map(Phases::medians),
        phases_uninstrumented: off.phases.as_ref().map(Phases::medians),
    })
}

/// Steps every trainer `steps` times, interleaved, and returns each one's median
/// step time in milliseconds. Every instrumented step's record goes to `sink`
/// inside the timed region. The device is synchronised at the end of every timed
/// step: on CUDA the step's kernels are queued, and only a synchronised clock sees
/// them finish.
fn measure_interleaved(
    trainers: &mut [&mut Trainer],
    steps: u64,
    device: &Device,
    mut sink: impl FnMut(u64, StepRecord),
) -> anyhow::Result<Vec<f64>> {
    anyhow::ensure!(steps > 0, "measure at least one step");
    for step in 0..WARM_UP_STEPS {
        for trainer in trainers.iter_mut() {
            trainer.step(step)?;
        }
    }
    device.synchronize()?;
    for trainer in trainers.iter_mut() {
        if let Some(phases) = &mut trainer.phases {
            phases.clear();
        }
    }
    let count = trainers.len();
    let mut times = vec![Vec::new(); count];
    for step in WARM_UP_STEPS..WARM_UP_STEPS + steps {
        // Rotate which goes first, so that none always runs on a warmer cache.
        let first = usize::try_from(step).unwrap_or(0) % count;
        for k in (first..count).chain(0..first) {
            let trainer = &mut *trainers[k];
            let start = Instant::now();
            let output = trainer.step(step)?;
            if trainer.options.instrument {
                // Building the record is part of the cost; serialising it is the reporter's.
                let record = output.record.context("an instrumented step has a record")?;
                sink(step, record);
            }
            device.synchronize()?;
            times[k].push(start.elapsed().as_secs_f64());
        }
    }
    Ok(times.into_iter().map(|t| median(t) * 1e3).collect())
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
