//! One step record → one row of cells, in the run's column order. This is also where
//! the server derives group norms (docs/PROTOCOL.md: "the L2 norm of the group's module
//! norms").

use rustc_hash::FxHashMap as HashMap;

use gradflow_protocol::{
    Float, GpuStat, ModuleStep, ParamStep, ScalerState, StepRecord, default_group,
};

use super::codec::{ABSENT_BITS, Cell, widen_for_display};
use super::columns::{ColumnAssigner, ColumnDictionary, SeriesKind};
use super::signal_cells::{SignalRecord, set_module_signal, signal_cells};

/// Flattens `record`; `module_groups` maps module names to their group, as the
/// registration's parameters say (modules not in it fall in their name's first part).
pub fn flatten(
    record: &StepRecord,
    module_groups: &HashMap<String, String>,
    columns: &mut ColumnAssigner<'_>,
) -> Vec<u32> {
    columns.begin_row();
    let mut writer = RowWriter {
        row: Row::new(columns.column_count()),
        columns,
    };
    writer.run_fields(record);
    // Columns are handed out kind by kind (all module norms, then all hook hits, then
    // each parameter field), not module by module: the run's first step fixes the
    // order, and keeping a kind's columns together keeps the constant ones (hook hits
    // of 1, update norms of 0) contiguous, which is what lets zstd squeeze them out.
    writer.module_fields(record, module_groups);
    writer.param_fields(record);
    writer.gpu_and_metrics(record);
    // v1.8: attention, activations, Adam, MoE loads, micro-batch losses.
    signal_cells(record, &mut |kind, subject, cell| {
        writer.put(kind, subject, cell)
    });
    writer.row.into_bits()
}

/// A row being filled: each value goes to its column, handed out on first use.
struct RowWriter<'a, 'c> {
    row: Row,
    columns: &'a mut ColumnAssigner<'c>,
}

fn wire(value: Option<Float>) -> Option<f64> {
    value.map(Float::get)
}

impl RowWriter<'_, '_> {
    fn put(&mut self, kind: SeriesKind, subject: &str, cell: Cell) {
        let position = self.columns.position(kind, subject);
        self.row.set(position, cell);
    }

    /// The run's own numbers ([`SCALARS`]: loss, lr, the scaler, the step's timing),
    /// with each optimizer parameter group's lr (v1.1) right after the run-wide one.
    fn run_fields(&mut self, record: &StepRecord) {
        for scalar in SCALARS {
            if let Some(cell) = (scalar.get)(record) {
                self.put(scalar.kind, "", cell);
            }
            if scalar.kind == SeriesKind::Lr {
                for (group, lr) in &record.lrs {
                    self.put(SeriesKind::Lr, group, Cell::from_wire(Some(lr.get())));
                }
            }
        }
    }

    /// Per module: gradient norms, hook hits, counts and sums, then the group norms
    /// derived from them: sqrt of the sum of squared module norms. A group none of
    /// whose reported modules had a gradient is null; one with no reported module,
    /// absent.
    fn module_fields(&mut self, record: &StepRecord, module_groups: &HashMap<String, String>) {
        let mut groups: Vec<(&str, GroupNorm)> = Vec::new();
        for module in &record.modules {
            // v1.4: a rank may send its partial sum of squares alone; its norm is the
            // square root (the server adds squares across ranks).
            let norm = wire(module.grad_norm).or_else(|| wire(module.grad_sumsq).map(f64::sqrt));
            self.put(
                SeriesKind::ModuleGradNorm,
                &module.module,
                Cell::from_wire(norm),
            );
            let group = module_groups
                .get(&module.module)
                .map(String::as_str)
                .unwrap_or_else(|| default_group(&module.module));
            let entry = match groups.iter_mut().find(|(name, _)| *name == group) {
                Some((_, entry)) => entry,
                None => {
                    groups.push((group, GroupNorm::default()));
                    &mut groups.last_mut().expect("just pushed").1
                }
            };
            entry.add(norm);
        }
        for module in &record.modules {
            if let Some(hits) = module.hook_hits {
                self.put(
                    SeriesKind::HookHits,
                    &module.module,
                    Cell::from_wire(Some(hits as f64)),
                );
            }
        }
        for (kind, field) in [
            (
                SeriesKind::ModuleNumel,
                (|m| m.numel) as fn(&gradflow_protocol::ModuleStep) -> Option<u64>,
            ),
            (SeriesKind::ModuleNonfinite, |m| m.nonfinite),
        ] {
            for module in &record.modules {
                if let Some(count) = field(module) {
                    self.put(kind, &module.module, Cell::from_wire(Some(count as f64)));
                }
            }
        }
        for module in &record.modules {
            if let Some(sum) = module.param_sum {
                self.put(
                    SeriesKind::ModuleParamSum,
                    &module.module,
                    Cell::from_wire(Some(sum.get())),
                );
            }
        }
        for (group, norm) in &groups {
            self.put(SeriesKind::GroupGradNorm, group, norm.cell());
        }
    }

    /// Per parameter, field by field.
    fn param_fields(&mut self, record: &StepRecord) {
        for (kind, field) in PARAM_FIELDS {
            for param in &record.params {
                if let Some(value) = field(param) {
                    self.put(kind, &param.name, Cell::from_wire(Some(value.get())));
                }
            }
        }
    }

    /// Device telemetry and the client's own named metrics.
    fn gpu_and_metrics(&mut self, record: &StepRecord) {
        for gpu in &record.gpu {
            let subject = gpu.index.to_string();
            for (kind, value) in gpu_fields(gpu) {
                if let Some(value) = value {
                    self.put(kind, &subject, Cell::from_wire(Some(value)));
                }
            }
        }

        for (name, value) in &record.metrics {
            self.put(SeriesKind::Metric, name, Cell::from_wire(wire(*value)));
        }
    }
}

type ParamField = fn(&ParamStep) -> Option<Float>;

/// A parameter's series, in the order their columns are handed out.
const PARAM_FIELDS: [(SeriesKind, ParamField); 9] = [
    (SeriesKind::ParamGradNorm, |p| p.grad_norm),
    (SeriesKind::UpdateNorm, |p| p.update_norm),
    (SeriesKind::Drift, |p| p.drift),
    (SeriesKind::ParamMean, |p| p.mean),
    (SeriesKind::IntendedUpdateNorm, |p| p.intended_update_norm),
    (SeriesKind::IntendedUpdateMaxUlp, |p| {
        p.intended_update_max_ulp
    }),
    (SeriesKind::IntendedNonzero, |p| {
        p.intended_nonzero.map(|n| Float(n as f64))
    }),
    (SeriesKind::RoundedAway, |p| {
        p.rounded_away.map(|n| Float(n as f64))
    }),
    (SeriesKind::ParamNumel, |p| p.numel.map(|n| Float(n as f64))),
];

/// A GPU's series and its values on this step.
fn gpu_fields(gpu: &GpuStat) -> [(SeriesKind, Option<f64>); 5] {
    let bytes = |b: Option<u64>| b.map(|b| b as f64);
    [
        (SeriesKind::GpuMemoryUsedBytes, bytes(gpu.memory_used_bytes)),
        (
            SeriesKind::GpuMemoryTotalBytes,
            bytes(gpu.memory_total_bytes),
        ),
        (SeriesKind::GpuUtilizationPct, wire(gpu.utilization_pct)),
        (SeriesKind::GpuTemperatureC, wire(gpu.temperature_c)),
        (SeriesKind::GpuPowerW, wire(gpu.power_w)),
    ]
}

/// Whether `record` measures a step: whether [`flatten`] stores any value of it,
/// read from the record without building the row. A record that only amends the
/// registration (the last `requires_grad_(False)` a client sends at `close`)
/// stores none; it is not a step the run took (docs/PROTOCOL.md, "What a step is").
/// The run's `step_count` counts rows with a value, the detectors ask this; a test
/// holds the two to each other.
pub fn measures_a_step(record: &StepRecord) -> bool {
    SCALARS.iter().any(|scalar| (scalar.get)(record).is_some())
        || !record.lrs.is_empty()
        || !record.modules.is_empty()
        || !record.metrics.is_empty()
        || record
            .params
            .iter()
            .any(|param| PARAM_FIELDS.iter().any(|(_, field)| field(param).is_some()))
        || record
            .gpu
            .iter()
            .any(|gpu| gpu_fields(gpu).iter().any(|(_, value)| value.is_some()))
        // A valid MoE layer has at least one expert's count.
        || !record.moe.is_empty()
        || record
            .batch
            .as_ref()
            .is_some_and(|batch| !batch.micro_losses.is_empty())
}

/// The step record a row of cells stands for: [`flatten`]'s inverse, for a row the
/// server computed (a multi-rank step combined from its ranks' rows) that the
/// detectors must see as a record. Group norms are left out (the detectors derive
/// them from the modules); values come back as the `f32`s they were stored as.
pub fn unflatten(step: u64, cells: &[u32], columns: &ColumnDictionary) -> StepRecord {
    let mut record = StepRecord {
        step,
        ..StepRecord::default()
    };
    let mut modules: Vec<ModuleStep> = Vec::new();
    let mut module_at: HashMap<&str, usize> = HashMap::default();
    let mut params: Vec<ParamStep> = Vec::new();
    let mut param_at: HashMap<&str, usize> = HashMap::default();
    let mut gpus: Vec<GpuStat> = Vec::new();
    let mut signals = SignalRecord::default();
    for (position, &bits) in cells.iter().enumerate() {
        let cell = Cell::from_bits(bits);
        if cell == Cell::Absent {
            continue;
        }
        let Some((kind, subject)) = columns.entry(position) else {
            continue;
        };
        let value = match cell {
            Cell::Value(v) => Some(widen_for_display(v)),
            _ => None,
        };
        let float = value.map(Float);
        let count = value.map(|v| v as u64);
        let mut module = |modules: &mut Vec<ModuleStep>| -> usize {
            *module_at.entry(subject).or_insert_with(|| {
                modules.push(ModuleStep {
                    module: subject.to_owned(),
                    ..ModuleStep::default()
                });
                modules.len() - 1
            })
        };
        let mut param = |params: &mut Vec<ParamStep>| -> usize {
            *param_at.entry(subject).or_insert_with(|| {
                params.push(ParamStep {
                    name: subject.to_owned(),
                    ..ParamStep::default()
                });
                params.len() - 1
            })
        };
        if signals.take(kind, subject, value) {
            continue;
        }
        match kind {
            SeriesKind::Lr if !subject.is_empty() => {
                if let Some(lr) = float {
                    record.lrs.insert(subject.to_owned(), lr);
                }
            }
            SeriesKind::Metric => {
                record.metrics.insert(subject.to_owned(), float);
            }
            SeriesKind::ModuleGradNorm
            | SeriesKind::HookHits
            | SeriesKind::ModuleNumel
            | SeriesKind::ModuleNonfinite
            | SeriesKind::ModuleParamSum => {
                let i = module(&mut modules);
                set_module_field(&mut modules[i], kind, float, count);
            }
            SeriesKind::AttnMaxLogit
            | SeriesKind::AttnMinEntropy
            | SeriesKind::ActRms
            | SeriesKind::ActAbsmax
            | SeriesKind::AdamUpdated
            | SeriesKind::AdamBelowEps
            | SeriesKind::AdamUpdateRms
            | SeriesKind::AdamUpdateAbsmax => {
                let i = module(&mut modules);
                set_module_signal(&mut modules[i], kind, value);
            }
            SeriesKind::GroupGradNorm => {}
            SeriesKind::ParamGradNorm
            | SeriesKind::UpdateNorm
            | SeriesKind::Drift
            | SeriesKind::ParamMean
            | SeriesKind::IntendedUpdateNorm
            | SeriesKind::IntendedUpdateMaxUlp
            | SeriesKind::IntendedNonzero
            | SeriesKind::RoundedAway
            | SeriesKind::ParamNumel => {
                let i = param(&mut params);
                set_param_field(&mut params[i], kind, float, count);
            }
            SeriesKind::GpuMemoryUsedBytes
            | SeriesKind::GpuMemoryTotalBytes
            | SeriesKind::GpuUtilizationPct
            | SeriesKind::GpuTemperatureC
            | SeriesKind::GpuPowerW => set_gpu_field(&mut gpus, kind, subject, float, count),
            // The run's own numbers, the run-wide lr among them.
            _ => {
                if let Some(scalar) = Scalar::of(kind) {
                    (scalar.set)(&mut record, value);
                }
            }
        }
    }
    record.modules = modules;
    record.params = params;
    record.gpu = gpus;
    signals.finish(&mut record);
    record
}

/// One of the run's own numbers (no subject): where a step record keeps it, read
/// for [`flatten`] and written back by [`unflatten`].
struct Scalar {
    kind: SeriesKind,
    /// The record's value as a cell; `None` when the record leaves it out.
    get: fn(&StepRecord) -> Option<Cell>,
    /// A stored value (`None` for a null cell) back into the record, as the field's
    /// own type: floats as they are, counts as integers, flags as anything but 0.
    set: fn(&mut StepRecord, Option<f64>),
}

/// Every subject-less series kind, in the order a run's first step hands out their
/// columns (a test holds it to [`SeriesKind::ALL`]).
const SCALARS: &[Scalar] = &[
    Scalar {
        kind: SeriesKind::Loss,
        get: |r| float_cell(r.loss),
        set: |r, v| r.loss = v.map(Float),
    },
    Scalar {
        kind: SeriesKind::Lr,
        get: |r| float_cell(r.lr),
        set: |r, v| r.lr = v.map(Float),
    },
    Scalar {
        kind: SeriesKind::DroppedSteps,
        get: |r| count_cell(r.dropped_steps),
        set: |r, v| r.dropped_steps = v.map(|v| v as u64),
    },
    Scalar {
        kind: SeriesKind::ScalerScale,
        get: |r| float_cell(r.scaler.as_ref()?.scale),
        set: |r, v| scaler(r).scale = v.map(Float),
    },
    Scalar {
        kind: SeriesKind::ScalerGrowthTracker,
        get: |r| count_cell(r.scaler.as_ref()?.growth_tracker),
        set: |r, v| scaler(r).growth_tracker = v.map(|v| v as u64),
    },
    Scalar {
        kind: SeriesKind::FoundInf,
        get: |r| r.scaler.as_ref()?.found_inf.map(flag),
        set: |r, v| scaler(r).found_inf = v.map(|v| v != 0.0),
    },
    Scalar {
        kind: SeriesKind::StepSkipped,
        get: |r| r.scaler.as_ref()?.step_skipped.map(flag),
        set: |r, v| scaler(r).step_skipped = v.map(|v| v != 0.0),
    },
    Scalar {
        kind: SeriesKind::StepTime,
        get: |r| float_cell(r.step_time),
        set: |r, v| r.step_time = v.map(Float),
    },
    Scalar {
        kind: SeriesKind::GradsCarriedOver,
        get: |r| r.grads_carried_over.map(flag),
        set: |r, v| r.grads_carried_over = v.map(|v| v != 0.0),
    },
    Scalar {
        kind: SeriesKind::LocalGradsNonfinite,
        get: |r| r.local_grads_nonfinite.map(flag),
        set: |r, v| r.local_grads_nonfinite = v.map(|v| v != 0.0),
    },
    Scalar {
        kind: SeriesKind::OptimizerSteps,
        get: |r| count_cell(r.optimizer_steps.map(u64::from)),
        set: |r, v| r.optimizer_steps = v.map(|v| v as u32),
    },
    Scalar {
        kind: SeriesKind::InputAbsmax,
        get: |r| float_cell(r.input_absmax),
        set: |r, v| r.input_absmax = v.map(Float),
    },
    Scalar {
        kind: SeriesKind::OutputLogzMean,
        get: |r| float_cell(r.output_logits.as_ref()?.logz_mean),
        set: |r, v| output_logits(r).logz_mean = v.map(Float),
    },
    Scalar {
        kind: SeriesKind::OutputLogitAbsmax,
        get: |r| float_cell(r.output_logits.as_ref()?.absmax),
        set: |r, v| output_logits(r).absmax = v.map(Float),
    },
    Scalar {
        kind: SeriesKind::OutputLogitMean,
        get: |r| float_cell(r.output_logits.as_ref()?.logit_mean),
        set: |r, v| output_logits(r).logit_mean = v.map(Float),
    },
    Scalar {
        kind: SeriesKind::RepeatedTokenShare,
        get: |r| float_cell(r.batch.as_ref()?.repeated_token_share),
        set: |r, v| {
            r.batch
                .get_or_insert_with(Default::default)
                .repeated_token_share = v.map(Float)
        },
    },
];

impl Scalar {
    /// The entry for `kind`, if it is one of the run's own numbers.
    fn of(kind: SeriesKind) -> Option<&'static Scalar> {
        SCALARS.iter().find(|scalar| scalar.kind == kind)
    }
}

fn float_cell(value: Option<Float>) -> Option<Cell> {
    value.map(|v| Cell::from_wire(Some(v.get())))
}

fn count_cell(value: Option<u64>) -> Option<Cell> {
    value.map(|n| Cell::from_wire(Some(n as f64)))
}

/// The record's scaler state, started empty if the record had none.
fn scaler(record: &mut StepRecord) -> &mut ScalerState {
    record.scaler.get_or_insert_with(ScalerState::default)
}

/// The record's output-logit statistics, started empty if the record had none.
fn output_logits(record: &mut StepRecord) -> &mut gradflow_protocol::OutputLogits {
    record.output_logits.get_or_insert_with(Default::default)
}

/// One module column's value, into the module's record.
fn set_module_field(
    module: &mut ModuleStep,
    kind: SeriesKind,
    float: Option<Float>,
    count: Option<u64>,
) {
    match kind {
        SeriesKind::ModuleGradNorm => module.grad_norm = float,
        SeriesKind::HookHits => module.hook_hits = count.map(|c| c as u32),
        SeriesKind::ModuleNumel => module.numel = count,
        SeriesKind::ModuleNonfinite => module.nonfinite = count,
        SeriesKind::ModuleParamSum => module.param_sum = float,
        _ => {}
    }
}

/// One parameter column's value, into the parameter's record.
fn set_param_field(
    param: &mut ParamStep,
    kind: SeriesKind,
    float: Option<Float>,
    count: Option<u64>,
) {
    match kind {
        SeriesKind::ParamGradNorm => param.grad_norm = float,
        SeriesKind::UpdateNorm => param.update_norm = float,
        SeriesKind::Drift => param.drift = float,
        SeriesKind::ParamMean => param.mean = float,
        SeriesKind::IntendedUpdateNorm => param.intended_update_norm = float,
        SeriesKind::IntendedUpdateMaxUlp => param.intended_update_max_ulp = float,
        SeriesKind::IntendedNonzero => param.intended_nonzero = count,
        SeriesKind::RoundedAway => param.rounded_away = count,
        SeriesKind::ParamNumel => param.numel = count,
        _ => {}
    }
}

/// One GPU column's value (its subject is the device index), into that device's
/// telemetry.
fn set_gpu_field(
    gpus: &mut Vec<GpuStat>,
    kind: SeriesKind,
    subject: &str,
    float: Option<Float>,
    count: Option<u64>,
) {
    let Ok(index) = subject.parse::<u32>() else {
        return;
    };
    let gpu = match gpus.iter().position(|g| g.index == index) {
        Some(i) => &mut gpus[i],
        None => {
            gpus.push(GpuStat {
                index,
                memory_used_bytes: None,
                memory_total_bytes: None,
                utilization_pct: None,
                temperature_c: None,
                power_w: None,
            });
            gpus.last_mut().expect("just pushed")
        }
    };
    match kind {
        SeriesKind::GpuMemoryUsedBytes => gpu.memory_used_bytes = count,
        SeriesKind::GpuMemoryTotalBytes => gpu.memory_total_bytes = count,
        SeriesKind::GpuUtilizationPct => gpu.utilization_pct = float,
        SeriesKind::GpuTemperatureC => gpu.temperature_c = float,
        _ => gpu.power_w = float,
    }
}

fn flag(on: bool) -> Cell {
    Cell::Value(if on { 1.0 } else { 0.0 })
}

#[derive(Default)]
struct GroupNorm {
    sum_of_squares: f64,
    any_value: bool,
}

impl GroupNorm {
    fn add(&mut self, norm: Option<f64>) {
        if let Some(norm) = norm {
            self.sum_of_squares += norm * norm;
            self.any_value = true;
        }
    }

    fn cell(&self) -> Cell {
        if self.any_value {
            Cell::from_wire(Some(self.sum_of_squares.sqrt()))
        } else {
            Cell::Null
        }
    }
}

/// A row that grows as columns are added while it is being filled.
struct Row(Vec<u32>);

impl Row {
    fn new(len: u32) -> Self {
        Row(vec![ABSENT_BITS; len as usize])
    }

    fn set(&mut self, position: u32, cell: Cell) {
        let position = position as usize;
        if position >= self.0.len() {
            self.0.resize(position + 1, ABSENT_BITS);
        }
        self.0[position] = cell.to_bits();
    }

    fn into_bits(self) -> Vec<u32> {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::columnar::columns::ColumnDictionary;
    use crate::model::metric::{METRICS, Subject};

    fn record(json: &str) -> StepRecord {
        gradflow_protocol::parse_steps_json(format!("[{json}]").as_bytes())
            .unwrap()
            .remove(0)
    }

    fn cell(row: &[u32], dictionary: &ColumnDictionary, kind: SeriesKind, subject: &str) -> Cell {
        let position = dictionary.get(kind, subject).expect("column exists") as usize;
        Cell::from_bits(row.get(position).copied().unwrap_or(ABSENT_BITS))
    }

    fn run(json: &str, groups: &HashMap<String, String>) -> (Vec<u32>, ColumnDictionary) {
        let base = ColumnDictionary::default();
        let mut assigner = ColumnAssigner::new(&base);
        let row = flatten(&record(json), groups, &mut assigner);
        let mut dictionary = ColumnDictionary::default();
        for (kind, subject, _) in assigner.added() {
            dictionary.push(kind, &subject);
        }
        (row, dictionary)
    }

    /// `measures_a_step` says what the stored row says: a record measures a step
    /// exactly when its row holds a value. A GPU-only record is a step (the server
    /// stores its telemetry); one that only amends the registration, or whose
    /// entries carry nothing, is not.
    #[test]
    fn a_record_measures_a_step_exactly_when_its_row_holds_a_value() {
        let cases = [
            (r#"{"step": 3}"#, false),
            (
                r#"{"step": 3, "amend": {"params": [{"name": "b.w", "requires_grad": false}]}}"#,
                false,
            ),
            (r#"{"step": 3, "params": [{"name": "b.w"}]}"#, false),
            (r#"{"step": 3, "gpu": [{"index": 0}]}"#, false),
            (r#"{"step": 3, "batch": {"ids": ["b3"]}}"#, false),
            (
                r#"{"step": 3, "gpu": [{"index": 0, "power_w": 300}]}"#,
                true,
            ),
            (r#"{"step": 3, "loss": 2.5}"#, true),
            (r#"{"step": 3, "lr": 0.001}"#, true),
            (r#"{"step": 3, "lrs": {"decay": 0.1}}"#, true),
            (r#"{"step": 3, "step_time": 0.08}"#, true),
            (r#"{"step": 3, "dropped_steps": 2}"#, true),
            (r#"{"step": 3, "scaler": {"scale": 65536}}"#, true),
            (
                r#"{"step": 3, "modules": [{"module": "a", "grad_norm": null}]}"#,
                true,
            ),
            (
                r#"{"step": 3, "params": [{"name": "b.w", "drift": 0.5}]}"#,
                true,
            ),
            (r#"{"step": 3, "metrics": {"acc": null}}"#, true),
            (
                r#"{"step": 3, "moe": [{"module": "m", "tokens_per_expert": [4, 0]}]}"#,
                true,
            ),
            (r#"{"step": 3, "batch": {"micro_losses": [2.0]}}"#, true),
        ];
        for (json, measured) in cases {
            let (row, _) = run(json, &HashMap::default());
            let stored = row.iter().any(|&bits| bits != ABSENT_BITS);
            assert_eq!(stored, measured, "the row of {json}");
            assert_eq!(measures_a_step(&record(json)), measured, "{json}");
        }
    }

    #[test]
    fn a_row_reads_back_as_the_record_it_came_from() {
        let sent = record(
            r#"{"step": 7, "loss": 2.5, "lr": 0.25, "lrs": {"decay": 0.125},
                "step_time": 0.5, "grads_carried_over": false, "input_absmax": 3.0,
                "local_grads_nonfinite": true, "optimizer_steps": 3,
                "scaler": {"scale": 65536, "growth_tracker": 3, "found_inf": true, "step_skipped": true},
                "modules": [{"module": "a.x", "grad_norm": 0.75, "hook_hits": 2, "numel": 64, "nonfinite": 0},
                            {"module": "a.y", "grad_norm": null, "hook_hits": 0}],
                "params": [{"name": "a.x.weight", "grad_norm": 0.5, "update_norm": 0.0625,
                            "drift": 0.25, "mean": 1.0, "intended_update_norm": 0.125,
                            "intended_update_max_ulp": 0.5, "intended_nonzero": 8,
                            "rounded_away": 2, "numel": 16}],
                "gpu": [{"index": 1, "memory_used_bytes": 1024, "utilization_pct": 50}],
                "metrics": {"reward": 0.5, "missing": null},
                "dropped_steps": 4}"#,
        );
        assert_eq!(read_back(&sent), sent);
    }

    #[test]
    fn the_v1_8_signals_read_back_as_they_were_sent() {
        let sent = record(
            r#"{"step": 3, "loss": 2.0,
                "modules": [{"module": "l.0.attn", "grad_norm": 0.5, "attn_max_logit": 12.5,
                             "attn_min_entropy": 0.25, "act_rms": 1.5, "act_absmax": 40.0,
                             "adam": {"updated": 4096, "below_eps": 0.125, "update_rms": 0.25,
                                      "update_absmax": 1.75}},
                            {"module": "l.0.mlp", "attn_max_logit": "Infinity"}],
                "output_logits": {"logz_mean": -3.5, "absmax": 20.0},
                "moe": [{"module": "l.0.mlp.gate", "tokens_per_expert": [5, 0, 3, 0], "router_z": 2.5},
                        {"module": "l.1.mlp.gate", "tokens_per_expert": [0, 0]}],
                "batch": {"micro_losses": [2.0, 9.5]}}"#,
        );
        assert_eq!(read_back(&sent), sent);
        let (row, dict) = run(
            r#"{"step": 1, "moe": [{"module": "g", "tokens_per_expert": [6, 2, 0, 0]}]}"#,
            &HashMap::default(),
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::MoeTopShare, "g"),
            Cell::Value(0.75)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::MoeMaxVio, "g"),
            Cell::Value(2.0)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::MoeIdleExperts, "g"),
            Cell::Value(2.0)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::MoeExpertTokens, "g/1"),
            Cell::Value(2.0)
        );
    }

    /// A record flattened into a fresh dictionary and read back.
    fn read_back(sent: &StepRecord) -> StepRecord {
        let base = ColumnDictionary::default();
        let mut assigner = ColumnAssigner::new(&base);
        let row = flatten(sent, &HashMap::default(), &mut assigner);
        let mut dictionary = ColumnDictionary::default();
        for (kind, subject, _) in assigner.added() {
            dictionary.push(kind, &subject);
        }
        unflatten(sent.step, &row, &dictionary)
    }

    /// The kinds that take a subject (a module, parameter, group, device, metric
    /// name, or an optimizer parameter group's lr); every other kind is a scalar.
    const PER_SUBJECT: &[SeriesKind] = &[
        SeriesKind::Lr,
        SeriesKind::ModuleGradNorm,
        SeriesKind::HookHits,
        SeriesKind::ModuleNumel,
        SeriesKind::ModuleNonfinite,
        SeriesKind::ModuleParamSum,
        SeriesKind::GroupGradNorm,
        SeriesKind::ParamGradNorm,
        SeriesKind::UpdateNorm,
        SeriesKind::Drift,
        SeriesKind::ParamMean,
        SeriesKind::IntendedUpdateNorm,
        SeriesKind::IntendedUpdateMaxUlp,
        SeriesKind::IntendedNonzero,
        SeriesKind::RoundedAway,
        SeriesKind::ParamNumel,
        SeriesKind::GpuMemoryUsedBytes,
        SeriesKind::GpuMemoryTotalBytes,
        SeriesKind::GpuUtilizationPct,
        SeriesKind::GpuTemperatureC,
        SeriesKind::GpuPowerW,
        SeriesKind::Metric,
        SeriesKind::AttnMaxLogit,
        SeriesKind::AttnMinEntropy,
        SeriesKind::ActRms,
        SeriesKind::ActAbsmax,
        SeriesKind::AdamUpdated,
        SeriesKind::AdamBelowEps,
        SeriesKind::AdamUpdateRms,
        SeriesKind::AdamUpdateAbsmax,
        SeriesKind::MoeExpertTokens,
        SeriesKind::MoeRouterZ,
        SeriesKind::MoeTopShare,
        SeriesKind::MoeMaxVio,
        SeriesKind::MoeIdleExperts,
        SeriesKind::MicroLoss,
    ];

    #[test]
    fn every_subject_less_kind_is_a_scalar_exactly_once() {
        for kind in SeriesKind::ALL {
            let entries = SCALARS.iter().filter(|s| s.kind == kind).count();
            // The lr is both: run-wide without a subject, per group with one.
            let expected = usize::from(!PER_SUBJECT.contains(&kind) || kind == SeriesKind::Lr);
            assert_eq!(entries, expected, "{kind:?}");
        }
        for metric in METRICS {
            if matches!(metric.subject, Subject::None | Subject::Optional) {
                for &kind in metric.kinds {
                    assert!(Scalar::of(kind).is_some(), "{}", metric.name);
                }
            }
        }
    }

    #[test]
    fn each_scalar_reads_back_the_field_it_writes() {
        for scalar in SCALARS {
            let mut record = StepRecord::default();
            assert_eq!((scalar.get)(&record), None, "{:?}", scalar.kind);
            (scalar.set)(&mut record, Some(1.0));
            for other in SCALARS {
                let expected = (other.kind == scalar.kind).then_some(Cell::Value(1.0));
                assert_eq!((other.get)(&record), expected, "{:?}", other.kind);
            }
        }
    }

    #[test]
    fn a_partial_sum_alone_stands_for_its_norm() {
        let (row, dict) = run(
            r#"{"step": 1, "modules": [{"module": "a.x", "grad_sumsq": 6.25, "numel": 3}]}"#,
            &HashMap::default(),
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::ModuleGradNorm, "a.x"),
            Cell::Value(2.5)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::ModuleNumel, "a.x"),
            Cell::Value(3.0)
        );
    }

    #[test]
    fn group_norm_is_the_l2_norm_of_module_norms() {
        let (row, dict) = run(
            r#"{"step": 1, "modules": [
                {"module": "qwen.a", "grad_norm": 3.0, "hook_hits": 1},
                {"module": "qwen.b", "grad_norm": 4.0, "hook_hits": 1},
                {"module": "agent.x", "grad_norm": null, "hook_hits": 0}]}"#,
            &HashMap::default(),
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::GroupGradNorm, "qwen"),
            Cell::Value(5.0)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::GroupGradNorm, "agent"),
            Cell::Null
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::ModuleGradNorm, "agent.x"),
            Cell::Null
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::HookHits, "agent.x"),
            Cell::Value(0.0)
        );
    }

    #[test]
    fn registered_groups_override_the_name_rule() {
        let groups = HashMap::from_iter([("backbone.mlp".to_owned(), "qwen".to_owned())]);
        let (row, dict) = run(
            r#"{"step": 1, "modules": [{"module": "backbone.mlp", "grad_norm": 2.0}]}"#,
            &groups,
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::GroupGradNorm, "qwen"),
            Cell::Value(2.0)
        );
        assert_eq!(dict.get(SeriesKind::GroupGradNorm, "backbone"), None);
    }

    #[test]
    fn non_finite_module_norms_poison_their_group() {
        let (row, dict) = run(
            r#"{"step": 1, "modules": [{"module": "q.a", "grad_norm": "NaN"}, {"module": "q.b", "grad_norm": 1}]}"#,
            &HashMap::default(),
        );
        assert!(
            matches!(cell(&row, &dict, SeriesKind::GroupGradNorm, "q"), Cell::Value(v) if v.is_nan())
        );
    }

    #[test]
    fn scalars_params_gpus_and_metrics_get_their_own_columns() {
        let (row, dict) = run(
            r#"{"step": 1, "loss": 2.5, "lr": 0.001,
                "scaler": {"scale": 65536, "growth_tracker": 3, "found_inf": true, "step_skipped": false},
                "params": [{"name": "w", "grad_norm": 0.1, "update_norm": 0, "drift": 0, "mean": 1}],
                "gpu": [{"index": 1, "memory_used_bytes": 1024, "utilization_pct": 50}],
                "metrics": {"reward": null, "acc": 0.5}}"#,
            &HashMap::default(),
        );
        assert_eq!(cell(&row, &dict, SeriesKind::Loss, ""), Cell::Value(2.5));
        assert_eq!(
            cell(&row, &dict, SeriesKind::FoundInf, ""),
            Cell::Value(1.0)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::StepSkipped, ""),
            Cell::Value(0.0)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::ScalerGrowthTracker, ""),
            Cell::Value(3.0)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::ParamMean, "w"),
            Cell::Value(1.0)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::UpdateNorm, "w"),
            Cell::Value(0.0)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::GpuMemoryUsedBytes, "1"),
            Cell::Value(1024.0)
        );
        assert_eq!(cell(&row, &dict, SeriesKind::Metric, "reward"), Cell::Null);
        assert_eq!(
            cell(&row, &dict, SeriesKind::Metric, "acc"),
            Cell::Value(0.5)
        );
        assert_eq!(dict.get(SeriesKind::GpuTemperatureC, "1"), None);
    }
}
