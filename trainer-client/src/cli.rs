//! Command-line flags, each also read from a `GRADFLOW_*` environment variable where
//! a deployment sets it (docker-compose, the demo).

use std::path::PathBuf;

use candle_core::DType;
use clap::builder::{PossibleValue, PossibleValuesParser};
use clap::{Parser, ValueEnum};

use crate::grad_sums::GradSums;
use crate::scenario;
use crate::train::Faults;

/// gradflow-trainer: trains a Qwen2 + agent hybrid model on ARC-like tasks and
/// streams gradient-flow telemetry to a gradflow server. `--scenario` reproduces a
/// failure: healthy, prompt-caching, detached-prompt, bf16-frozen-norms,
/// scaler-on-bf16, qwen-not-in-optimizer, fp16-overflow, nan-gradient, lr-too-high,
/// attention-logit-growth.
#[derive(Debug, Clone, Parser)]
#[command(name = "gradflow-trainer", version, about, long_about = None)]
pub struct Args {
    /// The gradflow server's base URL. Several (comma-separated, or the flag
    /// repeated) for failover: steps go to the first, and move to the next when the
    /// one in use stops answering.
    #[arg(
        long,
        env = "GRADFLOW_SERVER",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:7070"
    )]
    pub server: Vec<String>,

    /// The run's id on the server (default: generated from the scenario and the time).
    #[arg(long, env = "GRADFLOW_RUN_ID")]
    pub run_id: Option<String>,

    /// Bearer token for the server's writes, when it has one.
    #[arg(long, env = "GRADFLOW_INGEST_TOKEN", hide_env_values = true)]
    pub ingest_token: Option<String>,

    /// A named story that sets the options below (explicit flags override it).
    #[arg(long, env = "GRADFLOW_SCENARIO", default_value = "healthy", value_parser = scenario_names())]
    pub scenario: String,

    /// Training steps.
    #[arg(long, env = "GRADFLOW_STEPS", default_value_t = 120)]
    pub steps: u64,

    /// `cpu`, `cuda` or `cuda:N` (CUDA needs a build with `--features cuda`).
    #[arg(long, env = "GRADFLOW_DEVICE", default_value = "cpu")]
    pub device: String,

    /// Model shapes: tiny, small, qwen2.5-0.5b, qwen2.5-1.5b.
    #[arg(long, env = "GRADFLOW_PRESET", default_value = "tiny")]
    pub preset: String,

    /// A Hugging Face checkpoint folder for Qwen (config.json, model.safetensors or a
    /// sharded index); without it Qwen is randomly initialised.
    #[arg(long)]
    pub weights: Option<PathBuf>,

    /// Master weights, the dtype the optimizer updates.
    #[arg(long, value_enum)]
    pub param_dtype: Option<DtypeArg>,

    /// Forward/backward dtype; differing from the master dtype casts a compute copy
    /// each step (the autocast analogue).
    #[arg(long, value_enum)]
    pub compute_dtype: Option<DtypeArg>,

    /// Dynamic loss scaling with torch.amp.GradScaler semantics.
    #[arg(long, value_enum)]
    pub loss_scaler: Option<ScalerArg>,

    /// Clean steps before the loss scale doubles.
    #[arg(long, default_value_t = 2000)]
    pub scaler_growth_interval: u64,

    /// AdamW learning rate.
    #[arg(long)]
    pub lr: Option<f64>,

    /// How the learning rate moves: constant, or warmup-cosine (linear warm-up over
    /// --warmup-steps, then cosine decay to a tenth of --lr at the last step).
    #[arg(long, value_enum, default_value_t = ScheduleArg::Constant)]
    pub lr_schedule: ScheduleArg,

    /// Warm-up steps of --lr-schedule warmup-cosine.
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: u64,

    /// AdamW decoupled weight decay.
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f64,

    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Failures to inject: detach-prompt, qwen-not-in-optimizer, nan-grad-at:N,
    /// activation-overflow (repeatable).
    #[arg(long = "fault", value_parser = parse_fault)]
    pub faults: Vec<Fault>,

    /// Run Qwen forward/backward only every K-th step, reusing a cached, detached
    /// prompt embedding otherwise (prompt caching).
    #[arg(long)]
    pub qwen_every: Option<u64>,

    /// Send every K-th step's record.
    #[arg(long, default_value_t = 1)]
    pub report_every: u64,

    /// Compute the attention layers' statistics (largest logit, smallest head
    /// entropy) on every K-th step only: they cost about 4 ms of a 150 ms step of
    /// Qwen2.5-0.5B on an H200 (BENCHMARKS.md), which the Python client's default
    /// interval for the same family (10) brings down tenfold. 1: every step.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub attention_every: u64,

    /// Measure the norm weights' update, drift and intended update on the first
    /// steps, then on every K-th step only: their statistics cost about 2 ms of a
    /// 150 ms step of Qwen2.5-0.5B on an H200 (BENCHMARKS.md); a norm weight that
    /// stops moving is then seen at most K − 1 steps later. Rounded up to a
    /// multiple of `--report-every`, so that the steps measured are reported. 1:
    /// every step.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    pub norm_weights_every: u64,

    /// Pause this many milliseconds after each step, so a short demo run can be
    /// watched live on the dashboard.
    #[arg(long, env = "GRADFLOW_STEP_DELAY_MS", default_value_t = 0)]
    pub step_delay_ms: u64,

    /// Train without computing or sending telemetry (to measure its overhead).
    #[arg(long)]
    pub no_instrument: bool,

    /// Compute telemetry but send nothing (no server needed).
    #[arg(long)]
    pub no_report: bool,

    /// How each gradient's sum of squares is computed: one dot product a gradient
    /// (`per-tensor`, the cheaper on a CPU), same-shaped gradients stacked and
    /// reduced together (`stacked`), or every gradient in one launch of gradflow's
    /// own kernel (`fused`, CUDA builds on a CUDA device). `auto`: fused on CUDA,
    /// per tensor elsewhere. The sums are the same either way, up to f32 rounding.
    #[arg(long, value_enum, default_value_t = GradSums::Auto)]
    pub grad_sums: GradSums,

    /// Check the fused gradient sums against the per-tensor ones on --device (random
    /// gradients of every dtype and awkward shape), print the outcome, and exit: 0
    /// when they agree.
    #[arg(long, hide = true)]
    pub check_grad_sums: bool,

    /// Measure what instrumentation costs a step instead of training a run: a
    /// second, uninstrumented trainer of the same options and seed is stepped
    /// alternately with the instrumented one in this process, --steps steps each
    /// after 3 warm-up steps, the device synchronised at the end of each; prints the
    /// median step times as JSON on stdout. The instrumented steps are sent to the
    /// server unless --no-report, so the hand-over to the reporter is charged too.
    #[arg(long)]
    pub measure_overhead: bool,

    /// With --measure-overhead: also time each phase of both trainers' steps, the
    /// device synchronised between phases, and print each phase's median (the
    /// synchronisations slow the steps: the medians then locate the cost, and the
    /// overhead figure is the run without this flag).
    #[arg(long, requires = "measure_overhead")]
    pub phases: bool,

    /// With --measure-overhead: also step a third trainer in turn with the other two,
    /// instrumented but without the attention layers' statistics (largest logit,
    /// smallest head entropy): their own cost is `instrumented_ms` less
    /// `without_attention_ms` of the same run.
    #[arg(long, requires = "measure_overhead")]
    pub attention_cost: bool,

    /// Where undelivered steps are spooled while the server is unreachable.
    #[arg(long, env = "GRADFLOW_SPOOL_DIR")]
    pub spool_dir: Option<PathBuf>,

    /// Largest spool file in bytes; once full, new step records are dropped (and
    /// counted: the count goes to the server when it is back, and is shown at exit).
    #[arg(long, env = "GRADFLOW_SPOOL_MAX_BYTES", default_value_t = 256 * 1024 * 1024)]
    pub spool_max_bytes: u64,

    /// How step batches are encoded: `json` (the default), or `cbor` (protocol v1.6;
    /// the client falls back to JSON on its own against an older server, which
    /// answers `415`). CBOR costs the server less (about 10 % more module values a
    /// second, BENCHMARKS.md, "What bounds ingest"); JSON stays the default because
    /// every server and every person can read it.
    #[arg(long, env = "GRADFLOW_BODY", default_value = "json")]
    pub body: BodyArg,

    /// Logs only, no progress bar.
    #[arg(long, short)]
    pub quiet: bool,
}

/// `--body`: the encoding of step batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BodyArg {
    Cbor,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScheduleArg {
    Constant,
    WarmupCosine,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    F32,
    Bf16,
    F16,
}

impl From<DtypeArg> for DType {
    fn from(value: DtypeArg) -> DType {
        match value {
            DtypeArg::F32 => DType::F32,
            DtypeArg::Bf16 => DType::BF16,
            DtypeArg::F16 => DType::F16,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScalerArg {
    None,
    Dynamic,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    DetachPrompt,
    QwenNotInOptimizer,
    NanGradAt(u64),
    ActivationOverflow,
}

fn parse_fault(text: &str) -> Result<Fault, String> {
    match text {
        "detach-prompt" => Ok(Fault::DetachPrompt),
        "qwen-not-in-optimizer" => Ok(Fault::QwenNotInOptimizer),
        "activation-overflow" => Ok(Fault::ActivationOverflow),
        _ => match text.strip_prefix("nan-grad-at:") {
            Some(step) => step
                .parse()
                .map(Fault::NanGradAt)
                .map_err(|_| format!("nan-grad-at takes a step number, got {step:?}")),
            None => Err(format!(
                "unknown fault {text:?}: one of detach-prompt, qwen-not-in-optimizer, nan-grad-at:N, activation-overflow"
            )),
        },
    }
}

/// Every scenario of the table, with its symptom as the value's help: `--help`
/// lists them, and an unknown name is refused before anything starts.
fn scenario_names() -> PossibleValuesParser {
    PossibleValuesParser::new(
        scenario::SCENARIOS
            .iter()
            .map(|s| PossibleValue::new(s.name).help(s.symptom)),
    )
}

/// The scenario's settings with the explicit flags applied.
pub fn settings(args: &Args) -> anyhow::Result<scenario::ScenarioSettings> {
    let mut s = scenario::settings(&args.scenario)?;
    if let Some(d) = args.param_dtype {
        s.param_dtype = d.into();
    }
    if let Some(d) = args.compute_dtype {
        s.compute_dtype = d.into();
    }
    if let Some(scaler) = args.loss_scaler {
        s.loss_scaler = scaler == ScalerArg::Dynamic;
    }
    if let Some(lr) = args.lr {
        anyhow::ensure!(
            lr.is_finite() && lr >= 0.0,
            "--lr must be a finite number ≥ 0, got {lr}"
        );
        s.lr = lr;
    }
    if let Some(k) = args.qwen_every {
        anyhow::ensure!(k >= 1, "--qwen-every must be at least 1");
        s.qwen_every = k;
    }
    for fault in &args.faults {
        apply_fault(&mut s.faults, fault);
    }
    Ok(s)
}

fn apply_fault(faults: &mut Faults, fault: &Fault) {
    match fault {
        Fault::DetachPrompt => faults.detach_prompt = true,
        Fault::QwenNotInOptimizer => faults.qwen_not_in_optimizer = true,
        Fault::NanGradAt(step) => faults.nan_grad_at = Some(*step),
        Fault::ActivationOverflow => faults.activation_overflow = true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_and_name_the_accepted_ones() {
        assert_eq!(parse_fault("nan-grad-at:12"), Ok(Fault::NanGradAt(12)));
        assert!(
            parse_fault("nan-grad-at:x")
                .unwrap_err()
                .contains("step number")
        );
        assert!(
            parse_fault("explode")
                .unwrap_err()
                .contains("detach-prompt")
        );
    }

    #[test]
    fn flags_override_the_scenario() {
        let args = Args::parse_from([
            "gradflow-trainer",
            "--scenario",
            "bf16-frozen-norms",
            "--param-dtype",
            "f32",
            "--fault",
            "detach-prompt",
        ]);
        let s = settings(&args).unwrap();
        assert_eq!(s.param_dtype, DType::F32);
        assert_eq!(s.compute_dtype, DType::BF16);
        assert!(s.faults.detach_prompt);
    }
}
