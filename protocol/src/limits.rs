//! Bounds on what one request may carry. They keep a single client from exhausting
//! the server's memory or the store, and are far above what a real model sends: a
//! Qwen2.5-72B has about 960 parameter tensors.

/// The largest step number: 2^53 − 1, the largest integer a JavaScript client (the
/// dashboard) reads exactly.
pub const MAX_STEP: u64 = (1 << 53) - 1;
/// Parameters in one registration.
pub const MAX_PARAMS_PER_RUN: usize = 100_000;
/// Entries of `modules[]` in one step record.
pub const MAX_MODULES_PER_STEP: usize = 100_000;
/// Entries of `params[]` in one step record.
pub const MAX_PARAMS_PER_STEP: usize = 100_000;
/// Named scalars in one step record's `metrics`.
pub const MAX_METRICS_PER_STEP: usize = 10_000;
/// Devices in one step record's `gpu`.
pub const MAX_GPUS_PER_STEP: usize = 1_024;
/// Entries of `graph_cuts[]` in one step record.
pub const MAX_GRAPH_CUTS_PER_STEP: usize = 1_024;
/// Frames of a graph cut's `stack`.
pub const MAX_STACK_FRAMES: usize = 16;
/// Step records in one batch.
pub const MAX_STEPS_PER_BATCH: usize = 100_000;
/// Bytes in a parameter, module, group or metric name.
pub const MAX_NAME_BYTES: usize = 512;
/// Bytes in free-text fields: a run's name, host, optimizer name.
pub const MAX_TEXT_BYTES: usize = 1_024;
/// Dimensions of a parameter's shape.
pub const MAX_SHAPE_DIMS: usize = 16;
/// Ranks in one run (v1.4).
pub const MAX_WORLD_SIZE: u32 = 65_536;
/// Batch ids in one step record's `batch` (v1.8).
pub const MAX_BATCH_IDS: usize = 1_024;
/// Bytes in one batch id (v1.8).
pub const MAX_BATCH_ID_BYTES: usize = 256;
/// Micro-batch losses in one step record's `batch` (v1.8).
pub const MAX_MICRO_LOSSES: usize = 1_024;
/// Entries of `moe[]` in one step record (v1.8).
pub const MAX_MOE_LAYERS_PER_STEP: usize = 1_024;
/// Experts of one MoE layer (v1.8).
pub const MAX_EXPERTS: usize = 1_024;
