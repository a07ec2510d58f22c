//! The trainer's main job: build the model, register the run, train, report.

use std::time::{Duration, Instant};

use anyhow::Context;
use candle_core::{DType, Device};
use gradflow_protocol::{
    Dtype, Float, LossScaler, Optimizer, ParamGroup, ParamSpec, Precision, RunRegistration,
    SignalIntervals, Timestamp,
};
use indicatif::{ProgressBar, ProgressStyle};

use crate::cli::{self, Args};
use crate::model::HybridModel;
use crate::model::config::Preset;
use crate::overhead::{self, Overhead};
use crate::phases::Phases;
use crate::reporter::{Reporter, ReporterConfig, Summary};
use crate::scenario::ScenarioSettings;
use crate::telemetry::Telemetry;
use crate::train::{BETAS, EPS, LrSchedule, PARAM_GROUP, StepOutput, TrainOptions, Trainer};

/// How a run ended.
#[derive(Debug)]
pub struct RunOutcome {
    pub run_id: String,
    pub steps: u64,
    pub first_loss: Option<f64>,
    pub last_loss: Option<f64>,
    pub last_accuracy: Option<f64>,
    pub summary: Option<Summary>,
    /// The whole run: set-up, training and the reporter's final flush.
    pub seconds: f64,
    /// The training loop alone, from the first step to the end of the last.
    pub training_seconds: f64,
    /// `--measure-overhead`: the instrumented and uninstrumented medians.
    pub overhead: Option<Overhead>,
}

impl RunOutcome {
    /// The mean time of a step, in milliseconds (`None` without steps).
    pub fn step_ms(&self) -> Option<f64> {
        (self.steps > 0).then(|| self.training_seconds / self.steps as f64 * 1e3)
    }
}

pub fn device(name: &str) -> anyhow::Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => {
            Device::new_cuda(0).context("opening CUDA device 0 (is this a --features cuda build?)")
        }
        other => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => Device::new_cuda(n).with_context(|| {
                format!("opening CUDA device {n} (is this a --features cuda build?)")
            }),
            None => anyhow::bail!("unknown device {other:?}: cpu, cuda or cuda:N"),
        },
    }
}

pub fn protocol_dtype(dtype: DType) -> Option<Dtype> {
    match dtype {
        DType::F64 => Some(Dtype::F64),
        DType::F32 => Some(Dtype::F32),
        DType::F16 => Some(Dtype::F16),
        DType::BF16 => Some(Dtype::Bf16),
        _ => None,
    }
}

/// The run's registration: every parameter with its dtype, role, shape and whether
/// the optimizer holds it, the precision and optimizer settings, and the options.
pub fn registration(trainer: &Trainer, name: &str, config: serde_json::Value) -> RunRegistration {
    let options = &trainer.options;
    let params = trainer
        .model
        .store
        .iter()
        .map(|p| ParamSpec {
            name: p.name.clone(),
            module: Some(p.module.clone()),
            group: Some(p.group.clone()),
            role: Some(p.role),
            dtype: protocol_dtype(p.var.dtype()),
            shape: Some(p.var.dims().iter().map(|d| *d as u64).collect()),
            requires_grad: Some(true),
            in_optimizer: Some(p.in_optimizer),
            param_group: p.in_optimizer.then(|| PARAM_GROUP.to_owned()),
            layout: None,
            shard_ranks: None,
        })
        .collect();
    RunRegistration {
        name: Some(name.to_owned()),
        started_at: Some(Timestamp::now()),
        host: std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.is_empty() && h.len() < 256),
        rank: Some(0),
        world_size: Some(1),
        precision: Some(Precision {
            param_dtype: protocol_dtype(options.param_dtype),
            compute_dtype: protocol_dtype(options.compute_dtype),
            loss_scaler: Some(if options.loss_scaler {
                LossScaler::Dynamic
            } else {
                LossScaler::None
            }),
        }),
        optimizer: Some(Optimizer {
            name: Some("AdamW".into()),
            lr: Some(Float(options.lr)),
            betas: Some([Float(BETAS.0), Float(BETAS.1)]),
            eps: Some(Float(EPS)),
            weight_decay: Some(Float(options.weight_decay)),
            param_groups: vec![ParamGroup {
                name: PARAM_GROUP.to_owned(),
                lr: Some(Float(options.lr)),
                weight_decay: Some(Float(options.weight_decay)),
                betas: Some([Float(BETAS.0), Float(BETAS.1)]),
                eps: Some(Float(EPS)),
            }],
            other: Default::default(),
        }),
        params,
        detectors: None,
        config: Some(config),
        train: None,
        webhooks: Vec::new(),
        wiring: Vec::new(),
        // The instrumented step measures every attention call of Qwen, which runs
        // every `qwen_every` steps.
        signals: options.instrument.then(|| SignalIntervals {
            attention: Some(u32::try_from(options.qwen_every.max(1)).unwrap_or(u32::MAX)),
            ..SignalIntervals::default()
        }),
        // The trainer reports no training flag, so its mode is never judged.
        mode_dependent_modules: None,
    }
}

fn generated_run_id(scenario: &str) -> String {
    let seconds = Timestamp::now().unix_seconds() as u64;
    let suffix: u16 = rand::random();
    format!("{scenario}-{seconds}-{suffix:04x}")
}

pub fn run(args: &Args) -> anyhow::Result<RunOutcome> {
    let started = Instant::now();
    let settings = cli::settings(args)?;
    let device = device(&args.device)?;
    let preset = Preset::named(&args.preset)?;
    let build_model = || -> anyhow::Result<HybridModel> {
        Ok(match &args.weights {
            Some(dir) => {
                HybridModel::from_checkpoint(dir, &preset, settings.param_dtype, &device, args.seed)
                    .with_context(|| format!("loading the checkpoint in {}", dir.display()))?
            }
            None => HybridModel::random(&preset, settings.param_dtype, &device, args.seed)?,
        })
    };
    let model = build_model()?;
    let vocab_size = model.qwen.config.vocab_size;
    let tokenizer = || -> anyhow::Result<crate::tasks::Tokenizer> {
        Ok(match &args.weights {
            Some(dir) => crate::tasks::Tokenizer::for_checkpoint(dir, vocab_size)?,
            None => crate::tasks::Tokenizer::Bytes,
        })
    };
    let options = train_options(args, &settings);
    let mut trainer = Trainer::with_tokenizer(model, options, tokenizer()?, &device)?;
    let run_id = args
        .run_id
        .clone()
        .unwrap_or_else(|| generated_run_id(&args.scenario));
    let registration = registration(
        &trainer,
        &format!("{} ({})", args.scenario, preset.name),
        run_config(args, &settings, &preset),
    );
    let reporter = start_reporter(args, &run_id, registration)?;
    tracing::info!(run_id = %run_id, scenario = %args.scenario, preset = preset.name, params = trainer.model.store.len(), "training");

    if settings.loss_scaler && settings.param_dtype == DType::BF16 {
        // Registered first (the server flags it), then fail as PyTorch does.
        if let Some(reporter) = reporter {
            reporter.finish(Duration::from_secs(5));
        }
        anyhow::bail!(
            "GradScaler cannot unscale bf16 gradients: \"_amp_foreach_non_finite_check_and_unscale_cuda\" \
             not implemented for 'BFloat16' (PyTorch stops the same way). bf16 has fp32's exponent range \
             and needs no loss scaling: drop --loss-scaler, or keep f32 master weights \
             (--param-dtype f32 --compute-dtype bf16)"
        );
    }

    let telemetry = Telemetry::new();
    if args.measure_overhead {
        // A second trainer of the same options and seed, uninstrumented, stepped
        // alternately with the first in this process.
        let off = Trainer::with_tokenizer(
            build_model()?,
            TrainOptions {
                instrument: false,
                ..trainer.options.clone()
            },
            tokenizer()?,
            &device,
        )?;
        let without_attention = if args.attention_cost {
            Some(Trainer::with_tokenizer(
                build_model()?,
                TrainOptions {
                    attention_statistics: false,
                    ..trainer.options.clone()
                },
                tokenizer()?,
                &device,
            )?)
        } else {
            None
        };
        let pair = Pair {
            on: trainer,
            off,
            without_attention,
            device: &device,
        };
        return measure_overhead(args, pair, reporter, &telemetry, run_id, started);
    }
    let trained = train(args, &mut trainer, reporter.as_ref(), &telemetry)?;
    let summary = reporter.map(|r| r.finish(Duration::from_secs(10)));
    Ok(RunOutcome {
        run_id,
        steps: args.steps,
        first_loss: trained.first_loss,
        last_loss: trained.last.as_ref().map(|o| o.loss),
        last_accuracy: trained.last.and_then(|o| o.accuracy),
        summary,
        seconds: started.elapsed().as_secs_f64(),
        training_seconds: trained.seconds,
        overhead: None,
    })
}

/// The trainer's options from the command line and the scenario's settings.
fn train_options(args: &Args, settings: &ScenarioSettings) -> TrainOptions {
    TrainOptions {
        param_dtype: settings.param_dtype,
        compute_dtype: settings.compute_dtype,
        lr: settings.lr,
        schedule: match args.lr_schedule {
            cli::ScheduleArg::Constant => LrSchedule::Constant,
            cli::ScheduleArg::WarmupCosine => LrSchedule::WarmupCosine {
                warmup: args.warmup_steps,
                total: args.steps,
            },
        },
        weight_decay: args.weight_decay,
        loss_scaler: settings.loss_scaler,
        growth_interval: args.scaler_growth_interval,
        qwen_every: settings.qwen_every,
        faults: settings.faults.clone(),
        seed: args.seed,
        instrument: !args.no_instrument,
        attention_statistics: true,
        attention_every: args.attention_every,
        norm_weights_every: args
            .norm_weights_every
            .div_ceil(args.report_every.max(1))
            .max(1)
            * args.report_every.max(1),
        grad_sums: args.grad_sums,
    }
}

/// The registration's `config`: what this run was asked to do.
fn run_config(args: &Args, settings: &ScenarioSettings, preset: &Preset) -> serde_json::Value {
    serde_json::json!({
        "trainer": format!("gradflow-trainer {}", env!("CARGO_PKG_VERSION")),
        "scenario": args.scenario,
        "preset": preset.name,
        "steps": args.steps,
        "seed": args.seed,
        "device": args.device,
        "qwen_every": settings.qwen_every,
        "faults": format!("{:?}", settings.faults),
        "weights": args.weights.as_ref().map(|w| w.display().to_string()),
    })
}

/// The reporter of the run, unless it reports nothing.
fn start_reporter(
    args: &Args,
    run_id: &str,
    registration: RunRegistration,
) -> anyhow::Result<Option<Reporter>> {
    if args.no_report || args.no_instrument {
        return Ok(None);
    }
    let mut config = ReporterConfig::new(&args.server[0], run_id);
    config.servers = args
        .server
        .iter()
        .map(|url| url.trim_end_matches('/').to_owned())
        .collect();
    config.token = args.ingest_token.clone();
    config.spool_max_bytes = args.spool_max_bytes;
    config.cbor = args.body == crate::cli::BodyArg::Cbor;
    if let Some(dir) = &args.spool_dir {
        config.spool_path = dir.join(format!("gradflow-spool-{run_id}.ndjson"));
    }
    Ok(Some(Reporter::start(config, registration)?))
}

/// An instrumented trainer and an uninstrumented one of the same options and seed
/// (and, for `--attention-cost`, the instrumented one without attention statistics).
struct Pair<'a> {
    on: Trainer,
    off: Trainer,
    without_attention: Option<Trainer>,
    device: &'a Device,
}

/// `--measure-overhead`: the two trainers stepped alternately, the instrumented
/// one's records reported.
fn measure_overhead(
    args: &Args,
    mut pair: Pair<'_>,
    reporter: Option<Reporter>,
    telemetry: &Telemetry,
    run_id: String,
    started: Instant,
) -> anyhow::Result<RunOutcome> {
    let measuring = Instant::now();
    if args.phases {
        pair.on.phases = Some(Phases::new(pair.device));
        pair.off.phases = Some(Phases::new(pair.device));
    }
    let mut overhead = overhead::measure_pair(
        &mut pair.on,
        &mut pair.off,
        pair.without_attention.as_mut(),
        args.steps,
        pair.device,
        |_, mut record| {
            if let Some(reporter) = &reporter {
                record.gpu = telemetry.sample();
                reporter.report(record);
            }
        },
    )?;
    // As the user named it ("cuda"), not candle's description of the device.
    overhead.device = args.device.clone();
    let training_seconds = measuring.elapsed().as_secs_f64();
    let summary = reporter.map(|r| r.finish(Duration::from_secs(10)));
    Ok(RunOutcome {
        run_id,
        steps: args.steps,
        first_loss: None,
        last_loss: None,
        last_accuracy: None,
        summary,
        seconds: started.elapsed().as_secs_f64(),
        training_seconds,
        overhead: Some(overhead),
    })
}

/// What the training loop saw.
struct Trained {
    first_loss: Option<f64>,
    last: Option<StepOutput>,
    /// The loop alone, from the first step to the end of the last.
    seconds: f64,
}

/// The training loop: every step, its record reported every `--report-every`-th,
/// progress shown.
fn train(
    args: &Args,
    trainer: &mut Trainer,
    reporter: Option<&Reporter>,
    telemetry: &Telemetry,
) -> anyhow::Result<Trained> {
    let progress = progress_bar(args);
    let mut first_loss = None;
    let mut last = None;
    let report_every = args.report_every.max(1);
    let training = Instant::now();
    for step in 0..args.steps {
        let mut output = trainer
            .step(step)
            .with_context(|| format!("training step {step}"))?;
        first_loss.get_or_insert(output.loss);
        if let Some(reporter) = reporter
            && step % report_every == 0
            && let Some(mut record) = output.record.take()
        {
            record.gpu = telemetry.sample();
            reporter.report(record);
        }
        if let Some(bar) = &progress {
            bar.set_position(step + 1);
            bar.set_message(format!(
                "loss {:.4} qwen_grad {}",
                output.loss,
                output
                    .qwen_grad_norm
                    .map_or("-".into(), |n| format!("{n:.2e}"))
            ));
        } else if (step + 1) % (args.steps / 10).max(1) == 0 {
            tracing::info!(step, loss = output.loss, qwen_grad = ?output.qwen_grad_norm, "progress");
        }
        last = Some(output);
        if args.step_delay_ms > 0 {
            std::thread::sleep(Duration::from_millis(args.step_delay_ms));
        }
    }
    let seconds = training.elapsed().as_secs_f64();
    if let Some(bar) = progress {
        bar.finish();
    }
    Ok(Trained {
        first_loss,
        last,
        seconds,
    })
}

fn progress_bar(args: &Args) -> Option<ProgressBar> {
    if args.quiet || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return None;
    }
    let bar = ProgressBar::new(args.steps);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} step {pos}/{len} {msg} [{elapsed_precise}, {per_sec}]",
        )
        .expect("a valid template"),
    );
    Some(bar)
}
