//! gradflow-trainer: a real training step of a hybrid model (a Qwen2-architecture LLM
//! encodes a task prompt into an embedding that an agent consumes), instrumented to
//! stream gradient-flow telemetry to a gradflow server, with the failures gradflow
//! diagnoses reproducible on demand.
//!
//! # Layout
//!
//! - [`model`]: Qwen2 and the agent, from differentiable candle ops.
//! - [`tasks`]: ARC-like tasks and the byte-level tokenizer.
//! - [`train`]: one training step with precision, loss scaling, faults, and its
//!   instrumentation into a step record.
//! - [`optim`]: AdamW that also says what update it meant to apply.
//! - [`grad_sums`]: every gradient's sum of squares, per tensor, stacked by shape, or
//!   fused into one CUDA launch.
//! - [`norm_watch`]: the norm weights' update, drift, mean and intended update,
//!   measured a group of same-shaped weights at a time.
//! - [`scaler`]: `GradScaler`-style dynamic loss scaling.
//! - [`overhead`]: what instrumentation costs a step, measured side by side.
//! - [`phases`]: where a step's time goes, the device synchronised between phases.
//! - [`reporter`]: delivers step records to one or several servers, never blocking.
//! - [`threads`]: candle's thread count, settled once per process.

pub mod cli;
pub mod grad_sums;
pub mod model;
pub mod norm_watch;
pub mod optim;
pub mod overhead;
pub mod phases;
pub mod reporter;
pub mod run;
pub mod scaler;
pub mod scenario;
pub mod tasks;
pub mod telemetry;
pub mod threads;
pub mod train;
